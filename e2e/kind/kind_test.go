// Package kind runs ctscrub in a real Kubernetes cluster: kind nodes (Docker
// containers), Cilium installed with Helm writing the chain cilium-cni +
// ctscrub from conf/cilium-cni-configmap.yaml, and conf/daemonset.yaml applied
// as an operator would.
//
// The test runs only when CTSCRUB_KIND=1 is set and a Docker engine answers,
// so it never runs by accident in `make test`: it creates a cluster, pulls
// images from the internet and takes several minutes. How to run it and what
// it needs: docs/kind.md. It has not been run on this project's machines
// (they have no Docker engine); it was checked there by `go vet` and review.
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
	clusterName = "ctscrub-e2e"
	worker      = clusterName + "-worker" // kind names node containers <cluster>-<role>
	apiServer   = clusterName + "-control-plane"
	image       = "ctscrub:kind-e2e" // a fixed tag, not latest: the kubelet uses the loaded image
	podSubnet   = "10.244.0.0/16"    // kind's default, set explicitly below
	ns          = "ctscrub-e2e"

	// Pinned by tag; any kind node can pull them.
	serverImage = "registry.k8s.io/e2e-test-images/agnhost:2.53"
	clientImage = "docker.io/library/busybox:1.36.1"

	defaultCiliumVersion = "1.16.5"
	overall              = 20 * time.Minute
)

// TestKindCilium: a pod's CT entries in Cilium's real maps are indexed by
// scrubd, and deleting the pod scrubs them through the chain
// cilium-cni -> ctscrub (reason del, result complete); afterwards Cilium's
// own CT listing has no entry of the pod's IP.
func TestKindCilium(t *testing.T) {
	if os.Getenv("CTSCRUB_KIND") != "1" {
		t.Skip("set CTSCRUB_KIND=1 to run the kind cluster test (needs Docker, kind, kubectl, helm and the internet): see docs/kind.md")
	}
	if out, err := exec.Command("docker", "info", "--format", "{{.ServerVersion}}").CombinedOutput(); err != nil {
		t.Skipf("needs a Docker engine for kind; run on a machine with Docker: see docs/kind.md (docker info: %v: %s)", err, firstLine(out))
	}
	for _, tool := range []string{"kind", "kubectl", "helm"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s is not on PATH: see docs/kind.md for how to install it", tool)
		}
	}
	if dl, ok := t.Deadline(); ok && time.Until(dl) < overall+2*time.Minute {
		t.Fatalf("the test needs up to %s: run it with -timeout 30m (go test's default is 10m)", overall)
	}
	ctx, cancel := context.WithTimeout(context.Background(), overall)
	t.Cleanup(cancel)

	root := moduleRoot(t)
	tmp := t.TempDir()
	kubeconfig := filepath.Join(tmp, "kubeconfig")
	// A kubeconfig of its own: the developer's ~/.kube/config is not touched.
	c := &cluster{t: t, ctx: ctx, root: root, env: []string{"KUBECONFIG=" + kubeconfig}}

	// 1. The cluster: no default CNI and no kube-proxy, as on a Cilium node
	// with kube-proxy replacement.
	if out := c.must(time.Minute, "kind", "get", "clusters"); containsLine(out, clusterName) {
		t.Fatalf("a kind cluster %q exists already (kept by CTSCRUB_KIND_KEEP=1?): delete it with `kind delete cluster --name %s`", clusterName, clusterName)
	}
	kindConf := writeFile(t, tmp, "kind.yaml", `kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
networking:
  disableDefaultCNI: true
  kubeProxyMode: none
  podSubnet: `+podSubnet+`
nodes:
  - role: control-plane
  - role: worker
`)
	t.Cleanup(func() {
		if os.Getenv("CTSCRUB_KIND_KEEP") == "1" {
			t.Logf("CTSCRUB_KIND_KEEP=1: cluster %s kept; `kind export kubeconfig --name %s`, then `kind delete cluster --name %s` when done", clusterName, clusterName, clusterName)
			return
		}
		// The test's context may be spent by now: deletion gets its own.
		if _, err := runCmd(context.Background(), 3*time.Minute, nil, root, "kind", "delete", "cluster", "--name", clusterName); err != nil {
			t.Errorf("delete the kind cluster: %v", err)
		}
	})
	c.must(6*time.Minute, "kind", "create", "cluster", "--name", clusterName, "--config", kindConf, "--kubeconfig", kubeconfig)
	t.Cleanup(c.dumpOnFailure) // runs before the deletion above

	// 2. The image, built as conf/Containerfile expects: a context holding
	// bin/scrubd and bin/ctscrub, static, for the Docker engine's CPU.
	arch := strings.TrimSpace(c.must(time.Minute, "docker", "version", "--format", "{{.Server.Arch}}"))
	buildCtx := filepath.Join(tmp, "image")
	for pkg, name := range map[string]string{"./scrubd": "scrubd", "./plugin": "ctscrub"} {
		if _, err := runCmd(ctx, 5*time.Minute, []string{"CGO_ENABLED=0", "GOOS=linux", "GOARCH=" + arch}, root,
			"go", "build", "-o", filepath.Join(buildCtx, "bin", name), pkg); err != nil {
			t.Fatal(err)
		}
	}
	c.must(5*time.Minute, "docker", "build", "-f", filepath.Join(root, "conf", "Containerfile"), "-t", image, buildCtx)
	c.must(5*time.Minute, "kind", "load", "docker-image", image, "--name", clusterName)

	// 3. Cilium writes the chain itself from the ConfigMap (docs/plugin.md,
	// option 1); it must exist before the agents start.
	c.kubectl("apply", "-f", filepath.Join(root, "conf", "cilium-cni-configmap.yaml"))
	ciliumVersion := os.Getenv("CILIUM_VERSION")
	if ciliumVersion == "" {
		ciliumVersion = defaultCiliumVersion
	}
	c.must(5*time.Minute, "helm", "install", "cilium", "cilium", "--repo", "https://helm.cilium.io",
		"--version", ciliumVersion, "--namespace", "kube-system",
		"--set", "cni.customConf=true",
		"--set", "cni.configMap=cilium-cni-ctscrub",
		"--set", "cni.exclusive=false",
		// Pod IPs from the nodes' podCIDRs (kind's podSubnet), which scrubd's
		// pod_cidrs below name.
		"--set", "ipam.mode=kubernetes",
		"--set", "kubeProxyReplacement=true",
		"--set", "k8sServiceHost="+apiServer,
		"--set", "k8sServicePort=6443",
		"--set", "operator.replicas=1",
		"--set", "image.pullPolicy=IfNotPresent")
	c.must(10*time.Minute, "kubectl", "-n", "kube-system", "rollout", "status", "ds/cilium", "--timeout=10m")
	c.must(5*time.Minute, "kubectl", "wait", "--for=condition=Ready", "node", "--all", "--timeout=5m")

	// Cilium wrote cilium-cni then ctscrub on the node.
	var chain []string
	eventually(t, ctx, time.Minute, "Cilium's conflist on "+worker+" chains cilium-cni then ctscrub", func() (bool, string) {
		out, err := c.run(time.Minute, "docker", "exec", worker, "cat", "/etc/cni/net.d/05-cilium.conflist")
		if err != nil {
			return false, err.Error()
		}
		var conf struct {
			Plugins []struct {
				Type string `json:"type"`
			} `json:"plugins"`
		}
		if err := json.Unmarshal([]byte(out), &conf); err != nil {
			return false, fmt.Sprintf("%v: %s", err, out)
		}
		chain = chain[:0]
		for _, p := range conf.Plugins {
			chain = append(chain, p.Type)
		}
		return strings.Join(chain, ",") == "cilium-cni,ctscrub", fmt.Sprintf("chain %v", chain)
	})

	// 4. scrubd: conf/daemonset.yaml with the test's image, and
	// conf/scrubd.yaml with kind's pod subnet.
	scrubdConf, err := scrubdConfFor(readFile(t, root, "conf/scrubd.yaml"), podSubnet)
	if err != nil {
		t.Fatal(err)
	}
	c.kubectl("-n", "kube-system", "create", "configmap", "ctscrub-config",
		"--from-file=scrubd.yaml="+writeFile(t, tmp, "scrubd.yaml", scrubdConf))
	ds, err := daemonSetFor(readFile(t, root, "conf/daemonset.yaml"), image)
	if err != nil {
		t.Fatal(err)
	}
	c.kubectl("apply", "-f", writeFile(t, tmp, "daemonset.yaml", ds))
	c.must(5*time.Minute, "kubectl", "-n", "kube-system", "rollout", "status", "ds/ctscrub", "--timeout=5m")
	scrubdPod := c.podOn("kube-system", "app.kubernetes.io/name=ctscrub", worker)
	ciliumPod := c.podOn("kube-system", "k8s-app=cilium", worker)

	// 5. A server and a client on the same node, through the chain.
	c.kubectl("create", "namespace", ns)
	c.kubectl("apply", "-f", writeFile(t, tmp, "pods.yaml", fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {name: server, namespace: %[1]s}
spec:
  nodeName: %[2]s
  terminationGracePeriodSeconds: 2
  containers:
    - {name: server, image: %[3]s, args: ["netexec", "--http-port=8080"]}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: %[1]s}
spec:
  nodeName: %[2]s
  terminationGracePeriodSeconds: 1
  containers:
    - {name: client, image: %[4]s, command: ["sleep", "3600"]}
`, ns, worker, serverImage, clientImage)))
	c.must(5*time.Minute, "kubectl", "-n", ns, "wait", "--for=condition=Ready", "pod/server", "pod/client", "--timeout=5m")
	serverIP, err := netip.ParseAddr(strings.TrimSpace(c.kubectl("-n", ns, "get", "pod", "server", "-o", "jsonpath={.status.podIP}")))
	if err != nil || !netip.MustParsePrefix(podSubnet).Contains(serverIP) {
		t.Fatalf("server pod IP %v (%v): want an address in %s", serverIP, err, podSubnet)
	}
	ip := serverIP.String()

	// One connection held open for the whole test: its CT entries live for
	// hours, so neither Cilium's GC nor scrubd's expiry pass removes them
	// before the DEL (short HTTP flows expire 10 s after their FIN).
	hold := exec.CommandContext(ctx, "kubectl", "-n", ns, "exec", "-i", "client", "-c", "client", "--", "nc", ip, "8080")
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
		if out := strings.TrimSpace(c.kubectl("-n", ns, "exec", "client", "-c", "client", "--",
			"wget", "-qO-", "-T", "5", "http://"+ip+":8080/hostname")); out != "server" {
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
	eventually(t, ctx, 30*time.Second, "scrubd's index holds keys of "+ip, func() (bool, string) {
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
	delsBefore := c.delScrubs()
	// An earlier pod may have held the IP (a failed ADD is undone by a DEL):
	// only scrub lines logged from here on count.
	logged := len(delScrubsOf(c.kubectl("-n", "kube-system", "logs", scrubdPod, "-c", "scrubd"), ip))

	// 6. Delete the server: the DEL goes through ctscrub before cilium-cni
	// (a chain's DEL runs in reverse), so ctscrub finds the entries.
	c.must(3*time.Minute, "kubectl", "-n", ns, "delete", "pod", "server", "--wait=true", "--timeout=3m")
	var scrubs []scrubLine
	eventually(t, ctx, time.Minute, "scrubd logs a del scrub of "+ip, func() (bool, string) {
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
		if s.Deleted == 0 {
			t.Errorf("del scrub of %s on Cilium's maps deleted nothing, though Cilium listed its entries just before", ip)
		}
		if st.Complete && s.Method != "index" {
			t.Errorf("del scrub of %s used %q though its index was complete, want index", ip, s.Method)
		}
	}
	if lines := c.ctLines(ciliumPod, ip); len(lines) > 0 {
		t.Errorf("Cilium's CT on %s still lists %d entries of %s after the DEL:\n%s", worker, len(lines), ip, strings.Join(lines, "\n"))
	}
	if after := c.delScrubs(); after <= delsBefore {
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

// ctLines lists the lines of Cilium's global CT tables on the worker that
// name ip. Cilium 1.15+ calls the agent's CLI cilium-dbg; older ones cilium.
func (c *cluster) ctLines(ciliumPod, ip string) []string {
	c.t.Helper()
	var out string
	var err error
	for _, cli := range []string{"cilium-dbg", "cilium"} {
		out, err = c.run(2*time.Minute, "kubectl", "-n", "kube-system", "exec", ciliumPod, "-c", "cilium-agent", "--",
			cli, "bpf", "ct", "list", "global")
		if err == nil {
			break
		}
	}
	if err != nil {
		c.t.Fatal(err)
	}
	// The address alone, not a prefix of a longer one (10.244.1.5 vs 10.244.1.50).
	re := regexp.MustCompile(`(^|[^0-9.])` + regexp.QuoteMeta(ip) + `([^0-9]|$)`)
	var lines []string
	for _, l := range strings.Split(out, "\n") {
		if re.MatchString(l) {
			lines = append(lines, l)
		}
	}
	return lines
}

// delScrubs sums ctscrub_scrub_duration_seconds_count{reason="del"} from the
// worker's scrubd. Its metrics listen on the node's loopback (hostNetwork),
// reached from inside the kind node container.
func (c *cluster) delScrubs() float64 {
	c.t.Helper()
	out := c.must(time.Minute, "docker", "exec", worker, "curl", "-sf", "http://127.0.0.1:9967/metrics")
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
		c.t.Fatalf("scrubd's /metrics on %s has no ctscrub_ series:\n%s", worker, out)
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
