package recorder_test

import (
	"net/netip"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
)

// TestApplyDuringPrune: pruning a large set makes a few syscalls per stale
// key (lookups in Cilium's maps, the seen cache's forget); the ring buffer
// reader's Apply for the same IP must not wait for them, or indexing stalls
// for the whole node. Real maps: 20,000 indexed keys whose entries are gone.
//
// The prune takes about 0.2 s here; Apply, which does not wait for it, takes
// microseconds. On a loaded machine the test goroutine can be descheduled for
// longer than the whole prune, so one attempt where the prune ends first
// proves nothing: the test tries again, and fails only when the prune ends
// before Apply in every attempt, which is what an Apply that waits for the
// prune's lock does. TestPruneKeepsKeysAddedMeanwhile (package index) checks
// the same lock property deterministically with a blocked callback.
func TestApplyDuringPrune(t *testing.T) {
	const attempts = 5
	for i := range attempts {
		applyTook, pruneTook, overlapped := applyDuringPrune(t)
		if overlapped {
			t.Logf("attempt %d: Apply during prune: %v; prune: %v", i+1, applyTook, pruneTook)
			return
		}
		t.Logf("attempt %d: the prune ended before Apply returned (Apply %v, prune %v); trying again",
			i+1, applyTook, pruneTook)
	}
	t.Fatalf("in %d attempts Apply never returned before the prune ended: it waits for the prune's syscalls", attempts)
}

// applyDuringPrune prunes 20,000 stale keys of one IP and, 50 ms in, records
// a new flow of the same IP; it checks the prune's result and reports whether
// Apply returned while the prune was still running.
func applyDuringPrune(t *testing.T) (applyTook, pruneTook time.Duration, overlapped bool) {
	t.Helper()
	w := newWorld(t, 1)
	a := w.pods[0]
	peer := netip.MustParseAddr("192.0.2.77")
	const stale = 20_000
	for i := range stale {
		w.ix.Add4(ctmap.NewKey4(a.Addr4, peer, uint16(1+i/60000), uint16(1024+i%60000), ctmap.ProtoTCP, ctmap.FlagOut))
	}
	before := w.ix.State(a.Addr4).Keys

	pruned := make(chan int, 1)
	start := time.Now()
	go func() {
		n, err := w.rec.Prune(w.ix, w.ct, a.Addr4)
		if err != nil {
			t.Error(err)
		}
		pruned <- n
	}()
	time.Sleep(50 * time.Millisecond)
	fresh := ctmap.NewKey4(a.Addr4, peer, 8443, 50000, ctmap.ProtoUDP, ctmap.FlagOut)
	r := recorder.Record{Family: 4, Kind: recorder.RecFlow}
	copy(r.Key[:], fresh[:])
	applyStart := time.Now()
	recorder.Apply(w.ix, &r)
	applyTook = time.Since(applyStart)
	var n int
	select {
	case n = <-pruned:
	default:
		overlapped = true
		n = <-pruned
	}
	pruneTook = time.Since(start)
	if n != before {
		t.Errorf("prune dropped %d keys, want %d", n, before)
	}
	k4, _, _ := w.ix.KeysOf(a.Addr4)
	if !containsKey(k4, fresh) || !containsKey(k4, fresh.Related()) {
		t.Errorf("key recorded during the prune lost: %d keys left", len(k4))
	}
	return applyTook, pruneTook, overlapped
}
