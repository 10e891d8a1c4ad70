package index

import (
	"net/netip"
	"testing"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// The hooks see what Take handed out and which IP Track declared complete,
// and run without the IP's lock held (they may call back into the index).
func TestHooks(t *testing.T) {
	ix := New(Config{})
	pod, peer := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("192.0.2.1")
	k := ctmap.NewKey4(pod, peer, 80, 40000, ctmap.ProtoTCP, ctmap.FlagOut)
	var taken []ctmap.CTKey4
	var tracked []netip.Addr
	ix.SetHooks(&Hooks{
		Taken: func(ip netip.Addr, k4 []ctmap.CTKey4, k6 []ctmap.CTKey6) {
			_ = ix.State(ip) // would deadlock under the IP's lock
			taken = append(taken, k4...)
		},
		Tracked: func(ips []netip.Addr) {
			for _, ip := range ips {
				_ = ix.State(ip)
			}
			tracked = append(tracked, ips...)
		},
	})
	ix.Track(pod)
	ix.Add4(k)
	if len(tracked) != 1 || tracked[0] != pod {
		t.Fatalf("Tracked hook got %v, want [%s]", tracked, pod)
	}
	ix.TrackAll([]netip.Addr{pod, peer})
	if len(tracked) != 3 || !ix.State(peer).Complete {
		t.Fatalf("TrackAll: hook got %v, peer state %+v", tracked, ix.State(peer))
	}
	k4, _, _ := ix.Take(pod)
	if len(k4) != 1 || len(taken) != 1 || taken[0] != k {
		t.Fatalf("Take returned %v, Taken hook got %v, want [%s]", k4, taken, k)
	}
	ix.Take(pod) // empty set: no call
	if len(taken) != 1 {
		t.Fatalf("Taken hook called for an empty set: %v", taken)
	}
	ix.SetHooks(nil)
	ix.Add4(k)
	ix.Take(pod)
	if len(taken) != 1 {
		t.Fatal("Taken hook called after SetHooks(nil)")
	}
	// KeysOf leaves the index as it is.
	ix.Add4(k)
	if k4, _, _ := ix.KeysOf(pod); len(k4) != 1 || ix.Keys() != 2 {
		t.Fatalf("KeysOf: %v, index keys %d (want the key, still indexed under both addresses)", k4, ix.Keys())
	}
}
