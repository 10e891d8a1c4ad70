package index

import (
	"hash/maphash"
	"net/netip"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// ScrubKeys lists the CT keys an index scrub of ip deletes: Covered of the
// keys the index holds for it. It is the one definition of "covered": the
// Cilium backend deletes exactly these, and the audit counts a kernel key of
// a complete IP as missing when it is not among them.
func (ix *Index) ScrubKeys(ip netip.Addr) (k4 []ctmap.CTKey4, k6 []ctmap.CTKey6, st State) {
	k4, k6, st = ix.KeysOf(ip)
	k4, k6 = Covered(k4, k6)
	return k4, k6, st
}

// Covered expands an IP's indexed keys into every key a scrub deletes for
// them, without duplicates. For each flow key (neither RELATED nor SERVICE):
// the key, its RELATED twin, and the same flow with the other initiator
// (addresses and ports swapped, OUT and IN flipped) with its RELATED twin.
// Cilium's LRU may evict a live flow's entry; if the other side's packet
// comes first, Cilium re-creates the flow with that side as the initiator,
// and the recorder, which caches flows without their direction, does not
// record it again. Deleting that key costs one failed delete when it is
// absent. A RELATED key adds its other-initiator form; a SERVICE key (its
// daddr is a VIP) is only itself.
//
// Every flow key also adds its twin, the same tuple with the other
// direction flag (OUT and IN flipped), with its RELATED twin: a second
// program of Cilium's on the node tracks the same connection in the other
// direction, and nothing in the packets the pod sees tells when. Found by
// e2e/conformance at v1.16.5, v1.18.8 and v1.20.2: bpf_host's NodePort
// path creates an OUT entry beside the pod's IN one for a NodePort
// connection to a local backend and for DSR on the backend's node; the
// host firewall creates IN (pod to node) and OUT (node to pod) twins with
// their RELATED entries. Two failed deletes per flow when absent.
func Covered(k4 []ctmap.CTKey4, k6 []ctmap.CTKey6) ([]ctmap.CTKey4, []ctmap.CTKey6) {
	return covered(k4, Mirror4), covered(k6, Mirror6)
}

// ctKey is what covered needs of CTKey4 and CTKey6.
type ctKey[K any] interface {
	comparable
	Flags() uint8
	Related() K
	WithFlags(uint8) K
}

// covered is Covered for one family, each key once. It dedups with an
// open-addressing table of indexes into out, sized for the six forms of
// every key: a scrub of 1,000 keys adds up to 6,000 forms, and a Go map of
// them cost 0.28 ms for 1,000 keys (BenchmarkCovered; this table 0.19 ms),
// most of make bench's `take` step.
func covered[K ctKey[K]](keys []K, mirror func(K) K) []K {
	if len(keys) == 0 {
		return nil
	}
	out := make([]K, 0, 3*len(keys))
	size := 1
	for size < 12*len(keys) { // at most 6 forms per key, half full at worst
		size <<= 1
	}
	slots := make([]int32, size) // 0: empty; i+1: out[i]
	seed := maphash.MakeSeed()
	add := func(k K) {
		for i := maphash.Comparable(seed, k) & uint64(size-1); ; i = (i + 1) & uint64(size-1) {
			switch s := slots[i]; {
			case s == 0:
				out = append(out, k)
				slots[i] = int32(len(out))
				return
			case out[s-1] == k:
				return
			}
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

// Mirror4 is the key of the same flow with the other side as the initiator:
// daddr and saddr swapped, dport and sport swapped, OUT and IN flipped.
func Mirror4(k ctmap.CTKey4) ctmap.CTKey4 {
	var m ctmap.CTKey4
	copy(m[0:4], k[4:8])
	copy(m[4:8], k[0:4])
	copy(m[8:10], k[10:12])
	copy(m[10:12], k[8:10])
	m[12] = k[12]
	m[13] = k[13] ^ ctmap.FlagIn
	return m
}

// Mirror6 is Mirror4 for IPv6 keys.
func Mirror6(k ctmap.CTKey6) ctmap.CTKey6 {
	var m ctmap.CTKey6
	copy(m[0:16], k[16:32])
	copy(m[16:32], k[0:16])
	copy(m[32:34], k[34:36])
	copy(m[34:36], k[32:34])
	m[36] = k[36]
	m[37] = k[37] ^ ctmap.FlagIn
	return m
}
