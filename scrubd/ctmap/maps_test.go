package ctmap

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
)

// privateRoot makes a bpffs directory of the test's own to pin maps in.
func privateRoot(t *testing.T) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root for BPF maps and bpffs")
	}
	dir, err := os.MkdirTemp("/sys/fs/bpf", "ctscrub-test-")
	if err != nil {
		t.Skipf("bpffs not mounted at /sys/fs/bpf: %v", err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

func pin(t *testing.T, root string, spec *ebpf.MapSpec) *ebpf.Map {
	t.Helper()
	m, err := ebpf.NewMap(spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	if err := m.Pin(filepath.Join(root, spec.Name)); err != nil {
		t.Fatal(err)
	}
	return m
}

func TestOpenAllFour(t *testing.T) {
	root := privateRoot(t)
	for _, k := range Kinds {
		pin(t, root, k.Spec(1024+uint32(k)))
	}
	m, err := Open(root)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	for _, k := range Kinds {
		if m.Map(k) == nil || m.MaxEntries(k) != 1024+uint32(k) {
			t.Fatalf("%s: map %v max %d", k, m.Map(k), m.MaxEntries(k))
		}
	}
	if !m.HasIPv6() {
		t.Fatal("HasIPv6")
	}
}

func TestOpenIPv4Only(t *testing.T) {
	root := privateRoot(t)
	pin(t, root, TCP4.Spec(64))
	pin(t, root, Any4.Spec(64))
	m, err := Open(root)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if m.HasIPv6() || m.Map(TCP6) != nil {
		t.Fatal("v6 maps should be absent")
	}
}

func TestOpenMissingMap(t *testing.T) {
	root := privateRoot(t)
	_, err := Open(root)
	if err == nil {
		t.Fatal("Open of an empty root succeeded")
	}
	if !errors.Is(err, os.ErrNotExist) || !strings.Contains(err.Error(), "cilium_ct4_global") || !strings.Contains(err.Error(), "is Cilium running") {
		t.Fatalf("error does not name the map and what to check: %v", err)
	}
}

func TestOpenWrongKeySize(t *testing.T) {
	root := privateRoot(t)
	spec := TCP4.Spec(64)
	spec.KeySize = 16
	pin(t, root, spec)
	pin(t, root, Any4.Spec(64))
	_, err := Open(root)
	if !errors.Is(err, ErrLayout) || !strings.Contains(err.Error(), "key size 16, expected 14") || !strings.Contains(err.Error(), "cilium_ct4_global") {
		t.Fatalf("want a layout error naming map and sizes, got %v", err)
	}
}

func TestOpenWrongType(t *testing.T) {
	root := privateRoot(t)
	spec := TCP4.Spec(64)
	spec.Type = ebpf.Array
	spec.KeySize = 4
	pin(t, root, spec)
	_, err := Open(root)
	if !errors.Is(err, ErrLayout) || !strings.Contains(err.Error(), "expected LRU_HASH") {
		t.Fatalf("want a type error, got %v", err)
	}
}

func TestOpenHalfOfIPv6(t *testing.T) {
	root := privateRoot(t)
	pin(t, root, TCP4.Spec(64))
	pin(t, root, Any4.Spec(64))
	pin(t, root, TCP6.Spec(64))
	if _, err := Open(root); err == nil || !strings.Contains(err.Error(), "only one of") {
		t.Fatalf("want an error for a lone v6 map, got %v", err)
	}
}

// Replaced answers from the pins' inodes while they are the ones last seen
// holding the maps held, and looks the maps up again when a pin changed: a
// map re-created is replaced; the same map pinned again is not.
func TestReplacedCheapCheck(t *testing.T) {
	root := privateRoot(t)
	held := map[Kind]*ebpf.Map{}
	for _, k := range []Kind{TCP4, Any4} {
		held[k] = pin(t, root, k.Spec(1024))
	}
	m, err := Open(root)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	for i := range 2 { // the first call looks up, the second stats only
		if r, err := m.Replaced(); r || err != nil {
			t.Fatalf("call %d: replaced %v, %v; want false", i, r, err)
		}
	}
	if m.pins[TCP4].Load() == 0 || m.pins[Any4].Load() == 0 {
		t.Fatalf("pins not noted: %d %d", m.pins[TCP4].Load(), m.pins[Any4].Load())
	}
	// The same map unpinned and pinned again: a new inode, the same map.
	path := filepath.Join(root, TCP4.Name())
	before := m.pins[TCP4].Load()
	if err := held[TCP4].Unpin(); err != nil {
		t.Fatal(err)
	}
	if err := held[TCP4].Pin(path); err != nil {
		t.Fatal(err)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil || st.Ino == before {
		t.Fatalf("pinned again: inode %d (%v), was %d: the test needs a new inode", st.Ino, err, before)
	}
	if r, err := m.Replaced(); r || err != nil {
		t.Fatalf("same map pinned again: replaced %v, %v; want false", r, err)
	}
	if m.pins[TCP4].Load() != st.Ino {
		t.Errorf("the new pin's inode not noted")
	}
	// A new map under the pin: replaced, also on every later call.
	if err := held[TCP4].Unpin(); err != nil {
		t.Fatal(err)
	}
	pin(t, root, TCP4.Spec(2048))
	for i := range 2 {
		if r, err := m.Replaced(); !r || err != nil {
			t.Fatalf("call %d after re-create: replaced %v, %v; want true", i, r, err)
		}
	}
	// A family Cilium turns on later (IPv6 maps appear): replaced.
	m2, err := Open(root)
	if err != nil {
		t.Fatal(err)
	}
	defer m2.Close()
	m2.Replaced()
	pin(t, root, TCP6.Spec(1024))
	pin(t, root, Any6.Spec(1024))
	if r, _ := m2.Replaced(); !r {
		t.Fatal("IPv6 maps pinned after Open: not replaced")
	}
}

// Once Root has not changed for dirSettle, Replaced answers from Root's
// stat; a map re-created under it, or a pin added, changes Root's mtime and
// is seen at once.
func TestReplacedDirStamp(t *testing.T) {
	defer func(d time.Duration) { dirSettle = d }(dirSettle)
	dirSettle = 50 * time.Millisecond // bpffs's mtime ticks are a few ms
	root := privateRoot(t)
	held := pin(t, root, TCP4.Spec(1024))
	pin(t, root, Any4.Spec(1024))
	time.Sleep(2 * dirSettle)
	m, err := Open(root)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	for i := range 3 { // looks up, then stats the pins and keeps Root's stamp, then Root only
		if r, err := m.Replaced(); r || err != nil {
			t.Fatalf("call %d: replaced %v, %v; want false", i, r, err)
		}
	}
	if m.dir.Load() == nil {
		t.Fatal("Root's stamp not kept")
	}
	if err := held.Unpin(); err != nil {
		t.Fatal(err)
	}
	pin(t, root, TCP4.Spec(2048))
	if r, err := m.Replaced(); !r || err != nil {
		t.Fatalf("map re-created under a kept stamp: replaced %v, %v; want true", r, err)
	}
	m2, err := Open(root)
	if err != nil {
		t.Fatal(err)
	}
	defer m2.Close()
	time.Sleep(2 * dirSettle)
	for range 3 {
		m2.Replaced()
	}
	if m2.dir.Load() == nil {
		t.Fatal("Root's stamp not kept")
	}
	pin(t, root, TCP6.Spec(1024))
	pin(t, root, Any6.Spec(1024))
	if r, _ := m2.Replaced(); !r {
		t.Fatal("IPv6 maps pinned under a kept stamp: not replaced")
	}
}
