package natcompare

import (
	"context"
	"net/netip"
	"path/filepath"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// Cilium is one Cilium version's own code, run by a test module that
// depends on it (e2e/ciliumgc).
type Cilium interface {
	// Dir is where Cilium's own map code created and pinned its global CT
	// and SNAT maps.
	Dir() string
	// Scrub runs Cilium's endpoint scrub of ips over its maps: its ctmap
	// GC with a MatchIPs filter, every global map, with the SNAT deletes
	// its GC runner subscribes (ctmap.NatMapNext4/6).
	Scrub(ips []netip.Addr) error
	// Expire runs Cilium's GC of expired entries the same way.
	Expire() error
}

// Compare fills Cilium's maps and a clone of them (same specs) with Case's
// entries, lets Cilium scrub (or expire) one copy and ctscrub the other, and
// fails on any difference between what is left. It also fails when the
// case proves nothing: Cilium deleted no SNAT mapping, or kept none.
func Compare(t *testing.T, c Cilium) {
	ours := filepath.Join(filepath.Dir(c.Dir()), "ctscrub-copy")
	if err := Clone(c.Dir(), ours); err != nil {
		t.Fatal(err)
	}
	live := func(int) uint32 { return NowKtime() + 3600 }
	for _, tc := range []struct {
		name     string
		lifetime func(int) uint32
		cilium   func() error
		ctscrub  func(ctx context.Context, entries Maps) error
	}{
		{"scrub-index", live, func() error { return c.Scrub(ScrubIPs) }, func(ctx context.Context, e Maps) error {
			res, err := Scrub(ctx, ours, e, ScrubIPs, Index)
			t.Logf("ctscrub: %d CT entries, SNAT %v", res.Total, res.NATDeleted)
			return err
		}},
		{"scrub-sweep", live, func() error { return c.Scrub(ScrubIPs) }, func(ctx context.Context, e Maps) error {
			res, err := Scrub(ctx, ours, e, ScrubIPs, Sweep)
			t.Logf("ctscrub: %d CT entries, SNAT %v", res.Total, res.NATDeleted)
			return err
		}},
		{"expiry", func(i int) uint32 {
			// Every other entry expired 100 s ago, so each kind of entry
			// appears expired in one family and live in the other.
			if i%2 == 0 {
				return NowKtime() - 100
			}
			return NowKtime() + 3600
		}, c.Expire, func(ctx context.Context, _ Maps) error {
			rep, err := Expire(ctx, ours)
			tot := rep.Total()
			t.Logf("ctscrub expiry pass: %d CT entries, %d SNAT mappings deleted", tot.Deleted, tot.NATDeleted)
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			entries := Case(tc.lifetime)
			for _, dir := range []string{c.Dir(), ours} {
				if err := Clear(dir); err != nil {
					t.Fatal(err)
				}
				if err := Fill(dir, entries); err != nil {
					t.Fatal(err)
				}
			}
			before, err := Dump(c.Dir())
			if err != nil {
				t.Fatal(err)
			}
			if err := tc.cilium(); err != nil {
				t.Fatalf("Cilium's scrub: %v", err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			if err := tc.ctscrub(ctx, entries); err != nil {
				t.Fatalf("ctscrub: %v", err)
			}
			want, err := Dump(c.Dir())
			if err != nil {
				t.Fatal(err)
			}
			got, err := Dump(ours)
			if err != nil {
				t.Fatal(err)
			}
			nat := "cilium_snat_"
			t.Logf("Cilium left %d of %d entries (%d of %d SNAT mappings)", len(want), len(before), want.Count(nat), before.Count(nat))
			if d := Diff(want, got); d != "" {
				t.Errorf("ctscrub left other entries than Cilium's own scrub:\n%s", d)
			}
			if want.Count(nat) == before.Count(nat) || want.Count(nat) == 0 {
				t.Errorf("the case proves nothing: Cilium deleted %d of %d SNAT mappings", before.Count(nat)-want.Count(nat), before.Count(nat))
			}
			if want.Count(ctmap.TCP4.Name()) == before.Count(ctmap.TCP4.Name()) {
				t.Errorf("the case proves nothing: Cilium deleted no entry of %s", ctmap.TCP4.Name())
			}
		})
	}
}
