package kind

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestKindDay2: what operators do to a running cluster, with pods churning
// throughout on the worker (`make e2e-kind-day2`, e2e/kind/day2.sh). Steps,
// each a subtest: expiry_sweep (the chart's default expiry mode beside
// Cilium's GC and SNAT mappings: day2_expiry_test.go), node_restart (the worker's kind container stopped and
// started), scrubd_oom (scrubd OOM-killed by a real memory limit and
// restarted by the kubelet), ctscrub_upgrade (ctscrub taken back to the
// chart and image of an earlier commit, then upgraded to this tree's),
// cilium_upgrade and cilium_rollback (Cilium 1.17.6 -> 1.18.8 by Helm, and
// `helm rollback`). After each, from Cilium's own CT dump on the worker:
//   - stale_entries_left: entries of IPs whose pods were deleted (during
//     the step) and not held by a pod now;
//   - inherited_entries: entries a churn pod's IP had before its first
//     packet;
//   - live_entries_lost: established TCP entries between live pods (held
//     connections from the client to the live servers) present before the
//     step and gone after it; where the step re-creates every pod's sandbox
//     and Cilium's maps (node_restart) the live pods whose flows no longer
//     work instead;
//   - failed_pods: churn or live pods that did not become Ready or did not
//     answer, outside the step's fault window (those inside are
//     failed_pods_in_fault, reported, allowed).
//
// Each step's object goes to the results file as {"steps": {name: {...}}};
// day2.sh prints them on its last line.
func TestKindDay2(t *testing.T) {
	e := getKindEnv(t)
	e.skipUnlessCilium(t)
	if os.Getenv("CTSCRUB_KIND_DAY2") != "1" {
		t.Skip("CTSCRUB_KIND_DAY2=1 (make e2e-kind-day2) runs the day-2 steps: they restart the node and replace ctscrub and Cilium")
	}
	c := e.newCluster(t, 110*time.Minute)
	d := newDay2(c)
	d.setUp()
	defer d.stopChurn()

	type step struct {
		name string
		// run makes the change and returns when the cluster has recovered;
		// it marks the fault window with d.fault.
		run func(c *cluster) map[string]any
		// sandboxes: the step re-creates every pod's sandbox (new IPs, new
		// CT maps): live pods are judged by their flows, not their entries.
		sandboxes bool
	}
	steps := []step{
		{name: "expiry_sweep", run: d.expirySweep},
		{name: "node_restart", run: d.nodeRestart, sandboxes: true},
		{name: "scrubd_oom", run: d.scrubdOOM},
		{name: "ctscrub_upgrade", run: d.ctscrubUpgrade},
		{name: "cilium_upgrade", run: d.ciliumUpgrade},
		{name: "cilium_rollback", run: d.ciliumRollback},
	}
	only := os.Getenv("CTSCRUB_DAY2_STEPS") // comma-separated; empty: all
	for _, s := range steps {
		t.Run(s.name, func(t *testing.T) {
			if only != "" && !strings.Contains(","+only+",", ","+s.name+",") {
				d.record(s.name, map[string]any{"skipped": "not in CTSCRUB_DAY2_STEPS=" + only})
				t.Skipf("not in CTSCRUB_DAY2_STEPS=%s", only)
			}
			sc := &cluster{t: t, ctx: c.ctx, root: c.root, env: c.env, e: c.e}
			// What a step needs is checked before the step's own checks
			// read the cluster, so it skips with its reason, not a failure.
			if strings.HasPrefix(s.name, "cilium_") {
				d.ciliumPrev(sc)
			}
			if s.name == "cilium_rollback" && d.ciliumRev == 0 {
				d.record(s.name, map[string]any{"skipped": "cilium_upgrade did not reach the previous version: no revision to roll back to"})
				t.Skip("cilium_upgrade did not reach the previous version: no revision to roll back to")
			}
			d.runStep(sc, s.name, s.run, s.sandboxes)
		})
	}
}

// day2 holds the run's workloads: a client and live servers that stay for
// the whole run, and the background churn.
type day2 struct {
	c      *cluster
	node   string
	ns     string
	holds  []*hold
	mu     sync.Mutex
	waves  []churnWave
	faults []window
	// deleted: IP -> when a pod that held it was deleted (or lost it to a
	// new sandbox).
	deleted map[string]time.Time
	stop    context.CancelFunc
	done    chan struct{}
	results map[string]map[string]any
	// ciliumRev: Cilium's Helm revision on the previous version, for
	// cilium_rollback.
	ciliumRev int
	liveYAML  string
}

type window struct{ from, to time.Time }

// churnWave is one wave of the background churn.
type churnWave struct {
	n          int
	start, end time.Time
	pods       int
	notReady   int      // pods not Ready within the wave's limit
	noAnswer   int      // Ready pods that did not answer TCP and ping
	inherited  int      // entries of the wave's IPs before their first packet
	stale      int      // entries of the wave's IPs 30 s after their DELs
	unchecked  string   // why the CT could not be read (agent down)
	entries    int      // entries of the wave's IPs after the traffic
	ips        []string // the wave's pod IPs
	notes      []string
}

func newDay2(c *cluster) *day2 {
	return &day2{c: c, node: c.e.worker, ns: "ctscrub-day2", deleted: map[string]time.Time{}, results: map[string]map[string]any{}}
}

const (
	day2LiveServers = 2
	day2PerWave     = 4
)

func (d *day2) setUp() {
	c := d.c
	c.kubectl("create", "namespace", d.ns)
	c.t.Cleanup(func() {
		c.run(3*time.Minute, "kubectl", "delete", "namespace", d.ns, "--wait=true", "--timeout=2m")
	})
	// The live pods: bare pods bound to the worker, so a node restart gives
	// them new sandboxes (the kubelet re-creates them) rather than new pods.
	var b strings.Builder
	fmt.Fprintf(&b, `apiVersion: v1
kind: Pod
metadata: {name: client, namespace: %[1]s, labels: {role: live}}
spec:
  nodeName: %[2]s
  terminationGracePeriodSeconds: 1
  containers:
    - {name: client, image: %[3]s, imagePullPolicy: IfNotPresent, command: ["sleep", "36000"]}
---
`, d.ns, d.node, c.e.clientImage)
	for i := range day2LiveServers {
		fmt.Fprintf(&b, `apiVersion: v1
kind: Pod
metadata: {name: live-%[4]d, namespace: %[1]s, labels: {role: live}}
spec:
  nodeName: %[2]s
  terminationGracePeriodSeconds: 1
  containers:
    - {name: server, image: %[3]s, imagePullPolicy: IfNotPresent, args: ["netexec", "--http-port=8080"]}
---
`, d.ns, d.node, c.e.serverImage, i)
	}
	d.liveYAML = writeFile(c.t, c.t.TempDir(), "live.yaml", b.String())
	c.kubectl("apply", "-f", d.liveYAML)
	c.must(5*time.Minute, "kubectl", "-n", d.ns, "wait", "--for=condition=Ready", "pod", "-l", "role=live", "--timeout=5m")
	d.ensureHolds(c)
	ctx, cancel := context.WithCancel(c.ctx)
	d.stop, d.done = cancel, make(chan struct{})
	go d.churn(ctx)
}

func (d *day2) stopChurn() {
	if d.stop != nil {
		d.stop()
		<-d.done
		d.stop = nil
	}
	for _, h := range d.holds {
		h.close()
	}
}

// hold is one TCP connection from the client to a live server, held open
// (agnhost's HTTP server keeps an idle connection): its CT entries live for
// hours, and a request on it says whether the flow still works.
type hold struct {
	pod, ip string
	cmd     *exec.Cmd
	in      io.WriteCloser
	mu      sync.Mutex
	answers int // "HTTP/1.1 200" lines read
	exited  chan struct{}
}

func (h *hold) alive() bool {
	select {
	case <-h.exited:
		return false
	default:
		return true
	}
}

func (h *hold) close() {
	h.in.Close()
	h.cmd.Process.Kill()
	<-h.exited
}

// works sends one HTTP request on the held connection and waits for its answer.
func (h *hold) works() bool {
	if !h.alive() {
		return false
	}
	h.mu.Lock()
	before := h.answers
	h.mu.Unlock()
	if _, err := io.WriteString(h.in, "GET /hostname HTTP/1.1\r\nHost: live\r\n\r\n"); err != nil {
		return false
	}
	for range 20 {
		time.Sleep(500 * time.Millisecond)
		h.mu.Lock()
		n := h.answers
		h.mu.Unlock()
		if n > before {
			return true
		}
	}
	return false
}

// ensureHolds opens a held connection to each live server that has none
// alive (after a node restart the old ones died with the client's sandbox).
func (d *day2) ensureHolds(c *cluster) {
	c.t.Helper()
	var keep []*hold
	for _, h := range d.holds {
		if h.alive() && h.ip == d.podIP(c, h.pod) {
			keep = append(keep, h)
		} else {
			h.close()
		}
	}
	d.holds = keep
	for i := range day2LiveServers {
		pod := fmt.Sprintf("live-%d", i)
		have := false
		for _, h := range d.holds {
			have = have || h.pod == pod
		}
		if have {
			continue
		}
		ip := d.podIP(c, pod)
		cmd := exec.CommandContext(c.ctx, "kubectl", "-n", d.ns, "exec", "-i", "client", "-c", "client", "--", "nc", ip, "8080")
		cmd.Env = append(os.Environ(), c.env...)
		in, err := cmd.StdinPipe()
		if err != nil {
			c.t.Fatal(err)
		}
		out, err := cmd.StdoutPipe()
		if err != nil {
			c.t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			c.t.Fatalf("%s: %v", strings.Join(cmd.Args, " "), err)
		}
		h := &hold{pod: pod, ip: ip, cmd: cmd, in: in, exited: make(chan struct{})}
		go func() {
			sc := bufio.NewScanner(out)
			for sc.Scan() {
				// /hostname's body has no newline: the next answer's
				// status line follows it on the same line.
				if strings.Contains(sc.Text(), "HTTP/1.1 200") {
					h.mu.Lock()
					h.answers++
					h.mu.Unlock()
				}
			}
			cmd.Wait()
			close(h.exited)
		}()
		d.holds = append(d.holds, h)
		if !h.works() {
			c.t.Fatalf("held connection from client to %s (%s:8080) does not answer a request", pod, ip)
		}
	}
}

func (d *day2) podIP(c *cluster, pod string) string {
	c.t.Helper()
	return strings.TrimSpace(c.kubectl("-n", d.ns, "get", "pod", pod, "-o", "jsonpath={.status.podIP}"))
}

// liveIPs maps the live pods' IPs to their names.
func (d *day2) liveIPs(c *cluster) map[string]string {
	c.t.Helper()
	ips := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(c.kubectl("-n", d.ns, "get", "pods", "-l", "role=live",
		"-o", `jsonpath={range .items[*]}{.metadata.name} {.status.podIP}{"\n"}{end}`)), "\n") {
		if f := strings.Fields(l); len(f) == 2 {
			ips[f[1]] = f[0]
		}
	}
	return ips
}

// ctKeyRe is one line of `cilium-dbg bpf ct list global`: the flow (kind,
// direction, addresses and ports) before its expiry and counters.
var (
	ctFlowRe  = regexp.MustCompile(`^(TCP|UDP|ICMP)\S* (IN|OUT|SVC)\S* (\S+):(\d+) -> (\S+):(\d+)`)
	ctFlagsRe = regexp.MustCompile(`(Rx|Tx)FlagsSeen=0x([0-9a-fA-F]+)`)
)

// liveEntries are the established TCP entries between two live pods to a
// server's port 8080 (the held connections), by flow.
func liveEntries(dump string, live map[string]string) map[string]bool {
	out := map[string]bool{}
	for _, l := range strings.Split(dump, "\n") {
		m := ctFlowRe.FindStringSubmatch(strings.TrimSpace(l))
		if m == nil || m[1] != "TCP" {
			continue
		}
		if _, ok := live[m[3]]; !ok {
			continue
		}
		if _, ok := live[m[5]]; !ok {
			continue
		}
		if m[4] != "8080" && m[6] != "8080" {
			continue
		}
		closing := false
		for _, f := range ctFlagsRe.FindAllStringSubmatch(l, -1) {
			v, _ := strconv.ParseUint(f[2], 16, 8)
			closing = closing || v&0x05 != 0 // FIN or RST seen
		}
		if !closing {
			out[m[0]] = true
		}
	}
	return out
}

// dumpQuiet is Cilium's CT dump on node without failing the test: the
// churn runs in its own goroutine and meets the agent down in a fault.
func (d *day2) dumpQuiet(ctx context.Context) (string, error) {
	c := d.c
	pod, err := runCmd(ctx, time.Minute, c.env, c.root, "kubectl", "-n", "kube-system", "get", "pods", "-l", "k8s-app=cilium",
		"--field-selector", "spec.nodeName="+d.node+",status.phase=Running", "-o", "jsonpath={.items[0].metadata.name}")
	if err != nil || strings.TrimSpace(pod) == "" {
		return "", fmt.Errorf("no running Cilium agent on %s: %v", d.node, err)
	}
	return runCmd(ctx, 2*time.Minute, c.env, c.root, "kubectl", "-n", "kube-system", "exec", strings.TrimSpace(pod), "-c", "cilium-agent", "--",
		"cilium-dbg", "bpf", "ct", "list", "global")
}

// churn creates and deletes waves of pods on the worker until ctx ends,
// checking each wave as TestKindChurn does (no entry before the first
// packet, entries after traffic, none 30 s after the DELs). Errors are
// recorded in the wave, not fatal: a step's fault may make them.
func (d *day2) churn(ctx context.Context) {
	defer close(d.done)
	c := d.c
	kc := func(limit time.Duration, args ...string) (string, error) {
		return runCmd(ctx, limit, c.env, c.root, "kubectl", append([]string{"-n", d.ns}, args...)...)
	}
	for n := 0; ctx.Err() == nil; n++ {
		w := churnWave{n: n, start: time.Now(), pods: day2PerWave}
		var b strings.Builder
		for i := range day2PerWave {
			fmt.Fprintf(&b, `apiVersion: v1
kind: Pod
metadata: {name: churn-%[1]d-%[2]d, namespace: %[3]s, labels: {role: churn, wave: "%[1]d"}}
spec:
  nodeName: %[4]s
  terminationGracePeriodSeconds: 1
  containers:
    - {name: server, image: %[5]s, imagePullPolicy: IfNotPresent, args: ["netexec", "--http-port=8080"]}
---
`, n, i, d.ns, d.node, c.e.serverImage)
		}
		f, err := os.CreateTemp("", "day2-wave-*.yaml")
		if err != nil {
			return
		}
		f.WriteString(b.String())
		f.Close()
		_, err = kc(2*time.Minute, "apply", "-f", f.Name())
		os.Remove(f.Name())
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			w.notes = append(w.notes, "apply: "+firstLine([]byte(err.Error())))
			w.notReady = day2PerWave
		} else {
			d.wave(ctx, kc, &w)
		}
		// Whatever happened, the wave's pods go.
		kc(4*time.Minute, "delete", "pod", "-l", fmt.Sprintf("wave=%d", n), "--wait=true", "--timeout=3m", "--ignore-not-found")
		delAt := time.Now()
		d.mu.Lock()
		for _, ip := range w.ips {
			d.deleted[ip] = delAt
		}
		d.mu.Unlock()
		if len(w.ips) > 0 && w.unchecked == "" {
			d.staleOfWave(ctx, &w)
		}
		w.end = time.Now()
		if ctx.Err() != nil && w.unchecked == "" && w.notReady+w.noAnswer > 0 {
			return // cut short by the end of the run: not a result
		}
		d.mu.Lock()
		d.waves = append(d.waves, w)
		d.mu.Unlock()
		d.c.t.Logf("churn wave %d (%s-%s): %d pods, %d not Ready, %d no answer, %d inherited, %d entries after traffic, %d stale; %s %v",
			n, w.start.Format("15:04:05"), w.end.Format("15:04:05"), w.pods, w.notReady, w.noAnswer, w.inherited, w.entries, w.stale, w.unchecked, w.notes)
	}
}

func (d *day2) wave(ctx context.Context, kc func(time.Duration, ...string) (string, error), w *churnWave) {
	sel := fmt.Sprintf("wave=%d", w.n)
	if _, err := kc(4*time.Minute, "wait", "--for=condition=Ready", "pod", "-l", sel, "--timeout=3m"); err != nil {
		w.notes = append(w.notes, "wait Ready: "+firstLine([]byte(err.Error())))
	}
	out, err := kc(time.Minute, "get", "pods", "-l", sel, "-o",
		`jsonpath={range .items[*]}{.metadata.name} {.status.podIP} {.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}`)
	if err != nil {
		w.notReady = w.pods
		w.notes = append(w.notes, "get pods: "+firstLine([]byte(err.Error())))
		return
	}
	ips := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		f := strings.Fields(l)
		if len(f) != 3 || f[2] != "True" {
			w.notReady++
			continue
		}
		ips[f[1]] = f[0]
		w.ips = append(w.ips, f[1])
	}
	w.notReady += w.pods - len(strings.Split(strings.TrimSpace(out), "\n"))
	if len(ips) == 0 {
		return
	}
	dump, err := d.dumpQuiet(ctx)
	if err != nil {
		w.unchecked = "CT dump before traffic: " + firstLine([]byte(err.Error()))
		return
	}
	for ip, k := range countIPs(dump, ips) {
		if k > 0 {
			w.inherited += k
			w.notes = append(w.notes, fmt.Sprintf("%s (%s) inherits %d entries", ips[ip], ip, k))
		}
	}
	var script strings.Builder
	for ip := range ips {
		fmt.Fprintf(&script, `echo "tcp %[1]s $(timeout 5 wget -qO- http://%[1]s:8080/hostname)"; ping -c 1 -W 2 %[1]s >/dev/null && echo "ping %[1]s ok"; `, ip)
	}
	ans, _ := kc(3*time.Minute, "exec", "client", "-c", "client", "--", "sh", "-c", script.String())
	for ip, pod := range ips {
		if !strings.Contains(ans, "tcp "+ip+" "+pod) || !strings.Contains(ans, "ping "+ip+" ok") {
			w.noAnswer++
			w.notes = append(w.notes, fmt.Sprintf("%s (%s) did not answer", pod, ip))
		}
	}
	if dump, err = d.dumpQuiet(ctx); err != nil {
		w.unchecked = "CT dump after traffic: " + firstLine([]byte(err.Error()))
		return
	}
	for _, k := range countIPs(dump, ips) {
		w.entries += k
	}
}

// staleOfWave: 30 s after the DELs, no entry of the wave's IPs unless a pod
// holds the IP again.
func (d *day2) staleOfWave(ctx context.Context, w *churnWave) {
	deadline := time.Now().Add(30 * time.Second)
	for {
		left, err := d.staleOf(ctx, w.ips)
		if err != nil {
			w.unchecked = "CT dump after the DELs: " + firstLine([]byte(err.Error()))
			return
		}
		n := 0
		for _, k := range left {
			n += k
		}
		if n == 0 || time.Now().After(deadline) || ctx.Err() != nil {
			w.stale = n
			for ip, k := range left {
				w.notes = append(w.notes, fmt.Sprintf("%d stale entries of %s", k, ip))
			}
			return
		}
		time.Sleep(3 * time.Second)
	}
}

// staleOf counts the entries of the given IPs in Cilium's dump, leaving out
// IPs a pod of the run holds now.
func (d *day2) staleOf(ctx context.Context, ips []string) (map[string]int, error) {
	c := d.c
	held, err := runCmd(ctx, time.Minute, c.env, c.root, "kubectl", "get", "pods", "-A", "--field-selector", "spec.nodeName="+d.node,
		"-o", `jsonpath={range .items[*]}{.status.podIP}{"\n"}{end}`)
	if err != nil {
		return nil, err
	}
	heldSet := map[string]bool{}
	for _, ip := range strings.Fields(held) {
		heldSet[ip] = true
	}
	want := map[string]string{}
	for _, ip := range ips {
		if !heldSet[ip] {
			want[ip] = ""
		}
	}
	if len(want) == 0 {
		return map[string]int{}, nil
	}
	dump, err := d.dumpQuiet(ctx)
	if err != nil {
		return nil, err
	}
	left := map[string]int{}
	for ip, k := range countIPs(dump, want) {
		if k > 0 {
			left[ip] = k
		}
	}
	return left, nil
}

// fault marks a fault window (the step's own outage: pods started in it may
// fail and are retried by the kubelet).
func (d *day2) fault(from, to time.Time) {
	d.mu.Lock()
	d.faults = append(d.faults, window{from, to})
	d.mu.Unlock()
}

// inFault: the wave overlapped a fault window (with 30 s after it: the
// kubelet's retries of a failed ADD back off).
func (d *day2) inFault(w churnWave) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, f := range d.faults {
		if w.start.Before(f.to.Add(30*time.Second)) && w.end.After(f.from) {
			return true
		}
	}
	return false
}

func (d *day2) record(name string, obj map[string]any) {
	d.results[name] = obj
	result(d.c.t, "steps", d.results)
}

// runStep runs one step with the churn going, waits for two churn waves
// that start after the cluster recovered, and checks.
func (d *day2) runStep(c *cluster, name string, run func(*cluster) map[string]any, sandboxes bool) {
	t := c.t
	obj := map[string]any{}
	defer func() {
		if _, ok := obj["passed"]; !ok {
			obj["passed"] = false
			if t.Skipped() {
				delete(obj, "passed")
			}
		}
		d.record(name, obj)
	}()
	live := d.liveIPs(c)
	dump := c.ctDump(c.podOn("kube-system", "k8s-app=cilium", d.node))
	before := liveEntries(dump, live)
	if len(before) == 0 {
		t.Fatalf("no established entry between live pods in Cilium's dump before the step (held connections %d): the live check could not fail", len(d.holds))
	}
	oldIPs := live
	start := time.Now()
	t.Logf("%s: %d live entries before; live pods %v", name, len(before), live)
	for k, v := range run(c) {
		obj[k] = v
	}
	recovered := time.Now()
	obj["duration_s"] = int(recovered.Sub(start).Seconds())

	// Live pods Ready again (outside the fault window: not failed then).
	failedLive := 0
	if _, err := c.run(4*time.Minute, "kubectl", "-n", d.ns, "wait", "--for=condition=Ready", "pod", "-l", "role=live", "--timeout=3m"); err != nil {
		failedLive++
		t.Errorf("%s: live pods not Ready 3 min after the cluster recovered: %v", name, err)
	}
	// Two churn waves that start after the recovery.
	eventually(t, c.ctx, 10*time.Minute, name+": two churn waves after the recovery", func() (bool, string) {
		d.mu.Lock()
		defer d.mu.Unlock()
		n := 0
		for _, w := range d.waves {
			if w.start.After(recovered) {
				n++
			}
		}
		return n >= 2, fmt.Sprintf("%d waves", n)
	})

	// Live entries: still there, or (new sandboxes) the flows still work.
	nowLive := d.liveIPs(c)
	liveLost := 0
	brokenHolds := 0
	for _, h := range d.holds {
		if !h.works() {
			brokenHolds++
		}
	}
	if sandboxes {
		obj["live_check"] = "flows: every pod's sandbox and Cilium's maps are new after the restart; each live server must answer on a new held connection"
		for ip := range oldIPs {
			if _, ok := nowLive[ip]; !ok {
				d.mu.Lock()
				d.deleted[ip] = recovered
				d.mu.Unlock()
			}
		}
		d.ensureHolds(c)
		for _, h := range d.holds {
			if !h.works() {
				liveLost++
				t.Errorf("%s: live server %s (%s) does not answer on a held connection after the step", name, h.pod, h.ip)
			}
		}
		obj["held_connections_broken"] = brokenHolds // those of before the restart: gone with their sandboxes
	} else {
		obj["live_check"] = "entries: the held connections' established entries present before the step must be there after it"
		after := liveEntries(c.ctDump(c.podOn("kube-system", "k8s-app=cilium", d.node)), nowLive)
		var lost []string
		for k := range before {
			if !after[k] {
				lost = append(lost, k)
			}
		}
		sort.Strings(lost)
		liveLost = len(lost)
		if liveLost > 0 {
			t.Errorf("%s: %d of %d established entries between live pods lost:\n%s", name, liveLost, len(before), strings.Join(lost, "\n"))
		}
		obj["held_connections_broken"] = brokenHolds
		if brokenHolds > 0 {
			t.Errorf("%s: %d of %d held connections no longer answer", name, brokenHolds, len(d.holds))
		}
		d.ensureHolds(c)
	}
	obj["live_entries_before"] = len(before)

	// Stale: every IP deleted since the step began, not held now.
	d.mu.Lock()
	var gone []string
	for ip, at := range d.deleted {
		if at.After(start) {
			gone = append(gone, ip)
		}
	}
	d.mu.Unlock()
	left, err := d.staleOf(c.ctx, gone)
	if err != nil {
		t.Fatalf("%s: stale check: %v", name, err)
	}
	stale := 0
	for ip, k := range left {
		stale += k
		t.Errorf("%s: %d CT entries of %s (its pod deleted during the step) left", name, k, ip)
	}

	// The churn's waves of the step.
	var inherited, failed, failedInFault, waves, unchecked, pods, entries int
	d.mu.Lock()
	ws := append([]churnWave(nil), d.waves...)
	d.mu.Unlock()
	for _, w := range ws {
		if w.start.Before(start) {
			continue
		}
		waves++
		pods += w.pods
		entries += w.entries
		inherited += w.inherited
		stale += w.stale
		if w.unchecked != "" {
			unchecked++
		}
		bad := w.notReady + w.noAnswer
		if d.inFault(w) {
			failedInFault += bad
			continue
		}
		if w.unchecked != "" {
			t.Errorf("%s: churn wave %d (outside the fault window) could not be checked: %s", name, w.n, w.unchecked)
		}
		failed += bad
		if bad > 0 || w.inherited > 0 || w.stale > 0 {
			t.Errorf("%s: churn wave %d (%s-%s): %d not Ready, %d no answer, %d inherited, %d stale: %v", name, w.n,
				w.start.Format("15:04:05"), w.end.Format("15:04:05"), w.notReady, w.noAnswer, w.inherited, w.stale, w.notes)
		}
	}
	if inherited > 0 {
		t.Errorf("%s: %d inherited entries", name, inherited)
	}
	if entries == 0 {
		t.Errorf("%s: no CT entry of any churn pod after its traffic: the stale and inherited checks could not fail", name)
	}
	failed += failedLive
	// scrubd serves Cilium's maps again: a scrubd that runs with
	// nf_conntrack alone deletes nothing of Cilium's, and the checks above
	// would still pass on Cilium's own endpoint-delete walk.
	backends, recorder := d.scrubdServing(c)
	obj["scrubd_backends"] = backends
	obj["scrubd_recorder"] = recorder
	if !slices.Contains(backends, "cilium") || !recorder {
		t.Errorf("%s: scrubd on %s serves backends %v, recorder %v after the step: want the cilium backend and its recorder", name, d.node, backends, recorder)
	}
	obj["stale_entries_left"] = stale
	obj["inherited_entries"] = inherited
	obj["live_entries_lost"] = liveLost
	obj["failed_pods"] = failed
	obj["failed_pods_in_fault"] = failedInFault
	obj["churn_waves"] = waves
	obj["churn_pods"] = pods
	obj["churn_waves_unchecked"] = unchecked
	obj["passed"] = !t.Failed()
}

// scrubdServing is what the worker's scrubd said it serves when it last
// started ("scrubd serving": its backends and whether its recorder runs).
func (d *day2) scrubdServing(c *cluster) ([]string, bool) {
	c.t.Helper()
	pod := c.podOn("kube-system", "app.kubernetes.io/name=ctscrub", d.node)
	var line struct {
		Msg      string   `json:"msg"`
		Backends []string `json:"backends"`
		Recorder bool     `json:"recorder"`
	}
	var backends []string
	var recorder bool
	for _, l := range strings.Split(c.kubectl("-n", "kube-system", "logs", pod, "-c", "scrubd"), "\n") {
		if json.Unmarshal([]byte(l), &line) == nil && line.Msg == "scrubd serving" {
			backends, recorder = line.Backends, line.Recorder
		}
	}
	return backends, recorder
}
