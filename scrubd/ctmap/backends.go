package ctmap

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
)

// Names of Cilium's backend maps (key: backend ID, u32; value: struct
// lb4_backend / lb6_backend), pinned beside the CT maps. The same name and
// layout in 1.16 to 1.20 (read in each version's bpf/lib/common.h): address,
// port (network order), proto, flags, cluster ID, zone, pad; 12 and 24
// bytes. e2e/conformance reads every backend it adds back through Backends
// from Cilium's own maps, at each version.
const (
	BackendMap4 = "cilium_lb4_backends_v3"
	BackendMap6 = "cilium_lb6_backends_v3"
)

// Backend is one entry of a backend map.
type Backend struct {
	Addr  netip.Addr
	Port  uint16
	Flags uint8 // 0: BE_STATE_ACTIVE; Cilium re-picks a SYN's backend otherwise
}

// Backends are Cilium's two backend maps; a family whose map is not pinned
// has none (every lookup misses).
type Backends struct {
	m [2]*ebpf.Map
}

// OpenBackends opens the backend maps pinned under root.
func OpenBackends(root string) (*Backends, error) {
	b := &Backends{}
	for i, name := range []string{BackendMap4, BackendMap6} {
		m, err := ebpf.LoadPinnedMap(filepath.Join(root, name), &ebpf.LoadPinOptions{ReadOnly: true})
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			b.Close()
			return nil, fmt.Errorf("open Cilium backend map %s: %w", filepath.Join(root, name), err)
		}
		// Exactly the known layout: a longer value may have moved the
		// fields, and a backend read wrong would be a guess.
		if want := uint32(12 + 12*i); m.KeySize() != 4 || m.ValueSize() != want {
			m.Close()
			b.Close()
			return nil, fmt.Errorf("Cilium backend map %s: key %d value %d bytes, expected 4 and %d (an unsupported Cilium version? ctscrub knows 1.16 to 1.20)",
				filepath.Join(root, name), m.KeySize(), m.ValueSize(), want)
		}
		b.m[i] = m
	}
	return b, nil
}

// Lookup returns backend id of the family of v6; ok false when it is not
// in the map (removed, or never there).
func (b *Backends) Lookup(v6 bool, id uint32) (be Backend, ok bool, err error) {
	i := 0
	if v6 {
		i = 1
	}
	m := b.m[i]
	if m == nil {
		return Backend{}, false, nil
	}
	v := make([]byte, m.ValueSize())
	if err := m.Lookup(id, v); errors.Is(err, ebpf.ErrKeyNotExist) {
		return Backend{}, false, nil
	} else if err != nil {
		return Backend{}, false, err
	}
	if v6 {
		be.Addr = netip.AddrFrom16([16]byte(v[:16]))
		be.Port = binary.BigEndian.Uint16(v[16:18])
		be.Flags = v[19]
	} else {
		be.Addr = netip.AddrFrom4([4]byte(v[:4]))
		be.Port = binary.BigEndian.Uint16(v[4:6])
		be.Flags = v[7]
	}
	return be, true, nil
}

// Close closes the maps.
func (b *Backends) Close() {
	for _, m := range b.m {
		if m != nil {
			m.Close()
		}
	}
}
