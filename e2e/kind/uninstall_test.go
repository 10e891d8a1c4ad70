package kind

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// TestKindUninstall runs last (it removes ctscrub): the uninstall of
// docs/plugin.md on the live cluster, with no command on the nodes.
//
// First a rolling restart of the DaemonSet: each scrubd stopped by it must
// decide to keep the chain (its log, followed until the pod is gone, says
// "stopping with ctscrub chained"). Then Cilium goes back to its own
// conflist (option 1's step on Cilium's side: cni.customConf=false, agents
// restarted; the cni-conf sidecar chains ctscrub into it again) and the
// chart is uninstalled. Each scrubd, stopped because its DaemonSet was
// deleted, must take ctscrub off its node by itself. Pods started on every
// node right after `helm uninstall` must all become Ready
// (uninstall_pods_started); afterwards every node's conflist chains
// cilium-cni alone and no interface carries the recorder's filters.
//
// With CNI=kindnet there is no Cilium step (cluster.sh wrote the conflist,
// ctscrub's install-cni chained itself into it) and no recorder (the nfct
// backend learns from conntrack events): the conflist must be back to
// bridge, portmap.
func TestKindUninstall(t *testing.T) {
	e := getKindEnv(t)
	if e.uninstallSkipped(t) {
		return
	}
	c := e.newCluster(t, 15*time.Minute)

	// A rolling update keeps the chain.
	logs := c.followScrubdLogs()
	c.must(time.Minute, "kubectl", "-n", "kube-system", "rollout", "restart", "ds/ctscrub")
	c.must(5*time.Minute, "kubectl", "-n", "kube-system", "rollout", "status", "ds/ctscrub", "--timeout=5m")
	for pod, log := range logs(2 * time.Minute) {
		if !strings.Contains(log, `"msg":"stopping with ctscrub chained"`) || strings.Contains(log, "uninstall: taking ctscrub off") {
			t.Errorf("scrubd %s stopped by a rolling restart did not keep the chain; its log's end:\n%s", pod, tail([]byte(log)))
		}
	}

	own := []string{"cilium-cni"} // the conflist without ctscrub
	if e.nfct() {
		own = []string{"bridge", "portmap"}
	}
	chained := strings.Join(append(own[:1:1], append([]string{"ctscrub"}, own[1:]...)...), ",")
	chart := strings.TrimSpace(envOr("CILIUM_CHART", ""))
	args := []string{"upgrade", "cilium", chart, "--namespace", "kube-system", "--reuse-values", "--set", "cni.customConf=false"}
	if repo := envOr("CILIUM_CHART_REPO", ""); repo != "" {
		args = []string{"upgrade", "cilium", "cilium", "--repo", repo, "--version", e.ciliumVersion, "--namespace", "kube-system", "--reuse-values", "--set", "cni.customConf=false"}
	}
	if !e.nfct() {
		c.must(5*time.Minute, "helm", args...)
		c.must(5*time.Minute, "kubectl", "-n", "kube-system", "rollout", "restart", "ds/cilium")
		c.must(8*time.Minute, "kubectl", "-n", "kube-system", "rollout", "status", "ds/cilium", "--timeout=8m")
	}
	for _, n := range e.nodes {
		// Cilium's own conflist, with ctscrub chained again by the sidecar:
		// so the check after the uninstall can fail.
		eventually(t, c.ctx, time.Minute, "the cni-conf sidecar chains ctscrub into Cilium's own conflist on "+n, func() (bool, string) {
			chain, err := c.chain(n)
			if err != nil {
				return false, err.Error()
			}
			return strings.Join(chain, ",") == chained, fmt.Sprintf("chain %v, want %s", chain, chained)
		})
	}
	// One pod per node started through the chain now, so every node has a
	// pod interface carrying the recorder's filters before the uninstall
	// (which must take them off): the check after it can fail on each node.
	nsBefore := "ctscrub-before-uninstall"
	c.kubectl("create", "namespace", nsBefore)
	t.Cleanup(func() { c.run(2*time.Minute, "kubectl", "delete", "namespace", nsBefore, "--wait=false") })
	c.startPods(nsBefore, "before", "before-uninstall", 1, e.nodes, e.serverImage)
	filtersBefore := 0
	for _, n := range e.nodes {
		f := c.recorderFilters(n)
		filtersBefore += f
		if f == 0 && !e.nfct() {
			t.Errorf("no pod interface on %s carries the recorder's filters before the uninstall, though a pod started there through the chain; the node's netns and tc filters:\n%s", n, c.filterDump(n))
		}
	}

	// With the delegate (CILIUM_DELEGATE=1), the agents' fallbacks before
	// the uninstall: after it nobody serves the socket, so the pods below
	// must be scrubbed by the agents' own walks.
	fallbacksBefore := map[string]delegateCounts{}
	if e.delegate {
		for _, n := range e.nodes {
			fallbacksBefore[n] = c.ciliumCounts(n)
		}
	}

	logs = c.followScrubdLogs()
	start := time.Now()
	c.must(5*time.Minute, "helm", "uninstall", "ctscrub", "--namespace", "kube-system", "--wait", "--timeout", "5m")
	// Pods right away, on every node, while the ctscrub pods may still be
	// stopping: a pod whose ADD still meets the entry fails and the kubelet
	// retries it; left chained (before issue 25) none would ever start.
	ns := "ctscrub-uninstalled"
	c.kubectl("create", "namespace", ns)
	t.Cleanup(func() { c.run(2*time.Minute, "kubectl", "delete", "namespace", ns, "--wait=false") })
	const perNode = 3
	c.startPods(ns, "after", "after-uninstall", perNode, e.nodes, e.serverImage)
	ready := strings.Count(c.kubectl("-n", ns, "get", "pods", "-l", "app=after-uninstall", "-o",
		`jsonpath={range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}`), "True")
	t.Logf("%d pods Ready %s after helm uninstall began", ready, time.Since(start).Round(time.Second))
	if ready != perNode*len(e.nodes) {
		t.Errorf("%d of %d pods started after the uninstall are Ready", ready, perNode*len(e.nodes))
	}
	if e.delegate {
		walks := map[string]float64{}
		var n float64
		for _, node := range e.nodes {
			after := c.ciliumCounts(node)
			for k, v := range after.fallbacks {
				if d := v - fallbacksBefore[node].fallbacks[k]; d > 0 {
					walks[k] += d
					n += d
				}
			}
		}
		t.Logf("the agents' fallbacks to their walk after the uninstall: %v", walks)
		if n == 0 {
			t.Errorf("%d pods started after ctscrub's uninstall, yet no agent counted a fallback to its walk (the delegate's socket is gone)", ready)
		}
		result(t, "uninstall_fallback_walks", walks)
	}

	// What each scrubd did at its SIGTERM.
	for pod, log := range logs(2 * time.Minute) {
		if !strings.Contains(log, "uninstall: taking ctscrub off this node") {
			t.Errorf("scrubd %s did not take ctscrub off its node at the uninstall; its log's end:\n%s", pod, tail([]byte(log)))
			continue
		}
		for _, l := range strings.Split(log, "\n") {
			if strings.Contains(l, "uninstall") || strings.Contains(l, "DaemonSet") {
				t.Logf("%s: %s", pod, l)
			}
		}
	}
	for _, n := range e.nodes {
		chain, err := c.chain(n)
		if err != nil || strings.Join(chain, ",") != strings.Join(own, ",") {
			t.Errorf("%s: conflist chain %v (%v), want the CNI's own %v", n, chain, err, own)
		}
		if k := c.recorderFilters(n); k != 0 {
			t.Errorf("%s: %d recorder filters left on pod interfaces after the uninstall", n, k)
		}
		// Kept on purpose (docs/plugin.md, "Uninstall"): harmless, removed
		// by `ctscrub uninstall --remove-binary --remove-state`.
		out, _ := c.run(time.Minute, "docker", "exec", n, "sh", "-c", "ls -d /opt/cni/bin/ctscrub /sys/fs/bpf/ctscrub /run/ctscrub 2>/dev/null; true")
		t.Logf("%s: left on the node: %q", n, strings.Fields(out))
	}
	result(t, "uninstall_clean", !t.Failed())
	result(t, "uninstall_filters_removed", filtersBefore)
	result(t, "uninstall_pods_started", ready)
}

// followScrubdLogs follows the scrubd container's log of every ctscrub pod
// running now; the function it returns waits (up to a limit) for each pod
// to be gone and returns each pod's log. A pod's log goes with the pod, so
// what scrubd logs at its SIGTERM is only seen this way.
func (c *cluster) followScrubdLogs() func(time.Duration) map[string]string {
	c.t.Helper()
	names := strings.Fields(c.kubectl("-n", "kube-system", "get", "pods", "-l", "app.kubernetes.io/name=ctscrub",
		"--field-selector=status.phase=Running", "-o", "jsonpath={.items[*].metadata.name}"))
	if len(names) == 0 {
		c.t.Fatal("no running ctscrub pod to follow")
	}
	type follow struct {
		out  *bytes.Buffer
		done chan struct{}
	}
	fs := map[string]follow{}
	// Every line from a little before now: kubectl may connect after the
	// caller's next step has begun (a loaded machine), and a --tail of the
	// lines at connect time then misses the first of them (the default
	// run of 2026-12-02 19:00 UTC lost "uninstall: taking ctscrub off this
	// node" behind five later lines).
	since := time.Now().Add(-2 * time.Second).UTC().Format(time.RFC3339)
	for _, p := range names {
		f := follow{out: &bytes.Buffer{}, done: make(chan struct{})}
		cmd := exec.CommandContext(c.ctx, "kubectl", "-n", "kube-system", "logs", "-f", p, "-c", "scrubd", "--since-time="+since)
		cmd.Env = append(os.Environ(), c.env...)
		cmd.Stdout = f.out
		if err := cmd.Start(); err != nil {
			c.t.Fatal(err)
		}
		go func() { cmd.Wait(); close(f.done) }()
		c.t.Cleanup(func() { cmd.Process.Kill() })
		fs[p] = f
	}
	return func(limit time.Duration) map[string]string {
		deadline := time.After(limit)
		logs := map[string]string{}
		for p, f := range fs {
			select {
			case <-f.done:
			case <-deadline:
				c.t.Errorf("scrubd pod %s still logging %s later", p, limit)
			}
			logs[p] = f.out.String()
		}
		return logs
	}
}

// recorderFilters counts the recorder's tc filters (name ctscrub_recorder)
// on the interfaces of every pod network namespace of node.
func (c *cluster) recorderFilters(node string) int {
	c.t.Helper()
	return strings.Count(c.filterDump(node), "ctscrub_recorder")
}

// filterDump lists, for every network namespace on node, its interfaces'
// tc filters on both hooks.
func (c *cluster) filterDump(node string) string {
	c.t.Helper()
	return c.must(time.Minute, "docker", "exec", node, "sh", "-c",
		`for n in /var/run/netns/*; do [ -e "$n" ] || continue; echo "netns $n"; for d in $(nsenter --net="$n" ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//'); do `+
			`echo " dev $d"; nsenter --net="$n" tc filter show dev "$d" ingress; nsenter --net="$n" tc filter show dev "$d" egress; done; done 2>/dev/null; true`)
}

// startPods starts perNode agnhost pods labelled app=label in ns on each
// node (named <prefix>-<node>-<i>) and waits for them to be Ready.
func (c *cluster) startPods(ns, prefix, label string, perNode int, nodes []string, image string) {
	c.t.Helper()
	var pods strings.Builder
	for _, n := range nodes {
		for i := range perNode {
			fmt.Fprintf(&pods, `---
apiVersion: v1
kind: Pod
metadata: {name: %[5]s-%[2]s-%[3]d, namespace: %[1]s, labels: {app: %[6]s}}
spec:
  nodeName: %[2]s
  terminationGracePeriodSeconds: 1
  tolerations: [{operator: Exists}]
  containers:
    - {name: server, image: %[4]s, imagePullPolicy: IfNotPresent, args: ["netexec", "--http-port=8080"]}
`, ns, n, i, image, prefix, label)
		}
	}
	c.kubectl("apply", "-f", writeFile(c.t, c.t.TempDir(), prefix+".yaml", pods.String()))
	c.must(3*time.Minute, "kubectl", "-n", ns, "wait", "--for=condition=Ready", "pod", "-l", "app="+label, "--timeout=3m")
}

// uninstallSkipped: the uninstall takes ctscrub off the cluster; it runs only
// in a full e2e (`make e2e-kind` sets CTSCRUB_KIND_UNINSTALL=1), never on a
// cluster someone keeps using.
func (e *kindEnv) uninstallSkipped(t *testing.T) bool {
	if envOr("CTSCRUB_KIND_UNINSTALL", "") != "1" {
		t.Skip("uninstalls ctscrub from the cluster: set CTSCRUB_KIND_UNINSTALL=1 (make e2e-kind does)")
		return true
	}
	return false
}
