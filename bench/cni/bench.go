package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/ctscrub/ctscrub/internal/machcost"
	"github.com/ctscrub/ctscrub/internal/netnsnode"
)

// BenchCNIConfig is `make bench-cni`'s environment.
type BenchCNIConfig struct {
	Entries    int    // ENTRIES: CT entries the node's maps hold
	Pairs      int    // PAIRS: timed ADD/DEL pairs
	RangeSize  int    // addresses host-local hands out (IP reuse every RangeSize pairs)
	BinDir     string // bin/scrubd and bin/ctscrub
	RefPlugins string // Debian's reference plugins
	NoTrace    bool   // TRACE=0: no per-step trace of the plugin's calls
	// Baseline (BASELINE): another ctscrub binary (an older build) run side
	// by side: every other timed pair uses it, so both see the same machine.
	Baseline string
}

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

// BenchCNI is `make bench-cni`: the demo's node (its CT maps filled to
// ENTRIES, the Cilium datapath stand-in, scrubd as a process, the node
// netns and the outside host), and Pairs pods, each a netns with a veth,
// created and deleted one after the other as a container runtime does:
// bridge (+ host-local) ADD, then ctscrub ADD with the bridge's result as
// prevResult, some traffic to the outside host (so the pod has CT entries
// and index keys), ctscrub DEL, bridge DEL. Every plugin is the real binary,
// executed with the CNI environment and stdin a runtime gives it, from the
// node's netns; each call is timed from fork to exit, as is a bare process
// start of ctscrub (CNI_COMMAND=VERSION) in the same loop.
//
// host-local hands out RangeSize addresses, so each is reused every
// RangeSize pairs. The first pair of each address is a warm-up, not timed:
// scrubd has never seen the address (it held a previous owner's entries in
// the fill) and the ADD's scrub sweeps it, once per address and node.
func BenchCNI(ctx context.Context, cfg BenchCNIConfig, cleanup *netnsnode.Cleanup, w io.Writer) (BenchCNIResult, error) {
	res := BenchCNIResult{Date: time.Now().UTC().Format(time.RFC3339), Entries: cfg.Entries, Pairs: cfg.Pairs, WarmupPairs: cfg.RangeSize}
	if err := netnsnode.RemoveLeftovers(w); err != nil {
		return res, err
	}
	mc, err := machcost.Measure()
	if err != nil {
		return res, fmt.Errorf("machine costs: %w", err)
	}
	res.MachineCosts = mc
	fmt.Fprintf(w, "this machine now: %s\n", mc)
	if err := os.MkdirAll(netnsnode.WorkDir, 0o700); err != nil {
		return res, err
	}
	cleanup.Push("remove "+netnsnode.WorkDir, func() error { return os.RemoveAll(netnsnode.WorkDir) })
	if err := os.MkdirAll(netnsnode.BPFDir, 0o700); err != nil {
		return res, fmt.Errorf("create %s: %w (is bpffs mounted at /sys/fs/bpf? run scripts/setup.sh)", netnsnode.BPFDir, err)
	}
	cleanup.Push("remove "+netnsnode.BPFDir, func() error { return os.RemoveAll(netnsnode.BPFDir) })

	ctRoot := filepath.Join(netnsnode.BPFDir, "globals")
	maps, err := netnsnode.CreateCTMaps(ctRoot, cfg.Entries)
	if err != nil {
		return res, err
	}
	cleanup.Push("unpin CT maps in "+ctRoot, maps.Close)
	owners4, owners6 := netnsnode.PodRange(cfg.RangeSize)
	nbg := min(max(64, cfg.Entries/256), 16384)
	nbg -= nbg % 4
	put, took, err := netnsnode.Fill(ctx, maps, netnsnode.FillPlan{
		Entries:    cfg.Entries,
		Background: netnsnode.BackgroundPods(netnsnode.BGPods4, netnsnode.BGPods6, nbg),
		Owners:     append(owners4, owners6...),
		PerOwner:   2,
	})
	if err != nil {
		return res, err
	}
	fmt.Fprintf(w, "CT maps: %s entries in %s (%s other pods)\n", netnsnode.Num(put), netnsnode.Dur(took), netnsnode.Num(nbg))
	dp, err := netnsnode.NewDatapath(maps, nil)
	if err != nil {
		return res, err
	}
	cleanup.Push("unload the Cilium datapath stand-in", dp.Close)
	d, err := netnsnode.StartDaemon(ctx, cleanup, netnsnode.DaemonConfig{
		Bin:      filepath.Join(cfg.BinDir, "scrubd"),
		WorkDir:  netnsnode.WorkDir,
		PinDir:   filepath.Join(netnsnode.BPFDir, "scrubd"),
		CTRoot:   ctRoot,
		PodCIDRs: []netip.Prefix{netnsnode.PodCIDR4, netnsnode.PodCIDR6},
	})
	if err != nil {
		return res, err
	}
	res.StateFS = d.StateFS
	fmt.Fprintf(w, "scrubd's state file on %s\n", d.StateFS)
	node, err := netnsnode.AddNode(cleanup, netnsnode.NodeNS)
	if err != nil {
		return res, err
	}
	if _, err := netnsnode.AddOutside(cleanup); err != nil {
		return res, err
	}
	out, err := netnsnode.StartServer(netnsnode.NetnsPath(netnsnode.OutsideNS))
	if err != nil {
		return res, err
	}
	cleanup.Push("stop the outside host's servers", func() error { out.Close(); return nil })
	ch, err := netnsnode.NewChain(netnsnode.ChainConfig{
		Node: node, WorkDir: netnsnode.WorkDir, RefPlugins: cfg.RefPlugins,
		Plugin: filepath.Join(cfg.BinDir, "ctscrub"), Socket: d.Socket, RangeSize: cfg.RangeSize,
	})
	if err != nil {
		return res, err
	}
	bridgeConf, err := pluginConf(ch, 0)
	if err != nil {
		return res, err
	}
	ctscrubConf, err := pluginConf(ch, 1)
	if err != nil {
		return res, err
	}
	binDir := filepath.Join(netnsnode.WorkDir, "cni-bin")
	if cfg.Baseline != "" {
		b, err := os.ReadFile(cfg.Baseline)
		if err != nil {
			return res, fmt.Errorf("BASELINE: %w", err)
		}
		if err := os.WriteFile(filepath.Join(binDir, "ctscrub-baseline"), b, 0o755); err != nil {
			return res, err
		}
		fmt.Fprintf(w, "baseline %s: every other timed pair\n", cfg.Baseline)
	}
	var addSteps, delSteps, execSteps stepSamples
	timedCall := false // the calls of a warm-up pair are not broken down either
	faults := map[string][]int64{}
	run := func(plugin, command, containerID, netns string, conf []byte) ([]byte, time.Duration, error) {
		cmd := exec.Command(filepath.Join(binDir, plugin))
		cmd.Env = []string{"CNI_COMMAND=" + command, "CNI_CONTAINERID=" + containerID, "CNI_NETNS=" + netns,
			"CNI_IFNAME=eth0", "CNI_PATH=" + binDir, "PATH=/usr/sbin:/usr/bin:/sbin:/bin"}
		traced := plugin == "ctscrub" && (command == "ADD" || command == "DEL" || command == "VERSION") && !cfg.NoTrace
		if traced {
			cmd.Env = append(cmd.Env, pluginTraceEnv+"=1")
		}
		cmd.Stdin = bytes.NewReader(conf)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		var start, end time.Time
		err := netnsnode.InNetns(node, func() error {
			start = time.Now()
			err := cmd.Run()
			end = time.Now()
			return err
		})
		el := end.Sub(start)
		if err != nil {
			return nil, el, fmt.Errorf("%s %s: %v: %s %s", plugin, command, err, bytes.TrimSpace(stdout.Bytes()), bytes.TrimSpace(stderr.Bytes()))
		}
		if ru, ok := cmd.ProcessState.SysUsage().(*syscall.Rusage); ok && strings.HasPrefix(plugin, "ctscrub") && timedCall {
			faults[plugin+" "+command] = append(faults[plugin+" "+command], ru.Minflt)
		}
		if traced && timedCall {
			steps := map[string]*stepSamples{"ADD": &addSteps, "DEL": &delSteps, "VERSION": &execSteps}[command]
			if err := steps.addCall(stderr.Bytes(), start, end); err != nil {
				return nil, el, fmt.Errorf("%s %s: %w", plugin, command, err)
			}
		}
		return stdout.Bytes(), el, nil
	}
	if err := netnsnode.WaitDAD(ctx, netnsnode.BridgeName); err != nil && ctx.Err() != nil {
		return res, err
	}

	var add, del, execs, badd, bdel []time.Duration
	var base struct{ add, del, exec []time.Duration }
	flows := 0
	total := cfg.RangeSize + cfg.Pairs
	fmt.Fprintf(w, "%d pairs (%d warm-up, one per address host-local hands out) ...\n", total, cfg.RangeSize)
	for i := range total {
		if ctx.Err() != nil {
			return res, ctx.Err()
		}
		timed := i >= cfg.RangeSize
		timedCall = timed
		nsName := fmt.Sprintf("%s-bc%d", netnsnode.NamePrefix, i)
		path, err := netnsnode.AddNetns(nsName)
		if err != nil {
			return res, err
		}
		id := nsName
		prev, tb, err := run("bridge", "ADD", id, path, bridgeConf)
		if err != nil {
			netnsnode.DelNetns(nsName)
			return res, err
		}
		r, err := current.NewResult(prev)
		if err != nil {
			return res, fmt.Errorf("bridge ADD result: %w", err)
		}
		cr, err := current.GetResult(r)
		if err != nil {
			return res, err
		}
		var v4 netip.Addr
		hostVeth := ""
		for _, ipc := range cr.IPs {
			if a, ok := netip.AddrFromSlice(ipc.Address.IP); ok && a.Unmap().Is4() {
				v4 = a.Unmap()
			}
		}
		for _, ifc := range cr.Interfaces {
			if ifc.Sandbox == "" && ifc.Name != netnsnode.BridgeName {
				hostVeth = ifc.Name
			}
		}
		// Cilium's datapath on the pod's interface (the stand-in makes the
		// CT entries of its traffic); not part of any plugin's time.
		if err := netnsnode.InNetns(node, func() error { return dp.Attach(hostVeth) }); err != nil {
			return res, err
		}
		withPrev, err := injectPrev(ctscrubConf, prev)
		if err != nil {
			return res, err
		}
		// With a baseline, every other timed pair runs it instead.
		plugin := "ctscrub"
		if cfg.Baseline != "" && timed && (i-cfg.RangeSize)%2 == 1 {
			plugin = "ctscrub-baseline"
		}
		_, ta, err := run(plugin, "ADD", id, path, withPrev)
		if err != nil {
			return res, err
		}
		n, err := netnsnode.SendTraffic(ctx, path, netnsnode.OutsideAddr[0].Addr(), netnsnode.TrafficCounts{TCP: 2, UDP: 3})
		if err != nil {
			return res, fmt.Errorf("traffic of pod %d (%s): %w", i, v4, err)
		}
		flows += n
		_, td, err := run(plugin, "DEL", id, path, withPrev)
		if err != nil {
			return res, err
		}
		bridgeDel, err := injectPrev(bridgeConf, prev)
		if err != nil {
			return res, err
		}
		_, tbd, err := run("bridge", "DEL", id, path, bridgeDel)
		if err != nil {
			return res, err
		}
		_, tv, err := run(plugin, "VERSION", id, path, []byte(`{"cniVersion":"1.0.0"}`))
		if err != nil {
			return res, err
		}
		if err := netnsnode.DelNetns(nsName); err != nil {
			return res, err
		}
		// Now and then: nothing of the deleted pod is left (a full walk,
		// too slow for every pair at 16 M entries).
		if timed && (i-cfg.RangeSize)%max(1, cfg.Pairs/10) == 0 {
			left, err := netnsnode.EntriesOf(maps, v4)
			if err != nil {
				return res, err
			}
			res.Checks++
			res.ChecksLeft += left
		}
		if timed && plugin != "ctscrub" {
			base.add, base.del, base.exec = append(base.add, ta), append(base.del, td), append(base.exec, tv)
		} else if timed {
			add, del, execs, badd, bdel = append(add, ta), append(del, td), append(execs, tv), append(badd, tb), append(bdel, tbd)
			if len(add)%100 == 0 {
				fmt.Fprintf(w, "  %d pairs: ctscrub ADD p50 %s, DEL p50 %s, VERSION p50 %s, bridge ADD p50 %s\n", len(add),
					netnsnode.Dur(q(add, 0.5)), netnsnode.Dur(q(del, 0.5)), netnsnode.Dur(q(execs, 0.5)), netnsnode.Dur(q(badd, 0.5)))
			}
		}
	}
	res.AddP50, res.AddP99 = q(add, 0.5).Seconds(), q(add, 0.99).Seconds()
	res.DelP50, res.DelP99 = q(del, 0.5).Seconds(), q(del, 0.99).Seconds()
	res.ExecP50, res.ExecP99 = q(execs, 0.5).Seconds(), q(execs, 0.99).Seconds()
	res.BridgeAddP50, res.BridgeAddP99 = q(badd, 0.5).Seconds(), q(badd, 0.99).Seconds()
	res.BridgeDelP50 = q(bdel, 0.5).Seconds()
	res.AddOverExec, res.DelOverExec = res.AddP50-res.ExecP50, res.DelP50-res.ExecP50
	res.FlowsPerPod = float64(flows) / float64(total)
	res.AddFaultsP50, res.DelFaultsP50, res.ExecFaultsP50 = netnsnode.Median(faults["ctscrub ADD"]), netnsnode.Median(faults["ctscrub DEL"]), netnsnode.Median(faults["ctscrub VERSION"])
	fmt.Fprintf(w, "page faults per call, p50: ctscrub ADD %d, DEL %d, bare start %d\n", res.AddFaultsP50, res.DelFaultsP50, res.ExecFaultsP50)
	if cfg.Baseline != "" {
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
		res.AddSteps, res.DelSteps = addSteps.p50(), delSteps.p50()
		execSteps.print(w, "bare start (VERSION)", execs)
		addSteps.print(w, "ctscrub ADD", add)
		delSteps.print(w, "ctscrub DEL", del)
		res.ExecSteps = execSteps.p50()
	}
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		res.Load1 = string(bytes.TrimSpace(b))
	}
	return res, nil
}

// q is the nearest-rank quantile.
func q(d []time.Duration, f float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	i := int(f*float64(len(s))+0.999999) - 1
	return s[max(0, min(i, len(s)-1))]
}

// pluginConf is plugin i of the chain's conflist as a runtime hands it to
// that plugin: with the network's name and cniVersion.
func pluginConf(ch *netnsnode.Chain, i int) ([]byte, error) {
	if i >= len(ch.List.Plugins) {
		return nil, fmt.Errorf("conflist %s has no plugin %d", ch.ConfPath, i)
	}
	var m map[string]any
	if err := json.Unmarshal(ch.List.Plugins[i].Bytes, &m); err != nil {
		return nil, err
	}
	m["name"] = ch.List.Name
	m["cniVersion"] = ch.List.CNIVersion
	return json.Marshal(m)
}

// injectPrev adds prevResult to a plugin's configuration.
func injectPrev(conf, prev []byte) ([]byte, error) {
	var m map[string]any
	if err := json.Unmarshal(conf, &m); err != nil {
		return nil, err
	}
	m["prevResult"] = json.RawMessage(prev)
	return json.Marshal(m)
}
