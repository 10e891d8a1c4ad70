package main

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/bench/internal/ctfill"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
)

// The simulated node: every entry belongs to a local pod (pod CIDR
// 10.128.0.0/10) talking to a remote peer outside it.
var (
	podCIDR = netip.MustParsePrefix("10.128.0.0/10")
	target  = netip.MustParseAddr("10.128.0.1")
)

// v6MapEntries sizes the IPv6 maps: present (Cilium walks them too) but
// empty, and small so their preallocated LRU memory stays low.
const v6MapEntries = 65536

// node is one set of Cilium-layout CT maps in a private bpffs directory,
// filled with n entries and indexed.
type node struct {
	dir  string
	maps *ctmap.Maps
	ix   *index.Index
	n    int
	k    int
	pods int

	// The target's flows, to refill its entries between repetitions.
	targetRecs []recorder.Record
	target4    map[ctmap.Kind][]ctmap.CTKey4

	fillTime      time.Duration
	applyTime     time.Duration
	records       int
	heapPerKey    float64
	indexKeys     int64
	heapDeltaByte uint64

	// count returns a map's entry count; the Cilium backend's Count.
	count func(ctmap.Kind) (int64, error)
}

// newNode creates the maps: TCP and any maps of n max entries each (Cilium
// sizes the map; the walks visit every bucket), IPv6 maps small and empty.
func newNode(n, k, pods int) (*node, error) {
	dir, err := os.MkdirTemp("/sys/fs/bpf", "ctscrub-bench-")
	if err != nil {
		return nil, fmt.Errorf("create a private bpffs dir under /sys/fs/bpf: %w (is bpffs mounted? run scripts/setup.sh)", err)
	}
	nd := &node{dir: dir, n: n, k: k, pods: pods, target4: map[ctmap.Kind][]ctmap.CTKey4{}}
	for _, kind := range ctmap.Kinds {
		max := uint32(n)
		if kind.IPv6() {
			max = v6MapEntries
		}
		m, err := ebpf.NewMap(kind.Spec(max))
		if err != nil {
			nd.close()
			return nil, fmt.Errorf("create %s with %d entries: %w (out of memory? try a smaller ENTRIES)", kind.Name(), max, err)
		}
		err = m.Pin(filepath.Join(dir, kind.Name()))
		m.Close()
		if err != nil {
			nd.close()
			return nil, fmt.Errorf("pin %s: %w", kind.Name(), err)
		}
	}
	if nd.maps, err = ctmap.Open(dir); err != nil {
		nd.close()
		return nil, err
	}
	nd.ix = index.New(index.Config{PodCIDRs: []netip.Prefix{podCIDR}})
	return nd, nil
}

func (nd *node) close() {
	if nd.maps != nil {
		nd.maps.Close()
	}
	os.RemoveAll(nd.dir)
}

// fill writes n entries (the target's k among them) with BatchUpdate and
// indexes every one of them through recorder.Apply, the recorder's path. It
// measures the index's heap per key: runtime.GC before both readings, and
// nothing but the index allocated in between except fixed buffers.
func (nd *node) fill() error {
	const chunk = 1 << 16
	tcp := make([]ctmap.CTKey4, 0, chunk)
	anyK := make([]ctmap.CTKey4, 0, 2*chunk)
	vals := make([]ctmap.Entry, 2*chunk)
	val := ctmap.EncodeEntry(ctmap.EntryFields{Lifetime: 1 << 30, Packets: 10, Bytes: 1500})
	for i := range vals {
		vals[i] = val
	}
	recs := make([]recorder.Record, 0, chunk)
	podIPs := make([]netip.Addr, nd.pods)
	for p := range podIPs {
		podIPs[p] = ctfill.AddrAt(target, 1+p) // 10.128.0.2 ...
	}

	flush := func() error {
		for _, b := range []struct {
			kind ctmap.Kind
			keys []ctmap.CTKey4
		}{{ctmap.TCP4, tcp}, {ctmap.Any4, anyK}} {
			if len(b.keys) == 0 {
				continue
			}
			if _, err := nd.maps.Map(b.kind).BatchUpdate(b.keys, vals[:len(b.keys)], nil); err != nil {
				return fmt.Errorf("fill %s: %w", b.kind.Name(), err)
			}
		}
		t := time.Now()
		for i := range recs {
			recorder.Apply(nd.ix, &recs[i])
		}
		nd.applyTime += time.Since(t)
		nd.records += len(recs)
		tcp, anyK, recs = tcp[:0], anyK[:0], recs[:0]
		return nil
	}
	add := func(k ctmap.CTKey4, withRelated bool) {
		if k.Kind() == ctmap.TCP4 {
			tcp = append(tcp, k)
		} else {
			anyK = append(anyK, k)
		}
		if withRelated {
			anyK = append(anyK, k.Related())
		}
		r := recorder.Record{Family: 4, Kind: recorder.RecFlow}
		copy(r.Key[:], k[:])
		recs = append(recs, r)
	}

	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	start := time.Now()

	// Every pod IP has been on the node since the index started.
	nd.ix.Track(target)
	for _, p := range podIPs {
		nd.ix.Track(p)
	}

	// The target's k entries: k/2 flows, each with its related entry.
	peerT := netip.MustParseAddr("12.0.0.0")
	for j := 0; 2*j < nd.k; j++ {
		k := ctfill.FlowKey(target, ctfill.AddrAt(peerT, j), j)
		withRel := 2*j+1 < nd.k
		add(k, withRel)
		nd.target4[k.Kind()] = append(nd.target4[k.Kind()], k)
		if withRel {
			nd.target4[ctmap.Any4] = append(nd.target4[ctmap.Any4], k.Related())
		}
		nd.targetRecs = append(nd.targetRecs, recs[len(recs)-1])
	}
	// The rest: pods round robin, each flow with a peer of its own.
	peerB := netip.MustParseAddr("11.0.0.0")
	for i := 0; i < (nd.n-nd.k)/2; i++ {
		add(ctfill.FlowKey(podIPs[i%nd.pods], ctfill.AddrAt(peerB, i), i), true)
		if len(recs) == chunk {
			if err := flush(); err != nil {
				return err
			}
		}
	}
	if (nd.n-nd.k)%2 == 1 {
		add(ctfill.FlowKey(podIPs[0], netip.MustParseAddr("13.0.0.1"), 0), false)
	}
	if err := flush(); err != nil {
		return err
	}
	nd.fillTime = time.Since(start)

	// The fill buffers were allocated before the first reading: keep them
	// alive through the second so the difference is the index alone.
	runtime.GC()
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	runtime.KeepAlive(tcp)
	runtime.KeepAlive(anyK)
	runtime.KeepAlive(vals)
	runtime.KeepAlive(recs)
	nd.indexKeys = nd.ix.Keys()
	nd.heapDeltaByte = after.HeapAlloc - before.HeapAlloc
	nd.heapPerKey = float64(nd.heapDeltaByte) / float64(nd.indexKeys)

	got, err := nd.entries()
	if err != nil {
		return err
	}
	if got != int64(nd.n) {
		return fmt.Errorf("fill: the maps hold %d entries, want %d (LRU eviction? the maps are sized for it)", got, nd.n)
	}
	return nil
}

// entries counts the entries of every map: the kernel's element counter
// when the backend has it, else a batch walk.
func (nd *node) entries() (int64, error) {
	var total int64
	for _, kind := range ctmap.Kinds {
		var n int64
		var err error
		if nd.count != nil {
			n, err = nd.count(kind)
		} else {
			n, err = ctfill.Count(nd.maps.Map(kind))
		}
		if err != nil {
			return 0, err
		}
		total += n
	}
	return total, nil
}

// refill puts the target's entries back into the maps and its records
// through recorder.Apply, as new traffic would.
func (nd *node) refill() error {
	val := ctmap.EncodeEntry(ctmap.EntryFields{Lifetime: 1 << 30, Packets: 10, Bytes: 1500})
	for kind, keys := range nd.target4 {
		vals := make([]ctmap.Entry, len(keys))
		for i := range vals {
			vals[i] = val
		}
		if _, err := nd.maps.Map(kind).BatchUpdate(keys, vals, nil); err != nil {
			return fmt.Errorf("refill %s: %w", kind.Name(), err)
		}
	}
	for i := range nd.targetRecs {
		recorder.Apply(nd.ix, &nd.targetRecs[i])
	}
	return nil
}

// targetLeft counts the target's entries still in the maps.
func (nd *node) targetLeft() int {
	var val ctmap.Entry
	left := 0
	for kind, keys := range nd.target4 {
		for _, k := range keys {
			if nd.maps.Map(kind).Lookup(k, &val) == nil {
				left++
			}
		}
	}
	return left
}

// check verifies a scrub: none of the target's entries left, every other
// entry still there.
func (nd *node) check(method string) error {
	if left := nd.targetLeft(); left != 0 {
		return fmt.Errorf("%s left %d of the target's %d entries", method, left, nd.k)
	}
	got, err := nd.entries()
	if err != nil {
		return err
	}
	if want := int64(nd.n - nd.k); got != want {
		return fmt.Errorf("%s: the maps hold %d entries, want %d (wrong deletions)", method, got, want)
	}
	return nil
}
