package index

import (
	"net/netip"
	"testing"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// An inbound flow's scrub also deletes the OUT-flagged entry bpf_host
// creates for a NodePort connection to a local backend or a DSR connection
// to a backend on this node (e2e/conformance: nodeport-*-backend).
func TestCoveredInboundAddsNodePortOut(t *testing.T) {
	client, pod := netip.MustParseAddr("198.51.100.7"), netip.MustParseAddr("10.244.0.9")
	in := ctmap.NewKey4(client, pod, 8080, 50001, ctmap.ProtoTCP, ctmap.FlagIn)
	k4, _ := Covered([]ctmap.CTKey4{in}, nil)
	want := in.WithFlags(ctmap.FlagOut)
	found := false
	for _, k := range k4 {
		found = found || k == want
	}
	if !found {
		t.Fatalf("Covered(%s) = %v, lacks %s", in, k4, want)
	}
	out := ctmap.NewKey4(pod, client, 50001, 8080, ctmap.ProtoTCP, ctmap.FlagOut)
	k4, _ = Covered([]ctmap.CTKey4{out}, nil)
	for _, k := range k4 {
		if k == out.WithFlags(ctmap.FlagIn) {
			t.Fatalf("Covered(%s) adds %s: only IN keys get the OUT twin", out, k)
		}
	}
}
