package kind

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

// TestKindUninstall runs last (it removes ctscrub): the uninstall of
// docs/plugin.md on the live cluster. Cilium goes back to its own conflist
// (cni.customConf=false, agents restarted), the chart is uninstalled, each
// node runs `ctscrub uninstall --remove-binary` and removes scrubd's pin dir
// and run dir (scrubd keeps them across restarts on purpose, docs/daemon.md).
// Then on every node: the conflist chains cilium-cni alone, no ctscrub
// binary, pin, socket or file is left, no tcx link of ctscrub's recorder is
// attached, and a new pod still starts and answers.
func TestKindUninstall(t *testing.T) {
	e := getKindEnv(t)
	if e.uninstallSkipped(t) {
		return
	}
	c := e.newCluster(t, 10*time.Minute)
	chart := strings.TrimSpace(envOr("CILIUM_CHART", ""))
	args := []string{"upgrade", "cilium", chart, "--namespace", "kube-system", "--reuse-values", "--set", "cni.customConf=false"}
	if repo := envOr("CILIUM_CHART_REPO", ""); repo != "" {
		args = []string{"upgrade", "cilium", "cilium", "--repo", repo, "--version", e.ciliumVersion, "--namespace", "kube-system", "--reuse-values", "--set", "cni.customConf=false"}
	}
	c.must(5*time.Minute, "helm", args...)
	c.must(5*time.Minute, "kubectl", "-n", "kube-system", "rollout", "restart", "ds/cilium")
	c.must(8*time.Minute, "kubectl", "-n", "kube-system", "rollout", "status", "ds/cilium", "--timeout=8m")
	// While the DaemonSet runs, its cni-conf container (install --watch)
	// puts the entry back into the conflist Cilium now writes itself
	// (option 2 of docs/plugin.md), so the entry comes out after the
	// DaemonSet is gone (docs/plugin.md, "Uninstall").
	// The recorder's filters on the pods' interfaces before: some pods
	// (CoreDNS at least) started while ctscrub ran, so the check below can fail.
	filtersBefore := 0
	for _, n := range e.nodes {
		filtersBefore += c.recorderFilters(n)
	}
	if filtersBefore == 0 {
		t.Errorf("no pod interface on %v carries the recorder's filters before the uninstall", e.nodes)
	}
	c.must(5*time.Minute, "helm", "uninstall", "ctscrub", "--namespace", "kube-system", "--wait", "--timeout", "5m")
	// helm's --wait ends when the DaemonSet object is gone; its pods may
	// still be terminating, and scrubd still answer on its socket.
	c.must(3*time.Minute, "kubectl", "-n", "kube-system", "wait", "--for=delete", "pod", "-l", "app.kubernetes.io/name=ctscrub", "--timeout=2m")
	for _, n := range e.nodes {
		out := c.must(time.Minute, "docker", "exec", n, "/opt/cni/bin/ctscrub", "uninstall", "--conf-dir", "/etc/cni/net.d",
			"--bin-dir", "/opt/cni/bin", "--remove-binary", "--remove-state")
		t.Logf("%s: %s", n, strings.TrimSpace(out))
	}
	for _, n := range e.nodes {
		eventually(t, c.ctx, 2*time.Minute, "Cilium's own conflist on "+n, func() (bool, string) {
			chain, err := c.chain(n)
			if err != nil {
				return false, err.Error()
			}
			return strings.Join(chain, ",") == "cilium-cni", fmt.Sprintf("chain %v", chain)
		})
	}
	for _, n := range e.nodes {
		if k := c.recorderFilters(n); k != 0 {
			t.Errorf("%s: %d recorder filters left on pod interfaces after the uninstall", n, k)
		}
		out := c.must(time.Minute, "docker", "exec", n, "sh", "-c",
			"ls -d /opt/cni/bin/ctscrub /sys/fs/bpf/ctscrub /run/ctscrub 2>/dev/null; grep -l ctscrub /etc/cni/net.d/* 2>/dev/null; true")
		if strings.TrimSpace(out) != "" {
			t.Errorf("%s: ctscrub left after the uninstall:\n%s", n, out)
		}
		chain, err := c.chain(n)
		if err != nil || strings.Join(chain, ",") != "cilium-cni" {
			t.Errorf("%s: conflist chain %v (%v), want Cilium's own [cilium-cni]", n, chain, err)
		}
	}
	// A pod starts without ctscrub in the chain.
	ns := "ctscrub-uninstalled"
	c.kubectl("create", "namespace", ns)
	t.Cleanup(func() { c.run(2*time.Minute, "kubectl", "delete", "namespace", ns, "--wait=false") })
	c.kubectl("-n", ns, "run", "after", "--image="+e.serverImage, "--image-pull-policy=IfNotPresent",
		"--overrides", fmt.Sprintf(`{"spec":{"nodeName":%q}}`, e.worker), "--", "netexec", "--http-port=8080")
	c.must(3*time.Minute, "kubectl", "-n", ns, "wait", "--for=condition=Ready", "pod/after", "--timeout=3m")
	result(t, "uninstall_clean", !t.Failed())
	result(t, "uninstall_filters_removed", filtersBefore)
}

// recorderFilters counts the recorder's tc filters (name ctscrub_recorder)
// on the interfaces of every pod network namespace of node.
func (c *cluster) recorderFilters(node string) int {
	c.t.Helper()
	out := c.must(time.Minute, "docker", "exec", node, "sh", "-c",
		`for n in /var/run/netns/*; do [ -e "$n" ] || continue; for d in $(nsenter --net="$n" ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//'); do `+
			`nsenter --net="$n" tc filter show dev "$d" ingress; nsenter --net="$n" tc filter show dev "$d" egress; done; done 2>/dev/null; true`)
	return strings.Count(out, "ctscrub_recorder")
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
