package ctmap

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cilium/ebpf"
)

// DefaultRoot is where Cilium pins its global maps.
const DefaultRoot = "/sys/fs/bpf/tc/globals"

// Kind names one of Cilium's four global CT maps.
type Kind int

const (
	TCP4 Kind = iota
	Any4
	TCP6
	Any6
	NumKinds
)

// Kinds lists the four global maps in the order Cilium's scrub visits them.
var Kinds = [NumKinds]Kind{TCP4, Any4, TCP6, Any6}

// Name is the map's pin name.
func (k Kind) Name() string {
	switch k {
	case TCP4:
		return "cilium_ct4_global"
	case Any4:
		return "cilium_ct_any4_global"
	case TCP6:
		return "cilium_ct6_global"
	case Any6:
		return "cilium_ct_any6_global"
	}
	return fmt.Sprintf("ctmap.Kind(%d)", int(k))
}

func (k Kind) String() string { return k.Name() }

// IPv6 reports whether the map holds CTKey6 keys.
func (k Kind) IPv6() bool { return k == TCP6 || k == Any6 }

// KeySize is the key size the map must have.
func (k Kind) KeySize() uint32 {
	if k.IPv6() {
		return KeySize6
	}
	return KeySize4
}

// Spec is the layout Cilium gives the map; tests and benchmarks use it to make
// maps of their own with maxEntries entries.
func (k Kind) Spec(maxEntries uint32) *ebpf.MapSpec {
	return &ebpf.MapSpec{
		Name:       k.Name(),
		Type:       ebpf.LRUHash,
		KeySize:    k.KeySize(),
		ValueSize:  EntrySize,
		MaxEntries: maxEntries,
	}
}

// Maps holds Cilium's global CT maps, opened from their pins. A family whose
// maps are not pinned (IPv6 disabled in Cilium) has nil entries.
type Maps struct {
	Root string
	maps [NumKinds]*ebpf.Map
	max  [NumKinds]uint32
	// The SNAT maps (nat.go), v4 and v6: nil when not pinned or not usable
	// (natErr says why).
	nat    [2]*ebpf.Map
	natErr [2]error
	// ids are the kernel IDs of the maps held, the CT maps' then the SNAT
	// maps' (natSlot) (0: absent or unknown).
	ids [numSlots]ebpf.MapID
	// pins are the inodes of the pins last found to hold the maps held (0:
	// unknown, or no pin): Replaced's cheap check.
	pins [numSlots]atomic.Uint64
	// dir is Root's stat when every pin was last found to be the one
	// noted, taken when Root had not changed for dirSettle: while Root
	// still has that mtime no pin under it was added, removed or renamed
	// (bpffs sets a directory's mtime on each), and Replaced answers with
	// that one stat.
	dir atomic.Pointer[dirStamp]
}

// dirStamp identifies a directory and its last change.
type dirStamp struct {
	dev, ino uint64
	mtime    syscall.Timespec
}

func stampOf(st *syscall.Stat_t) dirStamp {
	return dirStamp{dev: st.Dev, ino: st.Ino, mtime: st.Mtim}
}

// dirSettle: a directory changed less than this before its stat may change
// again within the same mtime tick (bpffs uses the coarse clock), so such a
// stat is not kept as Maps.dir. A variable for tests.
var dirSettle = time.Second

// numSlots counts the maps Replaced watches: the CT maps and the SNAT maps.
const numSlots = int(NumKinds) + 2

// slotName is the pin name of slot i of Maps.ids and Maps.pins.
func slotName(i int) string {
	if i < int(NumKinds) {
		return Kind(i).Name()
	}
	return NATName(i == natSlot(true))
}

// Open opens the global CT maps under root (DefaultRoot when empty) and checks
// their type, key and value sizes. The IPv4 maps must be present; the IPv6 maps
// are optional as a pair (Cilium creates them only with IPv6 enabled).
func Open(root string) (*Maps, error) {
	if root == "" {
		root = DefaultRoot
	}
	m := &Maps{Root: root}
	for _, k := range Kinds {
		mp, err := openOne(root, k)
		if err != nil {
			if k.IPv6() && errors.Is(err, os.ErrNotExist) {
				continue
			}
			m.Close()
			return nil, err
		}
		m.maps[k] = mp
		m.max[k] = mp.MaxEntries()
		m.ids[k] = mapID(mp)
	}
	if (m.maps[TCP6] == nil) != (m.maps[Any6] == nil) {
		m.Close()
		return nil, fmt.Errorf("open CT maps under %s: only one of %s and %s is pinned (is Cilium mid-upgrade? both or neither must exist)",
			root, TCP6.Name(), Any6.Name())
	}
	m.openNAT(false)
	if m.HasIPv6() {
		m.openNAT(true)
	}
	return m, nil
}

// MapError is returned by Open for a missing or mismatched map.
type MapError struct {
	Path string
	Err  error
}

func (e *MapError) Error() string { return e.Path + ": " + e.Err.Error() }
func (e *MapError) Unwrap() error { return e.Err }

func openOne(root string, k Kind) (*ebpf.Map, error) {
	path := filepath.Join(root, k.Name())
	mp, err := ebpf.LoadPinnedMap(path, nil)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, &MapError{path, fmt.Errorf("open CT map: %w (is Cilium running on this node, and is the bpffs root %q right? set --ct-root)", os.ErrNotExist, root)}
		}
		return nil, &MapError{path, fmt.Errorf("open CT map: %w (is bpffs mounted at /sys/fs/bpf and are we root?)", err)}
	}
	if err := Check(k, mp); err != nil {
		mp.Close()
		return nil, &MapError{path, err}
	}
	return mp, nil
}

// ErrLayout marks a map whose type or sizes are not Cilium's CT layout.
var ErrLayout = errors.New("not a Cilium CT map layout")

// Check verifies that mp has the type, key and value size Cilium gives map k.
func Check(k Kind, mp *ebpf.Map) error {
	if t := mp.Type(); t != ebpf.LRUHash && t != ebpf.Hash {
		return fmt.Errorf("%w: map type %s, expected LRU_HASH (is this pin really %s?)", ErrLayout, t, k.Name())
	}
	if ks := mp.KeySize(); ks != k.KeySize() {
		return fmt.Errorf("%w: key size %d, expected %d (struct ipv%d_ct_tuple; unsupported Cilium version?)", ErrLayout, ks, k.KeySize(), map[bool]int{false: 4, true: 6}[k.IPv6()])
	}
	if vs := mp.ValueSize(); vs != EntrySize {
		return fmt.Errorf("%w: value size %d, expected %d (struct ct_entry; unsupported Cilium version?)", ErrLayout, vs, EntrySize)
	}
	return nil
}

// FromMaps wraps maps that are already open (tests, benchmarks). Entries may
// be nil for an absent family. Each non-nil map is checked.
func FromMaps(maps [NumKinds]*ebpf.Map) (*Maps, error) {
	m := &Maps{}
	for _, k := range Kinds {
		if maps[k] == nil {
			continue
		}
		if err := Check(k, maps[k]); err != nil {
			return nil, fmt.Errorf("%s: %w", k.Name(), err)
		}
		m.maps[k] = maps[k]
		m.max[k] = maps[k].MaxEntries()
		m.ids[k] = mapID(maps[k])
	}
	if m.maps[TCP4] == nil && m.maps[TCP6] == nil {
		return nil, errors.New("no CT map given")
	}
	return m, nil
}

// Map returns the map of kind k, or nil when that family is not present.
func (m *Maps) Map(k Kind) *ebpf.Map { return m.maps[k] }

// MaxEntries is the map's max_entries as read from the kernel (0 if absent).
func (m *Maps) MaxEntries(k Kind) uint32 { return m.max[k] }

// HasIPv6 reports whether the IPv6 maps are present.
func (m *Maps) HasIPv6() bool { return m.maps[TCP6] != nil }

// Close closes every map. Pins are left alone.
func (m *Maps) Close() error {
	var errs []error
	for i, mp := range m.maps {
		if mp != nil {
			errs = append(errs, mp.Close())
			m.maps[i] = nil
		}
	}
	for i, mp := range m.nat {
		if mp != nil {
			errs = append(errs, mp.Close())
			m.nat[i] = nil
		}
	}
	return errors.Join(errs...)
}

func mapID(mp *ebpf.Map) ebpf.MapID {
	info, err := mp.Info()
	if err != nil {
		return 0
	}
	id, _ := info.ID()
	return id
}

// ID is the kernel ID of the map of kind k held (0 when absent).
func (m *Maps) ID(k Kind) ebpf.MapID { return m.ids[k] }

// Replaced reports whether the maps pinned under Root now are other maps than
// the ones held: Cilium re-created them (an agent restart that changed their
// layout or size, a downgrade, an operator's cleanup) and the held ones are
// orphans its datapath no longer writes. A pin that is missing (between
// Cilium's unpin and its re-create) does not count as replaced: the caller
// checks again later. Maps made by FromMaps (no Root) are never replaced.
//
// It runs before every scrub, so on every CNI ADD and DEL: while Root has
// not changed since the pins were last found unchanged, one stat of Root
// is the answer; when each pin is still the inode last found to hold the
// map held (a stat per map, a few microseconds each: a re-created map is
// pinned anew, as a new inode), that is the answer; otherwise one
// BPF_OBJ_GET and one map info query per map (about 0.1 ms each on a
// loaded node), which also notes the pins' inodes.
func (m *Maps) Replaced() (bool, error) {
	if m.Root == "" {
		return false, nil
	}
	// Root is read before the pins: a pin changed after this stat changes
	// Root's mtime after it too, so the stamp kept below no longer matches.
	var ds syscall.Stat_t
	dirErr := syscall.Stat(m.Root, &ds)
	if dirErr == nil {
		if s := m.dir.Load(); s != nil && *s == stampOf(&ds) {
			return false, nil
		}
	}
	var inos [numSlots]uint64
	same := true
	for k := range numSlots {
		if k == natSlot(true) && !m.HasIPv6() {
			continue // not opened without the IPv6 CT maps
		}
		var st syscall.Stat_t
		if syscall.Stat(filepath.Join(m.Root, slotName(k)), &st) == nil {
			inos[k] = st.Ino
		}
		if inos[k] != m.pins[k].Load() || (inos[k] == 0 && m.ids[k] != 0) {
			same = false
		}
	}
	if same {
		if dirErr == nil && time.Since(time.Unix(ds.Mtim.Unix())) >= dirSettle {
			st := stampOf(&ds)
			m.dir.Store(&st)
		}
		return false, nil
	}
	m.dir.Store(nil)
	var errs []error
	for k := range numSlots {
		if k == natSlot(true) && !m.HasIPv6() {
			continue // not opened without the IPv6 CT maps
		}
		m.pins[k].Store(0)
		path := filepath.Join(m.Root, slotName(k))
		mp, err := ebpf.LoadPinnedMap(path, &ebpf.LoadPinOptions{ReadOnly: true})
		if errors.Is(err, os.ErrNotExist) {
			if k >= int(NumKinds) && m.ids[k] != 0 {
				// An SNAT map gone (NodePort and BPF masquerade turned
				// off): the scrubs' programs still hold it.
				return true, nil
			}
			continue
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", path, err))
			continue
		}
		id := mapID(mp)
		mp.Close()
		if id != 0 && id != m.ids[k] {
			return true, nil
		}
		if id != 0 {
			// Stat before the load: a pin replaced in between is seen by
			// the load (another ID) or by the next check (another inode).
			m.pins[k].Store(inos[k])
		}
	}
	return false, errors.Join(errs...)
}
