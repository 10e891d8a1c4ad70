package nfct

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// Every test works on the conntrack table of a network namespace of its own:
// conntrack tables are per namespace, so the host's is never touched.

// newTable gives the test a private network namespace and its conntrack table,
// closed when the test ends.
func newTable(t *testing.T) (string, *Table) {
	t.Helper()
	ns := privateNetns(t)
	tab, err := OpenTable(ns)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tab.Close() })
	return ns, tab
}

func privateNetns(t *testing.T) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates a network namespace and writes its conntrack table")
	}
	b := make([]byte, 4)
	rand.Read(b)
	name := "ctscrub-nfct-" + hex.EncodeToString(b)
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add %s: %v: %s", name, err, out)
	}
	t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	return "/var/run/netns/" + name
}

var podNet = netip.MustParsePrefix("10.244.0.0/16")

func udp(src, dst string, sport, dport uint16) Entry {
	s, d := netip.MustParseAddr(src), netip.MustParseAddr(dst)
	return Entry{
		Orig:  Tuple{Src: s, Dst: d, Proto: unix.IPPROTO_UDP, Ports: true, SPort: sport, DPort: dport},
		Reply: Tuple{Src: d, Dst: s, Proto: unix.IPPROTO_UDP, Ports: true, SPort: dport, DPort: sport},
	}
}

// dnat is a client's flow to a Service VIP that the node DNAT'd to a pod: the
// pod IP is only in the reply tuple.
func dnat(client, vip, pod string, cport, port uint16) Entry {
	e := udp(client, vip, cport, port)
	e.Reply.Src = netip.MustParseAddr(pod)
	return e
}

func fill(t *testing.T, tab *Table, es []Entry) {
	t.Helper()
	n, err := tab.Create(es, 600)
	if err != nil {
		t.Fatalf("create %d entries: %v", len(es), err)
	}
	if n != len(es) {
		t.Fatalf("created %d of %d entries", n, len(es))
	}
}

func snapshot(t *testing.T, tab *Table) map[flowKey]Entry {
	t.Helper()
	m := make(map[flowKey]Entry)
	if err := tab.Dump(func(e Entry) { m[keyOf(&e)] = e }); err != nil {
		t.Fatalf("dump: %v", err)
	}
	return m
}

func holds(e Entry, ip netip.Addr) bool {
	return e.Orig.Src == ip || e.Orig.Dst == ip || e.Reply.Src == ip || e.Reply.Dst == ip
}

// checkScrubbed asserts that no entry holds any of ips and every entry of
// before without them is still there, with the same ID.
func checkScrubbed(t *testing.T, tab *Table, before map[flowKey]Entry, ips ...netip.Addr) {
	t.Helper()
	holdsAny := func(e Entry) bool {
		for _, ip := range ips {
			if holds(e, ip) {
				return true
			}
		}
		return false
	}
	after := snapshot(t, tab)
	for _, e := range after {
		if holdsAny(e) {
			t.Errorf("entry %v -> %v (zone %d) survived the scrub of %v", e.Orig, e.Reply, e.Zone, ips)
		}
	}
	for k, e := range before {
		if holdsAny(e) {
			continue
		}
		if a, ok := after[k]; !ok || a.ID != e.ID {
			t.Errorf("unrelated entry %v was deleted or replaced", e.Orig)
		}
	}
}

// population: target owns entries as client, as server behind DNAT, in both
// orders; others talk among themselves.
func population(target string, k int) (mine, others []Entry) {
	for i := 0; i < k; i++ {
		switch i % 3 {
		case 0:
			mine = append(mine, udp(target, "10.244.9.9", uint16(10000+i), 53))
		case 1:
			mine = append(mine, dnat("10.244.7.7", "10.96.0.10", target, uint16(10000+i), 80))
		case 2:
			mine = append(mine, udp("192.168.1.1", target, uint16(10000+i), 8080))
		}
	}
	for i := 0; i < 3*k; i++ {
		others = append(others, udp(fmt.Sprintf("10.244.3.%d", 1+i%200), "10.244.9.9", uint16(20000+i), 53))
	}
	return mine, others
}

func TestScrubByIndex(t *testing.T) {
	ns, tab := newTable(t)
	target := netip.MustParseAddr("10.244.1.5")
	mine, others := population(target.String(), 300)
	// Half before the backend starts (found by the seed dump), half after
	// (found through NEW events).
	fill(t, tab, mine[:150])
	fill(t, tab, others)
	n, err := New(Config{PodCIDRs: []netip.Prefix{podNet}, Netns: ns})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	fill(t, tab, mine[150:])
	before := snapshot(t, tab)

	// Events are applied asynchronously: give the reader a moment.
	for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if k, _ := n.IndexIP(target); k == len(mine) {
			break
		}
	}
	if k, c := n.IndexIP(target); !c || k != len(mine) {
		t.Fatalf("index holds %d entries of the target (complete %v), want %d, complete", k, c, len(mine))
	}
	res, err := n.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{target}, Reason: scrub.ReasonDel})
	if err != nil {
		t.Fatal(err)
	}
	if res.Method != scrub.MethodIndex || res.Outcome != scrub.Complete {
		t.Fatalf("want an index scrub, complete; got %+v", res)
	}
	if res.Deleted[MapName] != len(mine) {
		t.Errorf("deleted %d, want %d", res.Deleted[MapName], len(mine))
	}
	checkScrubbed(t, tab, before, target)
	if st := n.Stats(); st.Lost != 0 || st.Events < uint64(len(mine)-150) {
		t.Errorf("stats %+v: want no loss and at least %d events", st, len(mine)-150)
	}

	// An address outside the pod CIDRs is never indexed: its scrub must walk.
	outside := netip.MustParseAddr("192.168.1.1")
	before = snapshot(t, tab)
	res, err = n.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{outside}})
	if err != nil {
		t.Fatal(err)
	}
	if res.Method != scrub.MethodSweep {
		t.Errorf("scrub of a non-pod address used %s, want the fallback", res.Method)
	}
	checkScrubbed(t, tab, before, outside)
}

func icmpEcho(src, dst string, id uint16) Entry {
	s, d := netip.MustParseAddr(src), netip.MustParseAddr(dst)
	proto := uint8(unix.IPPROTO_ICMP)
	req, rep := uint16(8<<8), uint16(0)
	if s.Is6() {
		proto, req, rep = unix.IPPROTO_ICMPV6, 128<<8, 129<<8
	}
	return Entry{
		Orig:  Tuple{Src: s, Dst: d, Proto: proto, SPort: id, DPort: req},
		Reply: Tuple{Src: d, Dst: s, Proto: proto, SPort: id, DPort: rep},
	}
}

func tcp(src, dst string, sport, dport uint16) Entry {
	e := udp(src, dst, sport, dport)
	e.Orig.Proto, e.Reply.Proto = unix.IPPROTO_TCP, unix.IPPROTO_TCP
	return e
}

// Every protocol shape and both families go through the index path: the
// delete rebuilds each tuple from the index key, so a wrong attribute would
// leave the entry behind.
func TestScrubProtocolsAndFamilies(t *testing.T) {
	ns, tab := newTable(t)
	v6net := netip.MustParsePrefix("fd00:244::/64")
	n, err := New(Config{PodCIDRs: []netip.Prefix{podNet, v6net}, Netns: ns})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	t4, t6 := netip.MustParseAddr("10.244.1.5"), netip.MustParseAddr("fd00:244::5")
	mine4 := []Entry{tcp("10.244.1.5", "1.1.1.1", 40000, 443), udp("10.244.1.5", "8.8.8.8", 5353, 53), icmpEcho("10.244.1.5", "9.9.9.9", 77)}
	mine6 := []Entry{tcp("fd00:244::5", "2001:db8::1", 40000, 443), udp("2001:db8::1", "fd00:244::5", 999, 53), icmpEcho("fd00:244::5", "2001:db8::9", 78)}
	others := []Entry{tcp("10.244.1.6", "1.1.1.1", 40000, 443), icmpEcho("fd00:244::6", "2001:db8::9", 78), udp("fd00:244::6", "2001:db8::1", 5353, 53)}
	fill(t, tab, append(append(append([]Entry{}, mine4...), mine6...), others...))
	before := snapshot(t, tab)
	res, err := n.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{t4, t6}})
	if err != nil {
		t.Fatal(err)
	}
	if res.Method != scrub.MethodIndex || res.Deleted[MapName] != len(mine4)+len(mine6) {
		t.Fatalf("want an index scrub deleting %d, got %+v", len(mine4)+len(mine6), res)
	}
	checkScrubbed(t, tab, before, t4, t6)
	if got := len(snapshot(t, tab)); got != len(others) {
		t.Errorf("%d entries left, want the %d others", got, len(others))
	}
}

// The fallback for an IPv6 address must not use the kernel's v6 address
// filter (inverted on this kernel, see TestKernelIPv6FilterMatch): with it,
// every OTHER entry would go. Auto mode takes the dump path for v6.
func TestIPv6FallbackKeepsOthers(t *testing.T) {
	ns, tab := newTable(t)
	n, err := New(Config{Netns: ns})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	target := netip.MustParseAddr("fd00:244::5")
	es := []Entry{udp("fd00:244::5", "fd00:244::9", 1, 53), dnat("fd00:244::7", "fd00:96::10", "fd00:244::5", 2, 80),
		udp("fd00:244::6", "fd00:244::9", 1, 53), udp("fd00:244::8", "fd00:244::9", 1, 53)}
	fill(t, tab, es)
	before := snapshot(t, tab)
	res, err := n.Sweep(context.Background(), scrub.Request{IPs: []netip.Addr{target}})
	if err != nil {
		t.Fatal(err)
	}
	if res.Method != scrub.MethodSweep || res.Deleted[MapName] != 2 {
		t.Fatalf("want a sweep deleting 2, got %+v", res)
	}
	checkScrubbed(t, tab, before, target)
}

func TestDryRunDeletesNothing(t *testing.T) {
	ns, tab := newTable(t)
	target := netip.MustParseAddr("10.244.1.5")
	mine, others := population(target.String(), 30)
	fill(t, tab, append(mine, others...))
	n, err := New(Config{PodCIDRs: []netip.Prefix{podNet}, Netns: ns})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	res, err := n.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{target}, DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	if res.Deleted[MapName] != len(mine) {
		t.Errorf("dry run counted %d, want %d", res.Deleted[MapName], len(mine))
	}
	if got := len(snapshot(t, tab)); got != len(mine)+len(others) {
		t.Errorf("dry run changed the table: %d entries, want %d", got, len(mine)+len(others))
	}
}

// The ID guard: a delete for an old flow must not remove a newer flow that
// reuses its tuple.
func TestDeleteHonoursFlowID(t *testing.T) {
	ns, tab := newTable(t)
	n, err := New(Config{PodCIDRs: []netip.Prefix{podNet}, Netns: ns})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	e := udp("10.244.1.5", "10.244.9.9", 1234, 53)
	fill(t, tab, []Entry{e})
	old := snapshot(t, tab)[keyOf(&e)]
	// Replace it: same tuple, new flow, new ID.
	if d, err := n.deleteFlows(context.Background(), netip.Addr{}, []flow{{keyOf(&e), old.ID}}); err != nil || d != 1 {
		t.Fatalf("delete the first flow: %d, %v", d, err)
	}
	// The kernel's ID hashes the entry's address: let fillers take the freed
	// slab slot so the new flow lands elsewhere and gets another ID. The
	// slab's free lists are per CPU, and the fillers may be made on the
	// other CPU than the new flow (CI found the same ID once): then free
	// the new flow's slot again and take it with more fillers.
	var cur Entry
	port := uint16(1)
	for try := 0; ; try++ {
		var fillers []Entry
		for i := 0; i < 64; i++ {
			fillers = append(fillers, udp("10.1.0.1", "10.1.0.2", port, 9))
			port++
		}
		fill(t, tab, fillers)
		fill(t, tab, []Entry{e})
		cur = snapshot(t, tab)[keyOf(&e)]
		if cur.ID != old.ID || try == 9 {
			break
		}
		if d, err := n.deleteFlows(context.Background(), netip.Addr{}, []flow{{keyOf(&e), cur.ID}}); err != nil || d != 1 {
			t.Fatalf("delete the recreated flow that took the old slot: %d, %v", d, err)
		}
	}
	if cur.ID == old.ID || cur.ID == 0 {
		t.Fatalf("recreated flow has ID %d, old %d after 10 tries: cannot test the guard", cur.ID, old.ID)
	}
	d, err := n.deleteFlows(context.Background(), netip.Addr{}, []flow{{keyOf(&e), old.ID}})
	if err != nil || d != 0 {
		t.Fatalf("delete with the stale ID: deleted %d, err %v; want 0, nil (ENOENT)", d, err)
	}
	if _, ok := snapshot(t, tab)[keyOf(&e)]; !ok {
		t.Fatal("the newer flow was deleted by a delete carrying the old flow's ID")
	}
}

// Lost events for real: a receive buffer of a few events and a burst of
// creations the reader cannot keep up with. The IPs become incomplete and the
// scrub falls back, for each fallback, and still leaves nothing.
func TestLostEventsFallBack(t *testing.T) {
	for _, fb := range []Fallback{FallbackFlush, FallbackDump} {
		t.Run(string(fb), func(t *testing.T) {
			if fb == FallbackFlush && !kernelAtLeast(6, 12) {
				t.Skip("filtered flush needs Linux 6.12+")
			}
			ns, tab := newTable(t)
			n, err := New(Config{PodCIDRs: []netip.Prefix{podNet}, Netns: ns, EventBufferBytes: 1, Fallback: fb, ResyncAfterLoss: -1})
			if err != nil {
				t.Fatal(err)
			}
			defer n.Close()
			target := netip.MustParseAddr("10.244.1.5")
			mine, others := population(target.String(), 2000)
			fill(t, tab, append(others, mine...))
			deadline := time.Now().Add(5 * time.Second)
			for n.Lost() == 0 && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
			}
			st := n.Stats()
			if st.Lost == 0 {
				t.Fatalf("no events lost with a %d-byte buffer and a burst of %d: cannot test the fallback (%+v)", st.EventBuffer, len(mine)+len(others), st)
			}
			t.Logf("lost %d events with a %d-byte event buffer", st.Lost, st.EventBuffer)
			before := snapshot(t, tab)
			gen := n.ix.gen()
			res, err := n.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{target}, Reason: scrub.ReasonAdd})
			if err != nil {
				t.Fatal(err)
			}
			if res.Method != scrub.MethodSweep || res.PerIP[target.String()] != scrub.MethodSweep {
				t.Fatalf("after a loss the scrub must fall back; got %+v", res)
			}
			if fb == FallbackDump && res.Deleted[MapName] != len(mine) {
				t.Errorf("dump fallback deleted %d, want %d", res.Deleted[MapName], len(mine))
			}
			checkScrubbed(t, tab, before, target)
			// The fallback's own deletes may overrun the tiny buffer again
			// (DESTROY events), so completeness is checked against the loss
			// generation the fallback started from, not the current one.
			n.ix.mu.Lock()
			s := n.ix.ips[target]
			n.ix.mu.Unlock()
			if s == nil || !s.cleaned || s.cleanGen < gen {
				t.Error("the fallback did not record the IP clean")
			}
		})
	}
}

// After losses, the re-seeding dump restores completeness for every IP.
func TestResyncAfterLoss(t *testing.T) {
	ns, tab := newTable(t)
	n, err := New(Config{PodCIDRs: []netip.Prefix{podNet}, Netns: ns, EventBufferBytes: 1, ResyncAfterLoss: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	target := netip.MustParseAddr("10.244.1.5")
	mine, others := population(target.String(), 2000)
	fill(t, tab, append(others, mine...))
	if n.Lost() == 0 {
		t.Skip("no events lost in this run: nothing to resync")
	}
	// The socket can count more drops after the loss the event loop first
	// noticed (the burst drains through a 1-byte buffer); a scrub notices
	// them in catchUp and rightly sweeps. Wait until every drop has been
	// noticed (catchUp, as a scrub does) and the re-seed after the last one
	// is done.
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		n.catchUp(context.Background())
		if n.lossSeen.Load() == n.ev.drops() && n.Complete(target) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !n.Complete(target) {
		t.Fatal("index never became complete again after the loss")
	}
	before := snapshot(t, tab)
	res, err := n.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{target}})
	if err != nil {
		t.Fatal(err)
	}
	if res.Method != scrub.MethodIndex {
		t.Errorf("after the re-seed the scrub should use the index, got %s (drops %d, noticed %d)", res.Method, n.ev.drops(), n.lossSeen.Load())
	}
	checkScrubbed(t, tab, before, target)
}

// Zones: the same tuple in two zones is two flows; a backend limited to a
// zone scrubs only that zone's.
func TestZones(t *testing.T) {
	ns, tab := newTable(t)
	target := netip.MustParseAddr("10.244.1.5")
	a := udp("10.244.1.5", "10.244.9.9", 1111, 53)
	b := a
	b.Zone = 7
	c := udp("10.244.1.6", "10.244.9.9", 1111, 53)
	c.Zone = 7

	nAll, err := New(Config{PodCIDRs: []netip.Prefix{podNet}, Netns: ns})
	if err != nil {
		t.Fatal(err)
	}
	defer nAll.Close()
	nZone, err := New(Config{PodCIDRs: []netip.Prefix{podNet}, Netns: ns, Zones: []uint16{7}})
	if err != nil {
		t.Fatal(err)
	}
	defer nZone.Close()
	fill(t, tab, []Entry{a, b, c})
	if got := len(snapshot(t, tab)); got != 3 {
		t.Fatalf("table has %d entries, want 3 (same tuple in zones 0 and 7, plus one)", got)
	}
	res, err := nZone.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{target}})
	if err != nil {
		t.Fatal(err)
	}
	after := snapshot(t, tab)
	if res.Deleted[MapName] != 1 || len(after) != 2 {
		t.Fatalf("zone-7 scrub deleted %d, table now %d; want 1 and 2", res.Deleted[MapName], len(after))
	}
	for _, e := range after {
		if e.Zone == 7 && holds(e, target) {
			t.Error("zone-7 entry of the target survived")
		}
	}
	res, err = nAll.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{target}})
	if err != nil {
		t.Fatal(err)
	}
	if res.Deleted[MapName] != 1 || len(snapshot(t, tab)) != 1 {
		t.Fatalf("all-zones scrub deleted %d; want the zone-0 entry", res.Deleted[MapName])
	}
}

func TestCancelledScrub(t *testing.T) {
	ns, tab := newTable(t)
	n, err := New(Config{PodCIDRs: []netip.Prefix{podNet}, Netns: ns})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	target := netip.MustParseAddr("10.244.1.5")
	mine, _ := population(target.String(), 50)
	fill(t, tab, mine)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	res, err := n.Scrub(ctx, scrub.Request{IPs: []netip.Addr{target}})
	if err == nil || res.Outcome != scrub.Cancelled {
		t.Fatalf("cancelled scrub returned %+v, %v", res, err)
	}
	if got := len(snapshot(t, tab)); got != len(mine) {
		t.Errorf("a scrub cancelled before it started deleted entries: %d left of %d", got, len(mine))
	}
	if !n.Complete(target) {
		t.Error("cancellation must not cost the index its completeness")
	}
}

// The kernel's filter on IPv6 addresses: recorded, because the backend avoids
// the IPv6 filtered flush on the strength of it.
func TestKernelIPv6FilterMatch(t *testing.T) {
	if !kernelAtLeast(6, 12) {
		t.Skip("filtered flush needs Linux 6.12+")
	}
	ns, tab := newTable(t)
	n, err := New(Config{Netns: ns, Fallback: FallbackFlush})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	fill(t, tab, []Entry{udp("fd00::5", "fd00::9", 1, 2), udp("fd00::6", "fd00::9", 1, 2)})
	// The same filter on a dump.
	var dumped []netip.Addr
	if err := tab.s.dump(unix.AF_INET6, func(m *msgBuf) {
		m.nest(ctaTupleOrig)
		m.nest(ctaTupleIP)
		m.attr(ctaIPv6Src, netip.MustParseAddr("fd00::5").AsSlice())
		m.endNest()
		m.endNest()
		m.nest(ctaFilter)
		m.attr(ctaFilterOrigFlags, binary.NativeEndian.AppendUint32(nil, filterFlagIPSrc))
		m.endNest()
	}, func(e Entry) { dumped = append(dumped, e.Orig.Src) }); err != nil {
		t.Fatalf("filtered v6 dump: %v", err)
	}
	t.Logf("a v6 CTA_FILTER dump for orig source fd00::5 returned sources %v", dumped)
	if len(dumped) != 1 {
		t.Fatalf("a filtered dump of two entries by one source returned %v", dumped)
	}
	if err := n.flushOne(netip.MustParseAddr("fd00::5"), ctaTupleOrig, ctaFilterOrigFlags, filterFlagIPSrc, 0, false); err != nil {
		t.Fatal(err)
	}
	left := snapshot(t, tab)
	var srcs []netip.Addr
	for _, e := range left {
		srcs = append(srcs, e.Orig.Src)
	}
	switch {
	case len(left) == 1 && srcs[0] == netip.MustParseAddr("fd00::6"):
		t.Log("this kernel matches IPv6 filters correctly")
	case len(left) == 1 && srcs[0] == netip.MustParseAddr("fd00::5"):
		t.Log("this kernel inverts the IPv6 address match: the flush removed every entry BUT the IP's (ctscrub uses the dump fallback for IPv6)")
	default:
		t.Fatalf("unexpected result of an IPv6 filtered flush: left %v", srcs)
	}
}

// With net.netfilter.nf_conntrack_events=2 (the default), entries created
// before anyone listened never send a DESTROY event: the seed indexes them
// and the index keeps them after they are gone. A scrub finds them gone
// (ENOENT), deletes nothing wrongly, and drops them from the index.
func TestStaleSeededKeysArePruned(t *testing.T) {
	if _, err := exec.LookPath("conntrack"); err != nil {
		t.Skip("conntrack-tools missing (apt-get install conntrack): it plays the other deleter")
	}
	ns := privateNetns(t)
	if v, err := readSysctl(ns, "net/netfilter/nf_conntrack_events"); err != nil || v != "2" {
		t.Skipf("nf_conntrack_events is %q (%v) in a new netns, this test needs 2", v, err)
	}
	tab, err := OpenTable(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer tab.Close()
	target := netip.MustParseAddr("10.244.1.5")
	mine, _ := population(target.String(), 30)
	fill(t, tab, mine)
	n, err := New(Config{PodCIDRs: []netip.Prefix{podNet}, Netns: ns})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	keys := n.Stats().Keys
	if keys < len(mine) {
		t.Fatalf("seed indexed %d keys, want at least %d", keys, len(mine))
	}
	// Someone else deletes them: no DESTROY event reaches the index.
	name := ns[len("/var/run/netns/"):]
	for _, flag := range []string{"--orig-src", "--reply-src", "--orig-dst"} {
		exec.Command("ip", "netns", "exec", name, "conntrack", "-D", flag, target.String()).Run()
	}
	if got := len(snapshot(t, tab)); got != 0 {
		t.Fatalf("conntrack -D left %d entries", got)
	}
	time.Sleep(100 * time.Millisecond)
	if n.Stats().Keys != keys {
		t.Skip("the kernel sent DESTROY events for pre-listener entries: nothing stale to prune")
	}
	res, err := n.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{target}})
	if err != nil {
		t.Fatal(err)
	}
	if res.Method != scrub.MethodIndex || res.Deleted[MapName] != 0 {
		t.Fatalf("want an index scrub deleting nothing (all gone), got %+v", res)
	}
	if _, c := n.ix.take(target); !c {
		t.Error("pruning must keep the IP complete")
	}
	if fs, _ := n.ix.take(target); len(fs) != 0 {
		t.Errorf("%d stale keys of %s still indexed after the scrub", len(fs), target)
	}
}

// Scrubs keep the index path while other pods' flows keep arriving: the
// catch-up before a scrub must not wait for a quiet table.
func TestScrubWhileFlowsArrive(t *testing.T) {
	ns, tab := newTable(t)
	churn, err := OpenTable(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer churn.Close()
	n, err := New(Config{PodCIDRs: []netip.Prefix{podNet}, Netns: ns})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		for k := 0; ; {
			select {
			case <-stop:
				return
			default:
			}
			es := make([]Entry, 200)
			for i := range es {
				es[i] = udp(fmt.Sprintf("10.244.%d.%d", 10+(k/250)%200, 1+k%250), "172.17.0.1", uint16(1024+k%50000), uint16(1+(k/50000)%1000))
				k++
			}
			churn.Create(es, 600)
			time.Sleep(10 * time.Millisecond) // ~20,000 new flows/s at most
		}
	}()
	defer func() { close(stop); <-done }()
	target := netip.MustParseAddr("10.244.1.5")
	mine, _ := population(target.String(), 300)
	for r := 0; r < 3; r++ {
		fill(t, tab, mine)
		before := snapshot(t, tab)
		ev := n.Stats().Events
		res, err := n.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{target}})
		if err != nil {
			t.Fatal(err)
		}
		if res.Method != scrub.MethodIndex || res.Deleted[MapName] != len(mine) {
			t.Fatalf("round %d under churn: want an index scrub deleting %d, got %+v", r, len(mine), res)
		}
		checkScrubbed(t, tab, before, target)
		if n.Stats().Events == ev {
			t.Fatal("no events arrived during the round: the churn is not running")
		}
	}
}

// A fallback for several IPs at once (one walk for the set) removes exactly
// their entries.
func TestSweepOfSeveralIPs(t *testing.T) {
	ns, tab := newTable(t)
	n, err := New(Config{PodCIDRs: []netip.Prefix{podNet}, Netns: ns})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	var ips []netip.Addr
	var all []Entry
	want := 0
	for i, a := range []string{"10.244.1.5", "10.244.1.6", "10.244.1.7"} {
		mine, others := population(a, 30+i)
		ips = append(ips, netip.MustParseAddr(a))
		// population's shared peers (10.244.7.7, 10.244.9.9) make
		// different IPs' entries collide: keep each IP's own ports apart.
		for j := range mine {
			mine[j].Orig.SPort += uint16(1000 * i)
			mine[j].Reply.DPort += uint16(1000 * i)
		}
		all = append(all, mine...)
		if i == 0 {
			all = append(all, others...)
		}
		want += len(mine)
	}
	fill(t, tab, all)
	before := snapshot(t, tab)
	res, err := n.Sweep(context.Background(), scrub.Request{IPs: ips})
	if err != nil {
		t.Fatal(err)
	}
	if res.Method != scrub.MethodSweep || res.Deleted[MapName] != want {
		t.Fatalf("sweep of %v: want %d deleted, got %+v", ips, want, res)
	}
	checkScrubbed(t, tab, before, ips...)
}

// The fallbacks respect zones too: limited to zone 7, neither the filtered
// flush (CTA_ZONE in the filter) nor the dump touches zone 0.
func TestZonedSweep(t *testing.T) {
	for _, fb := range []Fallback{FallbackFlush, FallbackDump} {
		t.Run(string(fb), func(t *testing.T) {
			if fb == FallbackFlush && !kernelAtLeast(6, 12) {
				t.Skip("filtered flush needs Linux 6.12+")
			}
			ns, tab := newTable(t)
			n, err := New(Config{PodCIDRs: []netip.Prefix{podNet}, Netns: ns, Zones: []uint16{7}, Fallback: fb})
			if err != nil {
				t.Fatal(err)
			}
			defer n.Close()
			target := netip.MustParseAddr("10.244.1.5")
			a := udp("10.244.1.5", "10.244.9.9", 1111, 53)
			b := a
			b.Zone = 7
			c := dnat("10.244.7.7", "10.96.0.10", "10.244.1.5", 2222, 80)
			c.Zone = 7
			fill(t, tab, []Entry{a, b, c})
			if _, err := n.Sweep(context.Background(), scrub.Request{IPs: []netip.Addr{target}}); err != nil {
				t.Fatal(err)
			}
			left := snapshot(t, tab)
			if len(left) != 1 {
				t.Fatalf("%d entries left, want only the zone-0 one", len(left))
			}
			for _, e := range left {
				if e.Zone != 0 {
					t.Errorf("left an entry of zone %d", e.Zone)
				}
			}
		})
	}
}
