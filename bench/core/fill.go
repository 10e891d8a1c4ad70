package main

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/bench/internal/ctfill"
	"github.com/ctscrub/ctscrub/scrubd/cilium"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
)

// The simulated node: every entry belongs to a local pod (pod CIDR
// 10.128.0.0/10) talking to a remote peer outside it. The scrubbed IPs
// ("targets") are a pool of their own, from 10.129.0.0: each timed scrub
// takes a fresh one, whose keys were indexed during the fill and not touched
// since (no re-insert before a scrub, so no warm cache).
var (
	podCIDR    = netip.MustParsePrefix("10.128.0.0/10")
	podBase    = netip.MustParseAddr("10.128.0.1")
	targetBase = netip.MustParseAddr("10.129.0.0")
)

// v6MapEntries sizes the IPv6 maps: present (Cilium walks them too) but
// empty, and small so their preallocated LRU memory stays low.
const v6MapEntries = 65536

// node is one set of Cilium-layout CT maps in a private bpffs directory,
// filled with n entries and indexed.
type node struct {
	dir  string
	maps *ctmap.Maps
	ix   *index.Index // the running scrubd's index
	n    int
	k    int
	pods int

	// The target pool: each target's k entries, by map; next is the first
	// target not scrubbed yet, deleted the entries scrubbed so far.
	targets []netip.Addr
	target4 [][]ctmap.CTKey4 // allocated before the fill: not counted as index memory
	next    int
	deleted int

	// The scrubd the socket figures go through (see daemon.go).
	scrubd *scrubd

	// extra is added to a series run's time (an extrapolated partial walk).
	extra time.Duration

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
func newNode(n, k, pods, targets int) (*node, error) {
	dir, err := os.MkdirTemp("/sys/fs/bpf", "ctscrub-bench-")
	if err != nil {
		return nil, fmt.Errorf("create a private bpffs dir under /sys/fs/bpf: %w (is bpffs mounted? run scripts/setup.sh)", err)
	}
	nd := &node{dir: dir, n: n, k: k, pods: pods}
	all := make([]ctmap.CTKey4, targets*k)
	for i := range targets {
		nd.targets = append(nd.targets, ctfill.AddrAt(targetBase, i))
		nd.target4 = append(nd.target4, all[i*k:i*k:(i+1)*k])
	}
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
	return nd, nil
}

// take returns the next fresh target.
func (nd *node) take() (netip.Addr, int, error) {
	if nd.next == len(nd.targets) {
		return netip.Addr{}, 0, fmt.Errorf("target pool of %d IPs used up", len(nd.targets))
	}
	nd.next++
	return nd.targets[nd.next-1], nd.next - 1, nil
}

func (nd *node) close() {
	if nd.scrubd != nil {
		nd.scrubd.close()
	}
	if nd.maps != nil {
		nd.maps.Close()
	}
	os.RemoveAll(nd.dir)
}

// fill writes n entries (each target's k among them) with BatchUpdate and
// indexes every one of them through recorder.Apply, the path every record
// of the recorder's ring buffer takes into scrubd's index. The IPs were
// made complete before by scrubd itself (complete, in main.go: a sweep
// through the socket, as for a pod whose index is not known complete). It
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
	podIPs := nd.podIPs()

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

	// Each target's k entries: k/2 flows, each with its related entry.
	peerT := netip.MustParseAddr("12.0.0.0")
	for t, ip := range nd.targets {
		for j := 0; 2*j < nd.k; j++ {
			k := ctfill.FlowKey(ip, ctfill.AddrAt(peerT, t*nd.k+j), j)
			withRel := 2*j+1 < nd.k
			add(k, withRel)
			nd.target4[t] = append(nd.target4[t], k)
			if withRel {
				nd.target4[t] = append(nd.target4[t], k.Related())
			}
			if len(recs) == chunk {
				if err := flush(); err != nil {
					return err
				}
			}
		}
	}
	// The rest: pods round robin, each flow with a peer of its own.
	peerB := netip.MustParseAddr("11.0.0.0")
	rest := nd.n - len(nd.targets)*nd.k
	for i := 0; i < rest/2; i++ {
		add(ctfill.FlowKey(podIPs[i%nd.pods], ctfill.AddrAt(peerB, i), i), true)
		if len(recs) == chunk {
			if err := flush(); err != nil {
				return err
			}
		}
	}
	if rest%2 == 1 {
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

// deleteTarget deletes the target's entries by key (after a partial walk),
// untimed.
func (nd *node) deleteTarget(target netip.Addr) error {
	i := slices.Index(nd.targets, target)
	if i < 0 {
		return fmt.Errorf("%s is not a target", target)
	}
	for _, k := range nd.target4[i] {
		if err := nd.maps.Map(k.Kind()).Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return err
		}
	}
	return nil
}

// podIPs are the node's other pods.
func (nd *node) podIPs() []netip.Addr {
	ips := make([]netip.Addr, nd.pods)
	for p := range ips {
		ips[p] = ctfill.AddrAt(podBase, 1+p) // 10.128.0.2 ...
	}
	return ips
}

// targetLeft counts target t's entries still in the maps.
func (nd *node) targetLeft(t int) int {
	var val ctmap.Entry
	left := 0
	for _, k := range nd.target4[t] {
		if nd.maps.Map(k.Kind()).Lookup(k, &val) == nil {
			left++
		}
	}
	return left
}

// scrubbed records that target t was scrubbed and checks it: none of its
// entries left. full also checks that every other entry is still there.
func (nd *node) scrubbed(method string, t int, full bool) error {
	if left := nd.targetLeft(t); left != 0 {
		return fmt.Errorf("%s left %d of %s's %d entries", method, left, nd.targets[t], nd.k)
	}
	nd.deleted += nd.k
	if !full {
		return nil
	}
	got, err := nd.entries()
	if err != nil {
		return err
	}
	if want := int64(nd.n - nd.deleted); got != want {
		return fmt.Errorf("%s: the maps hold %d entries, want %d (wrong deletions)", method, got, want)
	}
	return nil
}

// live tracks the node whose bpffs dir must go on an interrupt.
var live = make(chan *node, 1)

// setup creates and fills a node of n entries and loads the backend on it.
func setup(cfg config, n int) (*node, *cilium.Backend, error) {
	nd, err := newNode(n, cfg.perIP, cfg.pods, cfg.targets())
	if err != nil {
		return nil, nil, err
	}
	select {
	case <-live:
	default:
	}
	live <- nd
	if nd.scrubd, err = startScrubd(nd.dir); err != nil {
		nd.close()
		return nil, nil, err
	}
	nd.ix = nd.scrubd.d.Index()
	if err := nd.scrubd.complete(append(nd.podIPs(), nd.targets...)); err != nil {
		nd.close()
		return nil, nil, err
	}
	// The backend-only figures: the same backend code over the same maps
	// and scrubd's index, called directly.
	c, err := cilium.New(nd.maps, nd.ix, cilium.Options{})
	if err != nil {
		nd.close()
		return nil, nil, err
	}
	if err := c.DeleteError(); err != nil {
		// The figures would time the fallback, not the index scrub.
		c.Close()
		nd.close()
		return nil, nil, fmt.Errorf("the kernel refused the delete program: %w", err)
	}
	if c.CountIsCheap() {
		nd.count = c.Count
	}
	fmt.Printf("filling %d entries ...\n", n)
	if err := nd.fill(); err != nil {
		c.Close()
		nd.close()
		return nil, nil, err
	}
	return nd, c, nil
}
