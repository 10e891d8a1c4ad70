// Package ciliumwalk is the one baseline the demo and the benchmarks that
// time Cilium's walks (make bench, bench-incident, bench-expiry) compare
// ctscrub with: the full walks Cilium runs over its global CT maps to scrub
// an endpoint's IP or to expire entries.
//
//   - NextKey: Cilium 1.16 (ctmap.GC over DumpReliablyWithCallback): from
//     user space, BPF_MAP_GET_NEXT_KEY + BPF_MAP_LOOKUP_ELEM per entry, the
//     next key fetched before the current entry is deleted (so a deletion
//     never restarts the walk), BPF_MAP_DELETE_ELEM per match.
//   - Batch: Cilium 1.18+ (batched iteration): BPF_MAP_LOOKUP_BATCH in
//     chunks, then BPF_MAP_DELETE_ELEM per match.
//
// A Match decides from the key and the value (Cilium's filters look at both)
// whether an entry goes. With Options.CountOnly the walk deletes nothing (the
// demo times the walk and lets ctscrub delete).
package ciliumwalk

import (
	"context"
	"errors"
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// Match reports whether the entry (key of the map's kind, its value) goes.
type Match func(kind ctmap.Kind, key []byte, val *ctmap.Entry) bool

// HasIP matches entries holding any of ips as either address (an endpoint's
// scrub).
func HasIP(ips ...netip.Addr) Match {
	return func(kind ctmap.Kind, key []byte, _ *ctmap.Entry) bool {
		for _, ip := range ips {
			if kind.IPv6() {
				if ctmap.CTKey6(key).Has(ip) {
					return true
				}
			} else if ctmap.CTKey4(key).Has(ip) {
				return true
			}
		}
		return false
	}
}

// ExpiredAt matches entries whose lifetime lies before now (Cilium's clock).
func ExpiredAt(now uint32) Match {
	return func(_ ctmap.Kind, _ []byte, val *ctmap.Entry) bool { return val.Lifetime() < now }
}

// Options tune a walk. The zero value walks every entry and deletes matches.
type Options struct {
	// CountOnly: count the matches, delete nothing.
	CountOnly bool
	// MaxVisits stops a NextKey walk after that many entries (0: whole map);
	// Stats.Partial then says so.
	MaxVisits int
	// Batch is the BPF_MAP_LOOKUP_BATCH chunk (0: 4096; doubled when a hash
	// bucket does not fit).
	Batch int
	// Ctx, when set, is checked every 65,536 entries.
	Ctx context.Context
}

// Stats is what a walk did.
type Stats struct {
	Visited  int // entries read
	Matched  int // entries the Match accepted
	Deleted  int // of those, deleted by this walk
	Syscalls int
	Partial  bool // stopped at Options.MaxVisits
}

func (s *Stats) add(o Stats) {
	s.Visited += o.Visited
	s.Matched += o.Matched
	s.Deleted += o.Deleted
	s.Syscalls += o.Syscalls
	s.Partial = s.Partial || o.Partial
}

// NextKey walks every map of maps (nil ones skipped) the Cilium 1.16 way.
func NextKey(maps [ctmap.NumKinds]*ebpf.Map, match Match, opt Options) (Stats, error) {
	var st Stats
	for _, k := range ctmap.Kinds {
		if maps[k] == nil {
			continue
		}
		s, err := NextKeyMap(maps[k], k, match, opt)
		st.add(s)
		if err != nil {
			return st, fmt.Errorf("NextKey walk of %s: %w", k.Name(), err)
		}
		if s.Partial {
			break
		}
	}
	return st, nil
}

// Batch walks every map of maps (nil ones skipped) the Cilium 1.18+ way.
func Batch(maps [ctmap.NumKinds]*ebpf.Map, match Match, opt Options) (Stats, error) {
	var st Stats
	for _, k := range ctmap.Kinds {
		if maps[k] == nil {
			continue
		}
		s, err := BatchMap(maps[k], k, match, opt)
		st.add(s)
		if err != nil {
			return st, fmt.Errorf("batch walk of %s: %w", k.Name(), err)
		}
	}
	return st, nil
}

// Of returns the maps of a ctmap.Maps as the array the walks take.
func Of(m *ctmap.Maps) [ctmap.NumKinds]*ebpf.Map {
	var out [ctmap.NumKinds]*ebpf.Map
	for _, k := range ctmap.Kinds {
		out[k] = m.Map(k)
	}
	return out
}

func cancelled(opt *Options, visited int) error {
	if opt.Ctx != nil && visited%65536 == 0 {
		return opt.Ctx.Err()
	}
	return nil
}

// NextKeyMap is NextKey over one map of the given kind.
func NextKeyMap(m *ebpf.Map, kind ctmap.Kind, match Match, opt Options) (Stats, error) {
	var st Stats
	ks := kind.KeySize()
	cur, next := make([]byte, ks), make([]byte, ks)
	var val ctmap.Entry
	st.Syscalls++
	if err := m.NextKey(nil, cur); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return st, nil
		}
		return st, err
	}
	for {
		nextErr := m.NextKey(cur, next)
		err := m.Lookup(cur, &val)
		st.Syscalls += 2
		switch {
		case err == nil:
			st.Visited++
			if match(kind, cur, &val) {
				st.Matched++
				if !opt.CountOnly {
					st.Syscalls++
					if derr := m.Delete(cur); derr == nil {
						st.Deleted++
					} else if !errors.Is(derr, ebpf.ErrKeyNotExist) {
						return st, derr
					}
				}
			}
		case !errors.Is(err, ebpf.ErrKeyNotExist):
			// Deleted between the two calls (LRU or GC): Cilium skips it too.
			return st, err
		}
		if errors.Is(nextErr, ebpf.ErrKeyNotExist) {
			return st, nil
		}
		if nextErr != nil {
			return st, nextErr
		}
		if err := cancelled(&opt, st.Visited); err != nil {
			return st, err
		}
		if opt.MaxVisits > 0 && st.Visited >= opt.MaxVisits {
			st.Partial = true
			return st, nil
		}
		cur, next = next, cur
	}
}

// BatchMap is Batch over one map of the given kind.
func BatchMap(m *ebpf.Map, kind ctmap.Kind, match Match, opt Options) (Stats, error) {
	if kind.IPv6() {
		return batchMap[ctmap.CTKey6](m, kind, match, opt)
	}
	return batchMap[ctmap.CTKey4](m, kind, match, opt)
}

func batchMap[K ctmap.CTKey4 | ctmap.CTKey6](m *ebpf.Map, kind ctmap.Kind, match Match, opt Options) (Stats, error) {
	var st Stats
	size := opt.Batch
	if size <= 0 {
		size = 4096
	}
	keys, vals := make([]K, size), make([]ctmap.Entry, size)
	var doomed []K
	var cursor ebpf.MapBatchCursor
	for {
		n, err := m.BatchLookup(&cursor, keys, vals, nil)
		st.Syscalls++
		if errors.Is(err, unix.ENOSPC) { // a hash bucket larger than the buffer
			size *= 2
			keys, vals = make([]K, size), make([]ctmap.Entry, size)
			continue
		}
		for i := range n {
			st.Visited++
			var kb []byte
			switch k := any(&keys[i]).(type) {
			case *ctmap.CTKey4:
				kb = k[:]
			case *ctmap.CTKey6:
				kb = k[:]
			}
			if match(kind, kb, &vals[i]) {
				st.Matched++
				doomed = append(doomed, keys[i])
			}
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			break // end of the map
		}
		if err != nil {
			return st, err
		}
		if opt.Ctx != nil && opt.Ctx.Err() != nil {
			return st, opt.Ctx.Err()
		}
	}
	if opt.CountOnly {
		return st, nil
	}
	for i := range doomed {
		st.Syscalls++
		if err := m.Delete(&doomed[i]); err == nil {
			st.Deleted++
		} else if !errors.Is(err, ebpf.ErrKeyNotExist) {
			return st, err
		}
	}
	return st, nil
}
