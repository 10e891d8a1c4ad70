package demo

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// walkResult is one full walk over the four CT maps, the way Cilium scrubs an
// IP: every entry is read, the ones with the IP are what it would delete.
type walkResult struct {
	Entries  int // entries read
	Matches  int // entries holding one of the IPs
	Duration time.Duration
}

// nextKeyWalk reads every entry with BPF_MAP_GET_NEXT_KEY + BPF_MAP_LOOKUP_ELEM,
// two syscalls per entry, as Cilium 1.16's ctmap.GC does for an endpoint's
// scrub. It deletes nothing: the demo times the walk, ctscrub does the delete.
func nextKeyWalk(ctx context.Context, m *ctMaps, ips []netip.Addr) (walkResult, error) {
	var r walkResult
	start := time.Now()
	for _, k := range ctmap.Kinds {
		mp := m.maps[k]
		key := make([]byte, mp.KeySize())
		next := make([]byte, mp.KeySize())
		var val ctmap.Entry
		var cur any // nil: start from the first key
		for {
			if err := mp.NextKey(cur, &next); err != nil {
				if errors.Is(err, ebpf.ErrKeyNotExist) {
					break
				}
				return r, fmt.Errorf("walk %s: next key: %w", k.Name(), err)
			}
			copy(key, next)
			cur = key
			if err := mp.Lookup(key, &val); err != nil {
				// Deleted between the two calls (LRU or GC): Cilium skips it too.
				if errors.Is(err, ebpf.ErrKeyNotExist) {
					continue
				}
				return r, fmt.Errorf("walk %s: lookup: %w", k.Name(), err)
			}
			r.Entries++
			if r.Entries%65536 == 0 && ctx.Err() != nil {
				return r, ctx.Err()
			}
			if keyHas(k, key, ips) {
				r.Matches++
			}
		}
	}
	r.Duration = time.Since(start)
	return r, nil
}

// batchWalkAll is nextKeyWalk with BPF_MAP_LOOKUP_BATCH, as Cilium 1.18+ does.
func batchWalkAll(m *ctMaps, ips []netip.Addr) (walkResult, error) {
	var r walkResult
	start := time.Now()
	for _, k := range ctmap.Kinds {
		n, match, err := batchWalk(m.maps[k], func(key []byte) bool { return keyHas(k, key, ips) })
		if err != nil {
			return r, fmt.Errorf("batch walk %s: %w", k.Name(), err)
		}
		r.Entries += n
		r.Matches += match
	}
	r.Duration = time.Since(start)
	return r, nil
}

const walkChunk = 4096

// batchWalk reads every entry of mp in chunks and counts those match accepts.
func batchWalk(mp *ebpf.Map, match func(key []byte) bool) (n, matched int, err error) {
	if mp.KeySize() == ctmap.KeySize6 {
		return batchWalkKeys[ctmap.CTKey6](mp, match)
	}
	return batchWalkKeys[ctmap.CTKey4](mp, match)
}

func batchWalkKeys[K ctmap.CTKey4 | ctmap.CTKey6](mp *ebpf.Map, match func(key []byte) bool) (n, matched int, err error) {
	keys := make([]K, walkChunk)
	vals := make([]ctmap.Entry, walkChunk)
	var cursor ebpf.MapBatchCursor
	for {
		got, err := mp.BatchLookup(&cursor, keys, vals, nil)
		n += got
		if match != nil {
			for i := 0; i < got; i++ {
				var kb []byte
				switch k := any(&keys[i]).(type) {
				case *ctmap.CTKey4:
					kb = k[:]
				case *ctmap.CTKey6:
					kb = k[:]
				}
				if match(kb) {
					matched++
				}
			}
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return n, matched, nil
		}
		if err != nil {
			return n, matched, err
		}
	}
}

func keyHas(k ctmap.Kind, key []byte, ips []netip.Addr) bool {
	for _, ip := range ips {
		if k.IPv6() {
			if ctmap.CTKey6(key).Has(ip) {
				return true
			}
		} else if ctmap.CTKey4(key).Has(ip) {
			return true
		}
	}
	return false
}

// entriesOf counts the entries holding ip in all four maps (a check, not a
// scrub: the demo uses it to show what a reused IP inherits).
func entriesOf(m *ctMaps, ips ...netip.Addr) (int, error) {
	r, err := batchWalkAll(m, ips)
	return r.Matches, err
}
