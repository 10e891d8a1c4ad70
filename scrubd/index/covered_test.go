package index

import (
	"net/netip"
	"testing"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// A flow's scrub also deletes the same tuple with the other direction flag
// and its related entry: bpf_host's OUT entry for a NodePort or DSR
// connection to a local backend, the host firewall's twins
// (e2e/conformance: nodeport-*-backend, host-firewall-pod-node).
func TestCoveredAddsDirectionTwin(t *testing.T) {
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
	for _, w := range []ctmap.CTKey4{out.WithFlags(ctmap.FlagIn), out.WithFlags(ctmap.FlagIn).Related()} {
		found := false
		for _, k := range k4 {
			found = found || k == w
		}
		if !found {
			t.Errorf("Covered(%s) = %v, lacks %s", out, k4, w)
		}
	}
}
