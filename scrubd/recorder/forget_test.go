package recorder

import (
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/ringbuf"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// loaded is a Recorder with private pins, fed frames with BPF_PROG_TEST_RUN.
type loaded struct {
	*Recorder
	rd *ringbuf.Reader
}

func loadPinned(t *testing.T, opts Options) *loaded {
	t.Helper()
	requireRoot(t)
	dir, err := os.MkdirTemp("/sys/fs/bpf", "ctscrub-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	opts.PinDir, opts.CTRoot = filepath.Join(dir, "ctscrub"), dir
	r, err := Load(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	l := &loaded{Recorder: r}
	if l.rd, err = ringbuf.NewReader(r.objs.RecEvents); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.rd.Close() })
	return l
}

// records runs one frame and returns how many records it emitted.
func (l *loaded) records(t *testing.T, egress bool, frame []byte) int {
	t.Helper()
	prog := l.objs.RecorderIngress
	if egress {
		prog = l.objs.RecorderEgress
	}
	if _, _, err := prog.Test(frame); err != nil {
		t.Fatal(err)
	}
	n := 0
	for {
		l.rd.SetDeadline(time.Now().Add(5 * time.Millisecond))
		if _, err := l.rd.Read(); err != nil {
			return n
		}
		n++
	}
}

// ForgetIPs bumps generations: every cached flow of the address (its own,
// and live peers' flows towards it; IPv4 and IPv6; TCP through the front
// cache, UDP and ICMP errors) is recorded again at its next packet, other flows are not,
// whatever the cache holds.
func TestForgetIPs(t *testing.T) {
	l := loadPinned(t, Options{})
	other4 := netip.MustParseAddr("10.244.0.11")
	other6 := netip.MustParseAddr("fd00:244::b")
	if genSlot(other4) == genSlot(pod4) || genSlot(other6) == genSlot(pod6) {
		t.Fatal("test addresses share a generation slot")
	}
	flows := []struct {
		name   string
		egress bool
		frame  []byte
		of     netip.Addr // the address whose forgetting must re-record it
	}{
		{"own tcp4", true, eth(0x0800).add(ipv4(6, 0, pod4, peer4)...).add(ports(40000, 443, 20)...).b, pod4},
		{"own udp4", true, eth(0x0800).add(ipv4(17, 0, pod4, peer4)...).add(ports(40001, 53, 8)...).b, pod4},
		{"peer's tcp4 towards it", true, eth(0x0800).add(ipv4(6, 0, other4, pod4)...).add(ports(40002, 80, 20)...).b, pod4},
		{"own tcp6", true, eth(0x86dd).add(ipv6(6, pod6, peer6)...).add(ports(40003, 443, 20)...).b, pod6},
		{"peer's udp6 towards it", false, eth(0x86dd).add(ipv6(17, pod6, other6)...).add(ports(40004, 53, 8)...).b, pod6},
		// ICMP errors are cached flows of their own (RELATED in the seen
		// key): forgetting the address covers them too.
		{"icmp4 error received", false, eth(0x0800).add(ipv4(1, 0, peer4, pod4)...).add(icmpMsg(3, 0)...).b, pod4},
		{"icmp6 error sent", true, eth(0x86dd).add(ipv6(58, pod6, peer6)...).add(icmpMsg(1, 0)...).b, pod6},
		{"unrelated tcp4", true, eth(0x0800).add(ipv4(6, 0, other4, peer4)...).add(ports(40005, 443, 20)...).b, netip.Addr{}},
	}
	for _, f := range flows {
		if n := l.records(t, f.egress, f.frame); n != 1 {
			t.Fatalf("%s: first packet made %d records, want 1", f.name, n)
		}
		for range 3 { // established: the front cache (TCP) or the LRU
			if n := l.records(t, f.egress, f.frame); n != 0 {
				t.Fatalf("%s: established packet made %d records", f.name, n)
			}
		}
	}
	// A full cache changes nothing: forgetting is one slot per address.
	fill := make([]seenKeyValue4, 0, 100_000)
	for i := range cap(fill) {
		fill = append(fill, seenKeyValue4{local: [4]byte{10, 244, byte(i >> 8), byte(i)}, remote: [4]byte{192, 0, 2, byte(i)}})
	}
	keys, vals := seenBatch4(fill)
	if _, err := l.objs.RecFlows4.BatchUpdate(keys, vals, nil); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := l.ForgetIPs(pod4, pod6); err != nil {
		t.Fatal(err)
	}
	t.Logf("ForgetIPs of 2 addresses with %d cached flows: %v", len(fill)+len(flows), time.Since(start))
	for _, f := range flows {
		want := 0
		if f.of.IsValid() {
			want = 1
		}
		if n := l.records(t, f.egress, f.frame); n != want {
			t.Errorf("%s: after forgetting: %d records, want %d", f.name, n, want)
		}
		if n := l.records(t, f.egress, f.frame); n != 0 {
			t.Errorf("%s: recorded again twice", f.name)
		}
	}
}

type seenKeyValue4 struct{ local, remote [4]byte }

// seenBatch4 builds rec_flows4 keys (struct seen_key4) and values (struct
// seen_val, generation 0).
func seenBatch4(fs []seenKeyValue4) ([][16]byte, [][16]byte) {
	keys := make([][16]byte, len(fs))
	vals := make([][16]byte, len(fs))
	for i, f := range fs {
		copy(keys[i][0:4], f.local[:])
		copy(keys[i][4:8], f.remote[:])
		keys[i][9], keys[i][11], keys[i][12] = 1, 2, 6
	}
	return keys, vals
}

// A failure to forget an IP's cached flows marks the IP incomplete (before:
// it was only logged, and the IP stayed complete while flows re-created
// after its scrub could go unrecorded). The failure is caused for real: the
// generation map's descriptor is closed under the recorder.
func TestForgetFailureMarksIncomplete(t *testing.T) {
	l := loadPinned(t, Options{})
	ix := index.New(index.Config{})
	ix.SetHooks(l.hooks(ix))
	taken := netip.MustParseAddr("10.244.0.20")
	ix.Hold(taken) // pods of this node: a mark keeps their slots
	ix.Hold(netip.MustParseAddr("10.244.0.21"))
	ix.Track(taken)
	ix.Add4(ctmap.NewKey4(taken, peer4, 443, 40000, ctmap.ProtoTCP, ctmap.FlagOut))
	if st := ix.State(taken); !st.Complete {
		t.Fatalf("before: %+v", st)
	}
	l.objs.RecGen.Close()

	tracked := netip.MustParseAddr("10.244.0.21")
	ix.Track(tracked)
	if st := ix.State(tracked); st.Incomplete != ReasonForgetFailed {
		t.Errorf("Track with a failing forget: %+v, want incomplete (%s)", st, ReasonForgetFailed)
	}
	ix.Take(taken)
	if st := ix.State(taken); st.Incomplete != ReasonForgetFailed {
		t.Errorf("Take with a failing forget: %+v, want incomplete (%s)", st, ReasonForgetFailed)
	}
}

// Losses are never missed: the per-IP counters live in a hash that never
// evicts (before: an LRU, whose eviction reset an IP's count so that later
// losses did not exceed the count already acted on), and a loss the hash
// has no room for marks every IP incomplete. Real losses: new flows into a
// one-page ring buffer nobody reads.
func TestLostNeverMissed(t *testing.T) {
	l := loadPinned(t, Options{RingBytes: os.Getpagesize(), LostEntries: 2})
	ix := index.New(index.Config{})
	a, b, c := netip.MustParseAddr("10.244.0.30"), netip.MustParseAddr("10.244.0.31"), netip.MustParseAddr("10.244.0.32")
	for _, ip := range []netip.Addr{a, b, c} {
		ix.Hold(ip) // pods of this node: a mark keeps their slots
	}
	port := uint16(1000)
	lose := func(ip netip.Addr) {
		t.Helper()
		before := l.Lost()
		for l.Lost() == before {
			port++
			frame := eth(0x0800).add(ipv4(17, 0, ip, peer4)...).add(ports(port, 53, 8)...).b
			if _, _, err := l.objs.RecorderEgress.Test(frame); err != nil {
				t.Fatal(err)
			}
			if port == 3000 {
				t.Fatalf("no loss for %s after %d new flows into a one-page ring", ip, port-1000)
			}
		}
	}
	poll := func() {
		t.Helper()
		if err := l.PollLost(ix); err != nil {
			t.Fatal(err)
		}
	}
	want := func(step string, ip netip.Addr, incomplete bool) {
		t.Helper()
		st := ix.State(ip)
		if incomplete && st.Incomplete != index.ReasonLost || !incomplete && !st.Complete {
			t.Fatalf("%s: %s is %+v, want incomplete=%v", step, ip, st, incomplete)
		}
	}

	lose(a)
	poll()
	want("loss of a", a, true)
	ix.Track(a) // swept
	want("a swept", a, false)
	lose(b) // the counters are full now (2)
	poll()
	want("loss of b", b, true)
	want("loss of b", a, false)

	lose(c) // no room for c: every IP turns incomplete
	poll()
	if ix.State(c).Complete {
		t.Fatalf("loss of c (overflow): c is complete")
	}
	want("loss of c (overflow)", a, true)
	ix.Track(a)
	ix.Track(b)

	lose(a) // a's count is still there: it grows, a is marked
	poll()
	want("a's second loss", a, true)
	want("a's second loss", b, false)
}

// Addresses of one /24 never share a generation slot, so forgetting a pod
// IP never re-records the flows of another pod of the node's /24.
func TestGenSlotsOfA24(t *testing.T) {
	seen := map[uint32]netip.Addr{}
	for d := range 256 {
		ip := netip.AddrFrom4([4]byte{10, 244, 7, byte(d)})
		s := genSlot(ip)
		if s >= genSlots {
			t.Fatalf("%s: slot %d out of range", ip, s)
		}
		if o, ok := seen[s]; ok {
			t.Fatalf("%s and %s share slot %d", ip, o, s)
		}
		seen[s] = ip
	}
}

// An upgrade from the recorder that kept its lost counts in an LRU pinned as
// rec_lost: Load removes the previous layout's pins, and the old counter,
// which the old programs keep counting into until Attach replaces them, is
// still read: its counts found at start and its growth mark IPs incomplete.
func TestUpgradeReadsLegacyLostCounter(t *testing.T) {
	requireRoot(t)
	dir, err := os.MkdirTemp("/sys/fs/bpf", "ctscrub-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	pins := filepath.Join(dir, "ctscrub")
	if err := os.MkdirAll(pins, 0o700); err != nil {
		t.Fatal(err)
	}
	old, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.LRUHash, KeySize: 16, ValueSize: 8, MaxEntries: 16384})
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	a, b := netip.MustParseAddr("10.244.0.40"), netip.MustParseAddr("10.244.0.41")
	if err := old.Put(a.As16(), uint64(3)); err != nil {
		t.Fatal(err)
	}
	if err := old.Pin(filepath.Join(pins, "rec_lost")); err != nil {
		t.Fatal(err)
	}
	seen, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.LRUHash, KeySize: 16, ValueSize: 8, MaxEntries: 16})
	if err != nil {
		t.Fatal(err)
	}
	defer seen.Close()
	if err := seen.Pin(filepath.Join(pins, "rec_seen4")); err != nil {
		t.Fatal(err)
	}

	r, err := Load(Options{PinDir: pins, CTRoot: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	for _, n := range []string{"rec_lost", "rec_seen4"} {
		if _, err := os.Stat(filepath.Join(pins, n)); err == nil {
			t.Errorf("legacy pin %s left", n)
		}
	}
	ix := index.New(index.Config{})
	ix.Hold(a) // pods of this node: a mark keeps their slots
	ix.Hold(b)
	ix.Track(a)
	ix.Track(b)
	if err := r.PollLost(ix); err != nil {
		t.Fatal(err)
	}
	if st := ix.State(a); st.Incomplete != index.ReasonLost {
		t.Errorf("%s with losses in the old counter: %+v", a, st)
	}
	if err := old.Put(b.As16(), uint64(1)); err != nil { // the old program loses one
		t.Fatal(err)
	}
	if err := r.PollLost(ix); err != nil {
		t.Fatal(err)
	}
	if st := ix.State(b); st.Incomplete != index.ReasonLost {
		t.Errorf("%s lost in the old counter after Load: %+v", b, st)
	}
}

// ForgetAll (the bootstrap pass, before its walk) re-records every cached
// flow, whatever its addresses.
func TestForgetAll(t *testing.T) {
	l := loadPinned(t, Options{})
	frames := []struct {
		egress bool
		frame  []byte
	}{
		{true, eth(0x0800).add(ipv4(6, 0, pod4, peer4)...).add(ports(40000, 443, 20)...).b},
		{false, eth(0x86dd).add(ipv6(17, pod6, peer6)...).add(ports(40004, 53, 8)...).b},
		{true, eth(0x0800).add(ipv4(6, 0, netip.MustParseAddr("10.244.7.7"), peer4)...).add(ports(40005, 443, 20)...).b},
	}
	for i, f := range frames {
		if n := l.records(t, f.egress, f.frame); n != 1 {
			t.Fatalf("flow %d: first packet made %d records", i, n)
		}
		if n := l.records(t, f.egress, f.frame); n != 0 {
			t.Fatalf("flow %d: established packet made %d records", i, n)
		}
	}
	start := time.Now()
	if err := l.ForgetAll(); err != nil {
		t.Fatal(err)
	}
	t.Logf("ForgetAll: %v", time.Since(start))
	for i, f := range frames {
		if n := l.records(t, f.egress, f.frame); n != 1 {
			t.Errorf("flow %d: after ForgetAll: %d records, want 1", i, n)
		}
	}
}

// A loss the per-IP counters have no room for, while a bootstrap pass
// files, spoils the pass: the lost record may be of an address with no
// slot yet, which no mark could reach, so the pass vouches for none.
func TestLostOverflowSpoilsBootstrap(t *testing.T) {
	l := loadPinned(t, Options{RingBytes: os.Getpagesize(), LostEntries: 1})
	ix := index.New(index.Config{})
	a, b, quiet := netip.MustParseAddr("10.244.0.40"), netip.MustParseAddr("10.244.0.41"), netip.MustParseAddr("10.244.0.42")
	ix.Hold(quiet)
	f, err := ix.BeginFiling()
	if err != nil {
		t.Fatal(err)
	}
	port := uint16(1000)
	lose := func(ip netip.Addr) {
		t.Helper()
		before := l.Lost()
		for l.Lost() == before {
			port++
			frame := eth(0x0800).add(ipv4(17, 0, ip, peer4)...).add(ports(port, 53, 8)...).b
			if _, _, err := l.objs.RecorderEgress.Test(frame); err != nil {
				t.Fatal(err)
			}
			if port == 3000 {
				t.Fatalf("no loss for %s", ip)
			}
		}
	}
	lose(a) // the one counter
	lose(b) // no room: overflow
	if err := l.PollLost(ix); err != nil {
		t.Fatal(err)
	}
	// The walk then reaches an address that had no slot when the record
	// was lost: its slot is made now.
	late := netip.MustParseAddr("10.244.0.43")
	f.Add4([]ctmap.CTKey4{ctmap.NewKey4(late, peer4, 53, 999, ctmap.ProtoUDP, ctmap.FlagOut)})
	f.Merge(1)
	if got := f.End(); len(got) != 0 {
		t.Fatalf("the pass vouches for %v after an overflow of the lost counters", got)
	}
}
