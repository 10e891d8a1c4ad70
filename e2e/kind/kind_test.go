// Package kind runs ctscrub in a real Kubernetes cluster: kind nodes (Docker
// containers), real Cilium writing the chain cilium-cni + ctscrub from the CNI
// ConfigMap of ctscrub's chart (docs/plugin.md, option 1), and ctscrub
// installed with its chart (conf/chart), as an operator would.
//
// The cluster is made by e2e/kind/cluster.sh (`make e2e-kind` runs
// install.sh, the image builds, cluster.sh up, these tests and cluster.sh
// down): the tests take it from the variables cluster.sh prints (KUBECONFIG,
// CLUSTER, NODES, SERVER_IMAGE, CLIENT_IMAGE, ...). They run only when
// CTSCRUB_KIND=1 is set, so `make test` never needs Docker; the checks of
// what the chart and the e2e render from conf/ (TestChart*, TestManifests)
// need no cluster and run in `make test` (the chart's with helm installed).
// How to run them and what they need: docs/kind.md.
//
// The package imports nothing Linux-only, so it builds on a macOS laptop with
// Docker Desktop too.
package kind

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"
)

const (
	image     = "ctscrub:kind-e2e" // TestManifests' stand-in image name
	podSubnet = "10.244.0.0/16"    // cluster.sh's pod subnet
)

// kindEnv is the cluster of e2e/kind/cluster.sh, from its variables; nil
// when the kind tests are not asked for (the test skips).
type kindEnv struct {
	cluster, worker, kubeconfig string
	nodes                       []string
	serverImage, clientImage    string
	ciliumVersion, k8sVersion   string
	podSubnet                   string
	// The cluster's modes (cluster.sh): cni is cilium or kindnet (the
	// reference bridge + host-local standing in for kindnetd, kube-proxy
	// running, ctscrub's nfct backend); kubeProxyMode none, iptables or
	// nftables; ciliumLB kpr, default or hostns.
	cni, kubeProxyMode, ciliumLB string
	probeImage                   string
	ctscrubInstalled             bool
	// delegate: Cilium carries cilium/patches and asks scrubd before its
	// CT walk (CILIUM_DELEGATE=1, from cluster.sh's variables).
	delegate bool
}

// nfct: the cluster's CT state is the kernel's nf_conntrack (CNI=kindnet),
// scrubbed by ctscrub's nfct backend; otherwise Cilium's maps.
func (e *kindEnv) nfct() bool { return e.cni == "kindnet" }

// backend is the scrub backend whose del scrubs the tests count.
func (e *kindEnv) backend() string {
	if e.nfct() {
		return "nfct"
	}
	return "cilium"
}

// skipUnlessCilium: the test reads Cilium's own state.
func (e *kindEnv) skipUnlessCilium(t *testing.T) {
	t.Helper()
	if e.nfct() {
		t.Skipf("CNI=%s: this test reads Cilium's maps and agent", e.cni)
	}
}

func getKindEnv(t *testing.T) *kindEnv {
	t.Helper()
	if os.Getenv("CTSCRUB_KIND") != "1" {
		t.Skip("set CTSCRUB_KIND=1 and a cluster from e2e/kind/cluster.sh to run the kind tests (`make e2e-kind` does both): see docs/kind.md")
	}
	e := &kindEnv{
		cluster:       os.Getenv("CLUSTER"),
		kubeconfig:    os.Getenv("KUBECONFIG"),
		serverImage:   os.Getenv("SERVER_IMAGE"),
		clientImage:   os.Getenv("CLIENT_IMAGE"),
		ciliumVersion: os.Getenv("CILIUM_VERSION"),
		k8sVersion:    os.Getenv("K8S_VERSION"),
		podSubnet:     os.Getenv("POD_SUBNET"),
		cni:           envOr("CNI", "cilium"),
		kubeProxyMode: envOr("KUBE_PROXY_MODE", "none"),
		ciliumLB:      envOr("CILIUM_LB", "kpr"),
		probeImage:    os.Getenv("PROBE_IMAGE"),
		delegate:      os.Getenv("CILIUM_DELEGATE") == "1",
	}
	e.ctscrubInstalled = os.Getenv("CTSCRUB_INSTALLED") != "0"
	if e.cluster == "" || e.kubeconfig == "" || e.serverImage == "" || e.clientImage == "" || e.podSubnet == "" {
		t.Fatalf("CTSCRUB_KIND=1 needs the variables of `e2e/kind/cluster.sh up` (CLUSTER, KUBECONFIG, SERVER_IMAGE, CLIENT_IMAGE, POD_SUBNET): `eval \"$(e2e/kind/cluster.sh env)\"`, or run `make e2e-kind`")
	}
	e.worker = e.cluster + "-worker" // kind names node containers <cluster>-<role>
	e.nodes = strings.Split(os.Getenv("NODES"), ",")
	return e
}

func (e *kindEnv) newCluster(t *testing.T, limit time.Duration) *cluster {
	t.Helper()
	if dl, ok := t.Deadline(); ok && time.Until(dl) < limit+time.Minute {
		t.Fatalf("the test needs up to %s: run it with a longer -timeout", limit)
	}
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	t.Cleanup(cancel)
	c := &cluster{t: t, ctx: ctx, root: moduleRoot(t), env: []string{"KUBECONFIG=" + e.kubeconfig}, e: e}
	t.Cleanup(c.dumpOnFailure)
	return c
}

// result records one figure for the e2e's final JSON line (e2e/kind/run.sh
// prints it): the tests write them to CTSCRUB_KIND_RESULTS, one JSON object
// per line.
func result(t *testing.T, key string, value any) {
	t.Helper()
	path := os.Getenv("CTSCRUB_KIND_RESULTS")
	if path == "" {
		return
	}
	b, _ := json.Marshal(map[string]any{key: value})
	f, err := os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		t.Errorf("results file: %v", err)
		return
	}
	defer f.Close()
	fmt.Fprintf(f, "%s\n", b)
}

// TestKindCilium: a pod's CT entries in Cilium's real maps are indexed by
// scrubd, and deleting the pod scrubs them through the chain
// cilium-cni -> ctscrub (reason del, result complete); afterwards Cilium's
// own CT listing has no entry of the pod's IP.
func TestKindCilium(t *testing.T) {
	e := getKindEnv(t)
	e.skipUnlessCilium(t)
	c := e.newCluster(t, 10*time.Minute)
	worker := e.worker
	ns := "ctscrub-e2e"

	// Cilium wrote cilium-cni then ctscrub on the node.
	eventually(t, c.ctx, time.Minute, "Cilium's conflist on "+worker+" chains cilium-cni then ctscrub", func() (bool, string) {
		chain, err := c.chain(worker)
		if err != nil {
			return false, err.Error()
		}
		return strings.Join(chain, ",") == "cilium-cni,ctscrub", fmt.Sprintf("chain %v", chain)
	})
	scrubdPod := c.podOn("kube-system", "app.kubernetes.io/name=ctscrub", worker)
	ciliumPod := c.podOn("kube-system", "k8s-app=cilium", worker)

	// A server and a client on the same node, through the chain.
	c.kubectl("create", "namespace", ns)
	t.Cleanup(func() {
		runCmd(context.Background(), 3*time.Minute, c.env, c.root, "kubectl", "delete", "namespace", ns, "--wait=true", "--timeout=2m")
	})
	c.kubectl("apply", "-f", writeFile(t, t.TempDir(), "pods.yaml", fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {name: server, namespace: %[1]s}
spec:
  nodeName: %[2]s
  terminationGracePeriodSeconds: 2
  containers:
    - {name: server, image: %[3]s, imagePullPolicy: IfNotPresent, args: ["netexec", "--http-port=8080"]}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: %[1]s}
spec:
  nodeName: %[2]s
  terminationGracePeriodSeconds: 1
  containers:
    - {name: client, image: %[4]s, imagePullPolicy: IfNotPresent, command: ["sleep", "3600"]}
`, ns, worker, e.serverImage, e.clientImage)))
	c.must(5*time.Minute, "kubectl", "-n", ns, "wait", "--for=condition=Ready", "pod/server", "pod/client", "--timeout=5m")
	serverIP, err := netip.ParseAddr(strings.TrimSpace(c.kubectl("-n", ns, "get", "pod", "server", "-o", "jsonpath={.status.podIP}")))
	if err != nil || !netip.MustParsePrefix(e.podSubnet).Contains(serverIP) {
		t.Fatalf("server pod IP %v (%v): want an address in %s", serverIP, err, e.podSubnet)
	}
	ip := serverIP.String()

	// One connection held open for the whole test: its CT entries live for
	// hours, so neither Cilium's GC nor scrubd's expiry pass removes them
	// before the DEL (short HTTP flows expire 10 s after their FIN).
	hold := exec.CommandContext(c.ctx, "kubectl", "-n", ns, "exec", "-i", "client", "-c", "client", "--", "nc", ip, "8080")
	hold.Env = append(os.Environ(), c.env...)
	holdIn, err := hold.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := hold.Start(); err != nil {
		t.Fatalf("%s: %v", strings.Join(hold.Args, " "), err)
	}
	t.Cleanup(func() { holdIn.Close(); hold.Process.Kill(); hold.Wait() })
	for i := range 5 {
		// Debian's busybox 1.35 crashes on wget -T: timeout(1) bounds it.
		if out := strings.TrimSpace(c.kubectl("-n", ns, "exec", "client", "-c", "client", "--",
			"timeout", "5", "wget", "-qO-", "http://"+ip+":8080/hostname")); out != "server" {
			t.Fatalf("request %d from client to server %s:8080/hostname answered %q, want \"server\"", i, ip, out)
		}
	}

	// The index holds the server IP's keys (the recorder's ring buffer is
	// read asynchronously: wait for it).
	var st struct {
		Keys       int    `json:"keys"`
		Complete   bool   `json:"complete"`
		Incomplete string `json:"incomplete"`
	}
	eventually(t, c.ctx, 30*time.Second, "scrubd's index holds keys of "+ip, func() (bool, string) {
		out, err := c.run(time.Minute, "kubectl", "-n", "kube-system", "exec", scrubdPod, "-c", "scrubd", "--",
			"/usr/local/bin/scrubd", "index", "--ip", ip, "--json")
		if err != nil {
			return false, err.Error()
		}
		if err := json.Unmarshal([]byte(out), &st); err != nil {
			return false, fmt.Sprintf("%v: %s", err, out)
		}
		return st.Keys > 0, out
	})
	t.Logf("index of %s before the DEL: %d keys, complete %v %s", ip, st.Keys, st.Complete, st.Incomplete)
	// Before the DEL Cilium lists entries of the IP, so the check after it
	// can fail.
	if lines := c.ctLines(ciliumPod, ip); len(lines) == 0 {
		t.Fatalf("Cilium's CT on %s lists no entry of %s after traffic to it", worker, ip)
	}
	delsBefore := c.delScrubs(worker)
	// An earlier pod may have held the IP (a failed ADD is undone by a DEL):
	// only scrub lines logged from here on count.
	logged := len(delScrubsOf(c.kubectl("-n", "kube-system", "logs", scrubdPod, "-c", "scrubd"), ip))

	// Delete the server: the DEL goes through ctscrub before cilium-cni
	// (a chain's DEL runs in reverse), so ctscrub finds the entries.
	c.must(3*time.Minute, "kubectl", "-n", ns, "delete", "pod", "server", "--wait=true", "--timeout=3m")
	var scrubs []scrubLine
	eventually(t, c.ctx, time.Minute, "scrubd logs a del scrub of "+ip, func() (bool, string) {
		out, err := c.run(time.Minute, "kubectl", "-n", "kube-system", "logs", scrubdPod, "-c", "scrubd")
		if err != nil {
			return false, err.Error()
		}
		scrubs = delScrubsOf(out, ip)
		if len(scrubs) < logged {
			return false, fmt.Sprintf("scrubd's log is shorter than before the DEL (container restarted?): %d del scrubs of %s, %d before", len(scrubs), ip, logged)
		}
		scrubs = scrubs[logged:]
		for _, s := range scrubs {
			if s.Backend == "cilium" {
				return true, ""
			}
		}
		return false, fmt.Sprintf("del scrubs of %s logged: %+v", ip, scrubs)
	})
	for _, s := range scrubs {
		t.Logf("scrub: backend %s method %s deleted %d result %s", s.Backend, s.Method, s.Deleted, s.Result)
		if s.Result != "complete" {
			t.Errorf("del scrub of %s on backend %s: result %q (%s), want complete", ip, s.Backend, s.Result, s.Error)
		}
		if s.Backend != "cilium" {
			continue
		}
		// With the delegate, the agent's endpoint-delete asks scrubd again
		// after the CNI DEL's scrub (chain DELs run in reverse: ctscrub's
		// first): that second scrub, logged without a container ID, finds
		// nothing left.
		if s.Deleted == 0 && (s.ContainerID != "" || !c.e.delegate) {
			t.Errorf("del scrub of %s on Cilium's maps deleted nothing, though Cilium listed its entries just before", ip)
		}
		if st.Complete && s.Method != "index" {
			t.Errorf("del scrub of %s used %q though its index was complete, want index", ip, s.Method)
		}
	}
	if lines := c.ctLines(ciliumPod, ip); len(lines) > 0 {
		t.Errorf("Cilium's CT on %s still lists %d entries of %s after the DEL:\n%s", worker, len(lines), ip, strings.Join(lines, "\n"))
	}
	if after := c.delScrubs(worker); after <= delsBefore {
		t.Errorf("ctscrub_scrub_duration_seconds_count{reason=\"del\"} on %s: %v before the DEL, %v after; want more", worker, delsBefore, after)
	}
}

// TestManifests runs everywhere (no Docker): the operator's files still
// template the way the kind test needs.
func TestManifests(t *testing.T) {
	root := moduleRoot(t)
	conf, err := scrubdConfFor(readFile(t, root, "conf/scrubd.yaml"), podSubnet)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(conf, "10.0.0.0/8") {
		t.Errorf("templated scrubd.yaml still holds the example range 10.0.0.0/8:\n%s", conf)
	}
	ds, err := daemonSetFor(readFile(t, root, "conf/daemonset.yaml"), image)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(ds, "ghcr.io/ctscrub") {
		t.Errorf("templated daemonset.yaml still names ghcr.io/ctscrub")
	}
}

// cluster runs commands against the test's kind cluster.
type cluster struct {
	t    *testing.T
	ctx  context.Context
	root string
	env  []string // KUBECONFIG
	e    *kindEnv
}

func (c *cluster) run(timeout time.Duration, name string, args ...string) (string, error) {
	return runCmd(c.ctx, timeout, c.env, c.root, name, args...)
}

func (c *cluster) must(timeout time.Duration, name string, args ...string) string {
	c.t.Helper()
	out, err := c.run(timeout, name, args...)
	if err != nil {
		c.t.Fatal(err)
	}
	return out
}

func (c *cluster) kubectl(args ...string) string {
	c.t.Helper()
	return c.must(2*time.Minute, "kubectl", args...)
}

// podOn names the pod with label sel on node.
func (c *cluster) podOn(namespace, sel, node string) string {
	c.t.Helper()
	name := strings.TrimSpace(c.kubectl("-n", namespace, "get", "pods", "-l", sel,
		"--field-selector", "spec.nodeName="+node, "-o", "jsonpath={.items[0].metadata.name}"))
	if name == "" {
		c.t.Fatalf("no pod %s on node %s", sel, node)
	}
	return name
}

// ctDump is Cilium's global CT tables listed by the agent's own CLI.
// Cilium 1.15+ calls it cilium-dbg; older ones cilium.
func (c *cluster) ctDump(ciliumPod string) string {
	c.t.Helper()
	var out string
	var err error
	for _, cli := range []string{"cilium-dbg", "cilium"} {
		out, err = c.run(2*time.Minute, "kubectl", "-n", "kube-system", "exec", ciliumPod, "-c", "cilium-agent", "--",
			cli, "bpf", "ct", "list", "global")
		if err == nil {
			return out
		}
	}
	c.t.Fatal(err)
	return ""
}

// ctLines lists the lines of Cilium's global CT tables that name ip.
func (c *cluster) ctLines(ciliumPod, ip string) []string {
	c.t.Helper()
	// The address alone, not a prefix of a longer one (10.244.1.5 vs 10.244.1.50).
	re := regexp.MustCompile(`(^|[^0-9.])` + regexp.QuoteMeta(ip) + `([^0-9]|$)`)
	var lines []string
	for _, l := range strings.Split(c.ctDump(ciliumPod), "\n") {
		if re.MatchString(l) {
			lines = append(lines, l)
		}
	}
	return lines
}

// metrics is scrubd's /metrics on node: it listens on the node's IP
// (metrics_addr ${HOST_IP}:9967, hostNetwork), fetched from inside the kind
// node container.
func (c *cluster) metrics(node string) string {
	c.t.Helper()
	ip := strings.TrimSpace(c.kubectl("get", "node", node, "-o", `jsonpath={.status.addresses[?(@.type=="InternalIP")].address}`))
	if ip == "" {
		c.t.Fatalf("node %s has no InternalIP", node)
	}
	return c.must(time.Minute, "docker", "exec", node, "curl", "-sf", "http://"+net.JoinHostPort(ip, "9967")+"/metrics")
}

// chain is the plugin types of the node's conflist: the one Cilium wrote,
// or with CNI=kindnet the one cluster.sh wrote.
func (c *cluster) chain(node string) ([]string, error) {
	file := "/etc/cni/net.d/05-cilium.conflist"
	if c.e.nfct() {
		file = "/etc/cni/net.d/10-bridge.conflist"
	}
	out, err := c.run(time.Minute, "docker", "exec", node, "cat", file)
	if err != nil {
		return nil, err
	}
	var conf struct {
		Plugins []struct {
			Type string `json:"type"`
		} `json:"plugins"`
	}
	if err := json.Unmarshal([]byte(out), &conf); err != nil {
		return nil, fmt.Errorf("%v: %s", err, out)
	}
	var chain []string
	for _, p := range conf.Plugins {
		chain = append(chain, p.Type)
	}
	return chain, nil
}

// delScrubs sums ctscrub_scrub_duration_seconds_count{reason="del"} from the
// worker's scrubd (c.metrics).
func (c *cluster) delScrubs(node string) float64 {
	c.t.Helper()
	out := c.metrics(node)
	var sum float64
	var found bool
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		l := sc.Text()
		if !strings.HasPrefix(l, "ctscrub_scrub_duration_seconds_count{") || !strings.Contains(l, `reason="del"`) {
			continue
		}
		f := strings.Fields(l)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err != nil {
			c.t.Fatalf("metrics line %q: %v", l, err)
		}
		sum += v
		found = true
	}
	if !found && !strings.Contains(out, "ctscrub_") {
		c.t.Fatalf("scrubd's /metrics on %s has no ctscrub_ series:\n%s", node, out)
	}
	return sum
}

// dumpOnFailure logs what explains most failures, before the cluster goes.
func (c *cluster) dumpOnFailure() {
	if !c.t.Failed() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	for _, args := range [][]string{
		{"get", "pods", "-A", "-o", "wide"},
		{"-n", "kube-system", "logs", "-l", "app.kubernetes.io/name=ctscrub", "-c", "scrubd", "--tail=100"},
		{"-n", "kube-system", "logs", "-l", "app.kubernetes.io/name=ctscrub", "-c", "install-cni", "--tail=20"},
	} {
		out, err := runCmd(ctx, time.Minute, c.env, c.root, "kubectl", args...)
		c.t.Logf("kubectl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// scrubLine is one `"msg":"scrub"` log line of scrubd (docs/daemon.md, Logs).
type scrubLine struct {
	Msg     string   `json:"msg"`
	IPs     []string `json:"ips"`
	Reason  string   `json:"reason"`
	Backend string   `json:"backend"`
	Method  string   `json:"method"`
	Deleted int      `json:"deleted"`
	Result  string   `json:"result"`
	DryRun  bool     `json:"dry_run"`
	Error   string   `json:"error"`
	// ContainerID is the CNI call's; empty for a scrub the delegate API
	// asked for (docs/delegate-api.md).
	ContainerID string `json:"container_id"`
	// SweptWhy: for each IP the scrub swept, why the index could not vouch
	// for it (scrub.Result.SweptWhy).
	SweptWhy map[string]string `json:"swept_why"`
}

// delScrubsOf picks the real (not dry-run) del scrubs of ip out of scrubd's log.
func delScrubsOf(log, ip string) []scrubLine {
	var found []scrubLine
	for _, l := range strings.Split(log, "\n") {
		var s scrubLine
		if json.Unmarshal([]byte(l), &s) != nil || s.Msg != "scrub" || s.Reason != "del" || s.DryRun {
			continue
		}
		for _, x := range s.IPs {
			if x == ip {
				found = append(found, s)
				break
			}
		}
	}
	return found
}

// runCmd runs one command under ctx and a timeout of its own and returns its
// stdout; the error names the command and carries its output.
func runCmd(ctx context.Context, timeout time.Duration, env []string, dir, name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Dir = dir
	cmd.WaitDelay = 10 * time.Second
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		if ctx.Err() != nil {
			err = fmt.Errorf("%v (%v; this command's limit: %s)", err, ctx.Err(), timeout)
		}
		return stdout.String(), fmt.Errorf("%s: %v\n%s%s", strings.Join(cmd.Args, " "), err, tail(stdout.Bytes()), tail(stderr.Bytes()))
	}
	return stdout.String(), nil
}

// eventually polls cond every 2 s until it holds, within timeout and the
// test's context; on failure it reports cond's last detail.
func eventually(t *testing.T, ctx context.Context, timeout time.Duration, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, detail := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			t.Fatalf("%s: not within %s: %s", what, timeout, detail)
		}
		select {
		case <-ctx.Done():
		case <-time.After(2 * time.Second):
		}
	}
}

// scrubdConfFor is conf/scrubd.yaml with its example pod_cidrs entry
// replaced by cidr. It checks the result, so a changed file fails here
// (TestManifests) rather than in a cluster.
func scrubdConfFor(raw []byte, cidr string) (string, error) {
	rx := regexp.MustCompile(`(?m)^([ \t]*)- 10\.0\.0\.0/8\b.*$`)
	out := rx.ReplaceAllString(string(raw), "${1}- "+cidr)
	var conf struct {
		PodCIDRs []string `yaml:"pod_cidrs"`
	}
	if err := yaml.Unmarshal([]byte(out), &conf); err != nil {
		return "", fmt.Errorf("conf/scrubd.yaml with pod_cidrs %s: %v", cidr, err)
	}
	if len(conf.PodCIDRs) != 1 || conf.PodCIDRs[0] != cidr {
		return "", fmt.Errorf("conf/scrubd.yaml: pod_cidrs %v after replacing the example entry 10.0.0.0/8, want [%s]: update the kind test to the file", conf.PodCIDRs, cidr)
	}
	return out, nil
}

// daemonSetFor is conf/daemonset.yaml with every container on image, pulled
// only if not present (the image is loaded into the kind nodes, not pushed).
func daemonSetFor(raw []byte, image string) (string, error) {
	rx := regexp.MustCompile(`(?m)^([ \t]*)image: ghcr\.io/ctscrub/ctscrub:dev[ \t]*$`)
	out := rx.ReplaceAllString(string(raw), "${1}image: "+image+"\n${1}imagePullPolicy: IfNotPresent")
	type container struct {
		Name            string `yaml:"name"`
		Image           string `yaml:"image"`
		ImagePullPolicy string `yaml:"imagePullPolicy"`
	}
	var ds struct {
		Kind string `yaml:"kind"`
		Spec struct {
			Template struct {
				Spec struct {
					InitContainers []container `yaml:"initContainers"`
					Containers     []container `yaml:"containers"`
				} `yaml:"spec"`
			} `yaml:"template"`
		} `yaml:"spec"`
	}
	if err := yaml.Unmarshal([]byte(out), &ds); err != nil {
		return "", fmt.Errorf("conf/daemonset.yaml with image %s: %v", image, err)
	}
	all := append(ds.Spec.Template.Spec.InitContainers, ds.Spec.Template.Spec.Containers...)
	if ds.Kind != "DaemonSet" || len(ds.Spec.Template.Spec.Containers) == 0 {
		return "", fmt.Errorf("conf/daemonset.yaml: kind %q with %d containers, want a DaemonSet with containers", ds.Kind, len(ds.Spec.Template.Spec.Containers))
	}
	for _, c := range all {
		if c.Image != image || c.ImagePullPolicy != "IfNotPresent" {
			return "", fmt.Errorf("conf/daemonset.yaml: container %s has image %q, pull policy %q after templating, want %s, IfNotPresent: update the kind test to the file", c.Name, c.Image, c.ImagePullPolicy, image)
		}
	}
	return out, nil
}

func readFile(t *testing.T, root, rel string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, rel))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func writeFile(t *testing.T, dir, name, content string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// moduleRoot finds the directory of go.mod above the package's directory.
func moduleRoot(t *testing.T) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatal("no go.mod above the test's directory")
		}
		dir = parent
	}
}

func containsLine(out, want string) bool {
	for _, l := range strings.Split(out, "\n") {
		if strings.TrimSpace(l) == want {
			return true
		}
	}
	return false
}

func firstLine(b []byte) string {
	s, _, _ := strings.Cut(strings.TrimSpace(string(b)), "\n")
	return s
}

// tail keeps the last 4 KiB of a command's output for an error message.
func tail(b []byte) []byte {
	const limit = 4096
	if len(b) > limit {
		return append([]byte("...\n"), b[len(b)-limit:]...)
	}
	return b
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
