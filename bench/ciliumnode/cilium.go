package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"log"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// ciliumSetup is how Cilium runs during a variant: which agent image, its
// CT GC interval, and whether it asks ctscrub's delegate socket first.
type ciliumSetup struct {
	Image      string
	GCInterval string
	Delegate   bool
}

// delegateSocket is where conf/scrubd.yaml puts the delegate socket
// (delegate_socket), in a host directory of its own.
const delegateSocket = "/run/ctscrub-delegate/delegate.sock"

// values is the Helm values a setup adds to run.sh's (CILIUM_VALUES): the
// agent image, the GC interval and, for the delegate, the flag and the
// socket's directory as docs/delegate-api.md tells users to set them.
func (s ciliumSetup) values() string {
	var b strings.Builder
	fmt.Fprintf(&b, "image: {override: %q}\nconntrackGCInterval: %q\n", s.Image, s.GCInterval)
	if s.Delegate {
		dir := filepath.Dir(delegateSocket)
		fmt.Fprintf(&b, `extraArgs: ["--conntrack-scrub-delegate=%s"]
extraHostPathMounts:
  - name: ctscrub-delegate
    mountPath: %[2]s
    hostPath: %[2]s
    hostPathType: DirectoryOrCreate
    readOnly: false
    mountPropagation: HostToContainer
`, delegateSocket, dir)
	}
	return b.String()
}

// setupFor is the Cilium a variant runs with: stock Cilium with run.sh's
// GC interval (CT_GC_INTERVAL, 12h: drifted, as in the incident) for the
// first three; the one-line fix users apply instead of ctscrub
// (conntrackGCInterval 60s) for cilium_gc60; the agent with the coalesce
// series, otherwise as cilium_only, for cilium_coalesced; the patched agent
// with the delegate flag for ctscrub_delegate.
func setupFor(cfg config, variant string) ciliumSetup {
	s := ciliumSetup{Image: cfg.ciliumImage, GCInterval: cfg.gcInterval}
	switch variant {
	case "cilium_gc60":
		s.GCInterval = "60s"
	case "cilium_coalesced":
		s.Image = cfg.coalescedImage
	case "ctscrub_delegate", "ctscrub_delegate_restart", "ctscrub_delegate_upgrade":
		s.Image, s.Delegate = cfg.delegateImage, true
	}
	return s
}

// upgradeCilium re-runs Helm with run.sh's values and the setup's, waits
// for the agents to roll, and reopens the worker's CT maps (the agent
// keeps its pinned maps across a restart when their sizes stay, but a
// handle to a map it replaced would fill a map nobody reads).
func upgradeCilium(k *kube, cfg config, s ciliumSetup, maps **ctmap.Maps) error {
	log.Printf("upgrading Cilium: image %s, conntrackGCInterval %s, delegate %v", s.Image, s.GCInterval, s.Delegate)
	f, err := os.CreateTemp("", "ctscrub-bench-cilium-*.yaml")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	if _, err := f.WriteString(s.values()); err != nil {
		f.Close()
		return err
	}
	f.Close()
	began := time.Now().Add(-2 * time.Second) // API server timestamps are whole seconds
	if _, err := run(k.ctx, 5*time.Minute, "", "helm", "upgrade", "cilium", cfg.ciliumChart, "--namespace", "kube-system",
		"-f", cfg.ciliumValues, "-f", f.Name(), "--wait=false"); err != nil {
		return err
	}
	if _, err := k.kubectl(11*time.Minute, "-n", "kube-system", "rollout", "status", "ds/cilium", "--timeout=10m"); err != nil {
		return err
	}
	if _, err := k.kubectl(6*time.Minute, "wait", "--for=condition=Ready", "node", "--all", "--timeout=5m"); err != nil {
		return err
	}
	// The worker's agent must be a new one, on the setup's image: the
	// agent reads its ConfigMap only at start (run.sh sets
	// rollOutCiliumPods so that a ConfigMap change rolls it).
	agent, err := podOn(k, "kube-system", agentSel)
	if err != nil {
		return err
	}
	out, err := k.kubectl(time.Minute, "-n", "kube-system", "get", "pod", agent, "-o",
		`jsonpath={.metadata.creationTimestamp} {.spec.containers[?(@.name=="cilium-agent")].image}`)
	if err != nil {
		return err
	}
	f2 := append(strings.Fields(out), "", "")
	created, err := time.Parse(time.RFC3339, f2[0])
	if err != nil || created.Before(began) || f2[1] != s.Image {
		return fmt.Errorf("after the upgrade the worker's agent %s is %q, want one created after %s running %s", agent, out, began.UTC().Format(time.RFC3339), s.Image)
	}
	// The agent answers on its metrics port once its cells started.
	for deadline := time.Now().Add(3 * time.Minute); ; time.Sleep(2 * time.Second) {
		if _, err := k.nodeHTTP("http://127.0.0.1:9962/metrics"); err == nil {
			break
		} else if time.Now().After(deadline) {
			return fmt.Errorf("the upgraded agent's metrics: %w", err)
		}
	}
	m, err := ctmap.Open(k.nodeFile(ctRoot))
	if err != nil {
		return fmt.Errorf("the worker's CT maps after the upgrade: %w", err)
	}
	(*maps).Close()
	*maps = m
	return nil
}

// promSum sums the samples of metric name (Prometheus text format) whose
// labels pass keep (nil: all).
func promSum(text, name string, keep func(labels map[string]string) bool) float64 {
	sum := 0.0
	for _, s := range promSamples(text, name) {
		if keep == nil || keep(s.labels) {
			sum += s.value
		}
	}
	return sum
}

type promSample struct {
	labels map[string]string
	value  float64
}

// promSamples parses the samples of one metric: `name{a="x",b="y"} 1.5`
// or `name 1.5`. Label values are Go-quoted (the text format escapes \, "
// and newline as Go does).
func promSamples(text, name string) []promSample {
	var out []promSample
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		l := sc.Text()
		rest, ok := strings.CutPrefix(l, name)
		if !ok || rest == "" || (rest[0] != '{' && rest[0] != ' ') {
			continue
		}
		labels := map[string]string{}
		if rest[0] == '{' {
			end := strings.LastIndexByte(rest, '}')
			if end < 0 {
				continue
			}
			body := rest[1:end]
			rest = rest[end+1:]
			for body != "" {
				eq := strings.IndexByte(body, '=')
				if eq < 0 || eq+1 >= len(body) || body[eq+1] != '"' {
					break
				}
				key := strings.TrimSpace(body[:eq])
				val, err := strconv.QuotedPrefix(body[eq+1:])
				if err != nil {
					break
				}
				labels[key], _ = strconv.Unquote(val)
				body = strings.TrimPrefix(body[eq+1+len(val):], ",")
			}
		}
		f := strings.Fields(rest)
		if len(f) == 0 {
			continue
		}
		v, err := strconv.ParseFloat(f[0], 64)
		if err != nil {
			continue
		}
		out = append(out, promSample{labels, v})
	}
	return out
}

// agentCounters are the agent's counters a variant reports as deltas.
type agentCounters struct {
	gcRuns    float64            // cilium_datapath_conntrack_gc_runs_total: walks of a map, periodic or per endpoint
	delegated float64            // walks the delegate made unnecessary (patched agent)
	fallbacks map[string]float64 // "event/cause": walks after asking the delegate
	// The coalesce series' agent: endpoint scrubs answered, the walks that
	// did them, the scrubs not answered yet.
	scrubRequests, scrubWalks, scrubPending float64
}

func readAgentCounters(k *kube) (agentCounters, error) {
	text, err := k.nodeHTTP("http://127.0.0.1:9962/metrics")
	if err != nil {
		return agentCounters{}, fmt.Errorf("Cilium's metrics (prometheus.enabled=true, port 9962): %w", err)
	}
	return parseAgentCounters(text), nil
}

func parseAgentCounters(text string) agentCounters {
	c := agentCounters{fallbacks: map[string]float64{}}
	c.gcRuns = promSum(text, "cilium_datapath_conntrack_gc_runs_total", nil)
	c.scrubRequests = promSum(text, "cilium_datapath_conntrack_scrub_requests_total", nil)
	c.scrubWalks = promSum(text, "cilium_datapath_conntrack_scrub_walks_total", nil)
	c.scrubPending = promSum(text, "cilium_datapath_conntrack_scrub_pending_requests", nil)
	// The delegate's names since issue 38 (beside the CT GC's), and before.
	for _, prefix := range []string{"cilium_datapath_conntrack_scrub_delegate_", "cilium_conntrack_scrub_delegate_"} {
		c.delegated += promSum(text, prefix+"delegated_total", nil)
		for _, s := range promSamples(text, prefix+"fallbacks_total") {
			c.fallbacks[s.labels["event"]+"/"+s.labels["cause"]] += s.value
		}
	}
	return c
}

// waitGCRuns waits until Cilium's own CT GC has completed two runs over
// every map after `before` was read: the first may have started before
// the fill ended, the second started after it. (The counter also counts
// the per-endpoint scrub walks; no endpoint comes or goes meanwhile.)
func waitGCRuns(k *kube, before agentCounters, maps int, timeout time.Duration) (time.Duration, error) {
	start := time.Now()
	for {
		c, err := readAgentCounters(k)
		if err == nil && c.gcRuns-before.gcRuns >= float64(2*maps) {
			return time.Since(start), nil
		}
		if time.Since(start) > timeout {
			return time.Since(start), fmt.Errorf("Cilium's CT GC did not complete two runs within %s (cilium_datapath_conntrack_gc_runs_total +%.0f, want +%d; %v)", timeout, c.gcRuns-before.gcRuns, 2*maps, err)
		}
		time.Sleep(2 * time.Second)
	}
}

// waitScrubsAnswered waits until the agent (the coalesce series) has
// answered every endpoint scrub asked (its
// cilium_datapath_conntrack_scrub_pending_requests is 0): a deleted
// endpoint's scrub is queued, not waited for, so its walk may still run
// when the pod is gone. Returns the time waited.
func waitScrubsAnswered(k *kube, timeout time.Duration) (time.Duration, error) {
	start := time.Now()
	for {
		c, err := readAgentCounters(k)
		if err == nil && c.scrubPending == 0 {
			return time.Since(start), nil
		}
		if time.Since(start) > timeout {
			return time.Since(start), fmt.Errorf("the agent still had %.0f endpoint scrubs pending %s after the pods were gone (%v)", c.scrubPending, timeout, err)
		}
		time.Sleep(time.Second)
	}
}

// freeAddrs is the worker's pod range (its CiliumNode's, cluster-pool IPAM)
// less the addresses the agent's IPAM has given out (cilium-dbg status:
// pods, the router's cilium_host address, the health endpoint), less the
// range's first and last (the allocator never hands them out).
func freeAddrs(k *kube, agent string) ([]netip.Addr, error) {
	cidr, err := k.kubectl(time.Minute, "get", "ciliumnode", k.worker, "-o", "jsonpath={.spec.ipam.podCIDRs[0]}")
	if err != nil {
		return nil, err
	}
	st, err := k.kubectl(time.Minute, "-n", "kube-system", "exec", agent, "-c", "cilium-agent", "--", "cilium-dbg", "status", "-o", "json")
	if err != nil {
		return nil, err
	}
	return freeIn(strings.TrimSpace(cidr), st)
}

// freeIn is freeAddrs' computation from the CIDR and cilium-dbg's status JSON.
func freeIn(cidr, statusJSON string) ([]netip.Addr, error) {
	p, err := netip.ParsePrefix(cidr)
	if err != nil || !p.Addr().Is4() {
		return nil, fmt.Errorf("the worker's pod range %q: want an IPv4 CIDR (cluster-pool IPAM: CiliumNode .spec.ipam.podCIDRs)", cidr)
	}
	var st struct {
		IPAM struct {
			Allocations map[string]string `json:"allocations"`
			IPv4        []string          `json:"ipv4"`
		} `json:"ipam"`
	}
	if err := json.Unmarshal([]byte(statusJSON), &st); err != nil {
		return nil, fmt.Errorf("cilium-dbg status -o json: %w", err)
	}
	used := map[netip.Addr]bool{}
	for s := range st.IPAM.Allocations {
		if a, err := netip.ParseAddr(s); err == nil {
			used[a] = true
		}
	}
	for _, s := range st.IPAM.IPv4 {
		if a, err := netip.ParseAddr(s); err == nil {
			used[a] = true
		}
	}
	if len(used) == 0 {
		return nil, fmt.Errorf("cilium-dbg status -o json lists no allocated address (ipam.allocations, ipam.ipv4): the router's at least should be there")
	}
	p = p.Masked()
	first := p.Addr()
	var out []netip.Addr
	for a := first.Next(); p.Contains(a); a = a.Next() {
		if !p.Contains(a.Next()) { // the last: broadcast
			break
		}
		if !used[a] {
			out = append(out, a)
		}
	}
	return out, nil
}
