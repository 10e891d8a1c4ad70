package bootstrap

import (
	"context"
	"encoding/binary"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/rlimit"

	"github.com/ctscrub/ctscrub/scrubd/cilium"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

var (
	podCIDR4 = netip.MustParsePrefix("10.244.0.0/16")
	podCIDR6 = netip.MustParsePrefix("fd00:10:244::/64")
	remote4  = netip.MustParseAddr("192.0.2.10")
	remote6  = netip.MustParseAddr("2001:db8::10")
	vip4     = netip.MustParseAddr("10.96.0.10")
)

func needRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates BPF maps")
	}
	if err := rlimit.RemoveMemlock(); err != nil {
		t.Skipf("cannot lift RLIMIT_MEMLOCK: %v", err)
	}
}

// pinnedMaps creates Cilium-layout CT maps in a private bpffs directory and
// opens them through ctmap.Open, the daemon's path.
func pinnedMaps(t testing.TB, maxEntries uint32) *ctmap.Maps {
	t.Helper()
	dir, err := os.MkdirTemp("/sys/fs/bpf", "ctscrub-test-")
	if err != nil {
		t.Skipf("no bpffs at /sys/fs/bpf: %v", err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	for _, k := range ctmap.Kinds {
		m, err := ebpf.NewMap(k.Spec(maxEntries))
		if err != nil {
			t.Fatalf("create %s: %v", k.Name(), err)
		}
		if err := m.Pin(filepath.Join(dir, k.Name())); err != nil {
			t.Fatalf("pin %s: %v", k.Name(), err)
		}
		m.Close()
	}
	maps, err := ctmap.Open(dir)
	if err != nil {
		t.Fatalf("ctmap.Open(%s): %v", dir, err)
	}
	t.Cleanup(func() { maps.Close() })
	return maps
}

// fedIndex: hooks without Sync, the tests apply every record themselves.
func fedIndex() *index.Index {
	ix := index.New(index.Config{PodCIDRs: []netip.Prefix{podCIDR4, podCIDR6}})
	ix.SetHooks(&index.Hooks{})
	return ix
}

func pod4(i int) netip.Addr { return netip.AddrFrom4([4]byte{10, 244, byte(i >> 8), byte(i)}) }

func pod6(i int) netip.Addr {
	b := podCIDR6.Addr().As16()
	binary.BigEndian.PutUint16(b[14:], uint16(i))
	return netip.AddrFrom16(b)
}

// walks are the two ways a pass reads the maps; the tests of what a pass
// files run under both (the batch walk is the kernel read's fallback).
var walks = []struct {
	name string
	walk Walk
}{{"kernel", WalkKernel}, {"batch", WalkBatch}}

// readAt is the read after which a test's hook acts: the batch-th batch
// of a map, or its one kernel run.
func readAt(w Walk, batch int) int {
	if w == WalkKernel {
		return 1
	}
	return batch
}

// checkRead fails unless every map was read the way w says.
func checkRead(t testing.TB, res Result, w Walk) {
	t.Helper()
	if len(res.Read) != len(res.Maps) {
		t.Fatalf("read %v, maps %v", res.Read, res.Maps)
	}
	for m, how := range res.Read {
		if (w == WalkKernel) != (how == ReadKernel) {
			t.Fatalf("walk %d read %s: %q", w, m, how)
		}
	}
}

func owned(a netip.Addr) bool { return podCIDR4.Contains(a) || podCIDR6.Contains(a) }

// flowRec is a flow as the recorder reports it: the key Cilium creates
// (initiator in daddr; OUT when the pod initiated, IN when a peer did).
func flowRec4(k ctmap.CTKey4) *recorder.Record {
	r := &recorder.Record{Family: 4, Kind: recorder.RecFlow}
	copy(r.Key[:], k[:])
	return r
}

func flowRec6(k ctmap.CTKey6) *recorder.Record {
	r := &recorder.Record{Family: 6, Kind: recorder.RecFlow}
	copy(r.Key[:], k[:])
	return r
}

// cilium4 lists the entries Cilium's datapath makes for a flow whose key is
// k: the entry, its RELATED entry, and for a flow between two local pods
// the twin with the other direction and its RELATED entry.
func cilium4(k ctmap.CTKey4) []ctmap.CTKey4 {
	out := []ctmap.CTKey4{k, k.Related()}
	if owned(k.DAddr()) && owned(k.SAddr()) {
		tw := k.WithFlags(k.Flags() ^ ctmap.FlagIn)
		out = append(out, tw, tw.Related())
	}
	return out
}

func cilium6(k ctmap.CTKey6) []ctmap.CTKey6 {
	out := []ctmap.CTKey6{k, k.Related()}
	if owned(k.DAddr()) && owned(k.SAddr()) {
		tw := k.WithFlags(k.Flags() ^ ctmap.FlagIn)
		out = append(out, tw, tw.Related())
	}
	return out
}

func put4(t testing.TB, maps *ctmap.Maps, keys ...ctmap.CTKey4) {
	t.Helper()
	var v ctmap.Entry
	for _, k := range keys {
		if err := maps.Map(k.Kind()).Put(&k, &v); err != nil {
			t.Fatalf("put %v: %v", k, err)
		}
	}
}

func put6(t testing.TB, maps *ctmap.Maps, keys ...ctmap.CTKey6) {
	t.Helper()
	var v ctmap.Entry
	for _, k := range keys {
		if err := maps.Map(k.Kind()).Put(&k, &v); err != nil {
			t.Fatalf("put %v: %v", k, err)
		}
	}
}

// allKeys reads every key of the maps.
func allKeys(t testing.TB, maps *ctmap.Maps) (k4 []ctmap.CTKey4, k6 []ctmap.CTKey6) {
	t.Helper()
	for _, kind := range ctmap.Kinds {
		it := maps.Map(kind).Iterate()
		var v ctmap.Entry
		if kind.IPv6() {
			var k ctmap.CTKey6
			for it.Next(&k, &v) {
				k6 = append(k6, k)
			}
		} else {
			var k ctmap.CTKey4
			for it.Next(&k, &v) {
				k4 = append(k4, k)
			}
		}
		if err := it.Err(); err != nil {
			t.Fatalf("iterate %s: %v", kind.Name(), err)
		}
	}
	return k4, k6
}

// sorted4 is a set of keys in a comparable order.
func sorted4(k []ctmap.CTKey4) []ctmap.CTKey4 {
	k = slices.Clone(k)
	slices.SortFunc(k, func(a, b ctmap.CTKey4) int { return slices.Compare(a[:], b[:]) })
	return k
}

func sorted6(k []ctmap.CTKey6) []ctmap.CTKey6 {
	k = slices.Clone(k)
	slices.SortFunc(k, func(a, b ctmap.CTKey6) int { return slices.Compare(a[:], b[:]) })
	return k
}

// checkWhole fails unless every key of the maps holding an address the pass
// vouched for is in that address's set (a SERVICE key only under its
// saddr, as the recorder files it).
func checkWhole(t *testing.T, ix *index.Index, maps *ctmap.Maps, vouched []netip.Addr) {
	t.Helper()
	sets := map[netip.Addr]map[string]bool{}
	for _, ip := range vouched {
		k4, k6, _ := ix.KeysOf(ip)
		s := map[string]bool{}
		for _, k := range k4 {
			s[string(k[:])] = true
		}
		for _, k := range k6 {
			s[string(k[:])] = true
		}
		sets[ip] = s
	}
	missing := 0
	check := func(ip netip.Addr, kb []byte, str string) {
		if s, ok := sets[ip]; ok && !s[string(kb)] {
			if missing++; missing <= 5 {
				t.Errorf("%v: key %s is in the maps, not in its set", ip, str)
			}
		}
	}
	k4, k6 := allKeys(t, maps)
	for _, k := range k4 {
		if k.Flags()&ctmap.FlagService == 0 {
			check(k.DAddr(), k[:], k.String())
		}
		check(k.SAddr(), k[:], k.String())
	}
	for _, k := range k6 {
		if k.Flags()&ctmap.FlagService == 0 {
			check(k.DAddr(), k[:], k.String())
		}
		check(k.SAddr(), k[:], k.String())
	}
	if missing > 0 {
		t.Fatalf("%d keys of vouched-for addresses missing from their sets", missing)
	}
}

// The pass files exactly what the recorder files for the same flows: pod to
// a peer (OUT), a peer to a pod (IN), pod to pod on the node (both
// directions), pod to a released address, UDP, IPv6. Then an index scrub
// of a pod trusted from the pass deletes every entry of it and nothing
// else.
func TestPassFilesWhatTheRecorderFiles(t *testing.T) {
	needRoot(t)
	for _, w := range walks {
		t.Run(w.name, func(t *testing.T) { testPassFilesWhatTheRecorderFiles(t, w.walk) })
	}
}

func testPassFilesWhatTheRecorderFiles(t *testing.T, walk Walk) {
	maps := pinnedMaps(t, 65536)
	pods := []netip.Addr{pod4(1), pod4(2), pod4(3)}
	released := pod4(77) // no pod now; flows of live pods still go to it
	p6 := pod6(1)

	var recs []*recorder.Record
	var flows4 []ctmap.CTKey4
	var flows6 []ctmap.CTKey6
	for i, p := range pods {
		for j := range 20 {
			flows4 = append(flows4,
				ctmap.NewKey4(p, remote4, 443, uint16(30000+j), ctmap.ProtoTCP, ctmap.FlagOut),
				ctmap.NewKey4(remote4, p, 8080, uint16(40000+j), ctmap.ProtoTCP, ctmap.FlagIn),
				ctmap.NewKey4(p, remote4, 53, uint16(50000+j), ctmap.ProtoUDP, ctmap.FlagOut))
		}
		flows4 = append(flows4, ctmap.NewKey4(p, pods[(i+1)%len(pods)], 80, uint16(1000+i), ctmap.ProtoTCP, ctmap.FlagOut))
	}
	flows4 = append(flows4, ctmap.NewKey4(pods[0], released, 9000, 1234, ctmap.ProtoTCP, ctmap.FlagOut))
	for j := range 10 {
		flows6 = append(flows6, ctmap.NewKey6(p6, remote6, 443, uint16(30000+j), ctmap.ProtoTCP, ctmap.FlagOut))
	}
	for _, k := range flows4 {
		put4(t, maps, cilium4(k)...)
		recs = append(recs, flowRec4(k))
	}
	for _, k := range flows6 {
		put6(t, maps, cilium6(k)...)
		recs = append(recs, flowRec6(k))
	}
	// Two remote peers' flow (not on this node): no address of the pod
	// CIDRs, filed under nothing.
	put4(t, maps, ctmap.NewKey4(remote4, netip.MustParseAddr("198.51.100.1"), 80, 1, ctmap.ProtoTCP, ctmap.FlagOut))

	// What the recorder files, flow by flow, into an index that has the
	// addresses' slots (a pod's from its start, a released one's kept
	// since its pod's DEL).
	want := fedIndex()
	for _, ip := range append(slices.Clone(pods), released, p6) {
		want.Hold(ip)
	}
	for _, r := range recs {
		recorder.Apply(want, r)
	}

	ix := fedIndex()
	for _, ip := range append(slices.Clone(pods), p6) {
		ix.Hold(ip)
	}
	p := &Progress{}
	res, err := Run(context.Background(), ix, maps, Options{Walk: walk, Batch: 64, Progress: p})
	if err != nil {
		t.Fatal(err)
	}
	checkRead(t, res, walk)
	wantAddrs := []netip.Addr{pods[0], pods[1], pods[2], released, p6}
	if !slices.Equal(res.Addrs, wantAddrs) {
		t.Fatalf("the pass vouches for %v, want %v", res.Addrs, wantAddrs)
	}
	if res.Visited == 0 || res.Pairs != ix.Keys() || res.Pairs != want.Keys() {
		t.Fatalf("visited %d, filed %d pairs; index %d keys, the recorder's %d", res.Visited, res.Pairs, ix.Keys(), want.Keys())
	}
	for _, ip := range wantAddrs {
		g4, g6, _ := ix.KeysOf(ip)
		w4, w6, _ := want.KeysOf(ip)
		if !slices.Equal(sorted4(g4), sorted4(w4)) || !slices.Equal(sorted6(g6), sorted6(w6)) {
			t.Fatalf("%v: the pass filed %d+%d keys, the recorder %d+%d; they differ", ip, len(g4), len(g6), len(w4), len(w6))
		}
	}
	if st := p.Status(); st == nil || st.Running || st.Keys != res.Pairs || st.Addresses != len(wantAddrs) {
		t.Fatalf("status after the pass: %+v", st)
	}

	// Nothing is complete until the daemon says so.
	if st := ix.State(pods[0]); st.Complete {
		t.Fatalf("%v complete before TrackFiled: %+v", pods[0], st)
	}
	tracked, dropped := ix.TrackFiled(res.Filing, func(netip.Addr) bool { return true })
	if !slices.Equal(tracked, wantAddrs) || dropped != 0 {
		t.Fatalf("TrackFiled tracked %v, dropped %d", tracked, dropped)
	}

	// An index scrub of pod 1 (trusted from the pass) leaves none of its
	// entries, and every other entry.
	c, err := cilium.New(maps, ix, cilium.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	before4, before6 := allKeys(t, maps)
	r, err := c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{pods[0]}, Reason: scrub.ReasonDel})
	if err != nil {
		t.Fatal(err)
	}
	if r.Method != scrub.MethodIndex {
		t.Fatalf("scrub of a pod trusted from the pass: %+v", r)
	}
	after4, after6 := allKeys(t, maps)
	var kept4 []ctmap.CTKey4
	for _, k := range before4 {
		if !k.Has(pods[0]) {
			kept4 = append(kept4, k)
		}
	}
	if !slices.Equal(sorted4(after4), sorted4(kept4)) || len(after6) != len(before6) {
		t.Fatalf("after the index scrub of %v: %d IPv4 keys left, want %d (every other one)", pods[0], len(after4), len(kept4))
	}
	if r.Total != len(before4)-len(kept4) {
		t.Fatalf("scrub deleted %d, want %d", r.Total, len(before4)-len(kept4))
	}
}

// A SERVICE key (per-packet load balancing: daddr the VIP) is filed under
// the pod only, with a pending state, as a snapshot's SERVICE key: its
// scrub learns the backend first (the recorder's Resolve), and without a
// recorder to learn it from, sweeps.
func TestPassFilesServiceKeyUnderPod(t *testing.T) {
	needRoot(t)
	maps := pinnedMaps(t, 4096)
	p := pod4(5)
	svc := ctmap.NewKey4(vip4, p, 53, 40000, ctmap.ProtoUDP, ctmap.FlagService)
	put4(t, maps, svc)
	ix := fedIndex()
	ix.Hold(p)
	res, err := Run(context.Background(), ix, maps, Options{})
	if err != nil {
		t.Fatal(err)
	}
	ix.TrackFiled(res.Filing, func(netip.Addr) bool { return true })
	if ix.Gen(vip4) != 0 {
		t.Fatalf("the VIP %v got a slot", vip4)
	}
	svcs := ix.Services(p)
	if len(svcs) != 1 || svcs[0].K4 != svc || !svcs[0].Pending {
		t.Fatalf("service states of %v: %+v, want one pending for %v", p, svcs, svc)
	}
	k4, _, st := ix.Take(p)
	if len(k4) != 1 || k4[0] != svc || st.Complete || st.Incomplete != index.ReasonServiceUnresolved {
		t.Fatalf("Take: %v %+v; want the SERVICE key, and the IP unresolved (no recorder to learn the backend)", k4, st)
	}
}

// Records of entries made while the walk runs: some behind its cursor, so
// only the recorder files them, among them towards an address that had no
// slot when the pass began (the open slots). Marks during the pass take
// their addresses out of what the pass vouches for.
func TestPassWithRecordsDuringIt(t *testing.T) {
	needRoot(t)
	for _, w := range walks {
		t.Run(w.name, func(t *testing.T) { testPassWithRecordsDuringIt(t, w.walk) })
	}
}

func testPassWithRecordsDuringIt(t *testing.T, walk Walk) {
	maps := pinnedMaps(t, 1<<16)
	ix := fedIndex()
	var pods []netip.Addr
	for i := range 20 {
		pods = append(pods, pod4(i+1))
		ix.Hold(pods[i])
	}
	for i := range 8000 {
		put4(t, maps, cilium4(ctmap.NewKey4(pods[i%len(pods)], remote4, 443, uint16(i), ctmap.ProtoTCP, ctmap.FlagOut))...)
	}
	fresh := pod4(200)     // no slot, no entry when the pass begins
	marked := pods[3]      // records lost during the pass
	unslotted := pod4(201) // records lost, no slot yet
	put4(t, maps, cilium4(ctmap.NewKey4(pods[0], unslotted, 80, 9, ctmap.ProtoTCP, ctmap.FlagOut))...)
	ran := false
	hook := func(kind ctmap.Kind, batch int) {
		if kind != ctmap.TCP4 || batch != readAt(walk, 5) || ran {
			return
		}
		ran = true
		// The datapath makes entries, the recorder records them.
		for i := range 500 {
			for _, k := range []ctmap.CTKey4{
				ctmap.NewKey4(pods[i%len(pods)], fresh, 8080, uint16(i), ctmap.ProtoTCP, ctmap.FlagOut),
				ctmap.NewKey4(pods[i%len(pods)], remote4, 5000, uint16(i), ctmap.ProtoTCP, ctmap.FlagOut),
			} {
				put4(t, maps, cilium4(k)...)
				recorder.Apply(ix, flowRec4(k))
			}
		}
		ix.MarkIncomplete(marked, index.ReasonLost)
		ix.MarkIncomplete(unslotted, index.ReasonLost)
	}
	res, err := Run(context.Background(), ix, maps, Options{Walk: walk, Batch: 256, afterBatch: hook})
	if err != nil {
		t.Fatal(err)
	}
	checkRead(t, res, walk)
	if !ran {
		t.Fatal("the hook never ran: the walk read fewer than 5 batches")
	}
	if !slices.Contains(res.Addrs, fresh) {
		t.Fatalf("%v (recorded during the pass, no slot before it) not vouched for", fresh)
	}
	for _, ip := range []netip.Addr{marked, unslotted} {
		if slices.Contains(res.Addrs, ip) {
			t.Fatalf("%v marked during the pass, still vouched for", ip)
		}
	}
	if len(res.Addrs) != len(pods)+1-1 {
		t.Fatalf("vouched for %d addresses, want %d: %v", len(res.Addrs), len(pods), res.Addrs)
	}
	checkWhole(t, ix, maps, res.Addrs)
	tracked, _ := ix.TrackFiled(res.Filing, func(netip.Addr) bool { return true })
	if st := ix.State(marked); st.Complete || !slices.Contains(pods, marked) || slices.Contains(tracked, marked) {
		t.Fatalf("%v marked during the pass: %+v", marked, st)
	}
}

// A record lost without its IP known (the per-IP counter overflowed)
// spoils the pass: nothing is vouched for, and the slots it made that no
// pod holds go.
func TestSpoiledPassVouchesForNothing(t *testing.T) {
	needRoot(t)
	for _, w := range walks {
		t.Run(w.name, func(t *testing.T) { testSpoiledPassVouchesForNothing(t, w.walk) })
	}
}

func testSpoiledPassVouchesForNothing(t *testing.T, walk Walk) {
	maps := pinnedMaps(t, 4096)
	ix := fedIndex()
	held, peer := pod4(1), pod4(2)
	ix.Hold(held)
	put4(t, maps, cilium4(ctmap.NewKey4(held, peer, 80, 1, ctmap.ProtoTCP, ctmap.FlagOut))...)
	res, err := Run(context.Background(), ix, maps, Options{Walk: walk, Batch: 1, afterBatch: func(ctmap.Kind, int) { ix.SpoilFiling() }})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Addrs) != 0 {
		t.Fatalf("a spoiled pass vouches for %v", res.Addrs)
	}
	tracked, dropped := ix.TrackFiled(res.Filing, func(netip.Addr) bool { return true })
	if len(tracked) != 0 || ix.State(held).Complete {
		t.Fatalf("tracked %v after a spoiled pass", tracked)
	}
	// The slot the pass made for the peer, no pod's, goes; the held one stays.
	if dropped != 1 || ix.Gen(peer) != 0 || ix.Gen(held) == 0 {
		t.Fatalf("after a spoiled pass: dropped %d, slots %v", dropped, ix.IPs())
	}
}

// TrackFiled declares complete what the rule trusts; a slot the pass made
// that the rule refuses and no pod holds goes; one a pod holds stays,
// untracked; a mark after End still counts; a second call does nothing.
func TestTrackFiledFollowsTheRule(t *testing.T) {
	needRoot(t)
	maps := pinnedMaps(t, 4096)
	ix := fedIndex()
	var tr []netip.Addr
	ix.SetHooks(&index.Hooks{Tracked: func(ips []netip.Addr) { tr = append(tr, ips...) }})
	a, b, c, d := pod4(1), pod4(2), pod4(3), pod4(4)
	ix.Hold(a)
	ix.Hold(b)
	for _, peer := range []netip.Addr{c, d} {
		put4(t, maps, cilium4(ctmap.NewKey4(a, peer, 80, 1, ctmap.ProtoTCP, ctmap.FlagOut))...)
		put4(t, maps, cilium4(ctmap.NewKey4(b, peer, 80, 1, ctmap.ProtoTCP, ctmap.FlagOut))...)
	}
	res, err := Run(context.Background(), ix, maps, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(res.Addrs, []netip.Addr{a, b, c, d}) {
		t.Fatalf("vouched for %v", res.Addrs)
	}
	ix.MarkIncomplete(d, index.ReasonAuditMiss) // after End: d's slot goes (no pod holds it)
	trust := map[netip.Addr]bool{a: true, c: false, b: false, d: true}
	tracked, dropped := ix.TrackFiled(res.Filing, func(ip netip.Addr) bool { return trust[ip] })
	if !slices.Equal(tracked, []netip.Addr{a}) || !slices.Equal(tr, []netip.Addr{a}) || dropped != 1 {
		t.Fatalf("tracked %v (hook %v), dropped %d; want [%v], 1 (%v)", tracked, tr, dropped, a, c)
	}
	if !ix.State(a).Complete || ix.State(b).Complete || ix.State(b).Keys == 0 || ix.Gen(c) != 0 || ix.State(d).Complete {
		t.Fatalf("states: a %+v b %+v c gen %d d %+v", ix.State(a), ix.State(b), ix.Gen(c), ix.State(d))
	}
	if again, n := ix.TrackFiled(res.Filing, func(netip.Addr) bool { return true }); len(again) != 0 || n != 0 {
		t.Fatalf("second TrackFiled: %v %d", again, n)
	}
}

// A pass that fails (here: cancelled) vouches for nothing and leaves no
// slot a pod does not hold.
func TestFailedPassLeavesNoSlots(t *testing.T) {
	needRoot(t)
	for _, w := range walks {
		t.Run(w.name, func(t *testing.T) { testFailedPassLeavesNoSlots(t, w.walk) })
	}
}

func testFailedPassLeavesNoSlots(t *testing.T, walk Walk) {
	maps := pinnedMaps(t, 4096)
	ix := fedIndex()
	ix.Hold(pod4(1))
	for i := range 100 {
		put4(t, maps, cilium4(ctmap.NewKey4(pod4(1), pod4(100+i), 80, 1, ctmap.ProtoTCP, ctmap.FlagOut))...)
	}
	ctx, cancel := context.WithCancel(context.Background())
	res, err := Run(ctx, ix, maps, Options{Walk: walk, Batch: 8, afterBatch: func(ctmap.Kind, int) { cancel() }})
	if err == nil {
		t.Fatal("a cancelled pass succeeded")
	}
	if res.Filing != nil || len(res.Addrs) != 0 || len(ix.IPs()) != 1 {
		t.Fatalf("after a failed pass: filing %v, vouched %v, slots %v", res.Filing, res.Addrs, ix.IPs())
	}
	// And the next pass may run.
	if _, err := Run(context.Background(), ix, maps, Options{Walk: walk}); err != nil {
		t.Fatal(err)
	}
}

// Without a recorder feeding the index the pass cannot know what was made
// behind its walk: it fails (within SyncWait) and vouches for nothing.
func TestPassWithoutRecorderFails(t *testing.T) {
	needRoot(t)
	maps := pinnedMaps(t, 4096)
	put4(t, maps, cilium4(ctmap.NewKey4(pod4(1), remote4, 80, 1, ctmap.ProtoTCP, ctmap.FlagOut))...)
	ix := index.New(index.Config{PodCIDRs: []netip.Prefix{podCIDR4}}) // no hooks: nothing feeds it
	res, err := Run(context.Background(), ix, maps, Options{SyncWait: 100 * time.Millisecond})
	if err == nil || res.Filing != nil || len(ix.IPs()) != 0 {
		t.Fatalf("a pass with no recorder: %v, %+v, slots %v", err, res, ix.IPs())
	}
}

// Index memory after a pass over 1 M keys (1,000 pods of 1,000 flows each)
// by the index's own account: <= 16 bytes per key (issue 36).
func TestPassIndexBytesPerKey(t *testing.T) {
	needRoot(t)
	if testing.Short() {
		t.Skip("fills 1 M entries")
	}
	const pods, per = 1000, 1000
	maps := pinnedMaps(t, pods*per*5/4) // room: an LRU map evicts before it is full
	keys := make([]ctmap.CTKey4, 0, pods*per)
	for p := range pods {
		for f := range per {
			keys = append(keys, ctmap.NewKey4(pod4(p+1), remote4, 443, uint16(f), ctmap.ProtoTCP, ctmap.FlagOut))
		}
	}
	vals := make([]ctmap.Entry, len(keys))
	if _, err := maps.Map(ctmap.TCP4).BatchUpdate(keys, vals, nil); err != nil {
		t.Fatal(err)
	}
	keys, vals = nil, nil
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	ix := fedIndex()
	res, err := Run(context.Background(), ix, maps, Options{})
	if err != nil {
		t.Fatal(err)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	n := ix.Keys()
	per1 := float64(ix.Bytes()) / float64(n)
	heap := float64(after.HeapAlloc-before.HeapAlloc) / float64(n)
	t.Logf("pass over %d entries in %v: %d keys, %.2f bytes/key (index's account), %.2f (Go heap)", res.Visited, res.Duration(), n, per1, heap)
	if n != pods*per || res.Visited != pods*per {
		t.Fatalf("%d keys from %d entries, want %d", n, res.Visited, pods*per)
	}
	if per1 > 16 {
		t.Fatalf("%.2f bytes per key, target 16", per1)
	}
	runtime.KeepAlive(ix)
}

// BenchmarkPass: one pass over 4 M entries of 1,024 pods (16 M in `make
// bench`), each into a fresh index.
func BenchmarkPass(b *testing.B) {
	needRoot(b)
	const pods, per = 1024, 4096
	maps := pinnedMaps(b, pods*per*5/4)
	keys := make([]ctmap.CTKey4, 0, pods*per)
	for f := range per {
		for p := range pods {
			keys = append(keys, ctmap.NewKey4(pod4(p+1), netip.AddrFrom4([4]byte{11, byte(f >> 8), byte(f), byte(p)}), 443, uint16(f), ctmap.ProtoTCP, ctmap.FlagOut))
		}
	}
	if _, err := maps.Map(ctmap.TCP4).BatchUpdate(keys, make([]ctmap.Entry, len(keys)), nil); err != nil {
		b.Fatal(err)
	}
	keys = nil
	b.ResetTimer()
	for range b.N {
		ix := fedIndex()
		res, err := Run(context.Background(), ix, maps, Options{})
		if err != nil || res.Pairs != pods*per {
			b.Fatal(res.Pairs, err)
		}
	}
}

// The node's own range (Options.Cover): a free address, with no entry at
// all, is vouched for with an empty set, and a record of a flow towards it
// after the pass lands in its slot; without Cover it has no slot and stays
// unknown. A range past MaxCover fails the pass.
func TestPassCoversTheNodeRange(t *testing.T) {
	needRoot(t)
	maps := pinnedMaps(t, 4096)
	used, free := pod4(1), pod4(9)
	put4(t, maps, cilium4(ctmap.NewKey4(used, remote4, 80, 1, ctmap.ProtoTCP, ctmap.FlagOut))...)
	node := netip.MustParsePrefix("10.244.0.0/28")

	ix := fedIndex()
	ix.Hold(used)
	res, err := Run(context.Background(), ix, maps, Options{Cover: []netip.Prefix{node}})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Addrs) != 16 || !slices.Contains(res.Addrs, free) || !slices.Contains(res.Addrs, used) {
		t.Fatalf("vouched for %v, want the 16 addresses of %v", res.Addrs, node)
	}
	tracked, dropped := ix.TrackFiled(res.Filing, func(ip netip.Addr) bool { return ip == free || ip == used })
	if len(tracked) != 2 || dropped != 14 {
		t.Fatalf("tracked %v, dropped %d; want 2, and the 14 refused slots nobody holds", tracked, dropped)
	}
	// A live pod's new flow towards the free address, after the pass.
	k := ctmap.NewKey4(used, free, 8080, 2, ctmap.ProtoTCP, ctmap.FlagOut)
	recorder.Apply(ix, flowRec4(k))
	if k4, _, st := ix.KeysOf(free); !st.Complete || !slices.Contains(k4, k) {
		t.Fatalf("%v after the pass and a record towards it: %v, %+v", free, k4, st)
	}

	plain := fedIndex()
	res, err = Run(context.Background(), plain, maps, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if slices.Contains(res.Addrs, free) || plain.Gen(free) != 0 {
		t.Fatalf("without Cover the free %v is vouched for (%v)", free, res.Addrs)
	}
	if _, err := Run(context.Background(), fedIndex(), maps, Options{Cover: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}}); err == nil {
		t.Fatal("a /8 to cover was accepted")
	}
}
