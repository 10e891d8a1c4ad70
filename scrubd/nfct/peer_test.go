package nfct

import (
	"context"
	"fmt"
	"net/netip"
	"testing"
	"time"
)

// A Service backend on another node left the cluster: ScrubPeer deletes the
// entries this node's clients hold towards it (DNATed to it through the
// VIP, and sent to it directly), found by its address in O(k) although the
// address lies outside this node's pod CIDRs, and nothing else: the flows
// of the same clients to another backend of the Service stay.
func TestScrubPeerRemoteBackend(t *testing.T) {
	for _, peers := range []bool{true, false} {
		t.Run(fmt.Sprintf("peers=%v", peers), func(t *testing.T) {
			ns, tab := newTable(t)
			local := []netip.Prefix{netip.MustParsePrefix("10.244.1.0/24")}
			gone, live := "10.244.2.7", "10.244.2.8"
			var target, others []Entry
			for i := range 200 {
				client := fmt.Sprintf("10.244.1.%d", 2+i%50)
				switch i % 4 {
				case 0, 1:
					target = append(target, dnat(client, "10.96.0.10", gone, uint16(10000+i), 53))
				case 2:
					target = append(target, tcp(client, gone, uint16(10000+i), 8080))
				case 3:
					others = append(others, dnat(client, "10.96.0.10", live, uint16(10000+i), 53))
				}
			}
			// Half found by the seed dump, half by NEW events.
			fill(t, tab, target[:len(target)/2])
			n, err := New(Config{PodCIDRs: local, Netns: ns, Peers: peers})
			if err != nil {
				t.Fatal(err)
			}
			defer n.Close()
			// After the listener: their entries carry the event extension
			// (nf_conntrack_events=2), so their DESTROY events come below.
			fill(t, tab, others)
			fill(t, tab, target[len(target)/2:])
			before := snapshot(t, tab)
			addr := netip.MustParseAddr(gone)
			want := len(target)
			if !peers {
				want = 0 // without the peer records nothing finds them (before issue 37)
			}
			for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
				if len(n.ix.peerFlowsOf(addr)) == want {
					break
				}
			}
			res, err := n.ScrubPeer(context.Background(), addr)
			if err != nil {
				t.Fatal(err)
			}
			if res.Total != want {
				t.Fatalf("deleted %d entries towards %s, want %d", res.Total, gone, want)
			}
			if !peers {
				return
			}
			checkScrubbed(t, tab, before, addr)
			if left := len(n.ix.peerFlowsOf(addr)); left != 0 {
				t.Errorf("%d peer records of %s left after its scrub", left, gone)
			}
			// The live backend's records go with their entries' DESTROY
			// events: the records stay bounded by the table's local flows.
			lv := netip.MustParseAddr(live)
			var fs []flow
			for k, e := range before {
				if holds(e, lv) {
					fs = append(fs, flow{k, e.ID})
				}
			}
			if d, _, err := n.deleteBatch(fs); err != nil || d != len(others) {
				t.Fatalf("deleted %d of %d entries of %s: %v", d, len(others), live, err)
			}
			for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline) && len(n.ix.peerFlowsOf(lv)) > 0; time.Sleep(5 * time.Millisecond) {
			}
			if left := len(n.ix.peerFlowsOf(lv)); left != 0 {
				t.Errorf("%d peer records of %s left after its entries were destroyed", left, live)
			}
		})
	}
}
