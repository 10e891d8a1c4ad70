package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/ctscrub/ctscrub/bench/internal/ctfill"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/expiry"
)

// runVariant refills the table, sets ctscrub up as the variant needs, then
// creates PODS pods at once, waits until they run, deletes them at once,
// waits until they are gone, and reads what Cilium and containerd logged.
// It returns the variant's figures and the table's size when the pods
// started.
func runVariant(ctx context.Context, cfg config, k *kube, maps *ctmap.Maps, f *filler, clock expiry.Clock, name string) (*variantResult, int64, error) {
	log.Printf("== %s", name)
	if name == "cilium_only" {
		// ctscrub goes before the fill: a scrubd still running (the previous
		// variant's, expiry on) would sweep the expired share as it is written.
		if err := uninstallCtscrub(k); err != nil {
			return nil, 0, err
		}
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
	if n < int64(cfg.entries)*98/100 {
		return nil, 0, fmt.Errorf("after the fill the maps hold %d entries, want about %d (LRU eviction? size the maps with CT_MAX)", n, cfg.entries)
	}

	switch name {
	case "ctscrub_no_expiry":
		err = installCtscrub(k, cfg, "off")
	case "ctscrub":
		// scrubd (re)starts with the sweep on: its first pass runs at once.
		if err = installCtscrub(k, cfg, "sweep"); err == nil {
			err = waitFirstSweep(k, maps)
		}
	case "cilium_only":
		// uninstalled before the fill
	}
	if err != nil {
		return nil, 0, err
	}

	v := &variantResult{}
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
	v.AllReadyS = ready.Seconds()
	v.FailedPods = notReady
	log.Printf("%d/%d pods running after %.1fs", cfg.pods-notReady, cfg.pods, ready.Seconds())

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
