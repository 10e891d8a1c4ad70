package cilium

import (
	"encoding/binary"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/rlimit"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
)

var (
	podCIDR4 = netip.MustParsePrefix("10.244.0.0/16")
	podCIDR6 = netip.MustParsePrefix("fd00:10:244::/64")
	remote4  = netip.MustParseAddr("192.0.2.10")
	remote6  = netip.MustParseAddr("2001:db8::10")
)

func needRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates BPF maps and loads BPF programs")
	}
	if err := rlimit.RemoveMemlock(); err != nil {
		t.Skipf("cannot lift RLIMIT_MEMLOCK: %v", err)
	}
}

// pinnedMaps creates Cilium-layout CT maps (ctmap.Kind.Spec) in a private
// bpffs directory and opens them through ctmap.Open, the daemon's path.
func pinnedMaps(t testing.TB, maxEntries uint32, withV6 bool) *ctmap.Maps {
	t.Helper()
	dir, err := os.MkdirTemp("/sys/fs/bpf", "ctscrub-test-")
	if err != nil {
		t.Skipf("no bpffs at /sys/fs/bpf: %v", err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	for _, k := range ctmap.Kinds {
		if k.IPv6() && !withV6 {
			continue
		}
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

func newCilium(t testing.TB, maps *ctmap.Maps, ix *index.Index) *Backend {
	t.Helper()
	c, err := New(maps, ix, Options{})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func newIndex() *index.Index {
	return fedIndex(index.Config{PodCIDRs: []netip.Prefix{podCIDR4, podCIDR6}})
}

// fedIndex is an index these tests feed themselves, synchronously: hooks
// without Sync tell the backend that nothing is left to apply (without
// them a scrub finds no recorder and sweeps).
func fedIndex(cfg index.Config) *index.Index {
	ix := index.New(cfg)
	ix.SetHooks(&index.Hooks{})
	return ix
}

// flow is one connection as Cilium's datapath stores it: the key of the
// entry the record names, plus what Cilium creates beside it.
type flow struct {
	key4 *ctmap.CTKey4
	key6 *ctmap.CTKey6
	svc  bool // a per-packet service LB entry (the recorder reports it as REC_SERVICE)
}

// entries lists every CT key Cilium creates for the flow: the entry, its
// related ICMP entry, and for pod-to-pod traffic the IN twin and its related.
func (f flow) entries(ownsBoth bool) (k4 []ctmap.CTKey4, k6 []ctmap.CTKey6) {
	if f.key4 != nil {
		k := *f.key4
		k4 = append(k4, k)
		if f.svc {
			return k4, nil
		}
		k4 = append(k4, k.Related())
		if ownsBoth {
			tw := k.WithFlags(k.Flags() ^ ctmap.FlagIn)
			k4 = append(k4, tw, tw.Related())
		}
		return k4, nil
	}
	k := *f.key6
	k6 = append(k6, k)
	if f.svc {
		return nil, k6
	}
	k6 = append(k6, k.Related())
	if ownsBoth {
		tw := k.WithFlags(k.Flags() ^ ctmap.FlagIn)
		k6 = append(k6, tw, tw.Related())
	}
	return nil, k6
}

func (f flow) record() *recorder.Record {
	r := &recorder.Record{Kind: recorder.RecFlow}
	if f.svc {
		r.Kind = recorder.RecService
	}
	if f.key4 != nil {
		r.Family = 4
		copy(r.Key[:], f.key4[:])
	} else {
		r.Family = 6
		copy(r.Key[:], f.key6[:])
	}
	return r
}

// world is a set of CT entries in the maps, and what the test expects.
type world struct {
	t    testing.TB
	maps *ctmap.Maps
	ix   *index.Index
	all4 map[ctmap.CTKey4]bool
	all6 map[ctmap.CTKey6]bool
	port uint16
}

func newWorld(t testing.TB, maps *ctmap.Maps, ix *index.Index) *world {
	return &world{t: t, maps: maps, ix: ix, all4: map[ctmap.CTKey4]bool{}, all6: map[ctmap.CTKey6]bool{}, port: 1024}
}

func (w *world) nextPort() uint16 { w.port++; return w.port }

// addFlows creates, for pod ip, n flows of each kind real traffic makes
// (TCP and UDP out, TCP in, pod-to-pod with peer, ICMP echo), writes their
// entries to the maps and, with record set, sends their records through
// recorder.Apply as the recorder would.
func (w *world) addFlows(ip, peer netip.Addr, n int, record bool) {
	w.t.Helper()
	// Pods of this node: they hold their IPs, as after their ADD.
	w.ix.Hold(ip)
	w.ix.Hold(peer)
	var flows []flow
	remote := remote4
	if ip.Is6() {
		remote = remote6
	}
	for range n {
		mk := func(d, s netip.Addr, dport, sport uint16, proto, flags uint8) flow {
			if ip.Is4() {
				k := ctmap.NewKey4(d, s, dport, sport, proto, flags)
				return flow{key4: &k}
			}
			k := ctmap.NewKey6(d, s, dport, sport, proto, flags)
			return flow{key6: &k}
		}
		icmp := ctmap.ProtoICMP
		if ip.Is6() {
			icmp = ctmap.ProtoICMPv6
		}
		flows = append(flows,
			mk(ip, remote, 443, w.nextPort(), ctmap.ProtoTCP, ctmap.FlagOut), // pod connects out
			mk(ip, remote, 53, w.nextPort(), ctmap.ProtoUDP, ctmap.FlagOut),  // DNS
			mk(remote, ip, 8080, w.nextPort(), ctmap.ProtoTCP, ctmap.FlagIn), // remote connects in
			mk(ip, peer, 5432, w.nextPort(), ctmap.ProtoTCP, ctmap.FlagOut),  // pod to pod
			mk(ip, remote, 0, w.nextPort(), icmp, ctmap.FlagOut),             // ping: sport = id
		)
	}
	for _, f := range flows {
		w.addFlow(f, record)
	}
}

func (w *world) addFlow(f flow, record bool) {
	w.t.Helper()
	var both bool
	if f.key4 != nil {
		both = w.ix.Owns(f.key4.DAddr()) && w.ix.Owns(f.key4.SAddr())
	} else {
		both = w.ix.Owns(f.key6.DAddr()) && w.ix.Owns(f.key6.SAddr())
	}
	k4, k6 := f.entries(both)
	val := ctmap.EncodeEntry(ctmap.EntryFields{Lifetime: 1000, Packets: 1})
	for _, k := range k4 {
		if err := w.maps.Map(k.Kind()).Put(k, val); err != nil {
			w.t.Fatalf("put %s: %v", k, err)
		}
		w.all4[k] = true
	}
	for _, k := range k6 {
		if err := w.maps.Map(k.Kind()).Put(k, val); err != nil {
			w.t.Fatalf("put %s: %v", k, err)
		}
		w.all6[k] = true
	}
	if record {
		r := f.record()
		// Through the encoded form, exactly as the ring buffer reader does.
		parsed, err := recorder.ParseRecord(r.Encode())
		if err != nil {
			w.t.Fatal(err)
		}
		recorder.Apply(w.ix, &parsed)
	}
}

// addService adds a per-packet service LB entry of pod ip to a VIP (the pod
// sits in saddr, not reversed) and its record.
func (w *world) addService(ip, vip netip.Addr) {
	w.t.Helper()
	// The entry: SERVICE flag, daddr = VIP, saddr = pod.
	if ip.Is4() {
		k := ctmap.NewKey4(vip, ip, w.nextPort(), 80, ctmap.ProtoTCP, ctmap.FlagService)
		w.addFlow(flow{key4: &k, svc: true}, false)
		// The recorder's REC_SERVICE names the pod as the initiator (daddr).
		r := ctmap.NewKey4(ip, vip, 80, w.nextPort(), ctmap.ProtoTCP, ctmap.FlagOut)
		rec := flow{key4: &r, svc: true}.record()
		recorder.Apply(w.ix, rec)
		return
	}
	k := ctmap.NewKey6(vip, ip, w.nextPort(), 80, ctmap.ProtoTCP, ctmap.FlagService)
	w.addFlow(flow{key6: &k, svc: true}, false)
	r := ctmap.NewKey6(ip, vip, 80, w.nextPort(), ctmap.ProtoTCP, ctmap.FlagOut)
	recorder.Apply(w.ix, flow{key6: &r, svc: true}.record())
}

// dump reads every key of every map.
func dump(t testing.TB, maps *ctmap.Maps) (map[ctmap.CTKey4]bool, map[ctmap.CTKey6]bool) {
	t.Helper()
	k4 := map[ctmap.CTKey4]bool{}
	k6 := map[ctmap.CTKey6]bool{}
	var val ctmap.Entry
	for _, kind := range ctmap.Kinds {
		m := maps.Map(kind)
		if m == nil {
			continue
		}
		it := m.Iterate()
		if kind.IPv6() {
			var k ctmap.CTKey6
			for it.Next(&k, &val) {
				k6[k] = true
			}
		} else {
			var k ctmap.CTKey4
			for it.Next(&k, &val) {
				k4[k] = true
			}
		}
		if err := it.Err(); err != nil {
			t.Fatalf("dump %s: %v", kind.Name(), err)
		}
	}
	return k4, k6
}

// verify checks the maps against w after the IPs in gone were scrubbed:
// no entry holds one of them, every other entry w knows is still there.
// It returns the number of w's entries that held a scrubbed IP.
func (w *world) verify(gone ...netip.Addr) int {
	w.t.Helper()
	k4, k6 := dump(w.t, w.maps)
	isGone := func(has func(netip.Addr) bool) bool {
		for _, ip := range gone {
			if has(ip) {
				return true
			}
		}
		return false
	}
	removed := 0
	for k := range k4 {
		if isGone(k.Has) {
			w.t.Errorf("entry of a scrubbed IP left: %s", k)
		}
	}
	for k := range k6 {
		if isGone(k.Has) {
			w.t.Errorf("entry of a scrubbed IP left: %s", k)
		}
	}
	for k := range w.all4 {
		if isGone(k.Has) {
			removed++
			continue
		}
		if !k4[k] {
			w.t.Errorf("wrong deletion: %s (holds no scrubbed IP)", k)
		}
	}
	for k := range w.all6 {
		if isGone(k.Has) {
			removed++
			continue
		}
		if !k6[k] {
			w.t.Errorf("wrong deletion: %s (holds no scrubbed IP)", k)
		}
	}
	for k := range w.all4 {
		if isGone(k.Has) {
			delete(w.all4, k)
		}
	}
	for k := range w.all6 {
		if isGone(k.Has) {
			delete(w.all6, k)
		}
	}
	return removed
}

// expected counts w's entries per map that hold one of ips.
func (w *world) expected(ips ...netip.Addr) map[string]int {
	out := map[string]int{}
	for k := range w.all4 {
		for _, ip := range ips {
			if k.Has(ip) {
				out[k.Kind().Name()]++
				break
			}
		}
	}
	for k := range w.all6 {
		for _, ip := range ips {
			if k.Has(ip) {
				out[k.Kind().Name()]++
				break
			}
		}
	}
	return out
}

// bulkFill puts n TCP OUT entries of random pod IPs outside the 10.244.0.0/24
// the tests scrub, with BatchUpdate, so a sweep has a real map to walk.
func bulkFill(t testing.TB, m *ebpf.Map, n int) {
	t.Helper()
	const chunk = 65536
	keys := make([]ctmap.CTKey4, 0, chunk)
	vals := make([]ctmap.Entry, chunk)
	r := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < n; i++ {
		var d [4]byte
		binary.BigEndian.PutUint32(d[:], 0x0af40000|uint32(256+r.IntN(65536-256))) // 10.244.1.0 - 10.244.255.255
		keys = append(keys, ctmap.NewKey4(netip.AddrFrom4(d), remote4, uint16(i>>16), uint16(i), ctmap.ProtoTCP, ctmap.FlagOut))
		if len(keys) == chunk || i == n-1 {
			if _, err := m.BatchUpdate(keys, vals[:len(keys)], nil); err != nil {
				t.Fatalf("fill: %v", err)
			}
			keys = keys[:0]
		}
	}
}
