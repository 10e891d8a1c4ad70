package ctmap

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
)

// Cilium's global SNAT maps (pkg/maps/nat, v1.16-1.20), pinned beside the CT
// maps when NodePort or BPF masquerade is on. Each TUPLE_F_OUT CT entry may
// own mappings there, which Cilium's scrub deletes with the entry (and
// ctscrub's too: bpf/include/ctscrub_nat.h).
const (
	NATName4 = "cilium_snat_v4_external"
	NATName6 = "cilium_snat_v6_external"
	// NATEntrySize4 and NATEntrySize6 are struct ipv4_nat_entry and
	// ipv6_nat_entry. The keys are the CT keys' layout.
	NATEntrySize4 = 40
	NATEntrySize6 = 56
)

// NATName is the pin name of the family's SNAT map.
func NATName(ipv6 bool) string {
	if ipv6 {
		return NATName6
	}
	return NATName4
}

// NATSpec is the layout Cilium gives the family's SNAT map, for tests and
// benchmarks that make their own.
func NATSpec(ipv6 bool, maxEntries uint32) *ebpf.MapSpec {
	s := &ebpf.MapSpec{Name: NATName(ipv6), Type: ebpf.LRUHash, KeySize: KeySize4, ValueSize: NATEntrySize4, MaxEntries: maxEntries}
	if ipv6 {
		s.KeySize, s.ValueSize = KeySize6, NATEntrySize6
	}
	return s
}

// CheckNAT verifies that mp has the layout of the family's SNAT map.
func CheckNAT(ipv6 bool, mp *ebpf.Map) error {
	want := NATSpec(ipv6, 0)
	if t := mp.Type(); t != ebpf.LRUHash && t != ebpf.Hash {
		return fmt.Errorf("%w: map type %s, expected LRU_HASH (is this pin really %s?)", ErrLayout, t, NATName(ipv6))
	}
	if mp.KeySize() != want.KeySize || mp.ValueSize() != want.ValueSize {
		return fmt.Errorf("%w: key/value size %d/%d, expected %d/%d (struct ipv%d_ct_tuple / ipv%d_nat_entry; unsupported Cilium version?)",
			ErrLayout, mp.KeySize(), mp.ValueSize(), want.KeySize, want.ValueSize, map[bool]int{false: 4, true: 6}[ipv6], map[bool]int{false: 4, true: 6}[ipv6])
	}
	return nil
}

// natSlot is the index of the family's SNAT map in Maps.ids and Maps.pins,
// after the CT maps'.
func natSlot(ipv6 bool) int {
	if ipv6 {
		return int(NumKinds) + 1
	}
	return int(NumKinds)
}

func natIndex(ipv6 bool) int {
	if ipv6 {
		return 1
	}
	return 0
}

// openNAT opens the family's SNAT map under m.Root, when pinned. A map that
// is pinned but cannot be used is not an error of Open (CT scrubs do not
// need it): NATError says why, and whoever promises the SNAT deletes
// (the delegate API) must not.
func (m *Maps) openNAT(ipv6 bool) {
	i := natIndex(ipv6)
	path := filepath.Join(m.Root, NATName(ipv6))
	mp, err := ebpf.LoadPinnedMap(path, nil)
	if errors.Is(err, os.ErrNotExist) {
		return
	}
	if err != nil {
		m.natErr[i] = fmt.Errorf("open SNAT map %s: %w (its mappings are not deleted with the CT entries)", path, err)
		return
	}
	m.ids[natSlot(ipv6)] = mapID(mp)
	if err := CheckNAT(ipv6, mp); err != nil {
		mp.Close()
		m.natErr[i] = fmt.Errorf("SNAT map %s: %w (its mappings are not deleted with the CT entries)", path, err)
		return
	}
	m.nat[i] = mp
}

// SetNAT gives maps made by FromMaps their SNAT maps (nil: none for that
// family); each is checked. The maps stay the caller's until Close.
func (m *Maps) SetNAT(nat4, nat6 *ebpf.Map) error {
	for i, mp := range []*ebpf.Map{nat4, nat6} {
		if mp == nil {
			continue
		}
		if err := CheckNAT(i == 1, mp); err != nil {
			return fmt.Errorf("%s: %w", NATName(i == 1), err)
		}
	}
	m.nat = [2]*ebpf.Map{nat4, nat6}
	m.ids[natSlot(false)], m.ids[natSlot(true)] = 0, 0
	if nat4 != nil {
		m.ids[natSlot(false)] = mapID(nat4)
	}
	if nat6 != nil {
		m.ids[natSlot(true)] = mapID(nat6)
	}
	return nil
}

// NAT returns the family's SNAT map, or nil when Cilium has none pinned (no
// NodePort or BPF masquerade) or it could not be used (NATError).
func (m *Maps) NAT(ipv6 bool) *ebpf.Map { return m.nat[natIndex(ipv6)] }

// NATError says why the family's pinned SNAT map is not used (nil when it
// is, or when none is pinned).
func (m *Maps) NATError(ipv6 bool) error { return m.natErr[natIndex(ipv6)] }
