package main

import (
	"fmt"
	"io"
	"time"

	"github.com/ctscrub/ctscrub/internal/machcost"
	"github.com/ctscrub/ctscrub/internal/netnsnode"
)

// BenchCNIBaseline is the baseline binary's figures from the same run.
type BenchCNIBaseline struct {
	Binary        string  `json:"binary"`
	Pairs         int     `json:"pairs"`
	AddP50        float64 `json:"add_p50_s"`
	AddP99        float64 `json:"add_p99_s"`
	DelP50        float64 `json:"del_p50_s"`
	DelP99        float64 `json:"del_p99_s"`
	ExecP50       float64 `json:"exec_p50_s"`
	AddOverExec   float64 `json:"add_minus_exec_p50_s"`
	DelOverExec   float64 `json:"del_minus_exec_p50_s"`
	AddFaultsP50  int64   `json:"add_minflt_p50"`
	DelFaultsP50  int64   `json:"del_minflt_p50"`
	ExecFaultsP50 int64   `json:"exec_minflt_p50"`
}

// BenchCNIResult is the JSON line (seconds).
type BenchCNIResult struct {
	Date         string  `json:"date"`
	Entries      int     `json:"entries"`
	Pairs        int     `json:"pairs"`
	WarmupPairs  int     `json:"warmup_pairs"`
	AddP50       float64 `json:"add_p50_s"`
	AddP99       float64 `json:"add_p99_s"`
	DelP50       float64 `json:"del_p50_s"`
	DelP99       float64 `json:"del_p99_s"`
	ExecP50      float64 `json:"exec_p50_s"`
	ExecP99      float64 `json:"exec_p99_s"`
	BridgeAddP50 float64 `json:"bridge_add_p50_s"`
	BridgeAddP99 float64 `json:"bridge_add_p99_s"`
	BridgeDelP50 float64 `json:"bridge_del_p50_s"`
	AddOverExec  float64 `json:"add_minus_exec_p50_s"`
	DelOverExec  float64 `json:"del_minus_exec_p50_s"`
	FlowsPerPod  float64 `json:"flows_per_pod"`
	ChecksLeft   int     `json:"entries_left_at_checks"`
	Checks       int     `json:"checks"`
	Load1        string  `json:"load"`
	// What the machine charged for a page fault, a syscall and a process
	// start, measured before the pairs (internal/machcost).
	MachineCosts machcost.Costs `json:"machine_costs"`
	// Each step's median (seconds) of the ctscrub ADD and DEL calls
	// (stepSamples.addCall names them); absent with TRACE=0.
	AddSteps  map[string]float64 `json:"add_steps_p50_s,omitempty"`
	DelSteps  map[string]float64 `json:"del_steps_p50_s,omitempty"`
	ExecSteps map[string]float64 `json:"exec_steps_p50_s,omitempty"`
	StateFS   string             `json:"state_fs"`
	// Page faults (minor) of each ctscrub call, p50: the process's size as
	// the kernel sees it. A fault costs tens of µs on this VM (perf stat:
	// /bin/true 48 faults in 2.1 ms), so the pages an ADD touches beyond a
	// bare start are most of what it costs over one.
	AddFaultsP50  int64 `json:"add_minflt_p50"`
	DelFaultsP50  int64 `json:"del_minflt_p50"`
	ExecFaultsP50 int64 `json:"exec_minflt_p50"`
	// With BASELINE: the other binary, timed on every other pair.
	Baseline *BenchCNIBaseline `json:"baseline,omitempty"`
}

// summarize fills in the figures of the timed pairs and prints the page
// faults, the baseline's figures and, unless TRACE=0, each step's.
func (res *BenchCNIResult) summarize(w io.Writer, cfg BenchCNIConfig, t *timings, calls *pluginCalls, flowsPerPod float64) {
	res.AddP50, res.AddP99 = q(t.add, 0.5).Seconds(), q(t.add, 0.99).Seconds()
	res.DelP50, res.DelP99 = q(t.del, 0.5).Seconds(), q(t.del, 0.99).Seconds()
	res.ExecP50, res.ExecP99 = q(t.execs, 0.5).Seconds(), q(t.execs, 0.99).Seconds()
	res.BridgeAddP50, res.BridgeAddP99 = q(t.badd, 0.5).Seconds(), q(t.badd, 0.99).Seconds()
	res.BridgeDelP50 = q(t.bdel, 0.5).Seconds()
	res.AddOverExec, res.DelOverExec = res.AddP50-res.ExecP50, res.DelP50-res.ExecP50
	res.FlowsPerPod = flowsPerPod
	faults := calls.faults
	res.AddFaultsP50, res.DelFaultsP50, res.ExecFaultsP50 = netnsnode.Median(faults["ctscrub ADD"]), netnsnode.Median(faults["ctscrub DEL"]), netnsnode.Median(faults["ctscrub VERSION"])
	fmt.Fprintf(w, "page faults per call, p50: ctscrub ADD %d, DEL %d, bare start %d\n", res.AddFaultsP50, res.DelFaultsP50, res.ExecFaultsP50)
	if cfg.Baseline != "" {
		base := t.base
		b := &BenchCNIBaseline{Binary: cfg.Baseline, Pairs: len(base.add),
			AddP50: q(base.add, 0.5).Seconds(), AddP99: q(base.add, 0.99).Seconds(),
			DelP50: q(base.del, 0.5).Seconds(), DelP99: q(base.del, 0.99).Seconds(),
			ExecP50:      q(base.exec, 0.5).Seconds(),
			AddFaultsP50: netnsnode.Median(faults["ctscrub-baseline ADD"]), DelFaultsP50: netnsnode.Median(faults["ctscrub-baseline DEL"]),
			ExecFaultsP50: netnsnode.Median(faults["ctscrub-baseline VERSION"]),
		}
		b.AddOverExec, b.DelOverExec = b.AddP50-b.ExecP50, b.DelP50-b.ExecP50
		res.Baseline = b
		fmt.Fprintf(w, "baseline %s, side by side (%d pairs): ADD p50 %s (over its bare start %s), DEL p50 %s (%s), bare start %s; page faults ADD %d, DEL %d, bare start %d\n",
			cfg.Baseline, b.Pairs, netnsnode.Dur(q(base.add, 0.5)), netnsnode.Dur(time.Duration(b.AddOverExec*1e9)), netnsnode.Dur(q(base.del, 0.5)), netnsnode.Dur(time.Duration(b.DelOverExec*1e9)),
			netnsnode.Dur(q(base.exec, 0.5)), b.AddFaultsP50, b.DelFaultsP50, b.ExecFaultsP50)
	}
	if !cfg.NoTrace {
		res.AddSteps, res.DelSteps = calls.addSteps.p50(), calls.delSteps.p50()
		calls.execSteps.print(w, "bare start (VERSION)", t.execs)
		calls.addSteps.print(w, "ctscrub ADD", t.add)
		calls.delSteps.print(w, "ctscrub DEL", t.del)
		res.ExecSteps = calls.execSteps.p50()
	}
}
