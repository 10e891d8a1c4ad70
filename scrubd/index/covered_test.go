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

// BenchmarkCovered: Covered of one IP's 1,000 keys, 500 flows each with
// its RELATED entry and a peer of its own (make bench's targets): 3,000 keys.
func BenchmarkCovered(b *testing.B) {
	pod, peer := netip.MustParseAddr("10.129.0.1"), netip.MustParseAddr("10.128.0.2")
	var k4 []ctmap.CTKey4
	for p := uint16(0); p < 500; p++ {
		pa := peer.As4()
		pa[2], pa[3] = byte(p>>8), byte(p)
		k := ctmap.NewKey4(pod, netip.AddrFrom4(pa), 80, 1000+p, 6, ctmap.FlagOut)
		k4 = append(k4, k, k.Related())
	}
	b.ResetTimer()
	n := 0
	for range b.N {
		x, _ := Covered(k4, nil)
		n = len(x)
	}
	b.ReportMetric(float64(n), "keys")
}
