package daemon

import (
	"context"
	"log/slog"
	"net/netip"
	"testing"
	"time"

	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/endpoints"
)

// TestRemoteBackendAct: the remote-backend watch's action in a daemon Open
// builds from its config (remote_backends.enabled, the index with its peer
// table, the Cilium backend on real CT maps), driven by the watch's own
// loop (endpoints.Watch.Loop with the daemon's act, as the task runs it
// once the informer synced) with EndpointSlices handed to the watch's
// informer handlers. The informer itself: endpoints.TestWatchRunActsOnRemovedEndpoint
// and e2e/kind TestKindRemoteBackend.
//
//   - an address that left its slice: the local client's entries towards it
//     deleted from the maps, within the hold plus 2 s, those towards a live
//     backend kept; status and metrics count it;
//   - an endpoint that drains (terminating, still serving): nothing done
//     while it is listed, then acted on once it leaves;
//   - an address a pod of this node holds: skipped (local_pod), its
//     clients' entries kept;
//   - an address a slice names again by the time act runs: skipped
//     (back), entries kept.
func TestRemoteBackendAct(t *testing.T) {
	root := newCTRoot(t, 1<<16)
	cfg := testConfig(t, root)
	cfg.RemoteBackends.Enabled = true
	const hold = 200 * time.Millisecond
	cfg.RemoteBackends.Hold.Duration = hold
	logs := &logBuffer{}
	d, err := Open(cfg, slog.New(slog.NewJSONHandler(logs, nil)), "test")
	if err != nil {
		t.Fatalf("open daemon: %v", err)
	}
	t.Cleanup(func() { d.Close() })
	if d.remote == nil {
		t.Fatal("remote_backends.enabled: the daemon has no remote-backend watch")
	}
	td := &testDaemon{Daemon: d, logs: logs, cfg: cfg}

	client := mustAddr("10.244.0.5") // a pod of this node
	local := mustAddr("10.244.0.9")  // another pod of this node, a backend
	gone := mustAddr("10.244.9.7")   // another node's backend that leaves
	live := mustAddr("10.244.9.8")   // another node's backend that stays
	drain := mustAddr("10.244.9.30") // drains, then leaves
	back := mustAddr("10.244.9.20")  // named again when act runs
	flows := func(peer netip.Addr, base uint16) []ctmap.CTKey4 {
		// Each flow's RELATED key: one per pair of addresses (no ports).
		var ks []ctmap.CTKey4
		seen := map[ctmap.CTKey4]bool{}
		for i := range 20 {
			k := ctmap.NewKey4(client, peer, 8081, base+uint16(i), ctmap.ProtoUDP, ctmap.FlagOut)
			for _, k := range []ctmap.CTKey4{k, k.Related()} {
				if !seen[k] {
					seen[k] = true
					ks = append(ks, k)
				}
			}
		}
		return ks
	}
	toGone, toLive, toLocal, toDrain, toBack := flows(gone, 20000), flows(live, 21000), flows(local, 22000), flows(drain, 23000), flows(back, 24000)
	var all []ctmap.CTKey4
	for _, ks := range [][]ctmap.CTKey4{toGone, toLive, toLocal, toDrain, toBack} {
		all = append(all, ks...)
	}
	root.put4(t, all)
	indexFlows(d, client, all)
	d.Index().Hold(local) // local's own ADD
	if n := d.Index().PeerRecords(); n == 0 {
		t.Fatal("the index filed no peer record of the client's flows")
	}

	w := d.remote.w
	ctx, cancel := context.WithCancel(context.Background())
	loopDone := make(chan struct{})
	go func() { w.Loop(ctx, d.remote.act); close(loopDone) }()
	t.Cleanup(func() { cancel(); <-loopDone })

	web := rslice("web-a", "web", rlive(gone), rlive(live), rlive(drain))
	db := rslice("db-a", "db", rlive(local))
	other := rslice("other-a", "other", rlive(back))
	for _, s := range []*discoveryv1.EndpointSlice{web, db, other} {
		w.OnAdd(s, true)
	}
	settle := 3 * hold
	time.Sleep(settle)
	if got := root.present4(t, all); got != len(all) {
		t.Fatalf("%d of %d entries left while every address was listed", got, len(all))
	}

	// gone leaves; drain drains (terminating, serving).
	start := time.Now()
	w.OnUpdate(web, rslice("web-a", "web", rlive(live), rdraining(drain)))
	waitFor(t, "the entries towards "+gone.String()+" deleted", func() bool { return root.present4(t, toGone) == 0 })
	if el := time.Since(start); el > hold+2*time.Second {
		t.Errorf("entries towards the gone backend deleted %v after its slice change, want within the hold (%v) + 2 s", el, hold)
	}
	time.Sleep(settle)
	for name, ks := range map[string][]ctmap.CTKey4{"live": toLive, "draining": toDrain, "local": toLocal, "back": toBack} {
		if got := root.present4(t, ks); got != len(ks) {
			t.Errorf("%d of %d entries towards the %s backend left, want all", got, len(ks), name)
		}
	}
	st := d.remote.status()
	if st.Scrubbed != 1 || st.EntriesDeleted != uint64(len(toGone)) || st.Last == nil || st.Last.Addr != gone || st.Last.Service != "ns/web" {
		t.Errorf("status %+v (last %+v): want 1 scrubbed, %d entries, last %s of ns/web", st, st.Last, len(toGone), gone)
	}
	if v := counterValue(t, td, "ctscrub_remote_backend_entries_deleted_total", map[string]string{"backend": "cilium"}); v != float64(len(toGone)) {
		t.Errorf("ctscrub_remote_backend_entries_deleted_total{backend=cilium} %v, want %d", v, len(toGone))
	}

	// The draining endpoint leaves.
	w.OnUpdate(web, rslice("web-a", "web", rlive(live)))
	waitFor(t, "the entries towards "+drain.String()+" deleted once it left", func() bool { return root.present4(t, toDrain) == 0 })

	// A local pod's address leaves every slice: not this node's to act on.
	w.OnDelete(db)
	waitFor(t, "the watch hands "+local.String()+" to act", func() bool {
		return counterValue(t, td, "ctscrub_remote_backends_skipped_total", map[string]string{"why": "local_pod"}) == 1
	})
	if got := root.present4(t, toLocal); got != len(toLocal) {
		t.Errorf("%d of %d entries towards the local pod %s left, want all", got, len(toLocal), local)
	}

	// An address a slice names when act runs (a slice named it again after
	// the watch found it due): act checks again before it deletes.
	d.remote.act(ctx, endpoints.Gone{Addr: back, Since: time.Now(), Service: "ns/other"})
	if v := counterValue(t, td, "ctscrub_remote_backends_skipped_total", map[string]string{"why": "back"}); v != 1 {
		t.Errorf("ctscrub_remote_backends_skipped_total{why=back} %v, want 1", v)
	}
	if got := root.present4(t, toBack); got != len(toBack) {
		t.Errorf("%d of %d entries towards %s, named by a slice, left; want all", got, len(toBack), back)
	}
	if got := root.present4(t, toLive); got != len(toLive) {
		t.Errorf("%d of %d entries towards the live backend left, want all", got, len(toLive))
	}
	if st := d.remote.status(); st.Scrubbed != 2 {
		t.Errorf("status %+v: want 2 scrubbed (gone, drained)", st)
	}
	if v := counterValue(t, td, "ctscrub_remote_backends_scrubbed_total", map[string]string{"outcome": "complete"}); v != 2 {
		t.Errorf("ctscrub_remote_backends_scrubbed_total{outcome=complete} %v, want 2", v)
	}
}

func rslice(name, svc string, eps ...discoveryv1.Endpoint) *discoveryv1.EndpointSlice {
	return &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "ns", Name: name, Labels: map[string]string{discoveryv1.LabelServiceName: svc}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   eps,
	}
}

func rep(a netip.Addr, ready, serving, terminating bool) discoveryv1.Endpoint {
	return discoveryv1.Endpoint{Addresses: []string{a.String()},
		Conditions: discoveryv1.EndpointConditions{Ready: &ready, Serving: &serving, Terminating: &terminating}}
}

func rlive(a netip.Addr) discoveryv1.Endpoint     { return rep(a, true, true, false) }
func rdraining(a netip.Addr) discoveryv1.Endpoint { return rep(a, false, true, true) }
