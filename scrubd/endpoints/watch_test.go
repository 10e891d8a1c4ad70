package endpoints

import (
	"context"
	"fmt"
	"net/netip"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

// The informer wiring, over client-go's fake clientset (its watch delivers
// what the test writes; the kind e2e runs it against a real API server):
// a slice written before Run is listed, an endpoint dropped by an update
// is acted on once the hold ran out, and one still named is not.
func TestWatchRunActsOnRemovedEndpoint(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cs := fake.NewClientset()
	es := cs.DiscoveryV1().EndpointSlices("ns")
	if _, err := es.Create(ctx, slice("ns", "web-a", "web", live("10.1.0.5"), live("10.1.0.6")), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	w := NewWatch(100 * time.Millisecond)
	acted := make(chan Gone, 4)
	go w.Run(ctx, cs, func(_ context.Context, g Gone) { acted <- g })
	for deadline := time.Now().Add(5 * time.Second); !w.Synced() || w.Status().Addrs != 2; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("watch status %+v: the slice was not listed", w.Status())
		}
	}
	start := time.Now()
	if _, err := es.Update(ctx, slice("ns", "web-a", "web", live("10.1.0.6")), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	select {
	case g := <-acted:
		if g.Addr != netip.MustParseAddr("10.1.0.5") || g.Service != "ns/web" {
			t.Fatalf("acted on %+v, want 10.1.0.5 of ns/web", g)
		}
		if d := time.Since(start); d < 100*time.Millisecond {
			t.Fatalf("acted %v after the update, before the hold", d)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no action 5 s after the endpoint left its slice")
	}
	select {
	case g := <-acted:
		t.Fatalf("acted on %+v, still named by its slice", g)
	case <-time.After(300 * time.Millisecond):
	}
}

// Synced means the watch's own handler has seen the whole first list, not
// only the informer's store: status and the synced metric report the
// slices and addresses as listed, and a benchmark reads them then.
func TestWatchSyncedAfterHandlerSawList(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cs := fake.NewClientset()
	const n = 1000
	for i := range n {
		s := slice("ns", fmt.Sprintf("web-%d", i), "web", live(fmt.Sprintf("10.1.%d.%d", i/250, i%250+1)))
		if err := cs.Tracker().Add(s); err != nil {
			t.Fatal(err)
		}
	}
	w := NewWatch(time.Second)
	// A handler slower than the informer's store (as decoding and
	// stripping real slices makes it): 1000 x 200 us behind.
	w.now = func() time.Time { time.Sleep(200 * time.Microsecond); return time.Now() }
	go w.Run(ctx, cs, func(context.Context, Gone) {})
	for deadline := time.Now().Add(10 * time.Second); !w.Synced(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("not synced after 10 s")
		}
	}
	if st := w.Status(); st.Slices != n || st.Addrs != n {
		t.Errorf("synced with %d slices, %d addresses seen; want %d each", st.Slices, st.Addrs, n)
	}
}
