package kind

import (
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// The day-2 steps of TestKindDay2. Each makes its change, marks its fault
// window (d.fault) and returns when the worker's Cilium and scrubd run
// again, with what it saw for the step's JSON object.

// nodeRestart stops and starts the worker's kind container. Its tmpfs /run
// (scrubd's state file and snapshot, Cilium's state) and its bpffs mount
// (every pinned map) go with it; the kubelet re-creates every pod's sandbox.
// scrubd must start from nothing and sweep what it did not index: a DEL of a
// sandbox of before the restart must not be answered from the index.
func (d *day2) nodeRestart(c *cluster) map[string]any {
	t := c.t
	sandboxes := map[string]bool{}
	for _, id := range strings.Fields(c.must(time.Minute, "docker", "exec", d.node, "crictl", "pods", "-q", "--no-trunc")) {
		sandboxes[id] = true
	}
	from := time.Now()
	t.Logf("node_restart: docker stop %s (%d pod sandboxes)", d.node, len(sandboxes))
	c.must(3*time.Minute, "docker", "stop", d.node)
	c.must(2*time.Minute, "docker", "start", d.node)
	down := time.Since(from)
	d.waitRestarted(c, from, "k8s-app=cilium", "cilium-agent")
	d.waitRestarted(c, from, "app.kubernetes.io/name=ctscrub", "scrubd")
	c.must(5*time.Minute, "kubectl", "wait", "--for=condition=Ready", "node", d.node, "--timeout=5m")
	to := time.Now()
	d.fault(from, to)
	t.Logf("node_restart: the node was down %s; Cilium and scrubd back %s after the stop", down.Round(time.Second), to.Sub(from).Round(time.Second))

	// The live pods deleted and made again, as after a reboot: the kubelet
	// tears their sandboxes of before the restart down with them (CNI DEL).
	for _, h := range d.holds {
		h.close()
	}
	d.holds = nil
	c.must(4*time.Minute, "kubectl", "-n", d.ns, "delete", "pod", "-l", "role=live", "--wait=true", "--timeout=3m")
	c.kubectl("apply", "-f", d.liveYAML)
	c.must(5*time.Minute, "kubectl", "-n", d.ns, "wait", "--for=condition=Ready", "pod", "-l", "role=live", "--timeout=5m")

	// What scrubd made of its state at start, and its scrubs of the old
	// sandboxes' DELs.
	pod := c.podOn("kube-system", "app.kubernetes.io/name=ctscrub", d.node)
	var start []string
	var oldDels, fromIndex int
	methods := map[string]int{}
	// The DELs of the old sandboxes may come after scrubd is up: give them
	// a minute.
	deadline := time.Now().Add(time.Minute)
	for {
		log, _ := c.run(time.Minute, "kubectl", "-n", "kube-system", "logs", pod, "-c", "scrubd")
		start, oldDels, fromIndex = nil, 0, 0
		methods = map[string]int{}
		passDone := false
		for _, l := range strings.Split(log, "\n") {
			var s scrubLine
			if json.Unmarshal([]byte(l), &s) != nil {
				continue
			}
			if stateMsg(s.Msg) {
				start = append(start, s.Msg)
			}
			passDone = passDone || s.Msg == "bootstrap pass done"
			if s.Msg == "scrub" && sandboxes[s.ContainerID] && !s.DryRun {
				oldDels++
				methods[s.Method]++
				if s.Method == "index" && s.Result == "complete" {
					fromIndex++
					// After the pass an address it vouched for holds every
					// entry the old sandbox left (owner.DelGone); before
					// it, nothing can.
					if !passDone {
						t.Errorf("node_restart: scrubd answered the %s scrub of %v (sandbox %s, of before the restart) from its index as complete before its bootstrap pass ended: it cannot have indexed it", s.Reason, s.IPs, s.ContainerID)
					}
				}
			}
		}
		if oldDels > 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(5 * time.Second)
	}
	t.Logf("node_restart: scrubd's state messages at start: %q; scrubs of old sandboxes %d by method %v", start, oldDels, methods)
	// The live pods made again after the restart: their ADDs came after
	// the bootstrap pass, which vouched for the node's free addresses.
	log, _ := c.run(time.Minute, "kubectl", "-n", "kube-system", "logs", pod, "-c", "scrubd")
	pc := countAfterPass(log)
	pc.check(t, "node_restart")
	t.Logf("node_restart: after the bootstrap pass %d ADDs (%d swept), %d creates (%d swept)", pc.Adds, pc.AddsSwept, pc.Creates, pc.CreatesSwept)
	out := map[string]any{
		"node_down_s":                   int(down.Seconds()),
		"recovered_s":                   int(to.Sub(from).Seconds()),
		"scrubd_state_at_start":         start,
		"old_sandbox_scrubs":            methods,
		"old_sandbox_scrubs_from_index": fromIndex,
	}
	maps.Copy(out, pc.json())
	return out
}

// stateMsg: a scrubd log message about what it restored at start (state
// file, journal, index snapshot).
func stateMsg(msg string) bool {
	for _, k := range []string{"snapshot", "restored", "state file", "state journal", "never indexed"} {
		if strings.Contains(msg, k) {
			return true
		}
	}
	return false
}

// waitRestarted waits until the worker's pod with label sel has container
// running since after since, and Ready.
func (d *day2) waitRestarted(c *cluster, since time.Time, sel, container string) {
	eventually(c.t, c.ctx, 8*time.Minute, container+" on "+d.node+" running again after "+since.Format("15:04:05"), func() (bool, string) {
		out, err := c.run(time.Minute, "kubectl", "-n", "kube-system", "get", "pods", "-l", sel, "--field-selector", "spec.nodeName="+d.node,
			"-o", `jsonpath={range .items[*]}{.metadata.name} {.status.containerStatuses[?(@.name=="`+container+`")].state.running.startedAt} {.status.containerStatuses[?(@.name=="`+container+`")].ready}{"\n"}{end}`)
		if err != nil {
			return false, err.Error()
		}
		for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
			f := strings.Fields(l)
			if len(f) != 3 {
				continue
			}
			at, err := time.Parse(time.RFC3339, f[1])
			if err == nil && !at.Before(since.Truncate(time.Second)) && f[2] == "true" {
				return true, ""
			}
		}
		return false, out
	})
}

// helmRevision is the release's current revision.
func (d *day2) helmRevision(c *cluster, release string) int {
	var st struct {
		Version int `json:"version"`
	}
	if err := json.Unmarshal([]byte(c.must(time.Minute, "helm", "status", release, "-n", "kube-system", "-o", "json")), &st); err != nil || st.Version == 0 {
		c.t.Fatalf("helm status %s: %v", release, err)
	}
	return st.Version
}

// scrubdOOM gives scrubd a memory limit below what it uses, so the kernel's
// OOM killer ends it (lastState OOMKilled) and the kubelet restarts it; then
// `helm rollback` takes the limit away again.
func (d *day2) scrubdOOM(c *cluster) map[string]any {
	t := c.t
	ws := d.scrubdMemory(c)
	// The working set counts the BPF maps the container created (the
	// recorder's, after a node restart) and page cache; the next container
	// reuses the pinned maps. Its resident set is what the limit must cut.
	rss := d.scrubdRSS(c)
	limit := envOr("CTSCRUB_DAY2_OOM_LIMIT", "")
	if limit == "" {
		// Half its resident set, at least 4 MiB: enough for the Go
		// runtime to start, not for scrubd to load its programs and seed
		// its index, so the kernel's OOM killer ends it.
		limit = strconv.FormatInt(max(4, rss/2/(1<<20)), 10) + "Mi"
	}
	rev := d.helmRevision(c, "ctscrub")
	from := time.Now()
	t.Logf("scrubd_oom: scrubd's working set %d MiB, resident set %d MiB; helm upgrade --reuse-values resources.scrubd.limits.memory=%s", ws>>20, rss>>20, limit)
	c.must(3*time.Minute, "helm", "upgrade", "ctscrub", filepath.Join(c.root, "conf/chart"), "-n", "kube-system", "--reuse-values",
		"--set", "resources.scrubd.limits.memory="+limit, "--set", "resources.scrubd.requests.memory="+limit)
	// The DaemonSet rolls one node at a time, in no set order: the worker's
	// pod now, so that it is the worker's scrubd the limit meets.
	c.kubectl("-n", "kube-system", "delete", "pod", c.podOn("kube-system", "app.kubernetes.io/name=ctscrub", d.node), "--wait=false")
	var reason, restarts, exit string
	eventually(t, c.ctx, 5*time.Minute, "scrubd on "+d.node+" OOM-killed and restarted by the kubelet", func() (bool, string) {
		out, err := c.run(time.Minute, "kubectl", "-n", "kube-system", "get", "pods", "-l", "app.kubernetes.io/name=ctscrub", "--field-selector", "spec.nodeName="+d.node,
			"-o", `jsonpath={range .items[*]}{.metadata.creationTimestamp} {.status.containerStatuses[?(@.name=="scrubd")].restartCount} {.status.containerStatuses[?(@.name=="scrubd")].lastState.terminated.reason} {.status.containerStatuses[?(@.name=="scrubd")].lastState.terminated.exitCode}{"\n"}{end}`)
		if err != nil {
			return false, err.Error()
		}
		for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
			f := strings.Fields(l)
			if len(f) != 4 {
				continue
			}
			at, err := time.Parse(time.RFC3339, f[0])
			if err != nil || at.Before(from.Truncate(time.Second)) {
				continue // the pod of before the limit
			}
			if f[2] == "OOMKilled" && f[1] != "0" {
				restarts, reason, exit = f[1], f[2], f[3]
				return true, ""
			}
		}
		return false, out
	})
	t.Logf("scrubd_oom: scrubd %s (exit %s), restarted %s times by the kubelet; helm rollback ctscrub %d", reason, exit, restarts, rev)
	c.must(6*time.Minute, "helm", "rollback", "ctscrub", strconv.Itoa(rev), "-n", "kube-system", "--wait", "--timeout=5m")
	c.must(5*time.Minute, "kubectl", "-n", "kube-system", "rollout", "status", "ds/ctscrub", "--timeout=5m")
	to := time.Now()
	d.fault(from, to)
	return map[string]any{
		"memory_limit":        limit,
		"working_set_mib":     ws >> 20,
		"last_state_reason":   reason,
		"exit_code":           exit,
		"restarts_by_kubelet": restarts,
		"fault_s":             int(to.Sub(from).Seconds()),
	}
}

// scrubdMemory is the working set of scrubd's container on the worker, bytes.
func (d *day2) scrubdMemory(c *cluster) int64 {
	out := c.must(time.Minute, "docker", "exec", d.node, "sh", "-c",
		`id=$(crictl ps --name '^scrubd$' --state running -q | head -n 1) && crictl stats -o json "$id"`)
	var st struct {
		Stats []struct {
			Memory struct {
				WorkingSetBytes struct {
					Value string `json:"value"`
				} `json:"workingSetBytes"`
			} `json:"memory"`
		} `json:"stats"`
	}
	if err := json.Unmarshal([]byte(out), &st); err != nil || len(st.Stats) == 0 {
		c.t.Fatalf("crictl stats of scrubd on %s: %v\n%s", d.node, err, out)
	}
	v, err := strconv.ParseInt(st.Stats[0].Memory.WorkingSetBytes.Value, 10, 64)
	if err != nil || v == 0 {
		c.t.Fatalf("scrubd's working set on %s: %q", d.node, st.Stats[0].Memory.WorkingSetBytes.Value)
	}
	return v
}

// ctscrubUpgrade takes ctscrub back to the chart and image of an earlier
// commit (day2.sh builds them: CTSCRUB_PREV_CHART, CTSCRUB_PREV_IMAGE),
// churns on it, and upgrades to this tree's chart and image. What each
// scrubd made of the state and snapshot the other left is in its start log.
func (d *day2) ctscrubUpgrade(c *cluster) map[string]any {
	t := c.t
	prevChart, prevImage, prevRef := os.Getenv("CTSCRUB_PREV_CHART"), os.Getenv("CTSCRUB_PREV_IMAGE"), os.Getenv("CTSCRUB_PREV_REF")
	if prevChart == "" || prevImage == "" {
		t.Skip("no previous ctscrub (CTSCRUB_PREV_CHART, CTSCRUB_PREV_IMAGE: e2e/kind/day2.sh builds them from CTSCRUB_PREV_REF)")
	}
	image := os.Getenv("CTSCRUB_IMAGE")
	if image == "" {
		t.Fatal("CTSCRUB_IMAGE (cluster.sh's variables) not set")
	}
	imageArgs := func(img string) []string {
		return []string{"--set", "image.repository=" + img[:strings.LastIndex(img, ":")], "--set", "image.tag=" + img[strings.LastIndex(img, ":")+1:],
			"--set", "image.pullPolicy=IfNotPresent", "--set", "config.pod_cidrs={" + c.e.podSubnet + "}"}
	}
	startLog := func() []string {
		pod := c.podOn("kube-system", "app.kubernetes.io/name=ctscrub", d.node)
		log, _ := c.run(time.Minute, "kubectl", "-n", "kube-system", "logs", pod, "-c", "scrubd")
		var msgs []string
		for _, l := range strings.Split(log, "\n") {
			var s struct {
				Msg string `json:"msg"`
				Err string `json:"err"`
			}
			if json.Unmarshal([]byte(l), &s) == nil && stateMsg(s.Msg) {
				msgs = append(msgs, strings.TrimSpace(s.Msg+" "+s.Err))
			}
		}
		return msgs
	}

	from := time.Now()
	t.Logf("ctscrub_upgrade: helm upgrade ctscrub to %s's chart and %s", prevRef, prevImage)
	// --force (replace, not patch): the earlier chart has no
	// ServiceAccount, and a patch that drops serviceAccountName leaves the
	// deprecated serviceAccount field the API server filled in, so the
	// DaemonSet keeps naming the account the downgrade deleted and can
	// create no pod (seen here: "serviceaccount ctscrub not found").
	c.must(4*time.Minute, "helm", append([]string{"upgrade", "ctscrub", prevChart, "-n", "kube-system", "--force"}, imageArgs(prevImage)...)...)
	c.must(6*time.Minute, "kubectl", "-n", "kube-system", "rollout", "status", "ds/ctscrub", "--timeout=6m")
	d.waitRestarted(c, from, "app.kubernetes.io/name=ctscrub", "scrubd")
	prevUp := time.Now()
	d.fault(from, prevUp)
	prevStart := startLog()
	// A wave on the earlier version, so that the upgrade meets its state.
	eventually(t, c.ctx, 8*time.Minute, "a churn wave on the earlier ctscrub", func() (bool, string) {
		d.mu.Lock()
		defer d.mu.Unlock()
		for _, w := range d.waves {
			if w.start.After(prevUp) {
				return true, ""
			}
		}
		return false, "none yet"
	})
	from2 := time.Now()
	t.Logf("ctscrub_upgrade: helm upgrade ctscrub to this tree's chart and %s", image)
	c.must(4*time.Minute, "helm", append([]string{"upgrade", "ctscrub", filepath.Join(c.root, "conf/chart"), "-n", "kube-system"}, imageArgs(image)...)...)
	c.must(6*time.Minute, "kubectl", "-n", "kube-system", "rollout", "status", "ds/ctscrub", "--timeout=6m")
	d.waitRestarted(c, from2, "app.kubernetes.io/name=ctscrub", "scrubd")
	to := time.Now()
	d.fault(from2, to)
	newStart := startLog()
	t.Logf("ctscrub_upgrade: the earlier scrubd at start: %q; this tree's at start: %q", prevStart, newStart)
	// A wave after the upgrade: its ADDs come after the new scrubd's
	// bootstrap pass, and must go by the index.
	eventually(t, c.ctx, 8*time.Minute, "a churn wave after the upgrade", func() (bool, string) {
		d.mu.Lock()
		defer d.mu.Unlock()
		for _, w := range d.waves {
			if w.start.After(to) && !w.end.IsZero() {
				return true, ""
			}
		}
		return false, "none yet"
	})
	pod := c.podOn("kube-system", "app.kubernetes.io/name=ctscrub", d.node)
	log, _ := c.run(time.Minute, "kubectl", "-n", "kube-system", "logs", pod, "-c", "scrubd")
	pc := countAfterPass(log)
	pc.check(t, "ctscrub_upgrade")
	t.Logf("ctscrub_upgrade: after the bootstrap pass %d ADDs (%d swept), %d creates (%d swept)", pc.Adds, pc.AddsSwept, pc.Creates, pc.CreatesSwept)
	out := map[string]any{
		"from_ref":             prevRef,
		"from_image":           prevImage,
		"prev_scrubd_at_start": prevStart,
		"new_scrubd_at_start":  newStart,
	}
	maps.Copy(out, pc.json())
	return out
}

// Cilium 1.17.6 (day2.sh: CILIUM_PREV_IMAGE, CILIUM_PREV_OPERATOR_IMAGE,
// CILIUM_PREV_CHART) to the cluster's own (1.18.8) and back.
func (d *day2) ciliumPrev(c *cluster) (chart, agent, operator string) {
	chart, agent, operator = os.Getenv("CILIUM_PREV_CHART"), os.Getenv("CILIUM_PREV_IMAGE"), os.Getenv("CILIUM_PREV_OPERATOR_IMAGE")
	if chart == "" || agent == "" || operator == "" {
		why := os.Getenv("CILIUM_PREV_UNAVAILABLE")
		if why == "" {
			why = "CILIUM_PREV_CHART, CILIUM_PREV_IMAGE, CILIUM_PREV_OPERATOR_IMAGE not set"
		}
		c.t.Skipf("no Cilium %s images: %s", envOr("CILIUM_PREV_VERSION", "1.17.6"), why)
	}
	return chart, agent, operator
}

func (d *day2) helmCilium(c *cluster, chart, agent, operator string) {
	// --reset-then-reuse-values: the new chart's defaults and the
	// release's own values. --reuse-values carries the other chart's
	// defaults too, and 1.17.6's schema refuses 1.18.8's
	// (enableIPv4Masquerade: null).
	args := []string{"upgrade", "cilium", chart, "-n", "kube-system", "--reset-then-reuse-values",
		"--set", "image.override=" + agent, "--set", "operator.image.override=" + operator}
	if oldCiliumCaps(agent) {
		// As cluster.sh installs 1.16: the agent's bpftool (Debian's)
		// wants CAP_BPF and CAP_PERFMON, which these charts leave out.
		// Seen: 1.17.6's agent "could not run bpftool" without them.
		args = append(args, "--set", ciliumAgentCaps)
	}
	c.must(6*time.Minute, "helm", args...)
	c.must(10*time.Minute, "kubectl", "-n", "kube-system", "rollout", "status", "ds/cilium", "--timeout=10m")
	c.must(5*time.Minute, "kubectl", "-n", "kube-system", "rollout", "status", "deploy/cilium-operator", "--timeout=5m")
}

// ciliumAgentCaps is the capability list cluster.sh gives Cilium 1.16's
// agent (TestCiliumAgentCapsMatchClusterSh keeps the two the same).
const ciliumAgentCaps = "securityContext.capabilities.ciliumAgent={CHOWN,KILL,NET_ADMIN,NET_RAW,IPC_LOCK,SYS_MODULE,SYS_ADMIN,SYS_RESOURCE,PERFMON,BPF,DAC_OVERRIDE,FOWNER,SETGID,SETUID}"

// oldCiliumCaps: the agent image (ctscrub-kind/cilium:<version>-...) is
// 1.16 or 1.17, whose charts leave CAP_BPF and CAP_PERFMON out.
func oldCiliumCaps(image string) bool {
	_, tag, _ := strings.Cut(image, ":")
	return strings.HasPrefix(tag, "1.16.") || strings.HasPrefix(tag, "1.17.")
}

// ciliumUpgrade: the cluster's Cilium is first taken to the previous
// version (helm upgrade to its chart and images), a churn wave runs on it,
// then `helm upgrade` to the cluster's version, as an operator upgrades.
func (d *day2) ciliumUpgrade(c *cluster) map[string]any {
	t := c.t
	chart, agent, operator := d.ciliumPrev(c)
	curChart, curAgent, curOperator := os.Getenv("CILIUM_CHART"), os.Getenv("CILIUM_IMAGE"), os.Getenv("CILIUM_OPERATOR_IMAGE")
	from := time.Now()
	t.Logf("cilium_upgrade: Cilium to %s first", agent)
	d.helmCilium(c, chart, agent, operator)
	d.waitRestarted(c, from, "k8s-app=cilium", "cilium-agent")
	prevUp := time.Now()
	d.fault(from, prevUp)
	d.ciliumRev = d.helmRevision(c, "cilium")
	eventually(t, c.ctx, 8*time.Minute, "a churn wave on the previous Cilium", func() (bool, string) {
		d.mu.Lock()
		defer d.mu.Unlock()
		for _, w := range d.waves {
			if w.start.After(prevUp) {
				return true, ""
			}
		}
		return false, "none yet"
	})
	from2 := time.Now()
	t.Logf("cilium_upgrade: helm upgrade Cilium to %s", curAgent)
	d.helmCilium(c, curChart, curAgent, curOperator)
	d.waitRestarted(c, from2, "k8s-app=cilium", "cilium-agent")
	to := time.Now()
	d.fault(from2, to)
	return map[string]any{"from": agent, "to": curAgent, "upgrade_s": int(to.Sub(from2).Seconds())}
}

// ciliumRollback: `helm rollback` to the previous version's revision.
func (d *day2) ciliumRollback(c *cluster) map[string]any {
	d.ciliumPrev(c)
	if d.ciliumRev == 0 {
		c.t.Skip("cilium_upgrade did not run: no revision to roll back to")
	}
	from := time.Now()
	c.must(11*time.Minute, "helm", "rollback", "cilium", strconv.Itoa(d.ciliumRev), "-n", "kube-system", "--wait", "--timeout=10m")
	c.must(10*time.Minute, "kubectl", "-n", "kube-system", "rollout", "status", "ds/cilium", "--timeout=10m")
	d.waitRestarted(c, from, "k8s-app=cilium", "cilium-agent")
	to := time.Now()
	d.fault(from, to)
	return map[string]any{"to_revision": d.ciliumRev, "rollback_s": int(to.Sub(from).Seconds()), "note": fmt.Sprintf("helm rollback cilium %d", d.ciliumRev)}
}

// scrubdRSS is scrubd's resident set on the worker, bytes (VmRSS).
func (d *day2) scrubdRSS(c *cluster) int64 {
	out := strings.TrimSpace(c.must(time.Minute, "docker", "exec", d.node, "sh", "-c",
		`awk '/^VmRSS:/{print $2}' /proc/$(pgrep -x scrubd)/status`))
	kb, err := strconv.ParseInt(out, 10, 64)
	if err != nil || kb == 0 {
		c.t.Fatalf("scrubd's VmRSS on %s: %q", d.node, out)
	}
	return kb << 10
}
