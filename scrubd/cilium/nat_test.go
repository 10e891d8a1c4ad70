package cilium

import (
	"context"
	"encoding/binary"
	"net/netip"
	"slices"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
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

// BenchmarkDeleteKeysWithSNAT is BenchmarkDeleteKeys/program (1,000 OUT
// flows, 4,000 keys of which 2,000 present) with Cilium's SNAT map present,
// each flow holding its forward and reverse mapping: the cost of deleting
// the mappings with the entries. "none" is the same with no SNAT map.
func BenchmarkDeleteKeysWithSNAT(b *testing.B) {
	needRoot(b)
	node := netip.MustParseAddr("172.18.0.2")
	pod := netip.MustParseAddr("10.244.0.7")
	for _, withNAT := range []bool{false, true} {
		name := map[bool]string{false: "none", true: "snat"}[withNAT]
		b.Run(name, func(b *testing.B) {
			maps := pinnedMaps(b, 1<<16, false)
			var nat *ebpf.Map
			if withNAT {
				var err error
				if nat, err = ebpf.NewMap(ctmap.NATSpec(false, 1<<16)); err != nil {
					b.Fatal(err)
				}
				defer nat.Close()
				if err := maps.SetNAT(nat, nil); err != nil {
					b.Fatal(err)
				}
			}
			c := newCilium(b, maps, newIndex())
			var keys, present, mappings []ctmap.CTKey4
			var values [][]byte
			for port := uint16(1); port <= 1000; port++ {
				peer := netip.AddrFrom4([4]byte{198, 18, byte(port >> 8), byte(port)})
				k := ctmap.NewKey4(pod, peer, 80, port, 6, ctmap.FlagOut)
				x4, _ := index.Covered([]ctmap.CTKey4{k, k.Related()}, nil)
				keys = append(keys, x4...)
				present = append(present, k, k.Related())
				mappings = append(mappings, ctmap.NewKey4(peer, pod, 80, port, 6, ctmap.FlagOut), ctmap.NewKey4(node, peer, 20000+port, 80, 6, ctmap.FlagIn))
				values = append(values, natValue(node, 20000+port), natValue(pod, port))
			}
			tcp, other := splitTCP(slices.Clone(keys), ctmap.TCP4)
			var val ctmap.Entry
			for b.Loop() {
				b.StopTimer()
				for _, k := range present {
					if err := maps.Map(k.Kind()).Put(k, val); err != nil {
						b.Fatal(err)
					}
				}
				if nat != nil {
					for i, k := range mappings {
						if err := nat.Put(k, values[i]); err != nil {
							b.Fatal(err)
						}
					}
				}
				b.StartTimer()
				deleted := map[string]int{}
				var left []ctmap.CTKey4
				if err := deleteFrom(context.Background(), maps.Map(ctmap.TCP4), c.del, ctmap.TCP4, tcp, 1024, deleted, &left); err != nil {
					b.Fatal(err)
				}
				if err := deleteFrom(context.Background(), maps.Map(ctmap.Any4), c.del, ctmap.Any4, other, 1024, deleted, &left); err != nil {
					b.Fatal(err)
				}
				if withNAT && deleted[ctmap.NATName4] != len(mappings) {
					b.Fatalf("deleted %v, want %d SNAT mappings", deleted, len(mappings))
				}
			}
		})
	}
}
