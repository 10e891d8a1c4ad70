package cilium

import (
	"context"
	"net/netip"
	"strings"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// sweepCollision is a world with the entries of podA and of an address whose
// filter bit is podA's: a pass for podA visits the twin's entries and keeps
// them only because the twin is not in the shared IP set.
func sweepCollision(t *testing.T) (*world, *Backend, netip.Addr) {
	t.Helper()
	needRoot(t)
	maps := pinnedMaps(t, 1<<14, true)
	ix := newIndex()
	w := newWorld(t, maps, ix)
	twin := collider(podA)
	if twin == podA || addrFilter([]netip.Addr{podA}) != addrFilter([]netip.Addr{twin}) {
		t.Skipf("%s and %s do not collide in the filter on this CPU's byte order", podA, twin)
	}
	w.addFlows(podA, remote4, 10, false)
	w.addFlows(twin, remote4, 10, false)
	return w, newCilium(t, maps, ix), twin
}

// setEmpty fails the test if the sweep's shared IP sets hold an address.
func setEmpty(t *testing.T, sw *Sweeper) {
	t.Helper()
	for _, m := range []*ebpf.Map{sw.ips4, sw.ips6} {
		var k []byte
		var v uint64
		it := m.Iterate()
		for it.Next(&k, &v) {
			t.Errorf("the sweep's IP set still holds %x", k)
		}
		if err := it.Err(); err != nil {
			t.Fatal(err)
		}
	}
}

// A pass whose set-up fails half-way must take the IPs it wrote back out of
// the shared IP set: the next pass, another caller's, would delete the
// entries of every left IP whose filter bit it shares. The failure is real:
// the test swaps in an IPv6 set made too small (one entry), so the pass's
// IPv4 address is in the set when writing its second IPv6 address fails.
func TestSweepSetUpFailsHalfWay(t *testing.T) {
	w, c, twin := sweepCollision(t)
	sw := c.Sweeper()
	small, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 16, ValueSize: 8, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer small.Close()
	ips6 := sw.ips6
	sw.ips6 = small // no pass runs: the runner starts with the Sweep below
	_, err = sw.Sweep(context.Background(), []netip.Addr{twin, podA6, podB6}, false)
	sw.mu.Lock()
	sw.ips6 = ips6
	sw.mu.Unlock()
	if err == nil {
		t.Fatal("a pass whose IPv6 set overflows succeeded")
	}
	t.Logf("the failed pass: %v", err)
	setEmpty(t, sw)

	want := w.expected(podA)
	res, err := c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{podA}})
	if err != nil || res.Outcome != scrub.Complete || res.Method != scrub.MethodSweep {
		t.Fatalf("the next caller's scrub: %+v, %v", res, err)
	}
	checkDeleted(t, res, want)
	w.verify(podA) // reports the twin's entries if the pass deleted them
}

// An IP a pass cannot take out of the shared set (the set's fd fails: the
// test swaps in a closed map as the pass walks its second map) makes every
// later pass refuse to run until it is out: a pass would delete the left
// IP's entries, which by then may be a new pod's.
func TestSweepRefusedWhileSetIsDirty(t *testing.T) {
	w, c, twin := sweepCollision(t)
	sw := c.Sweeper()
	closed, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 4, ValueSize: 8, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	closed.Close()
	ips4 := sw.ips4
	walks := 0
	setHooks(sw, hooks{onWalking: func() {
		if walks++; walks == 2 { // the runner's goroutine: no pass races it
			sw.ips4 = closed
		}
	}})
	res, err := c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{twin}})
	if err == nil || res.Outcome != scrub.Failed {
		t.Fatalf("a pass whose set fails: %+v, %v; want scrub.Failed", res, err)
	}
	w.verify(twin) // both maps were walked: its own entries are gone
	w.addFlows(twin, remote4, 10, false)

	// The twin is stuck in the set: podA's pass would delete its new entries.
	res, err = c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{podA}})
	if err == nil || !strings.Contains(err.Error(), "sweep refused") || res.Outcome != scrub.Failed || res.Total != 0 {
		t.Fatalf("a pass with a dirty set: %+v, %v; want refused, nothing deleted", res, err)
	}
	// Marked for what happened: a failure, not a cancel.
	if st := c.ix.State(podA); st.Complete || st.Incomplete != ReasonSweepFailed {
		t.Errorf("an IP whose sweep was refused: %+v; want incomplete, %q", st, ReasonSweepFailed)
	}
	w.verify() // nothing deleted

	// Once the set is usable again the left IP goes first, then the pass.
	setHooks(sw, nil)
	sw.mu.Lock()
	sw.ips4 = ips4
	sw.mu.Unlock()
	want := w.expected(podA)
	res, err = c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{podA}})
	if err != nil || res.Outcome != scrub.Complete {
		t.Fatalf("after the set was cleared: %+v, %v", res, err)
	}
	checkDeleted(t, res, want)
	w.verify(podA)
	setEmpty(t, sw)
}
