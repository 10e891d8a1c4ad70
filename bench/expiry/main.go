// Command expiry (make bench-expiry) measures one expiry pass of ctscrub
// against the two ways Cilium garbage-collects a CT map, on the same map in
// one run:
//
//   - ctscrub: the in-kernel pass (bpf/expiry.c through scrubd/expiry), once
//     counting only (report) and once deleting (sweep);
//   - Cilium 1.16: a NextKey + Lookup walk from user space deleting expired
//     entries as it goes (two syscalls per entry, three per expired one);
//   - Cilium 1.18+: BPF_MAP_LOOKUP_BATCH over the whole map, then one delete
//     per expired entry.
//
// The map has Cilium's TCP4 layout and ENTRIES entries (default 4194304), half
// of them expired; the expired half is written back between methods so each
// sees the same map. The last line is JSON.
//
// Then, for the steady state (only what expired in the last interval is
// expired), the map is refilled with STEADY_EXPIRED_PERMILLE (default 10)
// per mille expired and swept once more.
//
// NEXTKEY_MAX_VISITS (default 0 = whole map) stops the NextKey walk after
// that many entries and extrapolates its time linearly to the whole map; the
// JSON says whether it did.
package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"os"
	"runtime"
	"slices"
	"strconv"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/rlimit"
	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/internal/ciliumwalk"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/expiry"
)

func envInt(name string, def int) int {
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	v, err := strconv.Atoi(s)
	if err != nil || v < 0 {
		log.Fatalf("%s=%q: want a non-negative integer", name, s)
	}
	return v
}

// key is the i-th entry's key: distinct for every i below 2^32.
func key(i int) ctmap.CTKey4 {
	var k ctmap.CTKey4
	binary.BigEndian.PutUint32(k[0:4], 0x0a000000|uint32(i>>8))   // daddr: initiator
	binary.BigEndian.PutUint32(k[4:8], 0x0aff0000|uint32(i&0xff)) // saddr: responder
	binary.BigEndian.PutUint16(k[8:10], 443)
	binary.BigEndian.PutUint16(k[10:12], uint16(32768+i%28232))
	k[12] = ctmap.ProtoTCP
	k[13] = ctmap.FlagOut
	return k
}

// lifetime of the i-th entry: odd entries expired (up to 50 min ago, or half
// the uptime on a freshly booted machine: no entry predates the boot), even
// ones live (for up to 6 h).
func lifetime(i int, now uint32) uint32 {
	if i%2 == 1 {
		return now - 1 - uint32(i)%min(3000, now/2)
	}
	return now + 60 + uint32(i%21600)
}

func expired(lt, now uint32) bool { return lt < now }

// liveExpiredBy counts the entries of the first n written live at fillNow
// (even i) whose lifetime is below t.
func liveExpiredBy(n int, fillNow, t uint32) int {
	c := 0
	for i := 0; i < n; i += 2 {
		if lifetime(i, fillNow) < t {
			c++
		}
	}
	return c
}

// monoNow is Cilium's ktime clock: CLOCK_MONOTONIC seconds, what
// bpf_ktime_get_ns() / 1e9 reads.
func monoNow() uint32 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		log.Fatal(err)
	}
	return uint32(ts.Sec)
}

const chunk = 1 << 16

// write puts entries i = start, start+step, ... < n.
func write(m *ebpf.Map, n, start, step int, now uint32) {
	keys := make([]ctmap.CTKey4, 0, chunk)
	vals := make([]ctmap.Entry, 0, chunk)
	flush := func() {
		if len(keys) == 0 {
			return
		}
		if _, err := m.BatchUpdate(keys, vals, nil); err != nil {
			log.Fatalf("fill map: %v", err)
		}
		keys, vals = keys[:0], vals[:0]
	}
	for i := start; i < n; i += step {
		keys = append(keys, key(i))
		vals = append(vals, ctmap.EncodeEntry(ctmap.EntryFields{Lifetime: lifetime(i, now), Packets: 10, Bytes: 1500, Flags: 1}))
		if len(keys) == chunk {
			flush()
		}
	}
	flush()
}

// census counts the map's entries and returns the keys of the expired ones,
// with a batch walk (not timed).
func census(m *ebpf.Map, now uint32) (total int, expiredKeys []ctmap.CTKey4, expiredVals []ctmap.Entry) {
	keys := make([]ctmap.CTKey4, chunk)
	vals := make([]ctmap.Entry, chunk)
	var cur ebpf.MapBatchCursor
	for {
		n, err := m.BatchLookup(&cur, keys, vals, nil)
		total += n
		for i := range n {
			if expired(vals[i].Lifetime(), now) {
				expiredKeys = append(expiredKeys, keys[i])
				expiredVals = append(expiredVals, vals[i])
			}
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return total, expiredKeys, expiredVals
		}
		if err != nil {
			log.Fatalf("census: %v", err)
		}
	}
}

func count(m *ebpf.Map) int {
	n, _, _ := census(m, 0)
	return n
}

// threadCPU is the calling thread's CPU time (user + system).
func threadCPU() time.Duration {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_THREAD, &ru); err != nil {
		log.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

type result struct {
	Date                       string  `json:"date"`
	Kernel                     string  `json:"kernel"`
	CPUs                       int     `json:"cpus"`
	Entries                    int     `json:"entries"`
	Expired                    int     `json:"expired"`
	MaxEntries                 int     `json:"max_entries"`
	CtscrubReportS             float64 `json:"ctscrub_report_s"`
	CtscrubReportCPUS          float64 `json:"ctscrub_report_cpu_s"`
	CtscrubSweepS              float64 `json:"ctscrub_sweep_s"`
	CtscrubSweepCPUS           float64 `json:"ctscrub_sweep_cpu_s"`
	CtscrubDeleted             uint64  `json:"ctscrub_deleted"`
	NextkeyGCS                 float64 `json:"nextkey_gc_s"`
	NextkeyCPUS                float64 `json:"nextkey_gc_cpu_s"`
	NextkeyExtrapolated        bool    `json:"nextkey_extrapolated"`
	NextkeyVisited             int     `json:"nextkey_visited"`
	NextkeyDeleted             int     `json:"nextkey_deleted"`
	BatchGCS                   float64 `json:"batch_gc_s"`
	BatchCPUS                  float64 `json:"batch_gc_cpu_s"`
	BatchDeleted               int     `json:"batch_deleted"`
	SpeedupVsBatch             float64 `json:"speedup_vs_batch"`
	SpeedupVsNextkey           float64 `json:"speedup_vs_nextkey"`
	SpeedupVsBatchCPU          float64 `json:"speedup_vs_batch_cpu"`
	CtscrubCPUShareAt60s       float64 `json:"ctscrub_cpu_share_at_60s"`
	SteadyExpired              int     `json:"steady_expired"`
	CtscrubSteadySweepS        float64 `json:"ctscrub_steady_sweep_s"`
	CtscrubSteadyCPUShareAt60s float64 `json:"ctscrub_steady_cpu_share_at_60s"`
	TargetSpeedupVsBatch2      bool    `json:"target_2x_vs_batch_met"`
	TargetCPUShare10pct        bool    `json:"target_cpu_share_le_10pct_met"`
	AuditExtraS                float64 `json:"audit_extra_s"`      // what the audit adds to a pass (audit.go)
	AuditExtraCPUS             float64 `json:"audit_extra_cpu_s"`  // the same in the process's CPU time
	AuditPassS                 float64 `json:"audit_pass_s"`       // a report pass with the audit
	AuditIPs                   int     `json:"audit_ips"`          // IPs audited in that pass
	AuditKeys                  int     `json:"audit_keys"`         // their keys, all copied out and checked
	AuditWithinBound           bool    `json:"audit_within_bound"` // the pass with the audit stays under interval / 2
}

func main() {
	log.SetFlags(0)
	if os.Geteuid() != 0 {
		log.Fatal("bench-expiry needs root (BPF maps and programs)")
	}
	if err := rlimit.RemoveMemlock(); err != nil {
		log.Fatal(err)
	}
	n := envInt("ENTRIES", 4194304)
	if n < 1024 {
		log.Fatalf("ENTRIES=%d: want at least 1024", n)
	}
	maxVisits := envInt("NEXTKEY_MAX_VISITS", 0)
	// Default: a map of exactly ENTRIES, as Cilium sizes its maps (a power
	// of two up to 16,777,216). The kernel gives a hash map
	// roundup_pow_of_two(max_entries) buckets, and every walk pays for empty
	// buckets too, so headroom above a power of two doubles the walk.
	maxEntries := envInt("MAX_ENTRIES", n)
	if maxEntries < n {
		log.Fatalf("MAX_ENTRIES=%d is below ENTRIES=%d", maxEntries, n)
	}
	// Keep every timed syscall on one thread so RUSAGE_THREAD sees it.
	runtime.LockOSThread()

	m, err := ebpf.NewMap(ctmap.TCP4.Spec(uint32(maxEntries)))
	if err != nil {
		log.Fatalf("create %d-entry map: %v (needs ~%d MB of kernel memory)", maxEntries, err, maxEntries*140>>20)
	}
	defer m.Close()
	now := monoNow()
	t0 := time.Now()
	write(m, n, 0, 1, now)
	// A full LRU map evicts a few entries (per-CPU free lists run dry before
	// the map is full): take the map as it is, and refill exactly the expired
	// entries it held.
	present, expiredKeys, expiredVals := census(m, now)
	nExpired := len(expiredKeys)
	if present < n-n/64 {
		log.Fatalf("filled %d entries of %d: the LRU map evicted too many", present, n)
	}
	n = present
	fmt.Printf("map: %s, %d entries (%d expired), max_entries %d, filled in %s\n", ctmap.TCP4.Name(), n, nExpired, maxEntries, time.Since(t0).Round(time.Millisecond))
	refill := func() (expiredNow int) {
		for off := 0; off < len(expiredKeys); off += chunk {
			end := min(off+chunk, len(expiredKeys))
			if _, err := m.BatchUpdate(expiredKeys[off:end], expiredVals[off:end], nil); err != nil {
				log.Fatalf("refill: %v", err)
			}
		}
		// Refilling a full LRU map may evict a handful of entries; the
		// methods then see maps that differ by that many (printed).
		c, e, _ := census(m, now)
		if c != n || len(e) != nExpired {
			fmt.Printf("refill: %d entries (%d expired) instead of %d (%d): LRU evicted %d\n", c, len(e), n, nExpired, n-c)
		}
		if c < n-n/1000 {
			log.Fatalf("refill: LRU evicted %d of %d entries; set MAX_ENTRIES above ENTRIES", n-c, n)
		}
		return len(e)
	}

	maps, err := ctmap.FromMaps([ctmap.NumKinds]*ebpf.Map{ctmap.TCP4: m})
	if err != nil {
		log.Fatal(err)
	}
	res := result{Date: time.Now().UTC().Format(time.RFC3339), CPUs: runtime.NumCPU(), Entries: n, Expired: nExpired, MaxEntries: maxEntries}
	var uts unix.Utsname
	if unix.Uname(&uts) == nil {
		res.Kernel = unix.ByteSliceToString(uts.Release[:])
	}
	ctx := context.Background()

	// ctscrub, report mode: counts only.
	rep, err := expiry.New(maps, expiry.Config{Mode: expiry.ModeReport, Clock: expiry.ClockAuto, PassTimeout: 10 * time.Minute}, expiry.Options{})
	if err != nil {
		log.Fatal(err)
	}
	c0 := threadCPU()
	r, err := rep.Pass(ctx)
	res.CtscrubReportCPUS = (threadCPU() - c0).Seconds()
	rep.Close()
	if err != nil {
		log.Fatal(err)
	}
	tot := r.Total()
	res.CtscrubReportS = tot.Duration.Seconds()
	// Entries written live expire while a long fill runs (16 M entries on a
	// loaded machine: many minutes): allow exactly those, by lifetime.
	late := liveExpiredBy(n, now, r.NowIn(expiry.ClockKtime))
	if tot.Live+tot.Expired != uint64(n) || tot.Expired < uint64(nExpired) || tot.Expired > uint64(nExpired+late) || !r.Decision.Confirmed || r.Decision.Clock != expiry.ClockKtime {
		log.Fatalf("report pass: live %d expired %d decision %+v; want %d, %d (+ up to %d written live that expired since the fill), ktime confirmed", tot.Live, tot.Expired, r.Decision, n-nExpired, nExpired, late)
	}
	fmt.Printf("ctscrub report pass: %.3fs (thread CPU %.3fs), clock %s confirmed\n", res.CtscrubReportS, res.CtscrubReportCPUS, r.Decision.Clock)
	extra, extraCPU, with, aips, akeys := auditCost(ctx, maps, n)
	res.AuditExtraS, res.AuditExtraCPUS, res.AuditPassS, res.AuditIPs, res.AuditKeys = round(extra.Seconds()), round(extraCPU.Seconds()), round(with.Seconds()), aips, akeys
	res.AuditWithinBound = with < expiry.DefaultInterval/2

	// ctscrub, sweep mode. The clock is configured so the measured pass is
	// the sweep alone (in auto mode the first pass counts, confirms, then
	// sweeps; every later pass is one sweep like this one).
	sw, err := expiry.New(maps, expiry.Config{Mode: expiry.ModeSweep, Clock: expiry.ClockKtime, PassTimeout: 10 * time.Minute}, expiry.Options{})
	if err != nil {
		log.Fatal(err)
	}
	c0 = threadCPU()
	r, err = sw.Pass(ctx)
	res.CtscrubSweepCPUS = (threadCPU() - c0).Seconds()
	sw.Close()
	if err != nil {
		log.Fatal(err)
	}
	tot = r.Total()
	res.CtscrubSweepS = tot.Duration.Seconds()
	res.CtscrubDeleted = tot.Deleted
	if left := count(m); tot.Deleted != uint64(nExpired) || left != n-nExpired {
		log.Fatalf("ctscrub sweep deleted %d, %d left; want %d and %d", tot.Deleted, left, nExpired, n-nExpired)
	}
	fmt.Printf("ctscrub sweep pass: %.3fs (thread CPU %.3fs), deleted %d\n", res.CtscrubSweepS, res.CtscrubSweepCPUS, tot.Deleted)
	want := refill()

	// Cilium 1.16: NextKey + Lookup walk.
	c0 = threadCPU()
	start := time.Now()
	st, err := ciliumwalk.NextKeyMap(m, ctmap.TCP4, ciliumwalk.ExpiredAt(now), ciliumwalk.Options{MaxVisits: maxVisits})
	visited, deleted, partial := st.Visited, st.Deleted, st.Partial
	took := time.Since(start)
	res.NextkeyCPUS = (threadCPU() - c0).Seconds()
	if err != nil {
		log.Fatalf("NextKey GC: %v", err)
	}
	res.NextkeyVisited, res.NextkeyDeleted = visited, deleted
	res.NextkeyGCS = took.Seconds()
	if partial {
		res.NextkeyExtrapolated = true
		res.NextkeyGCS = took.Seconds() * float64(n) / float64(visited)
		res.NextkeyCPUS = res.NextkeyCPUS * float64(n) / float64(visited)
		fmt.Printf("Cilium 1.16 NextKey GC: %d of %d entries in %.3fs, extrapolated to the whole map: %.3fs\n", visited, n, took.Seconds(), res.NextkeyGCS)
	} else {
		if deleted != want {
			log.Fatalf("NextKey GC deleted %d, want %d", deleted, want)
		}
		fmt.Printf("Cilium 1.16 NextKey GC: %.3fs, deleted %d\n", res.NextkeyGCS, deleted)
	}
	want = refill()

	// Cilium 1.18+: batch lookup, then deletes.
	c0 = threadCPU()
	start = time.Now()
	st, err = ciliumwalk.BatchMap(m, ctmap.TCP4, ciliumwalk.ExpiredAt(now), ciliumwalk.Options{})
	visited, deleted = st.Visited, st.Deleted
	res.BatchGCS = time.Since(start).Seconds()
	res.BatchCPUS = (threadCPU() - c0).Seconds()
	if err != nil {
		log.Fatalf("batch GC: %v", err)
	}
	res.BatchDeleted = deleted
	if deleted != want || visited < n-n/1000 {
		log.Fatalf("batch GC visited %d deleted %d, want ~%d and %d", visited, deleted, n, want)
	}
	fmt.Printf("Cilium 1.18+ batch GC: %.3fs, deleted %d\n", res.BatchGCS, deleted)

	// Steady state: after the first sweep only what expired during the last
	// interval is expired. Write the deleted half back as live entries except
	// STEADY_EXPIRED_PERMILLE of the map, and time one more sweep.
	steady := envInt("STEADY_EXPIRED_PERMILLE", 10)
	nSteady := min(n*steady/1000, len(expiredKeys))
	for off := 0; off < len(expiredKeys); off += chunk {
		end := min(off+chunk, len(expiredKeys))
		vals := make([]ctmap.Entry, 0, end-off)
		for i := off; i < end; i++ {
			v := expiredVals[i]
			if i >= nSteady {
				v.SetLifetime(now + 600 + uint32(i%3600))
			}
			vals = append(vals, v)
		}
		if _, err := m.BatchUpdate(expiredKeys[off:end], vals, nil); err != nil {
			log.Fatalf("steady-state fill: %v", err)
		}
	}
	sw, err = expiry.New(maps, expiry.Config{Mode: expiry.ModeSweep, Clock: expiry.ClockKtime, PassTimeout: 10 * time.Minute}, expiry.Options{})
	if err != nil {
		log.Fatal(err)
	}
	// The live half was filled with lifetimes from now+60 s on; a 16 M run
	// takes minutes to get here, so some of it has expired since, and more
	// may expire before the pass reads its clock: the pass must delete those
	// too. How many is not known in advance (it depends on how long the
	// machine took, hence its load), so the check is exact against what the
	// map held: the lifetimes before the pass (nothing else writes the map),
	// and the clock the pass froze at its start, whose in-kernel count of
	// expired entries comes back in the same pass.
	before := lifetimes(m)
	r, err = sw.Pass(ctx)
	sw.Close()
	if err != nil {
		log.Fatal(err)
	}
	tot = r.Total()
	res.SteadyExpired = int(tot.Expired)
	res.CtscrubSteadySweepS = round(tot.Duration.Seconds())
	res.CtscrubSteadyCPUShareAt60s = round(tot.Duration.Seconds() / 60)
	if err := checkSteadySweep(before, lifetimes(m), tot, nSteady); err != nil {
		log.Fatalf("steady-state sweep: %v", err)
	}
	fmt.Printf("ctscrub steady-state sweep (%d expired of %d): %.3fs\n", nSteady, tot.Entries, tot.Duration.Seconds())

	res.SpeedupVsBatch = round(res.BatchGCS / res.CtscrubSweepS)
	res.SpeedupVsNextkey = round(res.NextkeyGCS / res.CtscrubSweepS)
	// On a busy machine the user-space GCs wait for a CPU between syscalls
	// while the pass, one syscall, is rarely preempted: the CPU-time ratio
	// is the conservative one.
	res.SpeedupVsBatchCPU = round(res.BatchCPUS / res.CtscrubSweepCPUS)
	res.CtscrubCPUShareAt60s = round(res.CtscrubSweepS / 60)
	res.TargetSpeedupVsBatch2 = res.SpeedupVsBatch >= 2
	res.TargetCPUShare10pct = res.CtscrubCPUShareAt60s <= 0.10
	for _, p := range []*float64{&res.CtscrubReportS, &res.CtscrubReportCPUS, &res.CtscrubSweepS, &res.CtscrubSweepCPUS, &res.NextkeyGCS, &res.NextkeyCPUS, &res.BatchGCS, &res.BatchCPUS} {
		*p = round(*p)
	}
	fmt.Printf("ctscrub sweep vs batch GC: %.2fx (CPU time %.2fx), vs NextKey GC: %.2fx; CPU share at a 60 s interval: %.2f%% of one core (half expired), %.2f%% (steady state, %d‰ expired)\n",
		res.SpeedupVsBatch, res.SpeedupVsBatchCPU, res.SpeedupVsNextkey, 100*res.CtscrubCPUShareAt60s, 100*res.CtscrubSteadyCPUShareAt60s, steady)
	out, _ := json.Marshal(res)
	fmt.Println(string(out))
}

// lifetimes returns the lifetime of every entry of m, sorted (not timed).
func lifetimes(m *ebpf.Map) []uint32 {
	keys := make([]ctmap.CTKey4, chunk)
	vals := make([]ctmap.Entry, chunk)
	var out []uint32
	var cur ebpf.MapBatchCursor
	for {
		n, err := m.BatchLookup(&cur, keys, vals, nil)
		for i := range n {
			out = append(out, vals[i].Lifetime())
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			slices.Sort(out)
			return out
		}
		if err != nil {
			log.Fatalf("census: %v", err)
		}
	}
}

// checkSteadySweep checks a sweep exactly, whatever the machine's load: it
// deleted every entry its own clock found expired and nothing else (the map
// had no other writer, so nothing was refreshed or guarded), including every
// entry written expired; and what it deleted is exactly the entries below
// one lifetime threshold: the before and after censuses differ by the
// lowest Deleted lifetimes, every one of them below every lifetime left.
func checkSteadySweep(before, after []uint32, tot expiry.MapReport, writtenExpired int) error {
	del := int(tot.Deleted)
	switch {
	case tot.Stopped:
		return errors.New("the pass was stopped")
	case int(tot.Entries) != len(before):
		return fmt.Errorf("visited %d entries, the map held %d", tot.Entries, len(before))
	case tot.Deleted != tot.Expired || tot.Refreshed != 0 || tot.Guarded != 0:
		return fmt.Errorf("deleted %d of the %d its clock found expired (refreshed %d, guarded %d); with no other writer it must delete all of them", tot.Deleted, tot.Expired, tot.Refreshed, tot.Guarded)
	case del < writtenExpired:
		return fmt.Errorf("deleted %d, fewer than the %d written expired", del, writtenExpired)
	case len(after) != len(before)-del:
		return fmt.Errorf("%d entries left, want %d - %d deleted", len(after), len(before), del)
	case del > 0 && len(after) > 0 && before[del-1] >= after[0]:
		return fmt.Errorf("deleted an entry with lifetime %d or more while one of lifetime %d is left: not the expired ones", after[0], before[del-1])
	case !slices.Equal(before[del:], after):
		return errors.New("the entries left are not the ones above the pass's clock")
	}
	return nil
}

func round(v float64) float64 { return float64(int64(v*10000+0.5)) / 10000 }
