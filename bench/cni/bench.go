package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
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
	bn, err := setUpNode(ctx, cfg, cleanup, w)
	if err != nil {
		return res, err
	}
	res.StateFS = bn.stateFS
	calls := &pluginCalls{binDir: bn.binDir, node: bn.node, noTrace: cfg.NoTrace, faults: map[string][]int64{}}
	if err := netnsnode.WaitDAD(ctx, netnsnode.BridgeName); err != nil && ctx.Err() != nil {
		return res, err
	}

	var t timings
	flows := 0
	total := cfg.RangeSize + cfg.Pairs
	fmt.Fprintf(w, "%d pairs (%d warm-up, one per address host-local hands out) ...\n", total, cfg.RangeSize)
	for i := range total {
		if ctx.Err() != nil {
			return res, ctx.Err()
		}
		timed := i >= cfg.RangeSize
		calls.timed = timed
		// With a baseline, every other timed pair runs it instead.
		plugin := "ctscrub"
		if cfg.Baseline != "" && timed && (i-cfg.RangeSize)%2 == 1 {
			plugin = "ctscrub-baseline"
		}
		pt, err := bn.pair(ctx, calls, i, plugin)
		if err != nil {
			return res, err
		}
		flows += pt.flows
		// Now and then: nothing of the deleted pod is left (a full walk,
		// too slow for every pair at 16 M entries).
		if timed && (i-cfg.RangeSize)%max(1, cfg.Pairs/10) == 0 {
			left, err := netnsnode.EntriesOf(bn.maps, pt.v4)
			if err != nil {
				return res, err
			}
			res.Checks++
			res.ChecksLeft += left
		}
		if timed {
			t.record(w, plugin, pt)
		}
	}
	res.summarize(w, cfg, &t, calls, float64(flows)/float64(total))
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		res.Load1 = string(bytes.TrimSpace(b))
	}
	return res, nil
}

// benchNode is the demo's node as the pairs use it.
type benchNode struct {
	maps        *netnsnode.CTMaps
	dp          netnsnode.Datapath
	node        string // the node's netns path: the plugins run in it
	binDir      string // the chain's CNI bin dir (the baseline binary goes there too)
	bridgeConf  []byte // the bridge's and ctscrub's configuration as a runtime hands it to each
	ctscrubConf []byte
	stateFS     string // the file system of scrubd's state file
}

// setUpNode creates the demo's node: its CT maps filled to ENTRIES (with
// two stale entries of each address host-local will hand out), the
// datapath stand-in, scrubd, the node netns, the outside host and its
// servers, and the chain, with the baseline binary beside ctscrub.
func setUpNode(ctx context.Context, cfg BenchCNIConfig, cleanup *netnsnode.Cleanup, w io.Writer) (*benchNode, error) {
	if err := os.MkdirAll(netnsnode.WorkDir, 0o700); err != nil {
		return nil, err
	}
	cleanup.Push("remove "+netnsnode.WorkDir, func() error { return os.RemoveAll(netnsnode.WorkDir) })
	if err := os.MkdirAll(netnsnode.BPFDir, 0o700); err != nil {
		return nil, fmt.Errorf("create %s: %w (is bpffs mounted at /sys/fs/bpf? run scripts/setup.sh)", netnsnode.BPFDir, err)
	}
	cleanup.Push("remove "+netnsnode.BPFDir, func() error { return os.RemoveAll(netnsnode.BPFDir) })

	ctRoot := filepath.Join(netnsnode.BPFDir, "globals")
	maps, err := netnsnode.CreateCTMaps(ctRoot, cfg.Entries)
	if err != nil {
		return nil, err
	}
	cleanup.Push("unpin CT maps in "+ctRoot, maps.Close)
	owners4, owners6 := netnsnode.PodRange(cfg.RangeSize)
	nbg := netnsnode.BackgroundPodCount(cfg.Entries)
	put, took, err := netnsnode.Fill(ctx, maps, netnsnode.FillPlan{
		Entries:    cfg.Entries,
		Background: netnsnode.BackgroundPods(netnsnode.BGPods4, netnsnode.BGPods6, nbg),
		Owners:     append(owners4, owners6...),
		PerOwner:   2,
	})
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(w, "CT maps: %s entries in %s (%s other pods)\n", netnsnode.Num(put), netnsnode.Dur(took), netnsnode.Num(nbg))
	dp, err := netnsnode.NewDatapath(maps, nil)
	if err != nil {
		return nil, err
	}
	cleanup.Push("unload the Cilium datapath stand-in", dp.Close)
	d, err := netnsnode.StartDaemon(ctx, cleanup, netnsnode.NodeDaemonConfig(cfg.BinDir, ctRoot))
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(w, "scrubd's state file on %s\n", d.StateFS)
	node, err := netnsnode.AddNode(cleanup, netnsnode.NodeNS)
	if err != nil {
		return nil, err
	}
	if _, err := netnsnode.AddOutside(cleanup); err != nil {
		return nil, err
	}
	out, err := netnsnode.StartServer(netnsnode.NetnsPath(netnsnode.OutsideNS))
	if err != nil {
		return nil, err
	}
	cleanup.Push("stop the outside host's servers", func() error { out.Close(); return nil })
	ch, err := netnsnode.NewChain(netnsnode.ChainConfig{
		Node: node, WorkDir: netnsnode.WorkDir, RefPlugins: cfg.RefPlugins,
		Plugin: filepath.Join(cfg.BinDir, "ctscrub"), Socket: d.Socket, RangeSize: cfg.RangeSize,
	})
	if err != nil {
		return nil, err
	}
	bn := &benchNode{maps: maps, dp: dp, node: node, binDir: filepath.Join(netnsnode.WorkDir, "cni-bin"), stateFS: d.StateFS}
	if bn.bridgeConf, err = pluginConf(ch, 0); err != nil {
		return nil, err
	}
	if bn.ctscrubConf, err = pluginConf(ch, 1); err != nil {
		return nil, err
	}
	if cfg.Baseline != "" {
		b, err := os.ReadFile(cfg.Baseline)
		if err != nil {
			return nil, fmt.Errorf("BASELINE: %w", err)
		}
		if err := os.WriteFile(filepath.Join(bn.binDir, "ctscrub-baseline"), b, 0o755); err != nil {
			return nil, err
		}
		fmt.Fprintf(w, "baseline %s: every other timed pair\n", cfg.Baseline)
	}
	return bn, nil
}

// pairTimes is what one pair's calls took, fork to exit.
type pairTimes struct {
	bridgeAdd, add, del, bridgeDel, version time.Duration
	v4                                      netip.Addr // the pod's address
	flows                                   int        // its flows the outside host answered
}

// pair is pod i's life as a runtime runs it: a netns, bridge ADD, the
// stand-in on its veth, plugin's ADD with the bridge's result, traffic to
// the outside host, plugin's DEL, bridge DEL, then a bare start of plugin
// (VERSION) and the netns removed.
func (bn *benchNode) pair(ctx context.Context, calls *pluginCalls, i int, plugin string) (pairTimes, error) {
	var pt pairTimes
	nsName := fmt.Sprintf("%s-bc%d", netnsnode.NamePrefix, i)
	path, err := netnsnode.AddNetns(nsName)
	if err != nil {
		return pt, err
	}
	id := nsName
	prev, tb, err := calls.run("bridge", "ADD", id, path, bn.bridgeConf)
	if err != nil {
		netnsnode.DelNetns(nsName)
		return pt, err
	}
	pt.bridgeAdd = tb
	r, err := current.NewResult(prev)
	if err != nil {
		return pt, fmt.Errorf("bridge ADD result: %w", err)
	}
	cr, err := current.GetResult(r)
	if err != nil {
		return pt, err
	}
	hostVeth := ""
	for _, ipc := range cr.IPs {
		if a, ok := netip.AddrFromSlice(ipc.Address.IP); ok && a.Unmap().Is4() {
			pt.v4 = a.Unmap()
		}
	}
	for _, ifc := range cr.Interfaces {
		if ifc.Sandbox == "" && ifc.Name != netnsnode.BridgeName {
			hostVeth = ifc.Name
		}
	}
	// Cilium's datapath on the pod's interface (the stand-in makes the
	// CT entries of its traffic); not part of any plugin's time.
	if err := netnsnode.InNetns(bn.node, func() error { return bn.dp.Attach(hostVeth) }); err != nil {
		return pt, err
	}
	withPrev, err := injectPrev(bn.ctscrubConf, prev)
	if err != nil {
		return pt, err
	}
	if _, pt.add, err = calls.run(plugin, "ADD", id, path, withPrev); err != nil {
		return pt, err
	}
	n, err := netnsnode.SendTraffic(ctx, path, netnsnode.OutsideAddr[0].Addr(), netnsnode.TrafficCounts{TCP: 2, UDP: 3})
	if err != nil {
		return pt, fmt.Errorf("traffic of pod %d (%s): %w", i, pt.v4, err)
	}
	pt.flows = n
	if _, pt.del, err = calls.run(plugin, "DEL", id, path, withPrev); err != nil {
		return pt, err
	}
	bridgeDel, err := injectPrev(bn.bridgeConf, prev)
	if err != nil {
		return pt, err
	}
	if _, pt.bridgeDel, err = calls.run("bridge", "DEL", id, path, bridgeDel); err != nil {
		return pt, err
	}
	if _, pt.version, err = calls.run(plugin, "VERSION", id, path, []byte(`{"cniVersion":"1.0.0"}`)); err != nil {
		return pt, err
	}
	return pt, netnsnode.DelNetns(nsName)
}

// timings are the timed pairs' calls: ctscrub's (add, del, execs) beside
// the bridge's, and the baseline binary's.
type timings struct {
	add, del, execs, badd, bdel []time.Duration
	base                        struct{ add, del, exec []time.Duration }
}

// record adds a timed pair run with plugin, and prints the medians every
// 100 pairs of ctscrub.
func (t *timings) record(w io.Writer, plugin string, pt pairTimes) {
	if plugin != "ctscrub" {
		t.base.add, t.base.del, t.base.exec = append(t.base.add, pt.add), append(t.base.del, pt.del), append(t.base.exec, pt.version)
		return
	}
	t.add, t.del, t.execs, t.badd, t.bdel = append(t.add, pt.add), append(t.del, pt.del), append(t.execs, pt.version), append(t.badd, pt.bridgeAdd), append(t.bdel, pt.bridgeDel)
	if len(t.add)%100 == 0 {
		fmt.Fprintf(w, "  %d pairs: ctscrub ADD p50 %s, DEL p50 %s, VERSION p50 %s, bridge ADD p50 %s\n", len(t.add),
			netnsnode.Dur(q(t.add, 0.5)), netnsnode.Dur(q(t.del, 0.5)), netnsnode.Dur(q(t.execs, 0.5)), netnsnode.Dur(q(t.badd, 0.5)))
	}
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
