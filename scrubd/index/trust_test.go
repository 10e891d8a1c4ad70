package index

import (
	"context"
	"errors"
	"net/netip"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// Sync fails closed: before a recorder installed its hooks it waits for
// them (and fails when its bound ends), after the recorder stopped it fails
// at once, and it succeeds again once hooks are back.
func TestSyncFailsClosedWithoutRecorder(t *testing.T) {
	ix := New(Config{PodCIDRs: cidrs})
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := ix.Sync(ctx); !errors.Is(err, ErrNotFed) {
		t.Fatalf("Sync before any recorder: %v, want ErrNotFed", err)
	}

	// A waiter is released by the hooks' installation.
	done := make(chan error, 1)
	go func() { done <- ix.Sync(context.Background()) }()
	select {
	case err := <-done:
		t.Fatalf("Sync returned %v before the recorder started", err)
	case <-time.After(20 * time.Millisecond):
	}
	synced := 0
	ix.SetHooks(&Hooks{Sync: func(context.Context) error { synced++; return nil }})
	select {
	case err := <-done:
		if err != nil || synced != 1 {
			t.Fatalf("Sync after the recorder started: %v (hook ran %d times)", err, synced)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Sync still waiting after the recorder started")
	}
	if !ix.Fed() {
		t.Fatal("Fed false with hooks installed")
	}

	// The recorder stops: no wait, an error at once.
	ix.SetHooks(nil)
	start := time.Now()
	if err := ix.Sync(context.Background()); !errors.Is(err, ErrNotFed) {
		t.Fatalf("Sync after the recorder stopped: %v, want ErrNotFed", err)
	}
	if d := time.Since(start); d > time.Second {
		t.Fatalf("Sync after the recorder stopped waited %v", d)
	}
	if ix.Fed() {
		t.Fatal("Fed true after the hooks were removed")
	}

	// Restarted.
	ix.SetHooks(&Hooks{Sync: func(context.Context) error { return nil }})
	if err := ix.Sync(context.Background()); err != nil {
		t.Fatalf("Sync after the restart: %v", err)
	}
}

// Flows of this node's pods towards thousands of peers inside the pod
// CIDRs give the peers no slot: the index stays as many IPs as pods, and
// the keys are filed under the pods alone.
func TestPeersGetNoSlot(t *testing.T) {
	ix := New(Config{PodCIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}})
	pods := []netip.Addr{netip.MustParseAddr("10.244.1.2"), netip.MustParseAddr("10.244.1.3")}
	for _, p := range pods {
		ix.Hold(p)
		ix.Track(p)
	}
	for i := range 20000 {
		peer := netip.AddrFrom4([4]byte{10, byte(1 + i/65536), byte(i / 256), byte(i)})
		pod := pods[i%2]
		ix.Add4(ctmap.NewKey4(pod, peer, 80, uint16(i), ctmap.ProtoTCP, ctmap.FlagOut))
		ix.Add4(ctmap.NewKey4(peer, pod, uint16(i), 8080, ctmap.ProtoTCP, ctmap.FlagIn))
	}
	if n := ix.Slots(); n != len(pods) {
		t.Fatalf("%d IP slots after flows to 20,000 peers, want %d (the pods)", n, len(pods))
	}
	if k := ix.Keys(); k != 40000 {
		t.Fatalf("%d keys indexed, want 40000 (each under its pod only)", k)
	}
	if st := ix.State(pods[0]); !st.Complete || st.Keys != 20000 {
		t.Fatalf("pod state %+v, want complete with 20000 keys", st)
	}
}

// After a node-wide marking (every slot marked, as when Cilium re-creates
// its CT maps), the IPs no pod holds lose their slot at once and the held
// ones recover with their next sweep: ctscrub_index_incomplete_ips goes
// back to 0 instead of staying at the number of IPs ever seen.
func TestNodeWideMarkRecovers(t *testing.T) {
	ix := New(Config{PodCIDRs: cidrs})
	live := []netip.Addr{podA, podB}
	released := netip.MustParseAddr("10.244.0.12")
	for _, ip := range append(live, released) {
		ix.Hold(ip)
		ix.Track(ip)
		ix.Add4(ctmap.NewKey4(ip, remote, 80, 1000, ctmap.ProtoTCP, ctmap.FlagOut))
	}
	ix.Release(released) // its pod was deleted, its scrub complete: kept
	if st := ix.State(released); !st.Complete {
		t.Fatalf("released complete IP: %+v, want kept complete", st)
	}
	// A scrub of an IP of another node's range (an operator's), tracked.
	other := netip.MustParseAddr("10.244.9.9")
	ix.Track(other)

	for _, ip := range ix.IPs() {
		ix.MarkIncomplete(ip, ReasonCTMaps)
	}
	if n := ix.IncompleteIPs(); n != int64(len(live)) {
		t.Fatalf("%d incomplete IPs after the marking, want %d (the live pods)", n, len(live))
	}
	if n := ix.Slots(); n != len(live) {
		t.Fatalf("%d slots after the marking, want %d", n, len(live))
	}
	for _, ip := range []netip.Addr{released, other} {
		if st := ix.State(ip); st.Complete {
			t.Fatalf("%s complete after the marking: %+v", ip, st)
		}
	}
	// Each live pod's next scrub sweeps and tracks it again.
	for _, ip := range live {
		if st := ix.State(ip); st.Incomplete != ReasonCTMaps {
			t.Fatalf("%s: %+v, want %q", ip, st, ReasonCTMaps)
		}
		ix.Take(ip)
		ix.Track(ip)
	}
	if n := ix.IncompleteIPs(); n != 0 {
		t.Fatalf("%d incomplete IPs after the sweeps, want 0", n)
	}
	if ix.Keys() != 0 {
		t.Fatalf("%d keys left", ix.Keys())
	}
}

// A slot marked while no pod holds it goes, but one held again before it
// could be dropped keeps the mark: a Hold racing a marking never turns the
// mark into a complete slot.
func TestHoldRacingMarkKeepsMark(t *testing.T) {
	ix := New(Config{PodCIDRs: cidrs})
	ix.Track(podA)
	e := ix.entry(podA, false)
	e.mu.Lock()
	drop := ix.markLocked(e, ReasonLost)
	e.mu.Unlock()
	if !drop {
		t.Fatal("an unheld slot is not dropped when marked")
	}
	ix.Hold(podA) // between the mark and the drop
	ix.dropSlot(podA, e)
	if st := ix.State(podA); st.Complete || st.Incomplete != ReasonLost {
		t.Fatalf("held again before the drop: %+v, want marked %q", st, ReasonLost)
	}
}
