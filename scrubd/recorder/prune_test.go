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
func TestApplyDuringPrune(t *testing.T) {
	w := newWorld(t, 1)
	a := w.pods[0]
	peer := netip.MustParseAddr("192.0.2.77")
	const stale = 20_000
	for i := range stale {
		w.ix.Add4(ctmap.NewKey4(a.Addr4, peer, uint16(1+i/60000), uint16(1024+i%60000), ctmap.ProtoTCP, ctmap.FlagOut))
	}
	before := w.ix.State(a.Addr4).Keys

	pruned := make(chan int)
	start := time.Now()
	go func() {
		n, err := w.rec.Prune(w.ix, w.ct, a.Addr4)
		if err != nil {
			t.Error(err)
		}
		pruned <- n
	}()
	// Let the prune get going (several seconds here), then record a
	// new flow of the same IP as the reader does.
	time.Sleep(100 * time.Millisecond)
	fresh := ctmap.NewKey4(a.Addr4, peer, 8443, 50000, ctmap.ProtoUDP, ctmap.FlagOut)
	r := recorder.Record{Family: 4, Kind: recorder.RecFlow}
	copy(r.Key[:], fresh[:])
	applyStart := time.Now()
	recorder.Apply(w.ix, &r)
	applyTook := time.Since(applyStart)
	var n int
	select {
	case n = <-pruned:
		t.Fatalf("Apply returned only after the prune finished (Apply %v, prune %v): it waited for the prune's syscalls",
			applyTook, time.Since(start))
	default:
	}
	n = <-pruned
	t.Logf("Apply during prune: %v; prune of %d keys: %v", applyTook, before, time.Since(start))
	if n != stale {
		t.Errorf("prune dropped %d keys, want %d", n, stale)
	}
	k4, _, _ := w.ix.KeysOf(a.Addr4)
	if !containsKey(k4, fresh) || !containsKey(k4, fresh.Related()) {
		t.Errorf("key recorded during the prune lost: %d keys left", len(k4))
	}
}
