package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"log"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/ctscrub/ctscrub/bench/internal/ctfill"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/expiry"
)

// runVariant refills the table, sets ctscrub and Cilium up as the variant
// needs, then creates PODS pods at once, waits until they run, deletes them
// at once, waits until they are gone, and reads what Cilium, containerd and
// the kernel counted. It returns the variant's figures and the table's size
// when the pods started.
//
// The CPU window runs from the start of the fill to the last pod gone: it
// holds what each variant does to keep the table in shape (ctscrub's first
// expiry pass, Cilium's GC runs at 60 s) and the pods' scrubs.
func runVariant(ctx context.Context, cfg config, k *kube, maps *ctmap.Maps, f *filler, clock expiry.Clock, name string) (*variantResult, int64, error) {
	log.Printf("== %s", name)
	v := &variantResult{}
	cold := isDelegate(name) && !cfg.warmup
	if !usesCtscrub(name) || cold {
		// ctscrub goes before the fill: a scrubd still running (the previous
		// variant's, expiry on) would sweep the expired share as it is
		// written. Cold delegate variants install it after the fill, right
		// before the pods, as an operator installs or upgrades it on a busy
		// node: no dead sandbox removed, no address given a pod first.
		if err := uninstallCtscrub(k); err != nil {
			return nil, 0, err
		}
	}
	var warm map[netip.Addr]bool
	if isDelegate(name) && cfg.warmup {
		// WARMUP=1: a node's steady state: scrubd has seen every address of
		// the node's range given to a pod and taken back once, so its index
		// vouches for them (docs/cilium-node.md). Done on the real
		// entries alone: the previous variant's synthetic ones go first,
		// so the warm-up's first scrubs of each address (sweeps: a new
		// scrubd vouches for no address yet) stay short.
		n, err := f.clear()
		if err != nil {
			return nil, 0, err
		}
		log.Printf("cleared %d synthetic entries for the warm-up", n)
		if err := installCtscrub(k, cfg, "off"); err != nil {
			return nil, 0, err
		}
		if warm, v.WarmIPs, err = warmUp(k, cfg); err != nil {
			return nil, 0, err
		}
	}
	// The CPU window opens before the fill: with Cilium's GC at 60 s, its
	// runs during the fill are part of what it costs.
	windowStart := time.Now()
	cpu, err := startCPUWatch("/proc", k.containerID)
	if err != nil {
		return nil, 0, err
	}
	countersBefore, err := readAgentCounters(k)
	if err != nil {
		return nil, 0, err
	}
	took, err := f.fill()
	if err != nil {
		return nil, 0, err
	}
	n, err := ctfill.CountAll(maps)
	if err != nil {
		return nil, 0, err
	}
	log.Printf("refilled in %.1fs: %d entries", took.Seconds(), n)
	if want := fillWant(name, cfg.entries, f); n < want {
		return nil, 0, fmt.Errorf("after the fill the maps hold %d entries, want %d or more (LRU eviction? size the maps with CT_MAX)", n, want)
	}
	gcBase, err := readAgentCounters(k)
	if err != nil {
		return nil, 0, err
	}
	switch name {
	case "ctscrub_no_expiry":
		err = installCtscrub(k, cfg, "off")
	case "ctscrub":
		// scrubd (re)starts with the sweep on: its first pass runs at once.
		if err = installCtscrub(k, cfg, "sweep"); err == nil {
			err = waitFirstSweep(k, maps)
		}
	case "cilium_gc60":
		// Cilium's own GC, every 60 s, has been through the new table.
		var waited time.Duration
		if waited, err = waitGCRuns(k, gcBase, presentKinds(maps), 5*time.Minute); err == nil {
			log.Printf("Cilium's CT GC ran twice over every map (%.1fs after the fill)", waited.Seconds())
		}
	case "cilium_only", "cilium_coalesced":
		// uninstalled before the fill
	case "ctscrub_delegate", "ctscrub_delegate_restart", "ctscrub_delegate_upgrade":
		// With WARMUP=1 installed and warmed up before the fill; cold,
		// installed now. Then _restart kills scrubd, _upgrade rolls it.
		if cold {
			// The floor of the bootstrap pass: one batch walk of the same
			// maps (BPF_MAP_LOOKUP_BATCH of keys and values, 4,096 a call,
			// as Cilium's GC reads them), timed here right before.
			start := time.Now()
			if _, err = ctfill.CountAll(maps); err != nil {
				return nil, 0, err
			}
			v.BatchWalkS = time.Since(start).Seconds()
			err = installCtscrub(k, cfg, "off")
		}
		switch {
		case err != nil:
		case name == "ctscrub_delegate_restart":
			err = killScrubd(k)
		case name == "ctscrub_delegate_upgrade":
			err = rollScrubd(k)
		}
	}
	if err != nil {
		return nil, 0, err
	}
	var boot *bootstrapWatch
	if cold {
		boot = watchBootstrap(k)
	}
	scrubdBefore := ""
	if usesCtscrub(name) {
		if scrubdBefore, err = k.scrubdMetrics(); err != nil {
			return nil, 0, err
		}
	}

	if v.EntriesBefore, err = ctfill.CountAll(maps); err != nil {
		return nil, 0, err
	}
	if v.ExpiredBefore, err = countExpired(ctx, maps, clock); err != nil {
		return nil, 0, err
	}
	log.Printf("table before the pods: %d entries, %d expired", v.EntriesBefore, v.ExpiredBefore)

	// Where the logs stand now.
	_, cniOff, err := k.readFrom(cniLog, 0)
	if err != nil {
		return nil, 0, err
	}
	metricBefore, err := ctCleanMetric(k)
	if err != nil {
		return nil, 0, err
	}
	agent, err := podOn(k, "kube-system", agentSel)
	if err != nil {
		return nil, 0, err
	}
	t0 := time.Now().Add(-time.Second)
	prefix := variantPrefix[name]
	keep := func(pod string) bool { return strings.HasPrefix(pod, benchNS+"/"+prefix+"-") }

	// All pods at once.
	start := time.Now()
	if err := k.apply(benchPods(benchNS, prefix, cfg.worker, cfg.podImage, cfg.pods)); err != nil {
		return nil, 0, err
	}
	ready, notReady := waitPods(k, prefix, cfg.pods, cfg.podTimeout)
	v.ReadyAllS = ready.Seconds()
	v.FailedPods = notReady
	log.Printf("%d/%d pods running after %.1fs", cfg.pods-notReady, cfg.pods, ready.Seconds())
	if warm != nil {
		ips, err := podIPs(k, prefix)
		if err != nil {
			return nil, 0, err
		}
		for _, ip := range ips {
			if !warm[ip] {
				v.ColdIPs++
			}
		}
		log.Printf("%d of the pods' %d addresses were not given a pod in the warm-up", v.ColdIPs, len(ips))
	}

	// All deletes at once.
	start = time.Now()
	if _, err := k.kubectl(2*time.Minute, "-n", benchNS, "delete", "pods", "-l", "ctscrub-bench="+prefix, "--wait=false"); err != nil {
		return nil, 0, err
	}
	gone := waitGone(k, prefix, cfg.podTimeout)
	v.AllGoneS = time.Since(start).Seconds()
	if !gone {
		log.Printf("warning: pods of %s still present after %s", name, cfg.podTimeout)
		v.FailedPods = max(v.FailedPods, 1)
	}
	log.Printf("pods gone after %.1fs", v.AllGoneS)

	// containerd's StopPodSandbox (and the CNI DEL in it) may finish after
	// the API objects are gone: wait for every sandbox stop.
	var sbs map[string]*sandbox
	for deadline := time.Now().Add(2 * time.Minute); ; {
		out, err := run(ctx, 2*time.Minute, "", "docker", "exec", k.worker, "journalctl", "-u", "containerd", "--no-pager", "-o", "cat",
			"--since", "@"+strconv.FormatInt(t0.Unix(), 10))
		if err != nil {
			return nil, 0, err
		}
		sbs = parseContainerd(out, keep)
		pending := 0
		for _, s := range sbs {
			if !s.Ready.IsZero() && s.StopEnd.IsZero() {
				pending++
			}
		}
		if pending == 0 || time.Now().After(deadline) {
			if pending > 0 {
				log.Printf("warning: %d sandboxes not stopped yet", pending)
			}
			break
		}
		time.Sleep(2 * time.Second)
	}
	if name == "cilium_coalesced" {
		// The deletes' walks are the agent's work for these pods too.
		if _, err := waitScrubsAnswered(k, 10*time.Minute); err != nil {
			return nil, 0, err
		}
		v.ScrubDrainS = time.Since(start).Seconds()
		log.Printf("the agent had answered every endpoint scrub %.1fs after the deletes began (all pods gone after %.1fs)", v.ScrubDrainS, v.AllGoneS)
	}
	var sbT, stopT []time.Duration
	for _, s := range sbs {
		v.SandboxFailures += s.Failures
		if !s.Ready.IsZero() {
			sbT = append(sbT, s.Ready.Sub(s.Start))
		}
		if !s.StopEnd.IsZero() {
			stopT = append(stopT, s.StopEnd.Sub(s.StopStart))
		}
		if s.Failures > 0 {
			log.Printf("%s: %d failed RunPodSandbox, last: %s", s.Pod, s.Failures, s.LastError)
		}
	}
	if missing := cfg.pods - len(sbT); missing > v.FailedPods {
		v.FailedPods = missing
	}

	// Cilium: the agent's regeneration statistics per endpoint. The first
	// regeneration of an endpoint is the one that waits for the CT scrub.
	agentLogs, err := k.kubectl(2*time.Minute, "-n", "kube-system", "logs", agent, "-c", "cilium-agent", "--since-time="+t0.UTC().Format(time.RFC3339))
	if err != nil {
		return nil, 0, err
	}
	first := map[string]regen{}
	for _, r := range parseRegens(agentLogs, keep) {
		if _, ok := first[r.Pod]; !ok && r.HasStatsFor {
			first[r.Pod] = r
		}
	}
	var ctT, regT []time.Duration
	for _, r := range first {
		ctT = append(ctT, r.CTClean)
		regT = append(regT, r.Total)
	}

	// cilium-cni's ADD and DEL; a pod's first DEL is the one that tears it
	// down (containerd's second finds nothing).
	cniText, _, err := k.readFrom(cniLog, cniOff)
	if err != nil {
		return nil, 0, err
	}
	var addT, delT []time.Duration
	seenDel := map[string]bool{}
	for _, c := range parseCNILog(cniText) {
		if !c.Done || !keep(c.Pod) {
			continue
		}
		switch c.Cmd {
		case "ADD":
			addT = append(addT, c.Duration())
		case "DEL":
			if !seenDel[c.Pod] {
				seenDel[c.Pod] = true
				delT = append(delT, c.Duration())
			}
		}
	}
	metricAfter, err := ctCleanMetric(k)
	if err != nil {
		return nil, 0, err
	}
	// The window ends when the last sandbox stopped (the wait above).
	if v.AgentCPUS, v.ScrubdCPUS, err = cpu.stop(); err != nil {
		return nil, 0, err
	}
	v.CPUWindowS = time.Since(windowStart).Seconds()
	countersAfter, err := readAgentCounters(k)
	if err != nil {
		return nil, 0, err
	}
	v.CiliumGCRuns = countersAfter.gcRuns - countersBefore.gcRuns
	v.ScrubRequests = countersAfter.scrubRequests - countersBefore.scrubRequests
	v.ScrubWalks = countersAfter.scrubWalks - countersBefore.scrubWalks
	if name == "cilium_coalesced" && v.ScrubRequests == 0 {
		// Figures of another agent under this variant's name would mislead.
		return nil, 0, fmt.Errorf("the agent answered no endpoint scrub (cilium_datapath_conntrack_scrub_requests_total did not grow): %s is not built with cilium/patches/coalesce-v* (CILIUM_COALESCED=1 e2e/kind/images/cilium.sh), or its metrics are off", cfg.coalescedImage)
	}
	v.DelegatedScrubs = countersAfter.delegated - countersBefore.delegated
	v.FallbackCauses = map[string]float64{}
	for c, n := range countersAfter.fallbacks {
		if d := n - countersBefore.fallbacks[c]; d > 0 {
			v.FallbackCauses[c] = d
			v.FallbackWalks += d
		}
	}
	if usesCtscrub(name) {
		text, err := k.scrubdMetrics()
		if err != nil {
			return nil, 0, err
		}
		v.ScrubdScrubs = scrubCounts(scrubdBefore, text)
		v.DelegateAnswers = delegateAnswers(scrubdBefore, text)
		v.DelegateWithin = delegateWithin(scrubdBefore, text)
	}
	if isDelegate(name) {
		v.Walks = v.FallbackWalks
		var creates float64
		for k, n := range v.DelegateAnswers {
			if strings.HasPrefix(k, "endpoint-create/") {
				creates += n
			}
		}
		if creates > 0 {
			v.CompleteShare = v.DelegateAnswers["endpoint-create/complete"] / creates
		}
	}
	if boot != nil {
		if v.BootstrapS, v.BootstrapScrubdCPUS, err = boot.result(); err != nil {
			return nil, 0, err
		}
		log.Printf("bootstrap pass %.1fs (batch walk of the same maps %.1fs), scrubd CPU from its start to the pass's end %.1fs; creates answered complete %.0f %%",
			v.BootstrapS, v.BatchWalkS, v.BootstrapScrubdCPUS, 100*v.CompleteShare)
	}
	v.MetricCTClean.Count = metricAfter[0] - metricBefore[0]
	v.MetricCTClean.SumS = metricAfter[1] - metricBefore[1]

	ct, rg, sb, st, ad, dl := summarise(ctT), summarise(regT), summarise(sbT), summarise(stopT), summarise(addT), summarise(delT)
	v.CTCleanP50, v.CTCleanMax = ct.P50, ct.Max
	v.RegenTotalP50, v.RegenTotalMax = rg.P50, rg.Max
	v.SandboxP50, v.SandboxMax = sb.P50, sb.Max
	v.StopP50, v.StopMax = st.P50, st.Max
	v.CNIAddP50, v.CNIAddMax = ad.P50, ad.Max
	v.CNIDelP50, v.CNIDelMax = dl.P50, dl.Max
	v.Measured.Regens, v.Measured.Sandboxes, v.Measured.Stops, v.Measured.CNIAdd, v.Measured.CNIDel = ct.N, sb.N, st.N, ad.N, dl.N
	log.Printf("waitingForCTClean %s; regeneration %s; RunPodSandbox %s; StopPodSandbox %s; cilium-cni ADD %s, DEL %s; failed pods %d, failed RunPodSandbox calls %d; metric waitingForCTClean: %v observations, %.2fs in all",
		ct, rg, sb, st, ad, dl, v.FailedPods, v.SandboxFailures, v.MetricCTClean.Count, v.MetricCTClean.SumS)
	if name == "cilium_coalesced" {
		log.Printf("coalesced: %.0f endpoint scrubs answered by %.0f walks", v.ScrubRequests, v.ScrubWalks)
	}
	log.Printf("CPU over %.0fs: cilium-agent %.2fs, scrubd %.2fs; Cilium GC runs %.0f; delegate: %.0f scrubs delegated, %.0f walks after asking %v; scrubd's scrubs %v, delegate answers %v, within %v",
		v.CPUWindowS, v.AgentCPUS, v.ScrubdCPUS, v.CiliumGCRuns, v.DelegatedScrubs, v.FallbackWalks, v.FallbackCauses, v.ScrubdScrubs, v.DelegateAnswers, v.DelegateWithin)
	return v, v.EntriesBefore, nil
}

// countExpired counts the expired entries in clock with a report pass (a
// pass of ctscrub's own, outside the timed part; it deletes nothing).
func countExpired(ctx context.Context, maps *ctmap.Maps, clock expiry.Clock) (uint64, error) {
	r, err := expiry.New(maps, expiry.Config{Mode: expiry.ModeReport, Clock: clock, PassTimeout: 5 * time.Minute}, expiry.Options{})
	if err != nil {
		return 0, err
	}
	defer r.Close()
	rep, err := r.Pass(ctx)
	if err != nil {
		return 0, err
	}
	return rep.Total().Expired, nil
}

// waitPods waits until every pod of the variant is Running and Ready, or
// timeout; it returns the time taken and how many were not ready.
func waitPods(k *kube, prefix string, n int, timeout time.Duration) (time.Duration, int) {
	start := time.Now()
	notReady := n
	for time.Since(start) < timeout {
		out, err := k.kubectl(time.Minute, "-n", benchNS, "get", "pods", "-l", "ctscrub-bench="+prefix, "-o", "json")
		if err == nil {
			var pl struct {
				Items []struct {
					Status struct {
						Conditions []struct{ Type, Status string } `json:"conditions"`
					} `json:"status"`
				} `json:"items"`
			}
			if json.Unmarshal([]byte(out), &pl) == nil {
				ready := 0
				for _, p := range pl.Items {
					for _, c := range p.Status.Conditions {
						if c.Type == "Ready" && c.Status == "True" {
							ready++
						}
					}
				}
				notReady = n - ready
				if notReady == 0 {
					break
				}
			}
		}
		time.Sleep(500 * time.Millisecond)
	}
	return time.Since(start), notReady
}

func waitGone(k *kube, prefix string, timeout time.Duration) bool {
	for start := time.Now(); time.Since(start) < timeout; time.Sleep(500 * time.Millisecond) {
		out, err := k.kubectl(time.Minute, "-n", benchNS, "get", "pods", "-l", "ctscrub-bench="+prefix, "-o", "name")
		if err == nil && strings.TrimSpace(out) == "" {
			return true
		}
	}
	return false
}

// ctCleanMetric reads the agent's
// cilium_endpoint_regeneration_time_stats_seconds{scope="waitingForCTClean"}
// count and sum (success and failure together).
func ctCleanMetric(k *kube) ([2]float64, error) {
	var out [2]float64
	text, err := k.nodeHTTP("http://127.0.0.1:9962/metrics")
	if err != nil {
		return out, fmt.Errorf("Cilium's metrics (prometheus.enabled=true, port 9962): %w", err)
	}
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		l := sc.Text()
		if !strings.Contains(l, `scope="waitingForCTClean"`) {
			continue
		}
		f := strings.Fields(l)
		if len(f) < 2 {
			continue
		}
		val, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err != nil {
			continue
		}
		switch {
		case strings.HasPrefix(l, "cilium_endpoint_regeneration_time_stats_seconds_count{"):
			out[0] += val
		case strings.HasPrefix(l, "cilium_endpoint_regeneration_time_stats_seconds_sum{"):
			out[1] += val
		}
	}
	return out, nil
}

// installCtscrub installs (or reconfigures and restarts) ctscrub from
// conf/: scrubd's config with the expiry pass in mode, the DaemonSet, whose
// install-cni init container chains ctscrub after cilium-cni in Cilium's own
// conflist (docs/plugin.md, option 2). Waits for the rollout and the chain.
func installCtscrub(k *kube, cfg config, mode string) error {
	if cfg.warmup {
		if err := removeLeftSandboxes(k); err != nil {
			return err
		}
	}
	raw, err := os.ReadFile(filepath.Join(cfg.root, "conf", "scrubd.yaml"))
	if err != nil {
		return err
	}
	conf, err := scrubdConf(string(raw), cfg.podCIDR, mode)
	if err != nil {
		return err
	}
	cm, err := run(k.ctx, time.Minute, conf, "kubectl", "-n", "kube-system", "create", "configmap", "ctscrub-config", "--from-file=scrubd.yaml=/dev/stdin", "--dry-run=client", "-o", "yaml")
	if err != nil {
		return err
	}
	if err := k.apply(cm); err != nil {
		return err
	}
	// The DaemonSet's service account and its Role (the uninstall's watch).
	raw, err = os.ReadFile(filepath.Join(cfg.root, "conf", "rbac.yaml"))
	if err != nil {
		return err
	}
	if err := k.apply(string(raw)); err != nil {
		return err
	}
	raw, err = os.ReadFile(filepath.Join(cfg.root, "conf", "daemonset.yaml"))
	if err != nil {
		return err
	}
	ds, err := daemonSet(string(raw), cfg.ctscrubImage)
	if err != nil {
		return err
	}
	existed := false
	if _, err := k.kubectl(time.Minute, "-n", "kube-system", "get", "ds", "ctscrub"); err == nil {
		existed = true
	}
	if err := k.apply(ds); err != nil {
		return err
	}
	if existed {
		// A new config needs a new scrubd.
		if _, err := k.kubectl(time.Minute, "-n", "kube-system", "rollout", "restart", "ds/ctscrub"); err != nil {
			return err
		}
	}
	if _, err := k.kubectl(6*time.Minute, "-n", "kube-system", "rollout", "status", "ds/ctscrub", "--timeout=5m"); err != nil {
		return err
	}
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(time.Second) {
		b, err := os.ReadFile(k.nodeFile(conflist))
		if err == nil && strings.Contains(string(b), `"ctscrub"`) {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s on %s does not chain ctscrub a minute after the rollout: %s", conflist, k.worker, b)
		}
	}
	log.Printf("ctscrub installed, expiry mode %s", mode)
	return nil
}

// removeLeftSandboxes removes the worker's pod sandboxes that are no longer
// ready (an earlier variant's pods whose sandbox the kubelet has not
// garbage-collected yet, failed RunPodSandbox calls among them) before
// ctscrub comes: the runtime's CNI DEL of such a sandbox would otherwise
// reach ctscrub, which never indexed it, and scrubd would rightly stop
// trusting every released address (docs/daemon.md, "Ownership"), turning
// the next variant's scrubs into sweeps. Seen on 2026-12-02: cilium_only
// before ctscrub_delegate, 2 failed sandboxes, 17 of 20 creates answered
// incomplete. A node that ran pods before ctscrub came has the same, once.
// Part of WARMUP=1: an operator's node keeps its dead sandboxes.
//
// The kubelet's own garbage collection races with it: a sandbox listed may
// be gone by the time it is removed. Gone is what was wanted, so crictl's
// NotFound is not a failure (it aborted a run here before).
func removeLeftSandboxes(k *kube) error {
	out, err := run(k.ctx, time.Minute, "", "docker", "exec", k.worker, "crictl", "pods", "-q", "--state", "NotReady")
	if err != nil {
		return fmt.Errorf("list the worker's sandboxes: %w", err)
	}
	ids := strings.Fields(out)
	removed, vanished := 0, 0
	for _, id := range ids {
		_, err := run(k.ctx, time.Minute, "", "docker", "exec", k.worker, "crictl", "rmp", "-f", id)
		switch {
		case err == nil:
			removed++
		case sandboxNotFound(err):
			vanished++
		default:
			return fmt.Errorf("remove sandbox %s: %w", id, err)
		}
	}
	if len(ids) > 0 {
		log.Printf("removed %d sandboxes no longer ready before installing ctscrub (%d more were gone before their turn)", removed, vanished)
	}
	return nil
}

// sandboxNotFound: crictl rmp failed because the sandbox no longer exists
// (the runtime's gRPC NotFound, as crictl prints it: "... code = NotFound
// desc = ... not found", or "... does not exist").
func sandboxNotFound(err error) bool {
	m := strings.ToLower(err.Error())
	if strings.Contains(m, "code = notfound") {
		return true
	}
	// Not crictl or docker missing, nor the worker's container gone.
	if strings.Contains(m, "executable file not found") || strings.Contains(m, "no such container") {
		return false
	}
	return strings.Contains(m, "sandbox") && (strings.Contains(m, "not found") || strings.Contains(m, "does not exist"))
}

// uninstallCtscrub removes ctscrub as docs/plugin.md says, in the order that
// keeps pods starting: the DaemonSet (and with it the sidecar that puts the
// entry back), then the entry in the conflist.
func uninstallCtscrub(k *kube) error {
	if _, err := k.kubectl(time.Minute, "-n", "kube-system", "get", "ds", "ctscrub"); err != nil {
		return nil // not installed
	}
	if _, err := k.kubectl(3*time.Minute, "-n", "kube-system", "delete", "ds", "ctscrub", "--wait=true", "--timeout=2m"); err != nil {
		return err
	}
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(time.Second) {
		out, _ := k.kubectl(time.Minute, "-n", "kube-system", "get", "pods", "-l", scrubdSel, "-o", "name")
		if strings.TrimSpace(out) == "" {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("ctscrub pods still there 2 min after deleting the DaemonSet: %s", out)
		}
	}
	if _, err := run(k.ctx, time.Minute, "", "docker", "exec", k.worker, "/opt/cni/bin/ctscrub", "uninstall", "--conf-dir", "/etc/cni/net.d"); err != nil {
		return err
	}
	b, err := os.ReadFile(k.nodeFile(conflist))
	if err != nil {
		return err
	}
	if strings.Contains(string(b), `"ctscrub"`) {
		return fmt.Errorf("%s still chains ctscrub after ctscrub uninstall: %s", conflist, b)
	}
	log.Printf("ctscrub uninstalled: %s is Cilium's own again", conflist)
	return nil
}

// waitFirstSweep waits until the new scrubd's first expiry pass swept every
// CT map present (ctscrub_expiry_passes_total{result="swept"}).
func waitFirstSweep(k *kube, maps *ctmap.Maps) error {
	want := 0
	for _, kind := range ctmap.Kinds {
		if maps.Map(kind) != nil {
			want++
		}
	}
	start := time.Now()
	for deadline := start.Add(5 * time.Minute); ; time.Sleep(time.Second) {
		text, err := k.scrubdMetrics()
		swept := 0
		if err == nil {
			for _, l := range strings.Split(text, "\n") {
				if strings.HasPrefix(l, "ctscrub_expiry_passes_total{") && strings.Contains(l, `result="swept"`) && !strings.HasSuffix(l, " 0") {
					swept++
				}
			}
		}
		if swept >= want {
			log.Printf("scrubd's first expiry pass swept %d maps (%.1fs after the rollout)", swept, time.Since(start).Seconds())
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("scrubd's expiry pass swept %d of %d maps within 5 min (metrics: %v)", swept, want, err)
		}
	}
}

// usesCtscrub reports whether ctscrub is installed during the variant.
func usesCtscrub(variant string) bool {
	return variant != "cilium_only" && variant != "cilium_gc60" && variant != "cilium_coalesced"
}

func presentKinds(maps *ctmap.Maps) int {
	n := 0
	for _, kind := range ctmap.Kinds {
		if maps.Map(kind) != nil {
			n++
		}
	}
	return n
}

// podIPs lists the addresses of the pods labelled ctscrub-bench=prefix.
func podIPs(k *kube, prefix string) ([]netip.Addr, error) {
	out, err := k.kubectl(time.Minute, "-n", benchNS, "get", "pods", "-l", "ctscrub-bench="+prefix, "-o", "jsonpath={.items[*].status.podIP}")
	if err != nil {
		return nil, err
	}
	var ips []netip.Addr
	for _, f := range strings.Fields(out) {
		if a, err := netip.ParseAddr(f); err == nil {
			ips = append(ips, a)
		}
	}
	return ips, nil
}

// warmUp gives every free address of the worker's pod range a pod once,
// all at once (the range is sized for it: run.sh's NODE_CIDR_MASK), then
// deletes them: each address is scrubbed at the pod's ADD (a sweep: the new
// scrubd vouches for none yet) and at its DEL through ctscrub, which then
// vouches for it, as it would on a node where it has run a while. Returns
// the addresses the pods got and how many were free.
func warmUp(k *kube, cfg config) (map[netip.Addr]bool, int, error) {
	agent, err := podOn(k, "kube-system", agentSel)
	if err != nil {
		return nil, 0, err
	}
	free, err := freeAddrs(k, agent)
	if err != nil {
		return nil, 0, err
	}
	if len(free) < cfg.pods {
		return nil, 0, fmt.Errorf("the worker's pod range has %d free addresses, fewer than PODS=%d: give it more (NODE_CIDR_MASK)", len(free), cfg.pods)
	}
	log.Printf("warm-up: %d pods for the %d free addresses of the worker's range", len(free), len(free))
	if err := k.apply(benchPods(benchNS, "warm", cfg.worker, cfg.podImage, len(free))); err != nil {
		return nil, 0, err
	}
	took, notReady := waitPods(k, "warm", len(free), cfg.podTimeout)
	ips, err := podIPs(k, "warm")
	if err != nil {
		return nil, 0, err
	}
	warm := map[netip.Addr]bool{}
	for _, ip := range ips {
		warm[ip] = true
	}
	if _, err := k.kubectl(2*time.Minute, "-n", benchNS, "delete", "pods", "-l", "ctscrub-bench=warm", "--wait=false"); err != nil {
		return nil, 0, err
	}
	if !waitGone(k, "warm", cfg.podTimeout) {
		return nil, 0, fmt.Errorf("warm-up pods still present after %s", cfg.podTimeout)
	}
	// Their CNI DELs (ctscrub's, which lets the addresses go, then
	// Cilium's, which frees them in its IPAM) may end after the API
	// objects are gone: wait until the IPAM has them back.
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(2 * time.Second) {
		now, err := freeAddrs(k, agent)
		if err == nil && len(now) >= len(free) {
			break
		}
		if time.Now().After(deadline) {
			return nil, 0, fmt.Errorf("2 min after the warm-up pods went, the worker's IPAM has %d addresses free, had %d (%v)", len(now), len(free), err)
		}
	}
	log.Printf("warm-up: %d of %d pods ran (%.0fs), %d addresses covered", len(free)-notReady, len(free), took.Seconds(), len(warm))
	return warm, len(free), nil
}

// scrubCounts is scrubd's scrubs during the variant, by "reason/method"
// (ctscrub_scrub_duration_seconds_count of the Cilium backend: a CNI's and
// a delegate request's alike; method index or sweep).
func scrubCounts(before, after string) map[string]float64 {
	const name = "ctscrub_scrub_duration_seconds_count"
	return deltaBy(promSamples(before, name), promSamples(after, name), func(l map[string]string) string {
		if l["backend"] != "cilium" {
			return ""
		}
		return l["reason"] + "/" + l["method"]
	})
}

// delegateAnswers is scrubd's delegate requests during the variant, by
// "event/outcome".
func delegateAnswers(before, after string) map[string]float64 {
	const name = "ctscrub_delegate_requests_total"
	return deltaBy(promSamples(before, name), promSamples(after, name), func(l map[string]string) string {
		return l["event"] + "/" + l["outcome"]
	})
}

// delegateWithin is scrubd's delegate requests during the variant by
// "event le=<bound>", for the bounds 0.01, 0.1 and +Inf of its histogram.
func delegateWithin(before, after string) map[string]float64 {
	const name = "ctscrub_delegate_request_duration_seconds_bucket"
	return deltaBy(promSamples(before, name), promSamples(after, name), func(l map[string]string) string {
		switch l["le"] {
		case "0.01", "0.1", "+Inf":
			return l["event"] + " le=" + l["le"]
		}
		return ""
	})
}

// deltaBy sums after - before per key (samples keyed "" are left out;
// zero deltas too).
func deltaBy(before, after []promSample, key func(map[string]string) string) map[string]float64 {
	out := map[string]float64{}
	for _, s := range after {
		if k := key(s.labels); k != "" {
			out[k] += s.value
		}
	}
	for _, s := range before {
		if k := key(s.labels); k != "" {
			out[k] -= s.value
		}
	}
	for k, v := range out {
		if v == 0 {
			delete(out, k)
		}
	}
	return out
}

// fillWant is the fewest entries the maps may hold after the fill: 98 % of
// ENTRIES (a few real ones may come and go); with Cilium's GC at 60 s,
// which may run during the fill and delete the expired share as it is
// written, 98 % of the live part.
func fillWant(variant string, entries int, f *filler) int64 {
	if variant == "cilium_gc60" {
		return int64(entries-f.expiredEntries()) * 98 / 100
	}
	return int64(entries) * 98 / 100
}
