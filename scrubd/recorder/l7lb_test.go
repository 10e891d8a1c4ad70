package recorder_test

import (
	"net/netip"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/internal/testsupport/netpods"
	"github.com/ctscrub/ctscrub/internal/testsupport/standin"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
)

// A flow to an L7 load-balancer VIP (SVC_FLAG_L7_LOADBALANCER: Cilium
// Ingress, Gateway API): Cilium with ENABLE_L7_LB makes no SERVICE entry
// and does not DNAT, it keeps the plain OUT entry to the VIP (and its
// RELATED entry) and redirects the flow to Envoy; the stand-in does the
// same. Every such entry of the client must be among its keys and the
// client complete. Before, the recorder took the VIP for a per-packet
// load-balanced one (a SERVICE key, pending) and the client's OUT and
// RELATED entries were in no index (issue 35 item 1). Without ENABLE_L7_LB
// confirmed the client is marked instead.
func TestL7LoadBalancerVIPRecordedAsFlow(t *testing.T) {
	for _, confirmed := range []bool{true, false} {
		name := "ENABLE_L7_LB"
		if !confirmed {
			name = "unconfirmed"
		}
		t.Run(name, func(t *testing.T) {
			w := newWorldOpts(t, 2, func(o *recorder.Options) { o.L7LB = func() bool { return confirmed } })
			a, b := w.pods[0], w.pods[1]
			w.ix.Track(a.Addr4) // a fresh pod: complete from its first flow
			w.ix.Track(a.Addr6)
			vip4 := netip.MustParseAddrPort("10.96.0.80:8080")
			vip6 := netip.MustParseAddrPort("[fd00:96::80]:8080")
			for _, vip := range []netip.AddrPort{vip4, vip6} {
				be := netip.AddrPortFrom(b.Addr4, netpods.EchoPort)
				if vip.Addr().Is6() {
					be = netip.AddrPortFrom(b.Addr6, netpods.EchoPort)
				}
				if err := w.dp.AddServiceFlags(ctmap.ProtoUDP, vip, 0, standin.SvcFlag2L7LB, be); err != nil {
					t.Fatal(err)
				}
			}
			for _, vip := range []netip.AddrPort{vip4, vip6} {
				if err := a.SendUDP(vip.Addr(), vip.Port()); err != nil {
					t.Fatal(err)
				}
			}
			// The stand-in kept the flow to the VIP, as Cilium does.
			var k ctmap.CTKey4
			var v ctmap.Entry
			found := false
			it := w.ct.Map(ctmap.Any4).Iterate()
			for it.Next(&k, &v) {
				if k.Flags() == ctmap.FlagService && k.SAddr() == a.Addr4 {
					t.Fatalf("stand-in made a SERVICE entry for an L7 VIP: %s", k)
				}
				if k.Flags() == ctmap.FlagOut && k.DAddr() == a.Addr4 && k.SAddr() == vip4.Addr() && k.DPort() == vip4.Port() {
					found = true
				}
			}
			if !found {
				t.Fatalf("stand-in made no OUT entry %s -> %s", a.Addr4, vip4)
			}
			ips := []netip.Addr{a.Addr4, a.Addr6}
			// OUT + RELATED per family.
			w.requireIndexed(t, ips, 4)
			deadline := time.Now().Add(2 * time.Second)
			for _, ip := range ips {
				for {
					st := w.ix.State(ip)
					if confirmed && !st.Complete {
						t.Fatalf("%s: %+v, want complete (its L7 flow indexed)", ip, st)
					}
					if confirmed || st.Incomplete == recorder.ReasonL7LBUnconfirmed {
						break
					}
					if time.Now().After(deadline) {
						t.Fatalf("%s: %+v, want incomplete (%s)", ip, st, recorder.ReasonL7LBUnconfirmed)
					}
					time.Sleep(20 * time.Millisecond)
				}
				if svcs := w.ix.Services(ip); len(svcs) != 0 {
					t.Errorf("%s: service state %+v for an L7 VIP flow", ip, svcs)
				}
			}
		})
	}
}
