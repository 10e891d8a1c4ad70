// Package ciliumgc holds ctscrub's scrubs and expiry pass against Cilium
// v1.18.8's own scrub code on the same maps: Cilium's ctmap.GC, with the
// SNAT deletes the agent subscribes to every GC event (ctmap.NatMapNext4/6),
// over maps its own code created. See internal/testsupport/natcompare and
// docs/delegate-api.md.
package ciliumgc

import (
	"net/netip"
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/cilium/pkg/maps/ctmap"
	"github.com/cilium/cilium/pkg/maps/nat"
	"github.com/cilium/cilium/pkg/option"
	"github.com/cilium/ebpf/rlimit"

	"github.com/ctscrub/ctscrub/internal/testsupport/natcompare"
)

type cilium struct {
	dir string
	ct  []*ctmap.Map
}

func (c *cilium) Dir() string { return c.dir }

func (c *cilium) gc(f ctmap.GCFilter) error {
	for _, m := range c.ct {
		if _, err := ctmap.GC(m, f, ctmap.NatMapNext4, ctmap.NatMapNext6); err != nil {
			return err
		}
	}
	return nil
}

// Scrub is what (*Endpoint).scrubIPsInConntrackTable runs through
// GCRunner.Run: a GCFilter with the endpoint's IPs, map by map.
func (c *cilium) Scrub(ips []netip.Addr) error {
	f := ctmap.GCFilter{MatchIPs: map[netip.Addr]struct{}{}}
	for _, ip := range ips {
		f.MatchIPs[ip] = struct{}{}
	}
	return c.gc(f)
}

func (c *cilium) Expire() error { return c.gc(ctmap.GCFilter{RemoveExpired: true}) }

func TestMain(m *testing.M) { os.Exit(natcompare.Main(m)) }

func TestCiliumScrubMatchesCtscrub(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates BPF maps, loads BPF programs and mounts a bpffs")
	}
	if err := rlimit.RemoveMemlock(); err != nil {
		t.Fatal(err)
	}
	option.Config.CTMapEntriesGlobalTCP = 1 << 16
	option.Config.CTMapEntriesGlobalAny = 1 << 16
	option.Config.NATMapEntriesGlobal = 1 << 16

	// /sys/fs/bpf is a private bpffs here (TestMain).
	c := &cilium{dir: "/sys/fs/bpf/tc/globals", ct: ctmap.GlobalMaps(true, true)}
	for _, m := range c.ct {
		if err := m.OpenOrCreate(); err != nil {
			t.Fatalf("Cilium's %s: %v", m.Name(), err)
		}
	}
	// The NAT maps as the agent creates them with NodePort on; the GC opens
	// them by pin (ctmap.InitMapInfo makes its own handles).
	nat4, nat6 := nat.GlobalMaps(nil, true, true, true)
	for _, m := range []*nat.Map{nat4, nat6} {
		if err := m.OpenOrCreate(); err != nil {
			t.Fatalf("Cilium's %s: %v", m.Name(), err)
		}
	}
	if p, err := c.ct[0].Path(); err != nil || filepath.Dir(p) != c.dir {
		t.Fatalf("Cilium pinned %s (%v), not under %s", p, err, c.dir)
	}
	ctmap.InitMapInfo(nil, true, true, true)
	natcompare.Compare(t, c)
}
