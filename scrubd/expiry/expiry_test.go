package expiry

import (
	"compress/gzip"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"math/rand/v2"
	"net/netip"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/ctscrub/ctscrub/internal/testsupport/standin"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

func needRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates BPF maps and loads a BPF_PROG_TYPE_SYSCALL program")
	}
}

// newMap makes an unpinned map with Cilium's layout for kind k.
func newMap(t *testing.T, k ctmap.Kind, max uint32) *ebpf.Map {
	t.Helper()
	m, err := ebpf.NewMap(k.Spec(max))
	if err != nil {
		t.Fatalf("create %s: %v", k.Name(), err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// key returns the i-th distinct key of kind k as the map's raw bytes.
func key(k ctmap.Kind, i int) []byte {
	var a4 [4]byte
	binary.BigEndian.PutUint32(a4[:], 0x0a000000|uint32(i>>8))
	proto := ctmap.ProtoTCP
	if k == ctmap.Any4 || k == ctmap.Any6 {
		proto = ctmap.ProtoUDP
	}
	d := netip.AddrFrom4(a4)
	s := netip.MustParseAddr("10.255.0.1")
	if k.IPv6() {
		d = netip.AddrFrom16(netip.MustParseAddr("fd00::").As16())
		b := d.As16()
		binary.BigEndian.PutUint32(b[12:], uint32(i>>8))
		d = netip.AddrFrom16(b)
		s = netip.MustParseAddr("fd00::ffff:1")
		kk := ctmap.NewKey6(d, s, 80, uint16(1024+i&0xff), proto, ctmap.FlagOut)
		return kk[:]
	}
	kk := ctmap.NewKey4(d, s, 80, uint16(1024+i&0xff), proto, ctmap.FlagOut)
	return kk[:]
}

// nows reads both of the kernel's BPF clocks the way the program does, by
// running a report pass over an empty map.
func nows(t *testing.T) (ktime, jiffies uint32) {
	t.Helper()
	m := newMap(t, ctmap.TCP4, 16)
	p, err := loadPass(ctmap.TCP4, m, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	out, _, err := p.run(context.Background(), passArgs{})
	if err != nil {
		t.Fatal(err)
	}
	return out.Now[clockKtime], out.Now[clockJiffies]
}

type population struct {
	live, justExpired, longExpired int
	marked                         int    // of the expired ones, these carry marker in bytes
	marker                         uint64 // ct_entry.bytes of marked entries
}

// longAge is how long ago long-expired entries expired: an hour, or half the
// clock's value on a machine booted less than two hours ago (no lifetime
// predates the boot).
func longAge(now uint32) uint32 {
	floor := uint32(0)
	if now >= jiffiesFloor {
		floor = jiffiesFloor
	}
	return min(3600, (now-floor)/2)
}

// fill writes p's entries with lifetimes in clock c (now = that clock's now),
// returns the keys of live and expired entries. Long-expired entries expired
// longAge units ago.
func fill(t *testing.T, m *ebpf.Map, k ctmap.Kind, now uint32, p population) (live, expired, marked [][]byte) {
	t.Helper()
	var keys [][]byte
	var vals []ctmap.Entry
	add := func(lt uint32, bytes uint64) []byte {
		kk := key(k, len(keys))
		e := ctmap.EncodeEntry(ctmap.EntryFields{Lifetime: lt, Packets: 1, Bytes: bytes})
		keys = append(keys, kk)
		vals = append(vals, e)
		return kk
	}
	for i := 0; i < p.live; i++ {
		// Spread over the next hour, but no sooner than 300 units: no entry
		// expires while the test runs.
		live = append(live, add(now+300+uint32(i%3300), 0))
	}
	for i := 0; i < p.justExpired; i++ {
		var b uint64
		if i < p.marked {
			b = p.marker
		}
		kk := add(now-1, b)
		expired = append(expired, kk)
		if b != 0 {
			marked = append(marked, kk)
		}
	}
	for i := 0; i < p.longExpired; i++ {
		expired = append(expired, add(now-longAge(now)+uint32(i%60), 0))
	}
	if len(keys) > 0 {
		var batch any
		if k.IPv6() {
			ks := make([]ctmap.CTKey6, len(keys))
			for i := range keys {
				ks[i] = ctmap.CTKey6(keys[i])
			}
			batch = ks
		} else {
			ks := make([]ctmap.CTKey4, len(keys))
			for i := range keys {
				ks[i] = ctmap.CTKey4(keys[i])
			}
			batch = ks
		}
		if _, err := m.BatchUpdate(batch, vals, &ebpf.BatchOptions{}); err != nil {
			t.Fatalf("fill %s: %v", k.Name(), err)
		}
	}
	return live, expired, marked
}

func exists(m *ebpf.Map, k []byte) bool {
	var e ctmap.Entry
	return m.Lookup(k, &e) == nil
}

func count(t *testing.T, m *ebpf.Map) int {
	t.Helper()
	n := 0
	var e ctmap.Entry
	it := m.Iterate()
	k := make([]byte, m.KeySize())
	for it.Next(&k, &e) {
		n++
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	return n
}

func runner(t *testing.T, maps [ctmap.NumKinds]*ebpf.Map, cfg Config, reg prometheus.Registerer) *Runner {
	t.Helper()
	cm, err := ctmap.FromMaps(maps)
	if err != nil {
		t.Fatal(err)
	}
	r, err := New(cm, cfg, Options{Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

func clockNow(c Clock, kt, jf uint32) uint32 {
	if c == ClockJiffies {
		return jf
	}
	return kt
}

// Counts are exact in both clocks, for v4 and v6 maps, and report mode
// deletes nothing.
func TestReportCountsExact(t *testing.T) {
	needRoot(t)
	for _, clock := range []Clock{ClockKtime, ClockJiffies} {
		t.Run(string(clock), func(t *testing.T) {
			kt, jf := nows(t)
			now := clockNow(clock, kt, jf)
			var maps [ctmap.NumKinds]*ebpf.Map
			pops := map[ctmap.Kind]population{
				ctmap.TCP4: {live: 1000, justExpired: 300, longExpired: 700},
				ctmap.Any4: {live: 50, justExpired: 0, longExpired: 20},
				ctmap.TCP6: {live: 10, justExpired: 5, longExpired: 0},
				ctmap.Any6: {},
			}
			for k, p := range pops {
				maps[k] = newMap(t, k, 4096)
				fill(t, maps[k], k, now, p)
			}
			reg := prometheus.NewPedanticRegistry()
			r := runner(t, maps, Config{Mode: ModeReport}, reg)
			rep, err := r.Pass(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if !rep.Decision.Confirmed || rep.Decision.Clock != clock {
				t.Fatalf("decision %+v, want %s confirmed", rep.Decision, clock)
			}
			// NowIn is the pass's own reading of each clock, which benchmarks
			// write lifetimes against: at or after the readings taken before
			// the pass, and within seconds of them.
			for c, before := range map[Clock]uint32{ClockKtime: kt, ClockJiffies: jf} {
				if got := rep.NowIn(c); got < before || got > before+30 {
					t.Errorf("NowIn(%s) = %d, want %d..%d", c, got, before, before+30)
				}
			}
			if len(rep.Maps) != 4 {
				t.Fatalf("%d map reports, want 4", len(rep.Maps))
			}
			for _, mr := range rep.Maps {
				var k ctmap.Kind
				for _, kk := range ctmap.Kinds {
					if kk.Name() == mr.Map {
						k = kk
					}
				}
				p := pops[k]
				if mr.Live != uint64(p.live) || mr.Expired != uint64(p.justExpired+p.longExpired) || mr.Deleted != 0 {
					t.Errorf("%s: live %d expired %d deleted %d, want %d %d 0", mr.Map, mr.Live, mr.Expired, mr.Deleted, p.live, p.justExpired+p.longExpired)
				}
				if n := count(t, maps[k]); n != p.live+p.justExpired+p.longExpired {
					t.Errorf("%s: %d entries left after a report pass, want all %d", mr.Map, n, p.live+p.justExpired+p.longExpired)
				}
				if p.longExpired > 0 {
					// longAge units ago (+ the seconds the test took); jiffies
					// units are converted with the kernel's HZ.
					want := r.unitsToDuration(clockIndex(clock), longAge(now))
					if d := mr.OldestExpired - want; d < 0 || d > 30*time.Second {
						t.Errorf("%s: oldest expired %s, want about %s", mr.Map, mr.OldestExpired, want)
					}
				}
			}
			if v := value(t, r.m.entries.WithLabelValues("cilium", "cilium_ct4_global", "expired")); v != 1000 {
				t.Errorf("ctscrub_ct_entries{map=cilium_ct4_global,state=expired} = %v, want 1000", v)
			}
			if v := value(t, r.m.clock.WithLabelValues(string(clock), "true")); v != 1 {
				t.Errorf("ctscrub_ct_clock{clock=%s,confirmed=true} = %v, want 1", clock, v)
			}
			mfs, err := reg.Gather()
			if err != nil {
				t.Fatal(err)
			}
			var names []string
			for _, mf := range mfs {
				names = append(names, mf.GetName())
			}
			for _, want := range []string{"ctscrub_ct_entries", "ctscrub_ct_oldest_expired_seconds", "ctscrub_expiry_sweep_duration_seconds", "ctscrub_ct_clock", "ctscrub_expiry_passes_total"} {
				if !slices.Contains(names, want) {
					t.Errorf("metric %s not exported (have %s)", want, strings.Join(names, ", "))
				}
			}
		})
	}
}

// Sweep deletes exactly the expired entries, in both clocks; the first pass
// confirms the clock and sweeps at once.
func TestSweepDeletesExactlyExpired(t *testing.T) {
	needRoot(t)
	for _, clock := range []Clock{ClockKtime, ClockJiffies} {
		t.Run(string(clock), func(t *testing.T) {
			kt, jf := nows(t)
			now := clockNow(clock, kt, jf)
			m4 := newMap(t, ctmap.TCP4, 1<<16)
			m6 := newMap(t, ctmap.TCP6, 1<<14)
			live4, exp4, _ := fill(t, m4, ctmap.TCP4, now, population{live: 20000, justExpired: 5000, longExpired: 15000})
			live6, exp6, _ := fill(t, m6, ctmap.TCP6, now, population{live: 3000, justExpired: 100, longExpired: 2000})
			r := runner(t, [ctmap.NumKinds]*ebpf.Map{ctmap.TCP4: m4, ctmap.TCP6: m6}, Config{Mode: ModeSweep}, nil)
			rep, err := r.Pass(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if !rep.Swept || rep.Decision.Clock != clock {
				t.Fatalf("pass swept=%v decision %+v, want a sweep in %s", rep.Swept, rep.Decision, clock)
			}
			tot := rep.Total()
			if tot.Deleted != uint64(len(exp4)+len(exp6)) {
				t.Errorf("deleted %d, want %d", tot.Deleted, len(exp4)+len(exp6))
			}
			for _, c := range []struct {
				m             *ebpf.Map
				live, expired [][]byte
			}{{m4, live4, exp4}, {m6, live6, exp6}} {
				if n := count(t, c.m); n != len(c.live) {
					t.Errorf("%d entries left, want the %d live ones", n, len(c.live))
				}
				for _, k := range c.live {
					if !exists(c.m, k) {
						t.Fatalf("live entry %x deleted", k)
					}
				}
				for _, k := range c.expired {
					if exists(c.m, k) {
						t.Fatalf("expired entry %x left", k)
					}
				}
			}
			// A second pass finds nothing more to delete.
			rep, err = r.Pass(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if tot := rep.Total(); tot.Deleted != 0 || tot.Expired != 0 || tot.Live != uint64(len(live4)+len(live6)) {
				t.Errorf("second pass: %+v, want only the live entries", tot)
			}
		})
	}
}

// An entry the datapath refreshes between the count and the delete survives.
// The refresh is written at exactly that moment by the program built with
// its refresh hook (refresh_hook in bpf/expiry.c; the build is
// internal/testsupport/standin's, the shipped object has no hook): the real
// race, with Cilium's datapath on another CPU, cannot be hit on demand.
func TestRefreshedBeforeDeleteSurvives(t *testing.T) {
	needRoot(t)
	kt, _ := nows(t)
	m := newMap(t, ctmap.TCP4, 1<<14)
	const marker = 0xC75C_2B0B_0000_0001
	live, expired, marked := fill(t, m, ctmap.TCP4, kt, population{live: 2000, justExpired: 3000, longExpired: 1000, marked: 500, marker: marker})
	defer func(load func() (*ebpf.CollectionSpec, error)) { loadExpirySpec = load }(loadExpirySpec)
	loadExpirySpec = standin.LoadExpiryRefresh
	r := runner(t, [ctmap.NumKinds]*ebpf.Map{ctmap.TCP4: m}, Config{Mode: ModeSweep, Clock: ClockKtime}, nil)
	if err := r.passes[ctmap.TCP4].coll.Variables["test_refresh_marker"].Set(uint64(marker)); err != nil {
		t.Fatalf("set the refresh hook's marker: %v", err)
	}
	rep, err := r.Pass(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	tot := rep.Total()
	if tot.Refreshed != uint64(len(marked)) || tot.Deleted != uint64(len(expired)-len(marked)) {
		t.Errorf("refreshed %d deleted %d, want %d and %d", tot.Refreshed, tot.Deleted, len(marked), len(expired)-len(marked))
	}
	for _, k := range marked {
		var e ctmap.Entry
		if err := m.Lookup(k, &e); err != nil {
			t.Fatalf("refreshed entry %x was deleted: %v", k, err)
		}
		if e.Lifetime() < kt {
			t.Fatalf("entry %x survived but was not refreshed (lifetime %d, now %d)", k, e.Lifetime(), kt)
		}
	}
	if n := count(t, m); n != len(live)+len(marked) {
		t.Errorf("%d entries left, want %d live + %d refreshed", n, len(live), len(marked))
	}
}

// Ambiguous evidence deletes nothing: entries that fit neither clock, too few
// entries, and a configured clock the entries refute. It is logged in the
// decision and exposed as metrics.
func TestAmbiguousClockDeletesNothing(t *testing.T) {
	needRoot(t)
	kt, jf := nows(t)
	cases := []struct {
		name  string
		clock Clock
		fill  func(m *ebpf.Map)
	}{
		{"both clocks mixed", ClockAuto, func(m *ebpf.Map) {
			// Half the entries look like ktime, half like jiffies: each
			// clock is refuted by the other half.
			var lts []uint32
			for i := range 400 {
				if i%2 == 0 {
					lts = append(lts, kt-10, kt+100)
				} else {
					lts = append(lts, jf-10, jf+100)
				}
			}
			put(t, m, lts)
		}},
		{"too few entries", ClockAuto, func(m *ebpf.Map) {
			put(t, m, []uint32{kt - 100, kt - 5, kt + 50})
		}},
		{"configured jiffies, entries in ktime", ClockJiffies, func(m *ebpf.Map) {
			lts := make([]uint32, 0, 1000)
			for i := range 1000 {
				lts = append(lts, kt-uint32(i%500), kt+uint32(i))
			}
			put(t, m, lts)
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := newMap(t, ctmap.TCP4, 4096)
			c.fill(m)
			before := count(t, m)
			reg := prometheus.NewPedanticRegistry()
			r := runner(t, [ctmap.NumKinds]*ebpf.Map{ctmap.TCP4: m}, Config{Mode: ModeSweep, Clock: c.clock}, reg)
			for i := range 2 {
				rep, err := r.Pass(context.Background())
				if err != nil {
					t.Fatal(err)
				}
				// A configured clock is trusted until the entries refute it;
				// its first pass sweeps, and the in-kernel guard keeps
				// entries impossible in it.
				swept := rep.Swept && (c.clock == ClockAuto || i > 0)
				if swept || rep.Decision.Delete || rep.Total().Deleted != 0 {
					t.Fatalf("ambiguous evidence swept: %+v", rep)
				}
				if rep.Decision.Why == "" || rep.Decision.Confirmed {
					t.Fatalf("decision %+v: want unconfirmed, with a reason", rep.Decision)
				}
				t.Logf("why: %s", rep.Decision.Why)
			}
			if n := count(t, m); n != before {
				t.Errorf("%d entries left of %d: deleted under an ambiguous clock", n, before)
			}
			if v := value(t, r.m.withheld); v != 1 {
				t.Errorf("ctscrub_expiry_sweep_withheld = %v, want 1", v)
			}
			if v := value(t, r.m.clock.WithLabelValues(string(r.Decision().Clock), "false")); v != 1 {
				t.Errorf("ctscrub_ct_clock{confirmed=false} = %v, want 1", v)
			}
		})
	}
}

// The in-kernel guard: a sweep told the wrong clock (jiffies, entries in
// ktime) deletes nothing, even when user space got the decision wrong.
func TestWrongClockGuardInKernel(t *testing.T) {
	needRoot(t)
	kt, _ := nows(t)
	m := newMap(t, ctmap.TCP4, 4096)
	_, expired, _ := fill(t, m, ctmap.TCP4, kt, population{live: 100, justExpired: 100, longExpired: 100})
	p, err := loadPass(ctmap.TCP4, m, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	a := passArgs{Flags: flagSweep, Clock: clockJiffies, MaxFuture: [2]uint32{25000, 90000}, Floor: [2]uint32{0, jiffiesFloor}}
	out, _, err := p.run(context.Background(), a)
	if err != nil {
		t.Fatal(err)
	}
	if out.Deleted != 0 || out.Guarded != 300 {
		t.Errorf("deleted %d guarded %d, want 0 and 300 (every entry is expired when read as jiffies)", out.Deleted, out.Guarded)
	}
	if n := count(t, m); n != 300 {
		t.Errorf("%d entries left, want 300", n)
	}
	_ = expired
}

func put(t *testing.T, m *ebpf.Map, lts []uint32) {
	t.Helper()
	for i, lt := range lts {
		e := ctmap.EncodeEntry(ctmap.EntryFields{Lifetime: lt})
		if err := m.Put(key(ctmap.TCP4, i), &e); err != nil {
			t.Fatal(err)
		}
	}
}

// The stop flag ends a pass early: cancelling the context mid-pass stops the
// walk, and the pass reports it as stopped.
func TestStopFlagEndsPassEarly(t *testing.T) {
	needRoot(t)
	kt, _ := nows(t)
	const n = 1 << 20
	// The cancel comes from another goroutine 0-20 ms into the pass; on a
	// loaded machine it may land only after the whole pass is done (no
	// stop to test): then the attempt is repeated on a fresh map, up to 5
	// times. A stop flag that does not work fails every attempt.
	for attempt := 1; ; attempt++ {
		// Room to spare: an LRU map evicts before it is full.
		m := newMap(t, ctmap.TCP4, n+n/4)
		fill(t, m, ctmap.TCP4, kt, population{live: n / 2, longExpired: n / 2})
		if c := count(t, m); c != n {
			t.Fatalf("filled %d entries, want %d", c, n)
		}
		r := runner(t, [ctmap.NumKinds]*ebpf.Map{ctmap.TCP4: m}, Config{Mode: ModeSweep, Clock: ClockKtime}, nil)
		ctx, cancel := context.WithCancel(context.Background())
		go func() {
			time.Sleep(time.Duration(rand.IntN(20)) * time.Millisecond)
			cancel()
		}()
		start := time.Now()
		rep, err := r.Pass(ctx)
		took := time.Since(start)
		cancel()
		if err == nil && attempt < 5 {
			t.Logf("attempt %d: the pass ended (%s) before the cancel landed; again", attempt, took)
			continue
		}
		if !errors.Is(err, errStopped) && !errors.Is(err, context.Canceled) {
			t.Fatalf("err %v, want a stopped pass", err)
		}
		tot := rep.Total()
		t.Logf("stopped after %s, %d of %d entries visited, %d deleted", took, tot.Entries, n, tot.Deleted)
		if !rep.Stopped || tot.Entries >= n {
			t.Fatalf("pass not stopped early: stopped=%v visited %d of %d", rep.Stopped, tot.Entries, n)
		}
		if left := count(t, m); uint64(left) != n-tot.Deleted {
			t.Errorf("%d entries left, want %d - %d deleted", left, n, tot.Deleted)
		}
		return
	}
}

// value reads a gauge or counter.
func value(t *testing.T, m prometheus.Metric) float64 {
	t.Helper()
	var d dto.Metric
	if err := m.Write(&d); err != nil {
		t.Fatal(err)
	}
	if d.Gauge != nil {
		return d.Gauge.GetValue()
	}
	return d.Counter.GetValue()
}

// The HZ estimated from one reading of both clocks matches the kernel's
// CONFIG_HZ (when /proc/config.gz says it).
func TestKernelHZMatchesConfig(t *testing.T) {
	needRoot(t)
	f, err := os.Open("/proc/config.gz")
	if err != nil {
		t.Skipf("no /proc/config.gz to compare with: %v", err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := io.ReadAll(zr)
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^CONFIG_HZ=(\d+)$`).FindSubmatch(cfg)
	if m == nil {
		t.Skip("CONFIG_HZ not in /proc/config.gz")
	}
	want, _ := strconv.Atoi(string(m[1]))
	mp := newMap(t, ctmap.TCP4, 16)
	p, err := loadPass(ctmap.TCP4, mp, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	out, _, err := p.run(context.Background(), passArgs{})
	if err != nil {
		t.Fatal(err)
	}
	got := kernelHZ(out.NowJiffies64, out.NowKtimeNs)
	if got == 0 {
		t.Skipf("uptime %d s too close to 300 s to estimate HZ", out.NowKtimeNs/1e9)
	}
	if got != want {
		t.Errorf("estimated HZ %d, CONFIG_HZ=%d (jiffies64 %d, ktime %d ns)", got, want, out.NowJiffies64, out.NowKtimeNs)
	}
	if out.Now[clockJiffies] != uint32(out.NowJiffies64>>8) || out.Now[clockKtime] != uint32(out.NowKtimeNs/1e9) {
		t.Errorf("now %v does not match the clocks read (%d, %d)", out.Now, out.NowJiffies64, out.NowKtimeNs)
	}
}

// Run passes on the fixed interval until its context ends, then returns.
func TestRunFixedInterval(t *testing.T) {
	needRoot(t)
	kt, _ := nows(t)
	m := newMap(t, ctmap.TCP4, 4096)
	fill(t, m, ctmap.TCP4, kt, population{live: 100, longExpired: 50})
	reg := prometheus.NewPedanticRegistry()
	r := runner(t, [ctmap.NumKinds]*ebpf.Map{ctmap.TCP4: m}, Config{Mode: ModeSweep, Interval: time.Second}, reg)
	ctx, cancel := context.WithTimeout(context.Background(), 2500*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after its context ended")
	}
	passes := value(t, r.m.passes.WithLabelValues("cilium_ct4_global", "swept")) + value(t, r.m.passes.WithLabelValues("cilium_ct4_global", "reported"))
	if passes < 2 {
		t.Errorf("%v passes in 2.5 s at a 1 s interval, want at least 2", passes)
	}
	if n := count(t, m); n != 100 {
		t.Errorf("%d entries left, want the 100 live ones", n)
	}
}

// Mode off loads nothing and runs nothing.
func TestModeOff(t *testing.T) {
	r, err := New(nil, Config{Mode: ModeOff}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Run(context.Background()); err != nil {
		t.Fatalf("Run in mode off: %v", err)
	}
	rep, err := r.Pass(context.Background())
	if err != nil || len(rep.Maps) != 0 {
		t.Fatalf("Pass in mode off: %+v, %v", rep, err)
	}
}
