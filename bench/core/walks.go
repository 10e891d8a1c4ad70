package main

import (
	"errors"
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// walkStats is what one full walk of the CT maps did.
type walkStats struct {
	visited, deleted int
	syscalls         int
}

// nextKeyWalk is Cilium 1.16's scrub: a user-space walk of every global CT
// map with BPF_MAP_GET_NEXT_KEY + BPF_MAP_LOOKUP_ELEM per entry, deleting
// the entries that hold ip. The next key is fetched before the current one
// is deleted, so a deletion never restarts the walk.
func nextKeyWalk(maps *ctmap.Maps, ip netip.Addr) (walkStats, error) {
	var st walkStats
	for _, k := range ctmap.Kinds {
		m := maps.Map(k)
		if m == nil {
			continue
		}
		var err error
		if k.IPv6() {
			err = nextKeyWalkMap[ctmap.CTKey6](m, ip, &st, func(k ctmap.CTKey6) bool { return k.Has(ip) })
		} else {
			err = nextKeyWalkMap[ctmap.CTKey4](m, ip, &st, func(k ctmap.CTKey4) bool { return k.Has(ip) })
		}
		if err != nil {
			return st, fmt.Errorf("NextKey walk of %s: %w", k.Name(), err)
		}
	}
	return st, nil
}

func nextKeyWalkMap[K ctmap.CTKey4 | ctmap.CTKey6](m *ebpf.Map, ip netip.Addr, st *walkStats, has func(K) bool) error {
	var key, next K
	var val ctmap.Entry
	if err := m.NextKey(nil, &key); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil
		}
		return err
	}
	st.syscalls++
	for {
		st.visited++
		// Cilium reads the value of every entry (its GC filter looks at it).
		if err := m.Lookup(&key, &val); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return err
		}
		err := m.NextKey(&key, &next)
		st.syscalls += 2
		if has(key) {
			if derr := m.Delete(&key); derr == nil {
				st.deleted++
			} else if !errors.Is(derr, ebpf.ErrKeyNotExist) {
				return derr
			}
			st.syscalls++
		}
		if err != nil {
			if errors.Is(err, ebpf.ErrKeyNotExist) {
				return nil
			}
			return err
		}
		key = next
	}
}

// batchWalk is Cilium 1.18+'s scrub: BPF_MAP_LOOKUP_BATCH over every global
// CT map, then the matching keys deleted (here in one BPF_MAP_DELETE_BATCH
// per map, which is kinder to the walk than Cilium's per-key deletes).
func batchWalk(maps *ctmap.Maps, ip netip.Addr, batch int) (walkStats, error) {
	var st walkStats
	for _, k := range ctmap.Kinds {
		m := maps.Map(k)
		if m == nil {
			continue
		}
		var err error
		if k.IPv6() {
			err = batchWalkMap(m, batch, &st, func(k ctmap.CTKey6) bool { return k.Has(ip) })
		} else {
			err = batchWalkMap(m, batch, &st, func(k ctmap.CTKey4) bool { return k.Has(ip) })
		}
		if err != nil {
			return st, fmt.Errorf("batch walk of %s: %w", k.Name(), err)
		}
	}
	return st, nil
}

func batchWalkMap[K ctmap.CTKey4 | ctmap.CTKey6](m *ebpf.Map, batch int, st *walkStats, has func(K) bool) error {
	keys := make([]K, batch)
	vals := make([]ctmap.Entry, batch)
	var matched []K
	var cursor ebpf.MapBatchCursor
	for {
		n, err := m.BatchLookup(&cursor, keys, vals, nil)
		st.syscalls++
		for _, k := range keys[:n] {
			st.visited++
			if has(k) {
				matched = append(matched, k)
			}
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			break // end of the map
		}
		if err != nil {
			return err
		}
	}
	for len(matched) > 0 {
		n, err := m.BatchDelete(matched, nil)
		st.syscalls++
		st.deleted += n
		matched = matched[n:]
		if err != nil {
			if !errors.Is(err, ebpf.ErrKeyNotExist) {
				return err
			}
			matched = matched[1:] // gone meanwhile
		}
	}
	return nil
}
