package cilium

import (
	"context"
	"errors"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/scrub"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

var (
	podA  = netip.MustParseAddr("10.244.0.5")
	podB  = netip.MustParseAddr("10.244.0.6")
	podC  = netip.MustParseAddr("10.244.0.7")
	podA6 = netip.MustParseAddr("fd00:10:244::5")
	podB6 = netip.MustParseAddr("fd00:10:244::6")
)

// trackedWorld builds maps holding flows of several pods, every pod tracked
// from its creation and every flow recorded, so the index is complete.
func trackedWorld(t *testing.T, maxEntries uint32) (*world, *Backend) {
	needRoot(t)
	maps := pinnedMaps(t, maxEntries, true)
	ix := newIndex()
	for _, ip := range []netip.Addr{podA, podB, podC, podA6, podB6} {
		ix.Track(ip)
	}
	w := newWorld(t, maps, ix)
	w.addFlows(podA, podB, 40, true)
	w.addFlows(podB, podC, 30, true)
	w.addFlows(podC, podA, 20, true)
	w.addFlows(podA6, podB6, 25, true)
	w.addFlows(podB6, podA6, 15, true)
	return w, newCilium(t, maps, ix)
}

func checkDeleted(t *testing.T, res scrub.Result, want map[string]int) {
	t.Helper()
	for name, n := range want {
		if res.Deleted[name] != n {
			t.Errorf("Deleted[%s] = %d, want %d (result %+v)", name, res.Deleted[name], n, res)
		}
	}
	total := 0
	for _, n := range want {
		total += n
	}
	if res.Total != total {
		t.Errorf("Total = %d, want %d", res.Total, total)
	}
}

func TestScrubIndexPath(t *testing.T) {
	w, c := trackedWorld(t, 1<<16)
	want := w.expected(podA, podA6)
	if want[ctmap.TCP4.Name()] == 0 || want[ctmap.Any4.Name()] == 0 || want[ctmap.TCP6.Name()] == 0 || want[ctmap.Any6.Name()] == 0 {
		t.Fatalf("fill is missing entries of some map: %v", want)
	}
	res, err := c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{podA, podA6}, Reason: scrub.ReasonDel})
	if err != nil {
		t.Fatalf("Scrub: %v", err)
	}
	if res.Outcome != scrub.Complete || res.Method != scrub.MethodIndex || res.PerIP[podA.String()] != scrub.MethodIndex || res.PerIP[podA6.String()] != scrub.MethodIndex {
		t.Errorf("result %+v: want complete through the index", res)
	}
	checkDeleted(t, res, want)
	if n := w.verify(podA, podA6); n != res.Total {
		t.Errorf("world held %d entries of the IPs, scrub deleted %d", n, res.Total)
	}
	if st := c.ix.State(podA); !st.Complete || st.Keys != 0 {
		t.Errorf("index state of %s after scrub: %+v, want complete and empty", podA, st)
	}
	// The peer's index keeps its keys of the shared flows; they are stale now
	// and its scrub must still work.
	res, err = c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{podB}})
	if err != nil || res.Outcome != scrub.Complete {
		t.Fatalf("scrub of peer with stale keys: %+v, %v", res, err)
	}
	checkDeleted(t, res, w.expected(podB))
	w.verify(podB)
}

func TestScrubWhileOthersInsert(t *testing.T) {
	w, c := trackedWorld(t, 1<<18)
	// Other goroutines keep creating entries of other pods during the scrub
	// (as the datapath does); every one of them must survive.
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var mu sync.Mutex
	inserted := map[ctmap.CTKey4]bool{}
	for g := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			val := ctmap.EncodeEntry(ctmap.EntryFields{Lifetime: 1})
			other := netip.AddrFrom4([4]byte{10, 244, 9, byte(g)})
			for i := 0; ctx.Err() == nil && i < 60000; i++ {
				k := ctmap.NewKey4(other, remote4, 443, uint16(i), ctmap.ProtoTCP, ctmap.FlagOut)
				if err := c.maps.Map(ctmap.TCP4).Put(k, val); err != nil {
					t.Errorf("insert: %v", err)
					return
				}
				mu.Lock()
				inserted[k] = true
				mu.Unlock()
			}
		}()
	}
	want := w.expected(podA)
	res, err := c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{podA}})
	checkDeleted(t, res, want)
	w.verify(podA)
	// And the sweep path under the same load.
	c.ix.MarkIncomplete(podB, index.ReasonLost)
	wantB := w.expected(podB)
	resB, errB := c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{podB}})
	stop()
	wg.Wait()
	if err != nil || errB != nil {
		t.Fatalf("Scrub: %v / %v", err, errB)
	}
	if resB.Method != scrub.MethodSweep {
		t.Errorf("scrub of an IP marked lost used %s, want sweep", resB.Method)
	}
	checkDeleted(t, resB, wantB)
	w.verify(podB)
	k4, _ := dump(t, c.maps)
	for k := range inserted {
		if !k4[k] {
			t.Errorf("concurrently inserted entry of another pod deleted: %s", k)
		}
	}
	t.Logf("%d entries inserted concurrently, all intact", len(inserted))
}

func TestScrubIncompleteTakesSweep(t *testing.T) {
	needRoot(t)
	maps := pinnedMaps(t, 1<<16, true)
	ix := fedIndex(index.Config{PodCIDRs: []netip.Prefix{podCIDR4, podCIDR6}, MaxKeysPerIP: 50})
	w := newWorld(t, maps, ix)
	untracked := netip.MustParseAddr("10.244.0.20") // never tracked: flows from before the index started
	lost := netip.MustParseAddr("10.244.0.21")
	vip := netip.MustParseAddr("10.244.0.22")
	full := netip.MustParseAddr("10.244.0.23")
	untracked6 := netip.MustParseAddr("fd00:10:244::20")
	for _, ip := range []netip.Addr{lost, vip, full, podC} {
		ix.Track(ip)
	}
	w.addFlows(untracked, podC, 10, false)
	w.addFlows(untracked6, podB6, 10, false)
	w.addFlows(lost, podC, 10, true)
	ix.MarkIncomplete(lost, index.ReasonLost)
	w.addFlows(vip, podC, 2, true)
	w.addService(vip, netip.MustParseAddr("10.96.0.10"))
	w.addFlows(full, podC, 30, true) // 30*5 flows * >= 2 keys > MaxKeysPerIP
	w.addFlows(podC, podB, 5, true)
	c := newCilium(t, maps, ix)

	for _, ip := range []netip.Addr{untracked, lost, vip, full, untracked6} {
		st := ix.State(ip)
		if st.Complete {
			t.Fatalf("%s: index claims complete: %+v", ip, st)
		}
		want := w.expected(ip)
		res, err := c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{ip}})
		if err != nil {
			t.Fatalf("scrub %s (%s): %v", ip, st.Incomplete, err)
		}
		if res.Method != scrub.MethodSweep || res.Outcome != scrub.Complete {
			t.Errorf("scrub %s (%s): %+v, want a complete sweep", ip, st.Incomplete, res)
		}
		checkDeleted(t, res, want)
		w.verify(ip)
		if st := ix.State(ip); !st.Complete {
			t.Errorf("%s after a complete sweep: %+v, want tracked and complete", ip, st)
		}
	}
	if got := c.Sweeper().Passes(); got != 5 {
		t.Errorf("passes = %d, want 5 (one per scrub)", got)
	}
	// Flows after the sweep are indexed: the next scrub takes the index.
	w.addFlows(lost, podC, 3, true)
	res, err := c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{lost}})
	if err != nil || res.Method != scrub.MethodIndex {
		t.Fatalf("scrub after the sweep: %+v, %v; want the index", res, err)
	}
	checkDeleted(t, res, w.expected(lost))
	w.verify(lost)
}

func TestScrubStaleKeys(t *testing.T) {
	w, c := trackedWorld(t, 1<<16)
	// Entries of podA deleted behind the index's back (Cilium's GC, LRU
	// eviction): every other one of them.
	i := 0
	for k := range w.all4 {
		if !k.Has(podA) {
			continue
		}
		if i++; i%2 == 0 {
			if err := c.maps.Map(k.Kind()).Delete(k); err != nil {
				t.Fatal(err)
			}
			delete(w.all4, k)
		}
	}
	want := w.expected(podA)
	res, err := c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{podA}})
	if err != nil || res.Outcome != scrub.Complete {
		t.Fatalf("scrub with stale keys: %+v, %v", res, err)
	}
	checkDeleted(t, res, want)
	w.verify(podA)
	if st := c.ix.State(podA); st.Keys != 0 {
		t.Errorf("stale keys kept in the index: %+v", st)
	}
}

// TestSweepDeletesInBucket is the case the sweep's delayed delete exists for:
// many matching entries, and the sweep must leave none of them, also when the
// map is small enough that buckets hold several entries.
func TestSweepDeletesEverything(t *testing.T) {
	needRoot(t)
	maps := pinnedMaps(t, 4096, false)
	ix := newIndex()
	w := newWorld(t, maps, ix)
	ips := []netip.Addr{podA, podB, podC}
	for _, ip := range ips {
		w.addFlows(ip, remote4, 120, false)
	}
	c := newCilium(t, maps, ix)
	want := w.expected(podA, podB)
	res, err := c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{podA, podB}})
	if err != nil {
		t.Fatal(err)
	}
	checkDeleted(t, res, want)
	w.verify(podA, podB)
}

func TestScrubDryRun(t *testing.T) {
	w, c := trackedWorld(t, 1<<16)
	c.ix.MarkIncomplete(podB, index.ReasonLost)
	before4, before6 := dump(t, c.maps)
	keysBefore := c.ix.State(podA).Keys
	for _, ip := range []netip.Addr{podA, podB, podA6} {
		res, err := c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{ip}, DryRun: true})
		if err != nil || res.Outcome != scrub.Complete {
			t.Fatalf("dry run %s: %+v, %v", ip, res, err)
		}
		checkDeleted(t, res, w.expected(ip))
	}
	after4, after6 := dump(t, c.maps)
	if !maps.Equal(before4, after4) || !maps.Equal(before6, after6) {
		t.Errorf("dry run changed the maps: %d/%d -> %d/%d entries", len(before4), len(before6), len(after4), len(after6))
	}
	if st := c.ix.State(podA); st.Keys != keysBefore || !st.Complete {
		t.Errorf("dry run changed the index: %+v, had %d keys", st, keysBefore)
	}
	if st := c.ix.State(podB); st.Complete {
		t.Errorf("dry-run sweep marked %s complete", podB)
	}
}

func TestScrubBadInput(t *testing.T) {
	w, c := trackedWorld(t, 1<<16)
	before4, before6 := dump(t, c.maps)
	cases := []struct {
		name string
		ips  []netip.Addr
		want string
	}{
		{"none", nil, "no IP given"},
		{"zero", []netip.Addr{podA, {}}, "not a valid address"},
		{"unspecified v4", []netip.Addr{podA, netip.IPv4Unspecified()}, "unspecified"},
		{"unspecified v6", []netip.Addr{netip.IPv6Unspecified()}, "unspecified"},
		{"zone", []netip.Addr{netip.MustParseAddr("fe80::1%eth0")}, "zone"},
	}
	for _, tc := range cases {
		res, err := c.Scrub(context.Background(), scrub.Request{IPs: tc.ips})
		if err == nil || !errors.Is(err, scrub.ErrBadRequest) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err %v, want scrub.ErrBadRequest mentioning %q", tc.name, err, tc.want)
		}
		if res.Outcome != scrub.Failed || res.Total != 0 {
			t.Errorf("%s: result %+v, want error and nothing deleted", tc.name, res)
		}
	}
	after4, after6 := dump(t, c.maps)
	if !maps.Equal(before4, after4) || !maps.Equal(before6, after6) {
		t.Errorf("a rejected request deleted entries")
	}
	_ = w

	// A v6 IP on a node without the IPv6 maps.
	maps4 := pinnedMaps(t, 1024, false)
	c4 := newCilium(t, maps4, newIndex())
	_, err := c4.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{podA, podA6}})
	if err == nil || !errors.Is(err, scrub.ErrBadRequest) || !strings.Contains(err.Error(), "IPv6 CT maps") {
		t.Errorf("v6 IP without v6 maps: %v", err)
	}
	// An IPv4-mapped address means the IPv4 address.
	ips, err := scrub.CheckIPs([]netip.Addr{netip.MustParseAddr("::ffff:10.244.0.5"), podA})
	if err != nil || len(ips) != 1 || ips[0] != podA {
		t.Errorf("CheckIPs(::ffff:10.244.0.5, 10.244.0.5) = %v, %v; want [10.244.0.5]", ips, err)
	}
}

func TestOpenWrongLayout(t *testing.T) {
	needRoot(t)
	dir, err := os.MkdirTemp("/sys/fs/bpf", "ctscrub-test-")
	if err != nil {
		t.Skipf("no bpffs: %v", err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	// Missing maps.
	if _, err := ctmap.Open(dir); err == nil || !errors.Is(err, os.ErrNotExist) || !strings.Contains(err.Error(), ctmap.TCP4.Name()) {
		t.Errorf("Open of an empty dir: %v, want not-exist naming %s", err, ctmap.TCP4.Name())
	}
	// cilium_ct4_global with a v6-sized key.
	spec := ctmap.TCP4.Spec(1024)
	spec.KeySize = ctmap.KeySize6
	m, err := ebpf.NewMap(spec)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.Pin(filepath.Join(dir, ctmap.TCP4.Name())); err != nil {
		t.Fatal(err)
	}
	if _, err := ctmap.Open(dir); err == nil || !errors.Is(err, ctmap.ErrLayout) || !strings.Contains(err.Error(), "key size 38") {
		t.Errorf("Open with a wrong-size %s: %v, want ErrLayout naming the key size", ctmap.TCP4.Name(), err)
	}
	if _, err := New(nil, newIndex(), Options{}); err == nil {
		t.Error("New without maps: no error")
	}
}

func TestCount(t *testing.T) {
	w, c := trackedWorld(t, 1<<16)
	for _, k := range ctmap.Kinds {
		n, err := c.Count(k)
		if err != nil {
			t.Fatalf("Count(%s): %v", k.Name(), err)
		}
		want := 0
		if k.IPv6() {
			for key := range w.all6 {
				if key.Kind() == k {
					want++
				}
			}
		} else {
			for key := range w.all4 {
				if key.Kind() == k {
					want++
				}
			}
		}
		if n != int64(want) {
			t.Errorf("Count(%s) = %d, want %d", k.Name(), n, want)
		}
	}
	if !c.CountIsCheap() {
		t.Logf("Count walks the map: the kernel's element counter is unavailable: %v", c.CountError())
	}
	// The counter follows deletions too.
	res, err := c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{podA}})
	if err != nil {
		t.Fatal(err)
	}
	w.verify(podA)
	if n, want := mustCount(t, c, ctmap.TCP4), int64(len(dumpKind(t, c, ctmap.TCP4))); n != want {
		t.Errorf("Count(TCP4) after deleting %d entries = %d, want %d", res.Total, n, want)
	}
	if n, err := c.sweeper.countWalk(ctmap.TCP4); err != nil || n != mustCount(t, c, ctmap.TCP4) {
		t.Errorf("countWalk(TCP4) = %d, %v; want the Count figure", n, err)
	}
}

func mustCount(t *testing.T, c *Backend, k ctmap.Kind) int64 {
	n, err := c.Count(k)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// bigWorld is a map of bulk entries (so a pass takes long enough to cancel or
// to join) plus recorded flows of a few pods.
func bigWorld(t *testing.T, bulk int) (*world, *Backend) {
	needRoot(t)
	if testing.Short() && bulk >= 1<<20 {
		t.Skip("fills a map of millions of entries")
	}
	maps := pinnedMaps(t, uint32(bulk)+1<<16, false)
	bulkFill(t, maps.Map(ctmap.TCP4), bulk)
	ix := newIndex()
	w := newWorld(t, maps, ix)
	for i := range 8 {
		ip := netip.AddrFrom4([4]byte{10, 244, 0, byte(10 + i)})
		w.addFlows(ip, remote4, 10, false)
	}
	return w, newCilium(t, maps, ix)
}

func TestSweepCancel(t *testing.T) {
	// Big enough that a pass lasts about 0.2 s (with the address filter),
	// so the cancel below lands while the program walks the map.
	const bulk = 2 << 20
	w, c := bigWorld(t, bulk)
	target := netip.AddrFrom4([4]byte{10, 244, 0, 10})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	var res scrub.Result
	var err error
	go func() {
		defer close(done)
		res, err = c.Scrub(ctx, scrub.Request{IPs: []netip.Addr{target}})
	}()
	// Cancel while the program walks the map in the kernel.
	waitFor(t, c.Sweeper().inProg.Load)
	cancel()
	cancelled := time.Now()
	<-done
	took := time.Since(cancelled)
	if !errors.Is(err, context.Canceled) || res.Outcome != scrub.Cancelled {
		t.Fatalf("cancelled sweep: %+v, %v; want scrub.Cancelled", res, err)
	}
	st := c.Sweeper().lastStats()
	stopped := false
	for _, s := range st {
		stopped = stopped || s.Stopped
	}
	if !stopped {
		// The cancel landed after the walk of the first map (a starved test
		// goroutine on a loaded machine); TestSweepStopFlag checks the flag
		// deterministically.
		t.Logf("the cancel arrived after the walk: %+v", st)
	}
	t.Logf("cancelled after %d of %d entries; Scrub returned %v after cancel; deleted so far %d", st[ctmap.TCP4].Visited, bulk, took, res.Total)
	if s := c.ix.State(target); s.Complete || s.Incomplete == "" {
		t.Errorf("after a cancelled sweep the IP must stay incomplete: %+v", s)
	}
	// The retry completes.
	want := w.expected(target)
	want[ctmap.TCP4.Name()] -= res.Deleted[ctmap.TCP4.Name()]
	want[ctmap.Any4.Name()] -= res.Deleted[ctmap.Any4.Name()]
	res, err = c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{target}})
	if err != nil || res.Outcome != scrub.Complete || res.Method != scrub.MethodSweep {
		t.Fatalf("retry: %+v, %v", res, err)
	}
	checkDeleted(t, res, want)
	w.verify(target)
	if n := mustCount(t, c, ctmap.TCP4); n < bulk {
		t.Errorf("TCP4 holds %d entries, fewer than the %d bulk entries: wrong deletions", n, bulk)
	}
}

// The program obeys the stop flag: the only caller leaves right before the
// walk starts, so the flag is set when the program runs.
func TestSweepStopFlag(t *testing.T) {
	w, c := bigWorld(t, 1<<16)
	sw := c.Sweeper()
	target := netip.AddrFrom4([4]byte{10, 244, 0, 10})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	setHooks(sw, hooks{onWalking: func() {
		cancel()
		waitFor(t, func() bool { _, r := sw.Waiting(); return r == 0 })
	}})
	res, err := c.Scrub(ctx, scrub.Request{IPs: []netip.Addr{target}})
	if !errors.Is(err, context.Canceled) || res.Outcome != scrub.Cancelled || res.Total != 0 {
		t.Fatalf("%+v, %v; want scrub.Cancelled with nothing deleted", res, err)
	}
	st := sw.lastStats()[ctmap.TCP4]
	if !st.Stopped || st.Visited != 0 {
		t.Errorf("the program ran past the stop flag: %+v", st)
	}
	if s := c.ix.State(target); s.Complete {
		t.Errorf("after a stopped sweep the IP must stay incomplete: %+v", s)
	}
	setHooks(sw, nil)
	want := w.expected(target)
	res, err = c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{target}})
	if err != nil || res.Outcome != scrub.Complete {
		t.Fatalf("retry: %+v, %v", res, err)
	}
	checkDeleted(t, res, want)
	w.verify(target)
}

func TestSweepSharedPass(t *testing.T) {
	w, c := bigWorld(t, 1<<16)
	sw := c.Sweeper()
	ips := make([]netip.Addr, 6)
	for i := range ips {
		ips[i] = netip.AddrFrom4([4]byte{10, 244, 0, byte(10 + i)})
	}
	wants := make([]map[string]int, len(ips))
	for i, ip := range ips {
		wants[i] = w.expected(ip)
	}
	before := sw.Passes()
	results := make([]scrub.Result, len(ips))
	errs := make([]error, len(ips))
	var wg sync.WaitGroup
	scrubOne := func(ctx context.Context, i int) {
		defer wg.Done()
		results[i], errs[i] = c.Scrub(ctx, scrub.Request{IPs: []netip.Addr{ips[i]}})
	}
	// The first caller's pass is held while the others arrive: they must
	// all share the next pass.
	g := holdPasses(sw, 1)
	wg.Add(1)
	go scrubOne(context.Background(), 0)
	waitFor(t, func() bool { _, r := sw.Waiting(); return r == 1 })
	for i := 1; i < len(ips); i++ {
		wg.Add(1)
		go scrubOne(context.Background(), i)
	}
	waitFor(t, func() bool { p, _ := sw.Waiting(); return p == len(ips)-1 })
	g.release(0)
	wg.Wait()
	if got := sw.Passes() - before; got != 2 {
		t.Errorf("%d callers ran %d passes, want 2 (one for the first, one shared by the %d that arrived during it)", len(ips), got, len(ips)-1)
	}
	for i := range ips {
		if errs[i] != nil || results[i].Outcome != scrub.Complete {
			t.Fatalf("caller %d: %+v, %v", i, results[i], errs[i])
		}
		checkDeleted(t, results[i], wants[i])
	}
	w.verify(ips...)

	// A caller leaving a shared pass does not stop it for the others: three
	// callers arrive during a blocker's pass and share the next one; one
	// leaves after the runner took it.
	before = sw.Passes()
	for i, ip := range ips[:4] {
		w.addFlows(ip, remote4, 5, false)
		wants[i] = w.expected(ip)
		// Tracked since the first sweep; these flows were not recorded.
		c.ix.MarkIncomplete(ip, index.ReasonLost)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	g = holdPasses(sw, 2)
	wg.Add(1)
	go scrubOne(context.Background(), 3) // the blocker
	waitFor(t, func() bool { _, r := sw.Waiting(); return r == 1 })
	wg.Add(3)
	go scrubOne(ctx, 0)
	go scrubOne(context.Background(), 1)
	go scrubOne(context.Background(), 2)
	waitFor(t, func() bool { p, _ := sw.Waiting(); return p == 3 })
	g.release(0)
	waitFor(t, func() bool { _, r := sw.Waiting(); return r == 3 })
	cancel()
	waitFor(t, func() bool { _, r := sw.Waiting(); return r == 2 })
	g.release(1)
	wg.Wait()
	if !errors.Is(errs[0], context.Canceled) || results[0].Outcome != scrub.Cancelled {
		t.Errorf("caller that left: %+v, %v; want scrub.Cancelled", results[0], errs[0])
	}
	for i := 1; i < 4; i++ {
		if errs[i] != nil || results[i].Outcome != scrub.Complete {
			t.Errorf("caller %d of a pass another caller left: %+v, %v", i, results[i], errs[i])
			continue
		}
		checkDeleted(t, results[i], wants[i])
	}
	if got := sw.Passes() - before; got != 2 {
		t.Errorf("%d passes for a blocker and three callers arriving during it, want 2", got)
	}
	// The leaver's IP left the pass with its only caller, before the runner
	// filled the IP set: its entries, from then on maybe a new pod's, all
	// stay (w.verify reports any of them deleted); the others' are gone.
	w.verify(ips[1:4]...)
}

// waitFor polls cond (a state change of the code under test, not a timer
// standing in for one) for up to 20 s.
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not reached in 20 s")
		}
		time.Sleep(100 * time.Microsecond)
	}
}

func dumpKind(t *testing.T, c *Backend, k ctmap.Kind) []ctmap.CTKey4 {
	k4, _ := dump(t, c.maps)
	var out []ctmap.CTKey4
	for key := range k4 {
		if key.Kind() == k {
			out = append(out, key)
		}
	}
	return out
}

// Flows recorded and records lost while a sweep pass runs must survive its
// end: the keys stay indexed and a loss keeps the IP incomplete.
func TestSweepKeepsWhatHappensDuringPass(t *testing.T) {
	w, c := bigWorld(t, 1<<20)
	ip := netip.AddrFrom4([4]byte{10, 244, 0, 11})
	done := make(chan error, 1)
	go func() {
		_, err := c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{ip}})
		done <- err
	}()
	waitFor(t, c.Sweeper().inProg.Load)
	w.addFlows(ip, remote4, 1, true) // recorded while the pass runs
	c.ix.MarkIncomplete(ip, index.ReasonLost)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	st := c.ix.State(ip)
	if st.Complete || st.Incomplete != index.ReasonLost {
		t.Errorf("a loss during the pass was wiped: %+v", st)
	}
	if st.Keys == 0 {
		t.Errorf("keys recorded during the pass were dropped: %+v", st)
	}
}

// Real LRU eviction: the map overflows, the kernel evicts entries of the
// indexed IP behind the index's back, and the scrub still completes.
func TestScrubAfterLRUEviction(t *testing.T) {
	needRoot(t)
	maps := pinnedMaps(t, 2048, false)
	ix := newIndex()
	ix.Track(podA)
	w := newWorld(t, maps, ix)
	w.addFlows(podA, podB, 100, true) // 500 flows, about 1,000 entries
	// Flood both maps with other pods' flows, far past max_entries.
	val := ctmap.EncodeEntry(ctmap.EntryFields{Lifetime: 1})
	for i := range 8192 {
		other := netip.AddrFrom4([4]byte{10, 244, 7, byte(i)})
		k := ctmap.NewKey4(other, remote4, 443, uint16(i), ctmap.ProtoTCP, ctmap.FlagOut)
		for _, kk := range []ctmap.CTKey4{k, k.Related()} {
			if err := maps.Map(kk.Kind()).Put(kk, val); err != nil {
				t.Fatal(err)
			}
		}
	}
	before4, _ := dump(t, maps)
	present, evicted := 0, 0
	for k := range w.all4 {
		if k.Has(podA) {
			if before4[k] {
				present++
			} else {
				evicted++
			}
		}
	}
	if evicted == 0 {
		t.Fatalf("no entry of %s was evicted; the test needs LRU eviction", podA)
	}
	c := newCilium(t, maps, ix)
	res, err := c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{podA}})
	if err != nil || res.Outcome != scrub.Complete || res.Method != scrub.MethodIndex {
		t.Fatalf("scrub after eviction: %+v, %v", res, err)
	}
	if res.Total != present {
		t.Errorf("deleted %d, want the %d entries still present (%d were evicted)", res.Total, present, evicted)
	}
	after4, _ := dump(t, maps)
	for k := range before4 {
		if k.Has(podA) {
			if after4[k] {
				t.Errorf("entry left: %s", k)
			}
		} else if !after4[k] {
			t.Errorf("wrong deletion: %s", k)
		}
	}
	t.Logf("%d of %s's entries evicted by the LRU, %d deleted by the scrub", evicted, podA, present)
}

// cancelAfter is a context whose Err turns to Canceled after n calls: it
// stops an index scrub at a chosen point between two delete batches, which a
// timer cannot do deterministically (test tool, not a fake of the system).
type cancelAfter struct {
	context.Context
	n atomic.Int32
}

func (c *cancelAfter) Err() error {
	if c.n.Add(-1) < 0 {
		return context.Canceled
	}
	return nil
}

func TestIndexScrubCancel(t *testing.T) {
	w, _ := trackedWorld(t, 1<<16)
	c, err := New(w.maps, w.ix, Options{DeleteChunk: 16})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	keys := c.ix.State(podA).Keys
	ctx := &cancelAfter{Context: context.Background()}
	ctx.n.Store(4) // the IP loop check, then three delete batches
	res, err := c.Scrub(ctx, scrub.Request{IPs: []netip.Addr{podA}})
	if !errors.Is(err, context.Canceled) || res.Outcome != scrub.Cancelled {
		t.Fatalf("cancelled index scrub: %+v, %v", res, err)
	}
	if res.Total == 0 || res.Total >= keys {
		t.Fatalf("deleted %d of %d: want a partial scrub", res.Total, keys)
	}
	st := c.ix.State(podA)
	if !st.Complete || st.Keys == 0 {
		t.Errorf("after a cancelled index scrub the IP must stay complete with its untried keys: %+v", st)
	}
	// The retry deletes the rest, through the index.
	want := w.expected(podA)
	for name, n := range res.Deleted {
		want[name] -= n
	}
	res2, err := c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{podA}})
	if err != nil || res2.Method != scrub.MethodIndex {
		t.Fatalf("retry: %+v, %v", res2, err)
	}
	checkDeleted(t, res2, want)
	w.verify(podA)
}

// collider returns an address other than ip whose filter bit is ip's: the
// last four bytes b become (b0^b2, b1^b3, 0, 0), which folds the same on a
// little-endian CPU.
func collider(ip netip.Addr) netip.Addr {
	b := ip.AsSlice()
	n := len(b)
	b[n-4], b[n-3], b[n-2], b[n-1] = b[n-4]^b[n-2], b[n-3]^b[n-1], 0, 0
	a, _ := netip.AddrFromSlice(b)
	return a
}

// An address whose filter bit collides with a scrubbed IP's passes the
// sweep's bitmap and must be rejected by the exact set lookup.
func TestSweepFilterCollision(t *testing.T) {
	needRoot(t)
	maps := pinnedMaps(t, 1<<14, true)
	ix := newIndex()
	w := newWorld(t, maps, ix)
	for _, ip := range []netip.Addr{podA, podA6} {
		twin := collider(ip)
		if twin == ip || addrFilter([]netip.Addr{ip}) != addrFilter([]netip.Addr{twin}) {
			t.Skipf("%s and %s do not collide in the filter on this CPU's byte order", ip, twin)
		}
		remote := remote4
		if ip.Is6() {
			remote = remote6
		}
		w.addFlows(ip, remote, 10, false)
		w.addFlows(twin, remote, 10, false)
		t.Logf("%s collides with %s", ip, twin)
	}
	c := newCilium(t, maps, ix)
	want := w.expected(podA, podA6)
	res, err := c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{podA, podA6}})
	if err != nil || res.Method != scrub.MethodSweep {
		t.Fatalf("%+v, %v", res, err)
	}
	checkDeleted(t, res, want)
	w.verify(podA, podA6) // reports any entry of the colliding addresses deleted
}

// An IP outside the pod CIDRs is never indexed, so it must take the sweep on
// every scrub, also after a complete one.
func TestScrubIPOutsidePodCIDRs(t *testing.T) {
	needRoot(t)
	maps := pinnedMaps(t, 1<<14, false)
	ix := newIndex()
	w := newWorld(t, maps, ix)
	outside := netip.MustParseAddr("172.16.0.9")
	c := newCilium(t, maps, ix)
	for round := range 2 {
		w.addFlows(outside, remote4, 10, true) // records of it index nothing
		want := w.expected(outside)
		res, err := c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{outside}})
		if err != nil || res.Method != scrub.MethodSweep {
			t.Fatalf("round %d: %+v, %v; want the sweep", round, res, err)
		}
		checkDeleted(t, res, want)
		w.verify(outside)
	}
	if st := ix.State(outside); st.Complete {
		t.Errorf("an IP outside the pod CIDRs was declared tracked: %+v", st)
	}
}
