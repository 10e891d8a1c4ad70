package cilium

import (
	"context"
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// natMaps are CT maps with Cilium's IPv4 SNAT map beside them.
func natMaps(t *testing.T) (*ctmap.Maps, *ebpf.Map) {
	t.Helper()
	maps := pinnedMaps(t, 4096, false)
	nat, err := ebpf.NewMap(ctmap.NATSpec(false, 4096))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { nat.Close() })
	if err := maps.SetNAT(nat, nil); err != nil {
		t.Fatal(err)
	}
	return maps, nat
}

func natValue(to netip.Addr, port uint16) []byte {
	v := make([]byte, ctmap.NATEntrySize4)
	a := to.As4()
	copy(v[32:], a[:])
	binary.BigEndian.PutUint16(v[36:], port)
	return v
}

// TestScrubDeletesSNATMappings checks, for the index path and the sweep,
// that deleting an OUT entry deletes its forward and reverse SNAT mappings
// and nothing else (the full comparison with Cilium's own scrub is
// e2e/ciliumgc).
func TestScrubDeletesSNATMappings(t *testing.T) {
	needRoot(t)
	pod := netip.MustParseAddr("10.244.0.5")
	node := netip.MustParseAddr("172.18.0.2")
	for _, method := range []scrub.Method{scrub.MethodIndex, scrub.MethodSweep} {
		t.Run(string(method), func(t *testing.T) {
			maps, nat := natMaps(t)
			ix := newIndex()
			c := newCilium(t, maps, ix)
			out := ctmap.NewKey4(pod, remote4, 80, 40000, ctmap.ProtoTCP, ctmap.FlagOut)
			in := ctmap.NewKey4(remote4, pod, 8080, 40001, ctmap.ProtoTCP, ctmap.FlagIn)
			var e ctmap.Entry
			for _, k := range []ctmap.CTKey4{out, in} {
				if err := maps.Map(ctmap.TCP4).Put(k, e); err != nil {
					t.Fatal(err)
				}
			}
			fwd := ctmap.NewKey4(remote4, pod, 80, 40000, ctmap.ProtoTCP, ctmap.FlagOut)
			rev := ctmap.NewKey4(node, remote4, 50000, 80, ctmap.ProtoTCP, ctmap.FlagIn)
			inLike := ctmap.NewKey4(pod, remote4, 8080, 40001, ctmap.ProtoTCP, ctmap.FlagIn)
			for k, v := range map[ctmap.CTKey4][]byte{fwd: natValue(node, 50000), rev: natValue(pod, 40000), inLike: natValue(node, 1)} {
				if err := nat.Put(k, v); err != nil {
					t.Fatal(err)
				}
			}
			if method == scrub.MethodIndex {
				ix.Track(pod)
				ix.Add4(out)
				ix.Add4(in)
			}
			res, err := c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{pod}, Reason: scrub.ReasonDel})
			if err != nil {
				t.Fatal(err)
			}
			if res.PerIP[pod.String()] != method {
				t.Fatalf("method %q, want %q", res.PerIP[pod.String()], method)
			}
			if res.Total != 2 || res.NATDeleted[ctmap.NATName4] != 2 {
				t.Errorf("deleted %d CT entries and %v SNAT mappings, want 2 and 2", res.Total, res.NATDeleted)
			}
			var v [ctmap.NATEntrySize4]byte
			for _, k := range []ctmap.CTKey4{fwd, rev} {
				if nat.Lookup(k, &v) == nil {
					t.Errorf("SNAT mapping %s left", k)
				}
			}
			if nat.Lookup(inLike, &v) != nil {
				t.Errorf("SNAT key %s of no OUT entry deleted", inLike)
			}
		})
	}
}
