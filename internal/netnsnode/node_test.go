package netnsnode

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: BPF maps and network namespaces")
	}
}

// The fill puts exactly the planned entries in, in the planned maps, and both
// walks read them all and find each previous owner's share.
func TestFillAndWalks(t *testing.T) {
	needRoot(t)
	dir, err := os.MkdirTemp("/sys/fs/bpf", "ctscrub-test-")
	if err != nil {
		t.Skipf("bpffs not mounted at /sys/fs/bpf: %v", err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	const entries, perOwner = 1 << 15, 100
	m, err := CreateCTMaps(filepath.Join(dir, "globals"), entries)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	owners4, owners6 := PodRange(2)
	owners := append(owners4, owners6...)
	put, _, err := Fill(context.Background(), m, FillPlan{Entries: entries, Background: BackgroundPods(BGPods4, BGPods6, 128), Owners: owners, PerOwner: perOwner})
	if err != nil {
		t.Fatal(err)
	}
	if put != entries {
		t.Fatalf("fill put %d entries, want %d", put, entries)
	}
	per, total, err := m.Count()
	if err != nil {
		t.Fatal(err)
	}
	if total != entries {
		t.Fatalf("maps hold %d entries (%v), want %d: keys collided or the LRU evicted", total, per, entries)
	}
	for _, k := range ctmap.Kinds {
		if per[k] == 0 {
			t.Errorf("%s is empty", k.Name())
		}
	}
	for _, ip := range owners {
		nk, err := NextKeyWalk(context.Background(), m, []netip.Addr{ip})
		if err != nil {
			t.Fatal(err)
		}
		b, err := BatchWalkAll(m, []netip.Addr{ip})
		if err != nil {
			t.Fatal(err)
		}
		if nk.Entries != entries || b.Entries != entries {
			t.Errorf("walks read %d (nextkey) and %d (batch) entries, want %d", nk.Entries, b.Entries, entries)
		}
		if nk.Matches != perOwner || b.Matches != perOwner {
			t.Errorf("%s: walks found %d (nextkey) and %d (batch) entries, want %d", ip, nk.Matches, b.Matches, perOwner)
		}
	}
}

// host-local with a range as big as the pods hands a deleted pod's IPs to the
// next pod: the demo's IP reuse rests on it.
func TestChainReusesIPs(t *testing.T) {
	needRoot(t)
	if _, err := os.Stat("/usr/lib/cni/bridge"); err != nil {
		t.Skip("Debian's containernetworking-plugins not installed (scripts/setup.sh)")
	}
	lk, err := Lock(5*time.Minute, os.Stderr) // the demo uses the same names
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lk.Close() })
	work := t.TempDir()
	c := &Cleanup{}
	t.Cleanup(func() { c.Run(os.Stderr) })
	node, err := AddNode(c, NamePrefix+"-testnode") // the bridge and forwarding live in it
	if err != nil {
		t.Fatal(err)
	}
	ch, err := NewChain(ChainConfig{Node: node, WorkDir: work, RefPlugins: "/usr/lib/cni", RangeSize: 2})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	a, err := ch.Add(ctx, c, "test-a")
	if err != nil {
		t.Fatal(err)
	}
	b, err := ch.Add(ctx, c, "test-b")
	if err != nil {
		t.Fatal(err)
	}
	if a.V4 == b.V4 || !a.V6.IsValid() || a.V6 == b.V6 {
		t.Fatalf("pods got %v and %v", a.IPs(), b.IPs())
	}
	if _, err := ch.Del(ctx, a); err != nil {
		t.Fatal(err)
	}
	n, err := ch.Add(ctx, c, "test-c")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ch.Del(ctx, n); ch.Del(ctx, b) })
	if n.V4 != a.V4 || n.V6 != a.V6 {
		t.Fatalf("new pod got %v, want the deleted pod's %v", n.IPs(), a.IPs())
	}
}
