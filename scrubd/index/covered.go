package index

import (
	"encoding/binary"
	"math/bits"
	"net/netip"
	"slices"
	"sync"
	"unsafe"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// ScrubKeys lists the CT keys an index scrub of ip deletes: Covered of the
// keys the index holds for it. It is the one definition of "covered": the
// Cilium backend deletes exactly these, and the audit counts a kernel key of
// a complete IP as missing when it is not among them.
func (ix *Index) ScrubKeys(ip netip.Addr) (k4 []ctmap.CTKey4, k6 []ctmap.CTKey6, st State) {
	ix.resolve(ip)
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
	return AppendCovered(nil, nil, k4, k6)
}

// AppendCovered is Covered appending to dst4 and dst6 (a scrub's reused
// buffers: a fresh 42 KB slice per scrub of 1,000 keys is fresh memory the
// process faults in, between two GC cycles of a large index).
func AppendCovered(dst4 []ctmap.CTKey4, dst6 []ctmap.CTKey6, k4 []ctmap.CTKey4, k6 []ctmap.CTKey6) ([]ctmap.CTKey4, []ctmap.CTKey6) {
	x4, _ := covered(dst4, k4, false)
	x6, _ := covered(dst6, k6, false)
	return x4, x6
}

// AppendCoveredKeysFirst is AppendCovered with the keys (each once) first
// and their forms after them: x4[f4:] and x6[f6:] are the keys Covered adds
// to k4 and k6. The index scrub starts deleting k4 and k6 while it makes
// the forms.
func AppendCoveredKeysFirst(dst4 []ctmap.CTKey4, dst6 []ctmap.CTKey6, k4 []ctmap.CTKey4, k6 []ctmap.CTKey6) (x4 []ctmap.CTKey4, f4 int, x6 []ctmap.CTKey6, f6 int) {
	x4, f4 = covered(dst4, k4, true)
	x6, f6 = covered(dst6, k6, true)
	return x4, f4, x6, f6
}

// key is CTKey4 or CTKey6. covered works on the key's bytes (layout in
// scrubd/ctmap: daddr, saddr, dport, sport, nexthdr, flags), so each family
// compiles to its own code with constant offsets: through CTKey4's methods,
// which a generic function calls indirectly, it cost four times as much.
type key interface {
	~[ctmap.KeySize4]byte | ~[ctmap.KeySize6]byte
}

// slot is a dedup table entry: 0 empty, i+1 the i-th key added. uint16
// while a scrub's forms fit (most pods): the table is read in random order
// right after a delete step that evicted the caches, so its size in cache
// lines is its cost.
type slot interface{ uint16 | uint32 }

// slotPools recycle covered's tables, one per slot type.
var slotPools = [2]sync.Pool{
	{New: func() any { return new([]uint16) }},
	{New: func() any { return new([]uint32) }},
}

// coverSet is covered's output and its dedup table: open addressing over
// indexes into out[base:].
type coverSet[K key, S slot] struct {
	out   []K
	base  int
	slots []S
	mask  uint64
}

func bytesOf[K key](k *K) []byte { return unsafe.Slice((*byte)(unsafe.Pointer(k)), len(*k)) }

// hashKey hashes a key by two machine words (their XOR folds for IPv6 keys)
// with keySet's mix and per-process seed, so no pod can pick flows that all
// land in one chain of the table.
func hashKey(b []byte) uint64 {
	le := binary.LittleEndian
	if len(b) == ctmap.KeySize4 {
		return mix(mix(hashSeed, le.Uint64(b[0:8])), le.Uint64(b[6:14]))
	}
	return mix(mix(hashSeed, le.Uint64(b[0:8])^le.Uint64(b[16:24])),
		le.Uint64(b[8:16])^le.Uint64(b[24:32])^le.Uint64(b[30:38]))
}

// keep keeps the form written at out[n], just past the n keys kept so far,
// unless it is one of them, and returns how many are kept.
func (c *coverSet[K, S]) keep(n int) int {
	k := &c.out[n]
	for i := hashKey(bytesOf(k)) & c.mask; ; i = (i + 1) & c.mask {
		s := c.slots[i]
		if s == 0 {
			c.slots[i] = S(n + 1 - c.base)
			return n + 1
		}
		if c.out[c.base+int(s)-1] == *k {
			return n
		}
	}
}

// mirrorIn turns the key at k into its mirror (Mirror4, Mirror6) in place:
// addresses and ports swapped, OUT and IN flipped. In machine words: an
// IPv4 key's two addresses are one 64-bit word, either family's ports one
// 32-bit word.
func mirrorIn[K key](k *K) {
	b := bytesOf(k)
	le := binary.LittleEndian
	a := (len(b) - 6) / 2 // address size
	if a == 4 {
		le.PutUint64(b[0:8], bits.RotateLeft64(le.Uint64(b[0:8]), 32))
	} else {
		d0, d1 := le.Uint64(b[0:8]), le.Uint64(b[8:16])
		le.PutUint64(b[0:8], le.Uint64(b[16:24]))
		le.PutUint64(b[8:16], le.Uint64(b[24:32]))
		le.PutUint64(b[16:24], d0)
		le.PutUint64(b[24:32], d1)
	}
	le.PutUint32(b[2*a:2*a+4], bits.RotateLeft32(le.Uint32(b[2*a:2*a+4]), 16))
	b[len(b)-1] ^= ctmap.FlagIn
}

// mirror is Mirror4 and Mirror6.
func mirror[K key](k K) K {
	mirrorIn(&k)
	return k
}

// covered is Covered for one family, each key once, appended to dst. It
// dedups with an open-addressing table sized for the six forms of every
// key, at most three quarters full: a scrub of 1,000 keys adds up to 6,000
// forms. Each form is made in place, in the slot past the kept keys, and
// kept or overwritten: passed by value, a 14-byte key went through the
// stack as two overlapping 8-byte stores that the next loads could not be
// forwarded from. BenchmarkCovered, 1,000 keys: 0.28 ms with a Go map,
// 0.22 ms with a table of int32 through the keys' methods and
// hash/maphash, 0.115 ms with forms passed by value (warm caches; session
// 6); on 2026-12-02's loaded machine 0.13 ms passed by value, 0.08 ms made
// in place (minimum of alternating runs; docs/bench.md). keysFirst puts
// every key before every form; from is where the forms start.
func covered[K key](dst, keys []K, keysFirst bool) (out []K, from int) {
	if len(keys) == 0 {
		return dst, len(dst)
	}
	if 6*len(keys) < 1<<16 {
		return coverWith[K, uint16](dst, keys, &slotPools[0], keysFirst)
	}
	return coverWith[K, uint32](dst, keys, &slotPools[1], keysFirst)
}

func coverWith[K key, S slot](dst, keys []K, pool *sync.Pool, keysFirst bool) ([]K, int) {
	size := 1
	for 3*size < 4*6*len(keys) {
		size <<= 1
	}
	tab := pool.Get().(*[]S)
	if cap(*tab) < size {
		*tab = make([]S, size)
	}
	base := len(dst)
	c := coverSet[K, S]{out: slices.Grow(dst, 3*len(keys)), base: base, slots: (*tab)[:size], mask: uint64(size - 1)}
	c.out = c.out[:cap(c.out)]
	n := base
	if keysFirst {
		for i := range keys {
			if n+1 > len(c.out) {
				c.out = slices.Grow(c.out[:n], 1+len(keys)-i)
				c.out = c.out[:cap(c.out)]
			}
			c.out[n] = keys[i]
			n = c.keep(n)
		}
	}
	from := n
	for i := range keys {
		if n+6 > len(c.out) { // room for this key's forms
			c.out = slices.Grow(c.out[:n], 6+3*(len(keys)-i))
			c.out = c.out[:cap(c.out)]
		}
		k := &keys[i]
		flags := bytesOf(k)[len(*k)-1]
		if !keysFirst {
			c.out[n] = *k
			n = c.keep(n)
		}
		if flags&ctmap.FlagService != 0 {
			continue
		}
		c.out[n] = *k
		mirrorIn(&c.out[n])
		n = c.keep(n)
		if flags&ctmap.FlagRelated != 0 {
			continue
		}
		c.out[n] = *k
		ctmap.MakeRelated(bytesOf(&c.out[n]))
		n = c.keep(n)
		c.out[n] = *k
		mirrorIn(&c.out[n])
		ctmap.MakeRelated(bytesOf(&c.out[n]))
		n = c.keep(n)
		c.out[n] = *k
		bytesOf(&c.out[n])[len(*k)-1] ^= ctmap.FlagIn
		n = c.keep(n)
		c.out[n] = *k
		bytesOf(&c.out[n])[len(*k)-1] ^= ctmap.FlagIn
		ctmap.MakeRelated(bytesOf(&c.out[n]))
		n = c.keep(n)
	}
	clear(c.slots)
	pool.Put(tab)
	if !keysFirst {
		from = base
	}
	return c.out[:n], from
}

// Mirror4 is the key of the same flow with the other side as the initiator:
// daddr and saddr swapped, dport and sport swapped, OUT and IN flipped.
func Mirror4(k ctmap.CTKey4) ctmap.CTKey4 { return mirror(k) }

// Mirror6 is Mirror4 for IPv6 keys.
func Mirror6(k ctmap.CTKey6) ctmap.CTKey6 { return mirror(k) }
