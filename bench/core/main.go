// Command core is `make bench`: one IP's CT scrub through the index against
// Cilium 1.16's NextKey walk, Cilium 1.18+'s batch-lookup walk and the
// in-kernel sweep, all on the same Cilium-layout maps in one run, plus the
// recorder's cost per packet and the index's memory per key.
//
// It creates its own maps in a private bpffs directory and never touches
// Cilium's. Sizes come from the environment:
//
//	ENTRIES     entries in the CT maps (default 1048576)
//	PER_IP      entries of the scrubbed IP (default 1000)
//	PODS        pod IPs owning the other entries (default 1024)
//	INDEX_REPS  index scrubs, each through scrubd's socket and each through
//	            the backend alone (default 200 of each, at least 20)
//	REF_1M      0 to skip the 1M-entry reference series run when ENTRIES > 1M
//	NEXTKEY_MAX_VISITS  stop the NextKey walk after that many entries and
//	            extrapolate its time to the whole table (default 0: whole
//	            walk; at 16 M on a loaded machine it takes many minutes)
//
// What an index scrub is timed on: a real scrubd (scrubd/daemon, in this
// process) over the maps. Every pod IP and every target is made complete by
// a sweep scrub through its socket before the fill (as scrubd does for a pod
// it has not seen whole); the fill puts every key through recorder.Apply,
// the path of each ring buffer record. Each timed scrub takes a target IP
// not scrubbed before, whose keys were indexed during the fill and not
// touched since. socket_* times the whole request through the socket as the
// plugin sends it; index_* the backend's Scrub alone (take, deletes), beside
// it. Each walk run also scrubs a fresh target.
//
// The last line of output is one JSON object with every figure.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/netip"
	"os"
	"os/signal"
	"runtime"
	"runtime/metrics"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/cilium/ebpf/rlimit"
	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/internal/ciliumwalk"
	"github.com/ctscrub/ctscrub/internal/machcost"
	"github.com/ctscrub/ctscrub/scrubd/cilium"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

const refEntries = 1 << 20

// targetEntries is the size the acceptance targets are stated for.
const targetEntries = 1 << 24

type config struct {
	entries, perIP, pods, indexReps int
	ref1M                           bool
	nextKeyMax                      int
}

func envInt(name string, def int) (int, error) {
	s := os.Getenv(name)
	if s == "" {
		return def, nil
	}
	v, err := strconv.Atoi(strings.ReplaceAll(s, "_", ""))
	if err != nil || v < 0 {
		return 0, fmt.Errorf("%s=%q: want a non-negative integer", name, s)
	}
	return v, nil
}

func parseConfig() (config, error) {
	var c config
	var err error
	if c.entries, err = envInt("ENTRIES", refEntries); err != nil {
		return c, err
	}
	if c.perIP, err = envInt("PER_IP", 1000); err != nil {
		return c, err
	}
	if c.pods, err = envInt("PODS", 1024); err != nil {
		return c, err
	}
	if c.indexReps, err = envInt("INDEX_REPS", 200); err != nil {
		return c, err
	}
	if c.nextKeyMax, err = envInt("NEXTKEY_MAX_VISITS", 0); err != nil {
		return c, err
	}
	ref, err := envInt("REF_1M", 1)
	if err != nil {
		return c, err
	}
	c.ref1M = ref != 0 && c.entries > refEntries
	switch {
	case c.perIP < 2:
		return c, fmt.Errorf("PER_IP=%d: want at least 2 (a flow and its related entry)", c.perIP)
	case c.entries < c.targets()*c.perIP+2*c.pods:
		return c, fmt.Errorf("ENTRIES=%d: want at least %d (%d target IPs of PER_IP=%d entries, each scrubbed once, plus the other pods'); lower PER_IP or INDEX_REPS",
			c.entries, c.targets()*c.perIP+2*c.pods, c.targets(), c.perIP)
	case c.entries > 1<<26:
		return c, fmt.Errorf("ENTRIES=%d: at most %d (Cilium clamps CT maps to 16,777,216)", c.entries, 1<<26)
	case c.pods < 1 || c.pods > 1<<20:
		return c, fmt.Errorf("PODS=%d: want 1 to %d", c.pods, 1<<20)
	case c.indexReps < 20:
		return c, fmt.Errorf("INDEX_REPS=%d: want at least 20 (the p99 needs them)", c.indexReps)
	}
	return c, nil
}

// Walk runs at most: sweep, batch walk, NextKey walk.
const sweepReps, batchReps, nextKeyReps, floorReps = 5, 5, 3, 10

// targets is the size of the target pool: every scrub takes a fresh one.
func (c config) targets() int {
	return 2*c.indexReps + sweepReps + batchReps + nextKeyReps + floorReps
}

// result is the JSON line.
type result struct {
	Date    string `json:"date"`
	Machine string `json:"machine"`
	// What the machine charged for a page fault, a syscall and a process
	// start in this run (internal/machcost): compare runs by these.
	MachineCosts machcost.Costs `json:"machine_costs"`
	Entries      int            `json:"entries"`
	PerIP        int            `json:"per_ip"`
	Pods         int            `json:"pods"`

	NextKeyWalkS    float64 `json:"nextkey_walk_s"`
	NextKeyReps     int     `json:"nextkey_reps"`
	NextKeyExtrap   bool    `json:"nextkey_extrapolated,omitempty"`
	BatchWalkS      float64 `json:"batch_walk_s"`
	BatchReps       int     `json:"batch_reps"`
	SweepS          float64 `json:"sweep_s"`
	SweepReps       int     `json:"sweep_reps"`
	IndexMedianS    float64 `json:"index_median_s"`
	IndexP99S       float64 `json:"index_p99_s"`
	IndexMaxS       float64 `json:"index_max_s"`
	IndexReps       int     `json:"index_reps"`
	IndexCPUMedianS float64 `json:"index_cpu_median_s"`
	IndexCPUP99S    float64 `json:"index_cpu_p99_s"`
	IndexWaitP99S   float64 `json:"index_wait_for_cpu_p99_s"`
	IndexMedian1MS  float64 `json:"index_median_1m_s,omitempty"`
	SocketMedianS   float64 `json:"socket_median_s"`
	SocketP99S      float64 `json:"socket_p99_s"`
	SocketMaxS      float64 `json:"socket_max_s"`
	// Each step's median (s) of the socket scrubs (scrubd's Server-Timing
	// steps, the client's connect "dial" and the rest "client").
	SocketSteps     map[string]float64 `json:"socket_steps_p50_s,omitempty"`
	SocketMedian1MS float64            `json:"socket_median_1m_s,omitempty"`
	// The kernel's own cost of deleting one present, cold entry
	// (BPF_MAP_DELETE_BATCH of a fresh target's PER_IP keys, no other
	// work), median over floorReps targets: PER_IP times it is the floor
	// under any scrub of those entries, however it finds the keys.
	DeleteFloorNsKey float64 `json:"delete_floor_ns_per_key"`
	IndexerNsPacket  float64 `json:"indexer_ns_per_packet"`
	IndexerNsNew     float64 `json:"indexer_ns_new_flow"`
	ApplyNsRecord    float64 `json:"index_apply_ns_per_record"`
	IndexBytesKey    float64 `json:"index_bytes_per_key"`
	IndexKeys        int64   `json:"index_keys"`
	CountUs          float64 `json:"count_us"`
	CountCheap       bool    `json:"count_kfunc"`
	FillS            float64 `json:"fill_s"`

	NextKeyOverIndex float64 `json:"nextkey_over_index"`
	BatchOverIndex   float64 `json:"batch_over_index"`
	BatchOverSweep   float64 `json:"batch_over_sweep"`
	Index16MOver1M   float64 `json:"index_over_1m,omitempty"`   // socket (end-to-end) medians
	Backend16MOver1M float64 `json:"backend_over_1m,omitempty"` // backend-only medians

	// Targets holds each target's pass/fail at this run's size; the targets
	// are stated for TargetEntries (16 M) and TargetsAtSize says whether
	// this run is that size.
	Targets       map[string]bool `json:"targets"`
	TargetEntries int             `json:"target_entries"`
	TargetsAtSize bool            `json:"targets_at_size"`
}

// deleteFloor times BPF_MAP_DELETE_BATCH of floorReps fresh targets' keys
// (each map's share in one call), untouched since the fill, and returns the
// median. The index still holds them: the target is marked incomplete so
// nothing scrubs it later by index.
func deleteFloor(nd *node) (time.Duration, error) {
	var took []time.Duration
	for range floorReps {
		target, t, err := nd.take()
		if err != nil {
			return 0, err
		}
		nd.ix.MarkIncomplete(target, index.ReasonLost)
		byKind := map[ctmap.Kind][]ctmap.CTKey4{}
		for _, k := range nd.target4[t] {
			byKind[k.Kind()] = append(byKind[k.Kind()], k)
		}
		start := time.Now()
		for kind, keys := range byKind {
			if n, err := nd.maps.Map(kind).BatchDelete(keys, nil); err != nil || n != len(keys) {
				return 0, fmt.Errorf("delete floor: %d of %d keys of %s deleted: %v", n, len(keys), kind.Name(), err)
			}
		}
		took = append(took, time.Since(start))
		if err := nd.scrubbed("delete floor", t, false); err != nil {
			return 0, err
		}
	}
	return median(took), nil
}

func main() {
	if socket := os.Getenv(clientEnv); socket != "" {
		os.Exit(clientChild(socket))
	}
	cfg, err := parseConfig()
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(2)
	}
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "bench: needs root (creates BPF maps and runs BPF programs); run it with sudo")
		os.Exit(2)
	}
	if err := rlimit.RemoveMemlock(); err != nil {
		fmt.Fprintln(os.Stderr, "bench: lift RLIMIT_MEMLOCK:", err)
		os.Exit(1)
	}
	res, err := run(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
	printTable(res)
	line, err := json.Marshal(res)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
	fmt.Println(string(line))
}

// live tracks the node whose bpffs dir must go on an interrupt.
var live = make(chan *node, 1)

func run(cfg config) (result, error) {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	go func() {
		<-sig
		select {
		case nd := <-live:
			os.RemoveAll(nd.dir)
		default:
		}
		fmt.Fprintln(os.Stderr, "bench: interrupted; private maps removed")
		os.Exit(130)
	}()

	res := result{
		Date:    time.Now().UTC().Format(time.RFC3339),
		Machine: machine(),
		Entries: cfg.entries, PerIP: cfg.perIP, Pods: cfg.pods,
		Targets: map[string]bool{},
	}
	fmt.Printf("ctscrub core bench: %d entries, %d of them the target IP's, %d pod IPs; %s\n",
		cfg.entries, cfg.perIP, cfg.pods, res.Machine)
	var err error
	if res.MachineCosts, err = machcost.Measure(); err != nil {
		return res, fmt.Errorf("machine costs: %w", err)
	}
	fmt.Println("this machine now:", res.MachineCosts)

	// The recorder's cost per packet (H1's measurement, BPF_PROG_TEST_RUN).
	newNs, estNs, err := recorder.MeasurePacketCost(20000)
	if err != nil {
		return res, fmt.Errorf("recorder cost: %w", err)
	}
	res.IndexerNsPacket, res.IndexerNsNew = estNs, newNs

	if cfg.ref1M {
		fmt.Printf("reference: index scrubs at %d entries (same PER_IP) for the size ratio ...\n", refEntries)
		med, sock, err := indexOnly(cfg, refEntries)
		if err != nil {
			return res, fmt.Errorf("1M reference: %w", err)
		}
		res.IndexMedian1MS, res.SocketMedian1MS = med.Seconds(), sock.Seconds()
		runtime.GC()
	}

	nd, c, err := setup(cfg, cfg.entries)
	if err != nil {
		return res, err
	}
	defer nd.close()
	defer c.Close()
	res.FillS = nd.fillTime.Seconds()
	res.ApplyNsRecord = float64(nd.applyTime.Nanoseconds()) / float64(nd.records)
	res.IndexBytesKey = nd.heapPerKey
	res.IndexKeys = nd.indexKeys
	res.CountCheap = c.CountIsCheap()
	fmt.Printf("filled in %.1f s (BatchUpdate + recorder.Apply of %d records into scrubd's index, %.0f ns each); index: %d keys, %.1f bytes/key\n",
		nd.fillTime.Seconds(), nd.records, res.ApplyNsRecord, nd.indexKeys, nd.heapPerKey)

	t := time.Now()
	const countReps = 100
	for range countReps {
		if _, err := c.Count(ctmap.TCP4); err != nil {
			return res, err
		}
	}
	res.CountUs = float64(time.Since(t).Microseconds()) / countReps

	// (4) The index scrub.
	nd.scrubd.steps = nil
	idx, sock, idxCPU, idxWait, err := indexSeries(nd, c, cfg.indexReps)
	if err != nil {
		return res, err
	}
	res.SocketSteps = map[string]float64{}
	var names []string
	for name, d := range nd.scrubd.steps {
		res.SocketSteps[name] = quantile(d, 0.5).Seconds()
		names = append(names, name)
	}
	slices.Sort(names)
	fmt.Printf("  socket scrubs per step, median (dial and client: the client's side; the rest scrubd's, Server-Timing):")
	for _, name := range names {
		fmt.Printf(" %s %s", name, fmtDur(quantile(nd.scrubd.steps[name], 0.5)))
	}
	fmt.Println()
	res.SocketMedianS = quantile(sock, 0.5).Seconds()
	res.SocketP99S = quantile(sock, 0.99).Seconds()
	res.SocketMaxS = slices.Max(sock).Seconds()
	res.IndexReps = len(idx)
	res.IndexMedianS = quantile(idx, 0.5).Seconds()
	res.IndexP99S = quantile(idx, 0.99).Seconds()
	res.IndexMaxS = slices.Max(idx).Seconds()
	res.IndexCPUMedianS = quantile(idxCPU, 0.5).Seconds()
	res.IndexCPUP99S = quantile(idxCPU, 0.99).Seconds()
	res.IndexWaitP99S = quantile(idxWait, 0.99).Seconds()

	// (5) The kernel's floor: deleting the target's present keys and
	// nothing else.
	floor, err := deleteFloor(nd)
	if err != nil {
		return res, err
	}
	res.DeleteFloorNsKey = float64(floor.Nanoseconds()) / float64(nd.k)
	fmt.Printf("  kernel floor: BPF_MAP_DELETE_BATCH of a fresh target's %d present keys, median of %d: %s (%.0f ns per key)\n",
		nd.k, floorReps, fmtDur(floor), res.DeleteFloorNsKey)

	// (3) The sweep, through the backend (the IP marked incomplete).
	sweep, err := series("sweep", sweepReps, 30*time.Second, nd, func(target netip.Addr) error {
		nd.ix.MarkIncomplete(target, index.ReasonLost)
		r, err := c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{target}, Reason: scrub.ReasonDel})
		if err == nil && (r.Method != scrub.MethodSweep || r.Total != nd.k) {
			err = fmt.Errorf("sweep scrub: %+v, want method sweep and %d deleted", r, nd.k)
		}
		return err
	})
	if err != nil {
		return res, err
	}
	res.SweepS, res.SweepReps = median(sweep).Seconds(), len(sweep)

	// (2) Cilium 1.18+'s batch-lookup walk.
	batch, err := series("batch walk", batchReps, 30*time.Second, nd, func(target netip.Addr) error {
		st, err := ciliumwalk.Batch(ciliumwalk.Of(nd.maps), ciliumwalk.HasIP(target), ciliumwalk.Options{})
		if err == nil && st.Deleted != nd.k {
			err = fmt.Errorf("batch walk deleted %d, want %d", st.Deleted, nd.k)
		}
		return err
	})
	if err != nil {
		return res, err
	}
	res.BatchWalkS, res.BatchReps = median(batch).Seconds(), len(batch)

	// (1) Cilium 1.16's NextKey + Lookup walk. With NEXTKEY_MAX_VISITS the
	// walk stops early; its time is extrapolated to the whole table and the
	// target's entries it did not reach are deleted by key afterwards.
	nextKey, err := series("NextKey walk", nextKeyReps, 30*time.Second, nd, func(target netip.Addr) error {
		start := time.Now()
		st, err := ciliumwalk.NextKey(ciliumwalk.Of(nd.maps), ciliumwalk.HasIP(target), ciliumwalk.Options{MaxVisits: cfg.nextKeyMax})
		if err == nil && st.Partial {
			res.NextKeyExtrap = true
			extra := time.Duration(float64(time.Since(start)) * (float64(nd.n-nd.deleted)/float64(st.Visited) - 1))
			fmt.Printf("  NextKey walk stopped after %d of %d entries; its time is extrapolated (+%s)\n", st.Visited, nd.n-nd.deleted, fmtDur(extra))
			nd.extra = extra
			return nd.deleteTarget(target)
		}
		if err == nil && st.Deleted != nd.k {
			err = fmt.Errorf("NextKey walk deleted %d, want %d", st.Deleted, nd.k)
		}
		return err
	})
	if err != nil {
		return res, err
	}
	res.NextKeyWalkS, res.NextKeyReps = median(nextKey).Seconds(), len(nextKey)

	// Ratios to the scrub as the plugin gets it (through the socket).
	res.NextKeyOverIndex = res.NextKeyWalkS / res.SocketMedianS
	res.BatchOverIndex = res.BatchWalkS / res.SocketMedianS
	res.BatchOverSweep = res.BatchWalkS / res.SweepS
	if res.IndexMedian1MS > 0 {
		res.Index16MOver1M = res.SocketMedianS / res.SocketMedian1MS
		res.Backend16MOver1M = res.IndexMedianS / res.IndexMedian1MS
	}
	res.TargetEntries = targetEntries
	res.TargetsAtSize = cfg.entries == targetEntries
	// End to end: the scrub as the plugin gets it, through the socket.
	res.Targets["socket_median_le_1ms"] = res.SocketMedianS <= 0.001
	res.Targets["socket_p99_le_5ms"] = res.SocketP99S <= 0.005
	res.Targets["index_10000x_nextkey"] = res.NextKeyOverIndex >= 10000
	res.Targets["index_1000x_batch"] = res.BatchOverIndex >= 1000
	res.Targets["sweep_faster_than_batch"] = res.SweepS < res.BatchWalkS
	res.Targets["indexer_le_100ns_established"] = res.IndexerNsPacket <= 100
	res.Targets["index_le_20_bytes_per_key"] = res.IndexBytesKey <= 20
	if res.IndexMedian1MS > 0 {
		res.Targets["index_size_ratio_le_1.5"] = res.Index16MOver1M <= 1.5
	}

	return res, nil
}

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

// indexOnly runs the index series on a node of n entries, then frees it.
func indexOnly(cfg config, n int) (backend, sock time.Duration, err error) {
	nd, c, err := setup(cfg, n)
	if err != nil {
		return 0, 0, err
	}
	defer nd.close()
	defer c.Close()
	d, s, _, _, err := indexSeries(nd, c, cfg.indexReps)
	if err != nil {
		return 0, 0, err
	}
	fmt.Printf("  %d entries: scrub through the socket median %s, p99 %s; backend only median %s, p99 %s; %d scrubs each\n", n,
		fmtDur(quantile(s, 0.5)), fmtDur(quantile(s, 0.99)), fmtDur(quantile(d, 0.5)), fmtDur(quantile(d, 0.99)), len(d))
	return quantile(d, 0.5), quantile(s, 0.5), nil
}

// indexSeries times reps index scrubs through scrubd's socket and reps
// through the backend alone, alternating, each of a fresh target, and
// checks each scrub.
func indexSeries(nd *node, c *cilium.Backend, reps int) (d, sock, cpu, waited []time.Duration, err error) {
	gcDuring, gcDuringSock := 0, 0
	// One OS thread for the whole series, so its CPU time and its wait for a
	// CPU (schedstat) can be read around each backend scrub: on a shared
	// machine the slow tail is time spent runnable but not running.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	for i := range 2 * reps {
		target, t, err := nd.take()
		if err != nil {
			return nil, nil, nil, nil, err
		}
		if st := nd.ix.State(target); !st.Complete || st.Keys != nd.k {
			return nil, nil, nil, nil, fmt.Errorf("index before scrub %d: %+v, want complete with %d keys", i, st, nd.k)
		}
		var r scrub.Result
		if i%2 == 0 {
			var took time.Duration
			gc0 := gcCycles()
			r, took, err = nd.scrubd.scrub([]netip.Addr{target}, scrub.ReasonDel)
			sock = append(sock, took)
			if gcCycles() != gc0 {
				gcDuringSock++
			}
		} else {
			gc0, wait0 := gcCycles(), runDelay()
			cpu0 := threadCPU()
			start := time.Now()
			r, err = c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{target}, Reason: scrub.ReasonDel})
			d = append(d, time.Since(start))
			cpu = append(cpu, threadCPU()-cpu0)
			waited = append(waited, runDelay()-wait0)
			if gcCycles() != gc0 {
				gcDuring++
			}
		}
		if err != nil {
			return nil, nil, nil, nil, fmt.Errorf("index scrub %d: %w", i, err)
		}
		if r.Method != scrub.MethodIndex || r.Total != nd.k {
			return nil, nil, nil, nil, fmt.Errorf("index scrub %d: %+v, want method index and %d deleted", i, r, nd.k)
		}
		if err := nd.scrubbed("index scrub", t, i == 2*reps-1); err != nil {
			return nil, nil, nil, nil, err
		}
	}
	slow := slices.Clone(sock)
	slices.Sort(slow)
	slow = slow[max(0, len(slow)-5):]
	fmt.Printf("  index scrubs: slowest through the socket %v, a Go GC cycle of scrubd's ran during %d of %d; backend only: a Go GC cycle ran during %d of %d, CPU time median %s p99 %s, waiting for a CPU p99 %s\n",
		slow, gcDuringSock, len(sock), gcDuring, len(d), fmtDur(quantile(cpu, 0.5)), fmtDur(quantile(cpu, 0.99)), fmtDur(quantile(waited, 0.99)))
	return d, sock, cpu, waited, nil
}

// series times a full-map method: the first run always, more while they fit
// in budget, at most maxReps. Each run scrubs a fresh target; the first run
// is checked for exactness (every other entry still there).
func series(name string, maxReps int, budget time.Duration, nd *node, fn func(target netip.Addr) error) ([]time.Duration, error) {
	var d []time.Duration
	var total time.Duration
	for len(d) < maxReps {
		if len(d) > 0 && total+total/time.Duration(len(d)) > budget {
			break
		}
		target, ti, err := nd.take()
		if err != nil {
			return nil, err
		}
		t := time.Now()
		nd.extra = 0
		if err := fn(target); err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		el := time.Since(t) + nd.extra
		d = append(d, el)
		total += el
		fmt.Printf("  %s: %s\n", name, fmtDur(el))
		if err := nd.scrubbed(name, ti, len(d) == 1); err != nil {
			return nil, err
		}
	}
	return d, nil
}

// threadCPU is the calling thread's CPU time (user + system).
func threadCPU() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts); err != nil {
		return 0
	}
	return time.Duration(ts.Nano())
}

// runDelay is how long the calling thread has been runnable but waiting for
// a CPU (the second field of /proc/thread-self/schedstat).
func runDelay() time.Duration {
	b, err := os.ReadFile("/proc/thread-self/schedstat")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) < 2 {
		return 0
	}
	v, _ := strconv.ParseInt(f[1], 10, 64)
	return time.Duration(v)
}

var gcSample = []metrics.Sample{{Name: "/gc/cycles/total:gc-cycles"}}

// gcCycles reads the GC cycle count without stopping the world.
func gcCycles() uint64 {
	metrics.Read(gcSample)
	return gcSample[0].Value.Uint64()
}

func median(d []time.Duration) time.Duration { return quantile(d, 0.5) }

// quantile is the nearest-rank quantile.
func quantile(d []time.Duration, q float64) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	i := int(math.Ceil(q*float64(len(s)))) - 1
	return s[max(0, min(i, len(s)-1))]
}

func fmtDur(d time.Duration) string {
	switch {
	case d >= time.Second:
		return fmt.Sprintf("%.2f s", d.Seconds())
	case d >= time.Millisecond:
		return fmt.Sprintf("%.3f ms", float64(d.Microseconds())/1000)
	default:
		return fmt.Sprintf("%.1f µs", float64(d.Nanoseconds())/1000)
	}
}

func secs(s float64) string { return fmtDur(time.Duration(s * float64(time.Second))) }

func printTable(r result) {
	fmt.Println()
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintf(w, "scrub of one IP (%d of %d entries)\ttime\truns\tvs index (socket)\n", r.PerIP, r.Entries)
	fmt.Fprintf(w, "Cilium 1.16 NextKey+Lookup walk\t%s\t%d\t%.0fx\n", secs(r.NextKeyWalkS), r.NextKeyReps, r.NextKeyOverIndex)
	fmt.Fprintf(w, "Cilium 1.18+ batch-lookup walk\t%s\t%d\t%.0fx\n", secs(r.BatchWalkS), r.BatchReps, r.BatchOverIndex)
	fmt.Fprintf(w, "ctscrub sweep (in-kernel, 1 pass)\t%s\t%d\t%.0fx\n", secs(r.SweepS), r.SweepReps, r.SweepS/r.SocketMedianS)
	fmt.Fprintf(w, "ctscrub index scrub through scrubd's socket, median\t%s\t%d\t1x\n", secs(r.SocketMedianS), r.IndexReps)
	fmt.Fprintf(w, "  p99 / max\t%s / %s\t\t\n", secs(r.SocketP99S), secs(r.SocketMaxS))
	fmt.Fprintf(w, "  its backend alone (take + deletes), median\t%s\t%d\t\n", secs(r.IndexMedianS), r.IndexReps)
	fmt.Fprintf(w, "  p99 / max\t%s / %s\t\t\n", secs(r.IndexP99S), secs(r.IndexMaxS))
	fmt.Fprintf(w, "  backend CPU time, median / p99\t%s / %s\t\t(p99 waiting for a CPU: %s)\n", secs(r.IndexCPUMedianS), secs(r.IndexCPUP99S), secs(r.IndexWaitP99S))
	if r.IndexMedian1MS > 0 {
		fmt.Fprintf(w, "socket scrub median at 1M entries\t%s\t%d\t(%d entries / 1M: %.2fx; backend alone %.2fx)\n", secs(r.SocketMedian1MS), r.IndexReps, r.Entries, r.Index16MOver1M, r.Backend16MOver1M)
	}
	w.Flush()
	fmt.Printf("walks are timed fewer times than index scrubs (runs column) where a run is slow.\n")
	fmt.Printf("sweep vs batch walk: %.2fx faster\n", r.BatchOverSweep)
	fmt.Printf("recorder per packet: established %.1f ns, new flow %.1f ns (BPF_PROG_TEST_RUN); index apply %.0f ns/record\n",
		r.IndexerNsPacket, r.IndexerNsNew, r.ApplyNsRecord)
	fmt.Printf("index memory: %.1f bytes per key (%d keys); entry count per map: %.1f µs (kfunc counter: %v)\n",
		r.IndexBytesKey, r.IndexKeys, r.CountUs, r.CountCheap)
	var missed []string
	for name, ok := range r.Targets {
		if !ok {
			missed = append(missed, name)
		}
	}
	slices.Sort(missed)
	at := fmt.Sprintf("at %d entries", r.Entries)
	if !r.TargetsAtSize {
		at += fmt.Sprintf(" (the targets are stated for %d; ratios to the walks grow with the table)", r.TargetEntries)
	}
	if len(missed) == 0 {
		fmt.Println("targets: all met", at)
	} else {
		fmt.Println("targets MISSED", at+":", strings.Join(missed, ", "))
	}
}

func machine() string {
	cpu := "?"
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, "model name") {
				cpu = strings.TrimSpace(strings.SplitN(l, ":", 2)[1])
				break
			}
		}
	}
	var u syscall.Utsname
	kernel := "?"
	if syscall.Uname(&u) == nil {
		b := make([]byte, 0, len(u.Release))
		for _, c := range u.Release {
			if c == 0 {
				break
			}
			b = append(b, byte(c))
		}
		kernel = string(b)
	}
	var si syscall.Sysinfo_t
	mem := "?"
	if syscall.Sysinfo(&si) == nil {
		mem = fmt.Sprintf("%.0f GiB", float64(si.Totalram)*float64(si.Unit)/(1<<30))
	}
	return fmt.Sprintf("%d CPUs %s, %s, Linux %s", runtime.NumCPU(), cpu, mem, kernel)
}
