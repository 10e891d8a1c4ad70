package index

import (
	"bytes"
	"net/netip"
	"slices"
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

// coveredRef is Covered written the plain way, through ctmap's methods and
// a Go map: what the byte-level covered must equal, order included.
func coveredRef[K interface {
	comparable
	Flags() uint8
	Related() K
	WithFlags(uint8) K
}](keys []K, mirror func(K) K) []K {
	var out []K
	seen := map[K]bool{}
	add := func(k K) {
		if !seen[k] {
			seen[k] = true
			out = append(out, k)
		}
	}
	for _, k := range keys {
		add(k)
		if k.Flags()&ctmap.FlagService != 0 {
			continue
		}
		m := mirror(k)
		add(m)
		if k.Flags()&ctmap.FlagRelated == 0 {
			add(k.Related())
			add(m.Related())
			tw := k.WithFlags(k.Flags() ^ ctmap.FlagIn)
			add(tw)
			add(tw.Related())
		}
	}
	return out
}

// mirrorRef4 and mirrorRef6 build the other-initiator key from its fields.
func mirrorRef4(k ctmap.CTKey4) ctmap.CTKey4 {
	return ctmap.NewKey4(k.SAddr(), k.DAddr(), k.SPort(), k.DPort(), k.NextHdr(), k.Flags()^ctmap.FlagIn)
}

func mirrorRef6(k ctmap.CTKey6) ctmap.CTKey6 {
	return ctmap.NewKey6(k.SAddr(), k.DAddr(), k.SPort(), k.DPort(), k.NextHdr(), k.Flags()^ctmap.FlagIn)
}

// TestCoveredMatchesReference: both families, every flag, flows sharing
// peers (so RELATED forms repeat), both directions of one flow (so a mirror
// is another indexed key), at sizes that use each table type, appended
// after keys already in the buffer.
func TestCoveredMatchesReference(t *testing.T) {
	pod4, pod6 := netip.MustParseAddr("10.244.0.9"), netip.MustParseAddr("fd00::9")
	flags := []uint8{ctmap.FlagOut, ctmap.FlagIn, ctmap.FlagRelated, ctmap.FlagRelated | ctmap.FlagIn, ctmap.FlagService}
	for _, n := range []int{1, 7, 1000, 12000} { // 12,000 keys: more forms than a uint16 table holds
		var k4 []ctmap.CTKey4
		var k6 []ctmap.CTKey6
		for i := range n {
			peer4 := netip.AddrFrom4([4]byte{198, 51, byte(i % 37), 1})
			peer6 := netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 15: byte(i % 37)})
			f := flags[i%len(flags)]
			proto := []uint8{ctmap.ProtoTCP, ctmap.ProtoUDP}[i%2]
			sport, dport := uint16(30000+i), uint16(80+i%3)
			k := ctmap.NewKey4(pod4, peer4, dport, sport, proto, f)
			k4 = append(k4, k)
			k6 = append(k6, ctmap.NewKey6(peer6, pod6, sport, dport, proto, f))
			if i%11 == 0 {
				k4 = append(k4, mirrorRef4(k)) // both initiators indexed
			}
		}
		want4, want6 := coveredRef(k4, mirrorRef4), coveredRef(k6, mirrorRef6)
		got4, got6 := Covered(k4, k6)
		if !slices.Equal(got4, want4) || !slices.Equal(got6, want6) {
			t.Fatalf("%d keys: Covered gave %d and %d keys, the reference %d and %d (or another order)", n, len(got4), len(got6), len(want4), len(want6))
		}
		pre4 := []ctmap.CTKey4{want4[0], ctmap.NewKey4(pod4, pod4, 1, 1, ctmap.ProtoUDP, 0)}
		pre6 := []ctmap.CTKey6{want6[0]}
		got4, got6 = AppendCovered(slices.Clone(pre4), slices.Clone(pre6), k4, k6)
		if !slices.Equal(got4, append(pre4, want4...)) || !slices.Equal(got6, append(pre6, want6...)) {
			t.Fatalf("%d keys: AppendCovered did not append Covered's keys after the buffer's", n)
		}
		// Keys first: the same set, the keys (each once, in their
		// order) before every form, appended after the buffer's.
		x4, f4, x6, f6 := AppendCoveredKeysFirst(slices.Clone(pre4), slices.Clone(pre6), k4, k6)
		if !slices.Equal(x4[:len(pre4)], pre4) || !slices.Equal(x6[:len(pre6)], pre6) {
			t.Fatalf("%d keys: AppendCoveredKeysFirst changed the buffer's keys", n)
		}
		if !slices.Equal(x4[len(pre4):f4], slices.Compact(slices.Clone(k4))) || !slices.Equal(x6[len(pre6):f6], k6) {
			t.Fatalf("%d keys: AppendCoveredKeysFirst's first %d and %d keys are not the indexed keys", n, f4-len(pre4), f6-len(pre6))
		}
		sorted4, sorted6 := slices.Clone(x4[len(pre4):]), slices.Clone(x6[len(pre6):])
		ref4, ref6 := slices.Clone(want4), slices.Clone(want6)
		for _, l := range [][]ctmap.CTKey4{sorted4, ref4} {
			slices.SortFunc(l, func(a, b ctmap.CTKey4) int { return bytes.Compare(a[:], b[:]) })
		}
		for _, l := range [][]ctmap.CTKey6{sorted6, ref6} {
			slices.SortFunc(l, func(a, b ctmap.CTKey6) int { return bytes.Compare(a[:], b[:]) })
		}
		if !slices.Equal(sorted4, ref4) || !slices.Equal(sorted6, ref6) {
			t.Fatalf("%d keys: AppendCoveredKeysFirst gave %d and %d keys, Covered %d and %d (or other keys)", n, len(sorted4), len(sorted6), len(ref4), len(ref6))
		}
	}
}
