// Package ctfill is the benchmarks' one way to make a busy node's CT
// entries: the flow keys (bench/core fills its own maps with them,
// bench/ciliumnode a real Cilium node's), the lifetimes that make a share of
// them expired in Cilium's clock, and the batch writes and counts.
package ctfill

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// FlowKey returns the CT key of flow i of pod with peer: the kind mix of a
// busy node (50% TCP out, 30% TCP in, 20% UDP out). Give every flow a peer of
// its own and the related ICMP entry Cilium adds (Key.Related) is unique too.
func FlowKey(pod, peer netip.Addr, i int) ctmap.CTKey4 {
	eph := uint16(32768 + i%28000)
	switch i % 10 {
	case 0, 1, 2, 3, 4:
		return ctmap.NewKey4(pod, peer, 443, eph, ctmap.ProtoTCP, ctmap.FlagOut)
	case 5, 6, 7:
		return ctmap.NewKey4(peer, pod, 8080, eph, ctmap.ProtoTCP, ctmap.FlagIn)
	default:
		return ctmap.NewKey4(pod, peer, 53, eph, ctmap.ProtoUDP, ctmap.FlagOut)
	}
}

// AddrAt is base + i.
func AddrAt(base netip.Addr, i int) netip.Addr {
	b := base.As4()
	v := binary.BigEndian.Uint32(b[:]) + uint32(i)
	binary.BigEndian.PutUint32(b[:], v)
	return netip.AddrFrom4(b)
}

// Count counts a map's entries with BPF_MAP_LOOKUP_BATCH; for checks outside
// the timed parts. The map must have a Cilium CT layout (key of either
// family, struct ct_entry values).
func Count(m *ebpf.Map) (int64, error) {
	const n = 4096
	var keys any = make([]ctmap.CTKey4, n)
	if m.KeySize() == ctmap.KeySize6 {
		keys = make([]ctmap.CTKey6, n)
	}
	vals := make([]ctmap.Entry, n)
	var cursor ebpf.MapBatchCursor
	var total int64
	for {
		got, err := m.BatchLookup(&cursor, keys, vals, nil)
		total += int64(got)
		if err != nil {
			if errors.Is(err, ebpf.ErrKeyNotExist) {
				return total, nil
			}
			return total, fmt.Errorf("count entries of %s: %w", m, err)
		}
	}
}

// CountAll sums Count over every map present.
func CountAll(maps *ctmap.Maps) (int64, error) {
	var total int64
	for _, k := range ctmap.Kinds {
		if m := maps.Map(k); m != nil {
			n, err := Count(m)
			if err != nil {
				return total, err
			}
			total += n
		}
	}
	return total, nil
}
