package cilium

import (
	"context"
	"errors"
	"net/netip"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// A Service backend on another node left the cluster: ScrubPeer deletes,
// on real CT and SNAT maps, the entries this node's clients keep towards
// it, found through the index's peer table (no walk), and nothing else:
// the clients' flows to a live backend, a SERVICE entry Cilium re-picked
// to the live backend, and the clients' own index sets stay.
func TestScrubPeerRemoteBackend(t *testing.T) {
	needRoot(t)
	maps, nat := natMaps(t)
	ix := newIndex()
	ix.EnablePeers()
	c := newCilium(t, maps, ix)
	w := newWorld(t, maps, ix)

	gone := netip.MustParseAddr("10.244.9.7") // another node's pod, not held here
	live := netip.MustParseAddr("10.244.9.8")
	vip := netip.MustParseAddr("10.96.0.10")
	node := netip.MustParseAddr("172.18.0.2")
	const goneID, liveID = 7, 8
	clients := []netip.Addr{netip.MustParseAddr("10.244.0.5"), netip.MustParseAddr("10.244.0.6")}
	var goneSvc []ctmap.CTKey4 // SERVICE entries naming the gone backend: deleted too
	put := func(k ctmap.CTKey4, backend uint64) {
		if err := maps.Map(k.Kind()).Put(k, ctmap.EncodeEntry(ctmap.EntryFields{Lifetime: 1000, BackendID: backend})); err != nil {
			t.Fatal(err)
		}
		w.all4[k] = true
	}
	// svcFlow is a client's flow through the VIP as Cilium and the
	// recorder leave it: the SERVICE entry naming backend id, the OUT and
	// RELATED entries towards the backend, the pick resolved.
	svcFlow := func(cl, backend netip.Addr, id uint32, port uint16) ctmap.CTKey4 {
		sk := ctmap.NewKey4(vip, cl, port, 53, ctmap.ProtoUDP, ctmap.FlagService)
		out := ctmap.NewKey4(cl, backend, 53, port, ctmap.ProtoUDP, ctmap.FlagOut)
		put(sk, uint64(id))
		put(out, 0)
		put(out.Related(), 0)
		ix.ServiceRecord4(cl, sk, id)
		for _, s := range ix.Services(cl) {
			if s.K4 == sk {
				ix.ServiceBackend(cl, s, id, backend)
			}
		}
		ix.Add4(out)
		ix.Add4(out.Related())
		return sk
	}
	var repicked ctmap.CTKey4
	for i, cl := range clients {
		ix.Hold(cl)
		ix.Track(cl)
		for j := range 50 {
			p := uint16(20000 + 100*i + j)
			goneSvc = append(goneSvc, svcFlow(cl, gone, goneID, p))
			svcFlow(cl, live, liveID, p+5000)
			// Direct flows: the client connects to it, and it connected
			// to the client.
			w.addFlow(flowOf(ctmap.NewKey4(cl, gone, 8080, p+10000, ctmap.ProtoTCP, ctmap.FlagOut)), true)
			w.addFlow(flowOf(ctmap.NewKey4(gone, cl, 9090, p+15000, ctmap.ProtoTCP, ctmap.FlagIn)), true)
			w.addFlow(flowOf(ctmap.NewKey4(cl, live, 8080, p+10000, ctmap.ProtoTCP, ctmap.FlagOut)), true)
		}
		// A flow learnt towards the gone backend that Cilium has since
		// re-picked to the live one: its SERVICE entry names liveID.
		repicked = svcFlow(cl, gone, goneID, 30000+uint16(i))
		put(repicked, liveID)
	}
	// The SNAT mapping of one OUT entry towards the gone backend (the
	// client's flow to 8080 from port 30000).
	fwd := ctmap.NewKey4(gone, clients[0], 8080, 30000, ctmap.ProtoTCP, ctmap.FlagOut)
	if err := nat.Put(fwd, natValue(node, 50000)); err != nil {
		t.Fatal(err)
	}
	want := len(goneSvc)
	for k := range w.all4 {
		if k.Has(gone) {
			want++
		}
	}
	for _, k := range goneSvc {
		delete(w.all4, k) // verify: expected gone
	}
	setsBefore := map[netip.Addr]int{}
	for _, cl := range clients {
		k4, _, st := ix.KeysOf(cl)
		if !st.Complete {
			t.Fatalf("client %s incomplete before: %s", cl, st.Incomplete)
		}
		setsBefore[cl] = len(k4)
	}

	res, err := c.ScrubPeer(context.Background(), gone)
	if err != nil {
		t.Fatal(err)
	}
	// Every entry holding the gone address went, and every other stayed,
	// but for the re-picked flows' SERVICE entries, which stay: they do not
	// hold the address.
	w.verify(gone)
	for _, cl := range clients {
		k4, _, st := ix.KeysOf(cl)
		if !st.Complete || len(k4) != setsBefore[cl] {
			t.Errorf("client %s: %d keys (%v), want its %d keys and complete: a peer scrub takes nothing from a client's set", cl, len(k4), st, setsBefore[cl])
		}
	}
	if res.Total != want {
		t.Errorf("deleted %d entries, want %d", res.Total, want)
	}
	for _, k := range goneSvc {
		var e ctmap.Entry
		if maps.Map(k.Kind()).Lookup(k, &e) == nil {
			t.Errorf("SERVICE entry %s naming the gone backend left", k)
		}
	}
	var e ctmap.Entry
	if err := maps.Map(repicked.Kind()).Lookup(repicked, &e); err != nil {
		t.Errorf("the SERVICE entry Cilium re-picked to a live backend was deleted: %v", err)
	}
	var v [ctmap.NATEntrySize4]byte
	if nat.Lookup(fwd, &v) == nil {
		t.Errorf("SNAT mapping %s of an OUT entry towards the gone backend left", fwd)
	}
	t.Logf("deleted %d CT entries, %v SNAT mappings towards %s in %v", res.Total, res.NATDeleted, gone, res.Duration)

	// Without the peer table (before issue 37) nothing finds them.
	ix2 := newIndex()
	c2 := newCilium(t, maps, ix2)
	if _, err := c2.ScrubPeer(context.Background(), gone); !errors.Is(err, ErrNoPeerTable) {
		t.Errorf("ScrubPeer without a peer table: err %v, want ErrNoPeerTable", err)
	}
}

func flowOf(k ctmap.CTKey4) flow { return flow{key4: &k} }

// The peer table stays within its bound: records of keys no slot holds
// (taken by a scrub, the slot dropped) go at the cleanup.
func TestPeerTableBound(t *testing.T) {
	ix := index.New(index.Config{PodCIDRs: []netip.Prefix{podCIDR4}})
	ix.SetHooks(&index.Hooks{})
	ix.EnablePeers()
	cl := netip.MustParseAddr("10.244.0.5")
	ix.Hold(cl)
	ix.Track(cl)
	for i := range 10000 {
		ix.Add4(ctmap.NewKey4(cl, netip.AddrFrom4([4]byte{10, 244, 9, byte(i % 50)}), 80, uint16(1024+i), ctmap.ProtoTCP, ctmap.FlagOut))
	}
	if got := ix.PeerRecords(); got != 10000 {
		t.Fatalf("%d peer records, want 10000", got)
	}
	ix.Take(cl) // past the bound now: Take starts a cleanup
	for deadline := time.Now().Add(5 * time.Second); ix.PeerRecords() > 0 && time.Now().Before(deadline); {
		ix.CleanPeers()
	}
	if n := ix.PeerRecords(); n != 0 {
		t.Fatalf("%d peer records left of keys no slot holds", n)
	}
}
