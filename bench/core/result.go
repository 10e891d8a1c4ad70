package main

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/ctscrub/ctscrub/internal/machcost"
)

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
	// The same, both CT maps' calls at once from two threads (the scrub
	// deletes from its maps at once), median over floorReps other targets
	// measured alternately with the above.
	DeleteFloorParNsKey float64 `json:"delete_floor_parallel_ns_per_key"`
	// The socket scrub's median and p99 over PER_IP times each floor.
	SocketOverFloor       float64 `json:"socket_median_over_floor"`
	SocketP99OverFloor    float64 `json:"socket_p99_over_floor"`
	SocketOverParFloor    float64 `json:"socket_median_over_parallel_floor"`
	SocketP99OverParFloor float64 `json:"socket_p99_over_parallel_floor"`
	IndexerNsPacket       float64 `json:"indexer_ns_per_packet"`
	IndexerNsNew          float64 `json:"indexer_ns_new_flow"`
	ApplyNsRecord         float64 `json:"index_apply_ns_per_record"`
	IndexBytesKey         float64 `json:"index_bytes_per_key"`
	IndexKeys             int64   `json:"index_keys"`
	CountUs               float64 `json:"count_us"`
	CountCheap            bool    `json:"count_kfunc"`
	FillS                 float64 `json:"fill_s"`

	// The bootstrap pass (scrubd/bootstrap) into a fresh index, median of
	// BootstrapReps, alternating with Cilium's batch walk of the same maps
	// (count only): BootstrapWalkS; and the index after the first pass,
	// by its own account (index.Bytes) and by the Go heap.
	BootstrapS        float64 `json:"bootstrap_pass_s"`
	BootstrapWalkS    float64 `json:"bootstrap_batch_walk_s"`
	BootstrapReps     int     `json:"bootstrap_reps"`
	BootstrapOverWalk float64 `json:"bootstrap_over_batch_walk"`
	// The process's CPU time for each (medians), and the median of each
	// pair's wall-time ratio: on a loaded machine these move less.
	BootstrapCPUS         float64 `json:"bootstrap_pass_cpu_s"`
	BootstrapWalkCPUS     float64 `json:"bootstrap_batch_walk_cpu_s"`
	BootstrapPairRatio    float64 `json:"bootstrap_over_batch_walk_pair_median"`
	BootstrapKeys         int64   `json:"bootstrap_keys"`
	BootstrapAddrs        int     `json:"bootstrap_addresses"`
	BootstrapBytesKey     float64 `json:"bootstrap_bytes_per_key"`
	BootstrapHeapBytesKey float64 `json:"bootstrap_heap_bytes_per_key"`
	// The same pass reading every map with the batch walk (its fallback,
	// and the pass before the kernel read), in the same rounds.
	BootstrapBatchS         float64 `json:"bootstrap_batch_pass_s"`
	BootstrapBatchCPUS      float64 `json:"bootstrap_batch_pass_cpu_s"`
	BootstrapBatchPairRatio float64 `json:"bootstrap_batch_pass_over_batch_walk_pair_median"`
	BootstrapBatchBytesKey  float64 `json:"bootstrap_batch_pass_bytes_per_key"`

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
	fmt.Fprintf(w, "kernel floor: BPF_MAP_DELETE_BATCH of %d present keys, maps in turn\t%s\t%d\tsocket median %.2fx, p99 %.2fx\n",
		r.PerIP, secs(r.DeleteFloorNsKey*float64(r.PerIP)/1e9), floorReps, r.SocketOverFloor, r.SocketP99OverFloor)
	fmt.Fprintf(w, "  both maps at once, two threads\t%s\t%d\tsocket median %.2fx, p99 %.2fx\n",
		secs(r.DeleteFloorParNsKey*float64(r.PerIP)/1e9), floorReps, r.SocketOverParFloor, r.SocketP99OverParFloor)
	w.Flush()
	fmt.Printf("walks are timed fewer times than index scrubs (runs column) where a run is slow.\n")
	fmt.Printf("sweep vs batch walk: %.2fx faster\n", r.BatchOverSweep)
	fmt.Printf("recorder per packet: established %.1f ns, new flow %.1f ns (BPF_PROG_TEST_RUN); index apply %.0f ns/record\n",
		r.IndexerNsPacket, r.IndexerNsNew, r.ApplyNsRecord)
	fmt.Printf("index memory: %.1f bytes per key (%d keys); entry count per map: %.1f µs (kfunc counter: %v)\n",
		r.IndexBytesKey, r.IndexKeys, r.CountUs, r.CountCheap)
	fmt.Printf("bootstrap pass: %s (median of %d) against Cilium's batch walk of the same maps %s, alternately: %.2fx (pairs' median %.2fx; CPU %s against %s: %.2fx); index after it: %.1f bytes/key (its own account), %.1f (Go heap), %d keys\n",
		secs(r.BootstrapS), r.BootstrapReps, secs(r.BootstrapWalkS), r.BootstrapOverWalk, r.BootstrapPairRatio,
		secs(r.BootstrapCPUS), secs(r.BootstrapWalkCPUS), r.BootstrapCPUS/r.BootstrapWalkCPUS, r.BootstrapBytesKey, r.BootstrapHeapBytesKey, r.BootstrapKeys)
	fmt.Printf("bootstrap pass read with the batch walk (the fallback), same rounds: %s: %.2fx the batch walk (pairs' median %.2fx; CPU %s); %.1f bytes/key\n",
		secs(r.BootstrapBatchS), r.BootstrapBatchS/r.BootstrapWalkS, r.BootstrapBatchPairRatio, secs(r.BootstrapBatchCPUS), r.BootstrapBatchBytesKey)
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

// compare sets the ratios and the targets' pass/fail.
func (res *result) compare(cfg config) {
	// Ratios to the scrub as the plugin gets it (through the socket).
	res.NextKeyOverIndex = res.NextKeyWalkS / res.SocketMedianS
	res.BatchOverIndex = res.BatchWalkS / res.SocketMedianS
	res.BatchOverSweep = res.BatchWalkS / res.SweepS
	if res.IndexMedian1MS > 0 {
		res.Index16MOver1M = res.SocketMedianS / res.SocketMedian1MS
		res.Backend16MOver1M = res.IndexMedianS / res.IndexMedian1MS
	}
	if res.DeleteFloorNsKey > 0 && res.DeleteFloorParNsKey > 0 {
		floor := res.DeleteFloorNsKey * float64(res.PerIP) / 1e9
		par := res.DeleteFloorParNsKey * float64(res.PerIP) / 1e9
		res.SocketOverFloor, res.SocketP99OverFloor = res.SocketMedianS/floor, res.SocketP99S/floor
		res.SocketOverParFloor, res.SocketP99OverParFloor = res.SocketMedianS/par, res.SocketP99S/par
		// Issue 23: the scrub's cost in units of the kernel's own delete of
		// the same entries, measured in the same run.
		res.Targets["socket_median_le_2x_floor"] = res.SocketOverFloor <= 2
		res.Targets["socket_p99_le_6x_floor"] = res.SocketP99OverFloor <= 6
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
	if res.BootstrapWalkS > 0 {
		// Issue 36: the bootstrap pass against one batch walk of the same
		// maps in the same run, and the index it leaves.
		res.BootstrapOverWalk = res.BootstrapS / res.BootstrapWalkS
		res.Targets["bootstrap_le_1.5x_batch_walk"] = res.BootstrapOverWalk <= 1.5
		res.Targets["bootstrap_le_16_bytes_per_key"] = res.BootstrapBytesKey <= 16
		res.Targets["bootstrap_le_batch_walk"] = res.BootstrapOverWalk <= 1
	}
	if res.IndexMedian1MS > 0 {
		res.Targets["index_size_ratio_le_1.5"] = res.Index16MOver1M <= 1.5
	}
}
