package kind

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestKindDelegateUnseenWave (issue 34): one wave of pods starts while the
// node's conflist does not chain ctscrub, so scrubd never sees their ADDs
// and the recorder never sits on their interfaces; ctscrub is chained
// again, the wave's pods are deleted and new pods take their addresses.
// Cilium's agent asks scrubd (the delegate, CILIUM_DELEGATE=1) at each of
// those endpoint deletes and creates, and skips its own CT walk on a
// complete answer: the index knows nothing of the wave's own flows, so no
// answer about the wave's IPs may come from the index alone.
//
// How the wave is unseen: on the worker (docker exec into the kind node),
// the sidecar that keeps ctscrub chained (the chart's cni-conf container,
// `ctscrub install --watch=10s`) is paused with SIGSTOP (its PID from
// crictl), and the runtime's conflist (the first config file of
// /etc/cni/net.d, Cilium's 05-cilium.conflist) is rewritten without the
// ctscrub entry (a temp file and a rename). Cilium's agent runs with
// cni.exclusive=false, so it does not watch the directory and never rewrites
// the file after its start. The test waits until scrubd's own conflist watch
// (every 5 s) reports it (ctscrub_cni_chained 0), then creates the wave, and
// checks afterwards that the file was still unchained once the wave was
// Ready and that scrubd logged no ADD scrub of any wave IP. Re-chaining
// writes the original bytes back, then SIGCONT resumes the sidecar (a
// cleanup does both if the test stops early), and the test waits for
// ctscrub_cni_chained 1 before the DELs.
//
// First, pods through the chain fill every free address of the node and
// are deleted: the wave then gets addresses the index tracks as complete,
// released by DELs scrubd saw (unseen_wave_ips_seen_before). Without that,
// on a fresh cluster, every wave address is one the index never tracked and
// every scrub of it sweeps whatever the ownership rules say (the first run,
// 2026-12-03 13:25 UTC, passed on the old code that way).
//
// The wave's flows are the churn's: TCP, UDP and ping from a client pod,
// plus each pod's own egress out of the cluster (SNAT mappings) and its own
// DNS and requests through a Service: flows only the wave pods' own
// interfaces see. The reuse: after the DELs, as many pods as the node's
// pod CIDR has free addresses (Cilium's `cilium-dbg status`), so every
// address the wave freed is taken again (Cilium's allocator picks at
// random).
//
// Checked: 0 CT entries of the wave's IPs left after the DELs
// (unseen_wave_stale_entries), 0 entries of them in a reusing pod before its
// first packet (unseen_wave_inherited_entries), no SNAT mapping of them left
// (unseen_wave_nat_left), and the delegate's answers about the wave's IPs
// from the DELs on (endpoint-delete of the wave, endpoint-create of the
// reusing pods) counted by how they were reached (unseen_wave_answers):
// `index` (complete, the scrub took the index), `sweep` (complete, it
// swept), `incomplete` (complete false: the agent walked). `index` must be 0.
// From scrubd's log: each "delegate scrub" line's answers, and for a
// complete one the method of the "scrub" line its scrub logged just before
// it (no container ID, the one IP, reason add or del).
func TestKindDelegateUnseenWave(t *testing.T) {
	e := getKindEnv(t)
	e.skipUnlessCilium(t)
	if !e.delegate {
		t.Skip("CILIUM_DELEGATE=0: this test counts the answers of scrubd's delegate API, which only Cilium built with cilium/patches asks (CILIUM_DELEGATE=1 make e2e-kind)")
	}
	c := e.newCluster(t, 20*time.Minute)
	const (
		ns      = "ctscrub-unseen"
		perWave = 6
	)
	node := e.worker
	c.kubectl("create", "namespace", ns)
	t.Cleanup(func() {
		c.run(3*time.Minute, "kubectl", "delete", "namespace", ns, "--wait=true", "--timeout=2m")
	})
	c.kubectl("apply", "-f", writeFile(t, t.TempDir(), "base.yaml", fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {name: client, namespace: %[1]s}
spec:
  nodeName: %[2]s
  terminationGracePeriodSeconds: 1
  containers:
    - {name: client, image: %[3]s, imagePullPolicy: IfNotPresent, command: ["sleep", "36000"]}
    - {name: dialer, image: %[4]s, imagePullPolicy: IfNotPresent, args: ["netexec", "--http-port=8090"]}
---
apiVersion: v1
kind: Service
metadata: {name: unseen, namespace: %[1]s}
spec:
  selector: {app: unseen-wave}
  ports:
    - {name: tcp, port: 8080, protocol: TCP}
    - {name: udp, port: 8081, protocol: UDP}
`, ns, node, e.clientImage, e.serverImage)))
	c.must(5*time.Minute, "kubectl", "-n", ns, "wait", "--for=condition=Ready", "pod/client", "--timeout=5m")
	agent := c.podOn("kube-system", "k8s-app=cilium", node)
	// Seen first: pods through the chain on every free address of the
	// node, then deleted, so that whatever address the wave gets is one
	// the index tracks, complete, released by a DEL scrubd saw (on a fresh
	// cluster an address never tracked sweeps anyway: "not tracked since
	// the index started", and the test could not fail).
	seeded := c.fill(ns, "seed", node, agent, e.clientImage)
	c.must(5*time.Minute, "kubectl", "-n", ns, "delete", "pod", "-l", "app=unseen-seed", "--wait=true", "--timeout=5m")
	c.waitReleased(agent, seeded)

	// Unchain and hold it.
	file, orig, sidecar := c.unchain(node)
	if v := c.cniChained(node, 0, time.Minute); v != 0 {
		t.Fatalf("scrubd on %s still reports ctscrub_cni_chained %v after %s was rewritten without ctscrub", node, v, file)
	}
	created := c.markScrubdLog(node)

	var b strings.Builder
	for i := range perWave {
		fmt.Fprintf(&b, `apiVersion: v1
kind: Pod
metadata: {name: unseen-%[1]d, namespace: %[2]s, labels: {app: unseen-wave}}
spec:
  nodeName: %[3]s
  terminationGracePeriodSeconds: 1
  containers:
    - {name: server, image: %[4]s, imagePullPolicy: IfNotPresent, args: ["netexec", "--http-port=8080", "--udp-port=8081"]}
---
`, i, ns, node, e.serverImage)
	}
	c.kubectl("apply", "-f", writeFile(t, t.TempDir(), "wave.yaml", b.String()))
	c.must(8*time.Minute, "kubectl", "-n", ns, "wait", "--for=condition=Ready", "pod", "-l", "app=unseen-wave", "--timeout=8m")
	ips := c.podIPs(ns, "app=unseen-wave")
	if len(ips) != perWave {
		t.Fatalf("wave: %d pod IPs (%v), want %d", len(ips), ips, perWave)
	}
	t.Logf("the unseen wave: %v", ips)
	seenBefore := 0
	for ip := range ips {
		if seeded[ip] != "" {
			seenBefore++
		}
	}
	result(t, "unseen_wave_ips_seen_before", seenBefore)
	if seenBefore == 0 {
		t.Errorf("no address of the unseen wave %v was held by a seen pod before: the index tracked none of them", ips)
	}
	// Was it really unseen? The file, as the runtime read it for the ADDs,
	// and scrubd's log: no ADD scrub of a wave IP (the plugin's scrubs name
	// their container; the delegate's do not).
	if chain, err := c.chain(node); err != nil || slices.Contains(chain, "ctscrub") {
		t.Fatalf("%s on %s after the wave was Ready: chain %v (%v), want no ctscrub: the wave was not unseen", file, node, chain, err)
	}
	waveLog := c.scrubdLogSince(created)
	for _, s := range scrubLinesOf(waveLog) {
		if s.Reason == "add" && s.ContainerID != "" && slices.ContainsFunc(s.IPs, func(ip string) bool { return ips[ip] != "" }) {
			t.Fatalf("scrubd logged an ADD scrub of the wave's %v (container %s) while ctscrub was not chained: the wave was not unseen", s.IPs, s.ContainerID)
		}
	}
	// For the record: what the agent's creates of the wave got (not
	// counted: the question is what comes after).
	cr, crDetail := waveAnswers(waveLog, ips)
	t.Logf("delegate answers at the wave's creates: %v\n%s", cr, strings.Join(crDetail, "\n"))

	// Flows of the wave's pods, while still unchained.
	var script strings.Builder
	for ip := range ips {
		fmt.Fprintf(&script, `echo "tcp %[1]s $(timeout 5 wget -qO- http://%[1]s:8080/hostname)"; `+
			`echo "udp %[1]s $(timeout 5 wget -qO- 'http://127.0.0.1:8090/dial?request=hostname&protocol=udp&host=%[1]s&port=8081&tries=2')"; `+
			`ping -c 1 -W 2 %[1]s >/dev/null && echo "ping %[1]s ok"; `, ip)
		// The pod's own egress out of the cluster (SNAT) and its own DNS
		// and requests through the Service: nothing of them passes the
		// client's interface.
		fmt.Fprintf(&script, `timeout 5 wget -qO- 'http://%[1]s:8080/dial?request=x&protocol=udp&host=%[2]s&port=9&tries=1' >/dev/null 2>&1; `, ip, worldAddr)
		for _, d := range []struct{ proto, port string }{{"http", "8080"}, {"udp", "8081"}} {
			fmt.Fprintf(&script, `echo "pod%[2]s %[1]s $(timeout 8 wget -qO- 'http://%[1]s:8080/dial?request=hostname&protocol=%[2]s&host=unseen.%[3]s.svc.cluster.local&port=%[4]s&tries=1')"; `,
				ip, d.proto, ns, d.port)
		}
	}
	out, _ := c.run(10*time.Minute, "kubectl", "-n", ns, "exec", "client", "-c", "client", "--", "sh", "-c", script.String())
	t.Logf("the wave's flows:\n%s", out)
	for ip, pod := range ips {
		if !containsLine(out, "tcp "+ip+" "+pod) {
			t.Errorf("wave: %s (%s) did not answer over TCP:\n%s", pod, ip, out)
		}
	}
	before := 0
	for ip, n := range c.ctCount(node, ips) {
		t.Logf("wave: %d CT entries of %s (%s) after its flows", n, ip, ips[ip])
		before += n
	}
	if before == 0 {
		t.Fatalf("the CT on %s lists no entry of the wave's IPs after traffic to them: the checks could not fail", node)
	}
	natBefore := 0
	for _, n := range c.natCount(agent, ips) {
		natBefore += n
	}
	result(t, "unseen_wave_pods", perWave)
	result(t, "unseen_wave_ct_entries_before_del", before)
	result(t, "unseen_wave_nat_entries_before_del", natBefore)

	// Chain again; the DELs go through ctscrub as usual.
	c.rechain(node, file, orig, sidecar)
	if v := c.cniChained(node, 1, time.Minute); v != 1 {
		t.Fatalf("scrubd on %s reports ctscrub_cni_chained %v after %s was chained again", node, v, file)
	}
	if chain, err := c.chain(node); err != nil || strings.Join(chain, ",") != "cilium-cni,ctscrub" {
		t.Fatalf("%s on %s after re-chaining: chain %v (%v), want cilium-cni,ctscrub", file, node, chain, err)
	}
	mark := c.markScrubdLog(node)
	c.must(5*time.Minute, "kubectl", "-n", ns, "delete", "pod", "-l", "app=unseen-wave", "--wait=true", "--timeout=5m")

	// Stale: nothing of the wave's IPs left (30 s for late deletes, as the
	// churn allows).
	var left, natLeftOf map[string]int
	deadline := time.Now().Add(30 * time.Second)
	for {
		left, natLeftOf = map[string]int{}, map[string]int{}
		for ip, k := range c.ctCount(node, ips) {
			if k > 0 {
				left[ip] = k
			}
		}
		for ip, k := range c.natCount(agent, ips) {
			if k > 0 {
				natLeftOf[ip] = k
			}
		}
		if len(left)+len(natLeftOf) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(2 * time.Second)
	}
	stale, natLeft := 0, 0
	for ip, k := range left {
		stale += k
		t.Errorf("%d CT entries of %s (deleted unseen pod %s) left after its DEL; evidence:\n%s", k, ip, ips[ip], c.evidence(node, ip))
	}
	for ip, k := range natLeftOf {
		natLeft += k
		t.Errorf("%d SNAT lines of %s (deleted unseen pod %s) left in Cilium's NAT dump after its DEL", k, ip, ips[ip])
	}
	result(t, "unseen_wave_stale_entries", stale)
	result(t, "unseen_wave_nat_left", natLeft)

	// Reuse: every free address of the node's pod CIDR taken again, the
	// wave's among them.
	c.waitReleased(agent, ips)
	reused := c.fill(ns, "reuse", node, agent, e.clientImage)
	reusers := map[string]string{} // wave IP -> the pod that has it now
	for ip, pod := range reused {
		if ips[ip] != "" {
			reusers[ip] = pod
			t.Logf("reuse: %s has %s, held by unseen %s before", pod, ip, ips[ip])
		}
	}
	result(t, "unseen_wave_ips_reused", len(reusers))
	if len(reusers) == 0 {
		t.Errorf("no reusing pod got an address of the unseen wave %v: the reuse was not tested", ips)
	}
	// Inherited: before any packet of theirs, nothing in the CT of a
	// reusing pod's address.
	inherited := 0
	for ip, n := range c.ctCount(node, reusers) {
		if n > 0 {
			inherited += n
			t.Errorf("reusing pod %s (%s, unseen %s before) has %d CT entries before its first packet; evidence:\n%s", reusers[ip], ip, ips[ip], n, c.evidence(node, ip))
		}
	}
	result(t, "unseen_wave_inherited_entries", inherited)

	// The delegate's answers about the wave's IPs from the DELs on. The
	// agent asks at every endpoint delete and create; wait for an answer of
	// each delete and each reusing create to be logged.
	var byEvent map[string]map[string]int
	var detail []string
	deadline = time.Now().Add(time.Minute)
	for {
		byEvent, detail = waveAnswers(c.scrubdLogSince(mark), ips)
		del, add := 0, 0
		for _, n := range byEvent["endpoint-delete"] {
			del += n
		}
		for _, n := range byEvent["endpoint-create"] {
			add += n
		}
		if del >= len(ips) && add >= len(reusers) {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("scrubd logged %d endpoint-delete answers about the %d unseen IPs and %d endpoint-create answers about the %d reused ones: the agent did not ask for each", del, len(ips), add, len(reusers))
			break
		}
		time.Sleep(2 * time.Second)
	}
	answers := map[string]int{"index": 0, "sweep": 0, "incomplete": 0}
	for _, m := range byEvent {
		for k, n := range m {
			answers[k] += n
		}
	}
	t.Logf("delegate answers about the unseen wave's IPs, by event: %v\n%s", byEvent, strings.Join(detail, "\n"))
	// The CNI DEL scrubs of the wave (ctscrub's DEL runs before
	// cilium-cni's, chain DELs run in reverse), for the record.
	cniDels := map[string]int{} // method -> the CNI DEL scrubs of wave IPs
	for _, s := range scrubLinesOf(c.scrubdLogSince(mark)) {
		if s.ContainerID != "" && slices.ContainsFunc(s.IPs, func(ip string) bool { return ips[ip] != "" }) {
			t.Logf("CNI scrub of %v: reason %s backend %s method %s deleted %d result %s swept_why %v", s.IPs, s.Reason, s.Backend, s.Method, s.Deleted, s.Result, s.SweptWhy)
			if s.Reason == "del" && s.Backend == "cilium" {
				cniDels[s.Method]++
			}
		}
	}
	result(t, "unseen_wave_cni_del_scrubs", cniDels)
	result(t, "unseen_wave_answers", answers)
	result(t, "unseen_wave_answers_by_event", byEvent)
	if answers["index"] > 0 {
		t.Errorf("%d delegate answers about the unseen wave's IPs came from the index alone (%v): the index never saw those pods' flows", answers["index"], byEvent)
	}
}

// fill creates, on node, as many pods (label app=unseen-<name>) as its pod
// CIDR has free addresses (Cilium's allocator starts at a random offset:
// filling the range is what makes every free address taken), waits for
// them, and returns IP -> pod of those that got one.
func (c *cluster) fill(ns, name, node, agent, image string) map[string]string {
	c.t.Helper()
	return c.fillAs(ns, name, "unseen-"+name, node, agent, image)
}

// fillPods is fill with pods named <app>-<i>, label app=<app>.
func (c *cluster) fillPods(ns, app, node, agent, image string) map[string]string {
	c.t.Helper()
	return c.fillAs(ns, app, app, node, agent, image)
}

// fillAs is fill with pods named <name>-<i>, label app=<app>.
func (c *cluster) fillAs(ns, name, app, node, agent, image string) map[string]string {
	c.t.Helper()
	alloc, size := c.ipamAllocated(agent)
	free := size - alloc
	c.t.Logf("%s: %d of %d addresses allocated on %s: %d pods take every free one", name, alloc, size, node, free)
	var b strings.Builder
	for i := range free {
		fmt.Fprintf(&b, `apiVersion: v1
kind: Pod
metadata: {name: %[5]s-%[1]d, namespace: %[2]s, labels: {app: %[6]s}}
spec:
  nodeName: %[3]s
  terminationGracePeriodSeconds: 1
  containers:
    - {name: sleep, image: %[4]s, imagePullPolicy: IfNotPresent, command: ["sleep", "36000"]}
---
`, i, ns, node, image, name, app)
	}
	c.kubectl("apply", "-f", writeFile(c.t, c.t.TempDir(), name+".yaml", b.String()))
	// Done when every pod is Ready, or when the range is full and every
	// pod that got an address is Ready: an address taken meanwhile by
	// another pod (the agent's health endpoint, CoreDNS) leaves one of ours
	// without ("unable to allocate IP"; the full run of 13:41 UTC waited
	// 10 min for it). Those are deleted, so that they take no address
	// later.
	var noIP []string
	settledAt, settledSince := -1, time.Time{}
	eventually(c.t, c.ctx, 10*time.Minute, name+": pods on every free address of "+node, func() (bool, string) {
		out := c.kubectl("-n", ns, "get", "pods", "-l", "app="+app, "-o",
			`jsonpath={range .items[*]}{.metadata.name} {.status.conditions[?(@.type=="Ready")].status} {.status.podIP}{"\n"}{end}`)
		ready, withIP := 0, 0
		noIP = nil
		for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
			f := strings.Fields(l)
			switch {
			case len(f) == 3:
				withIP++
				if f[1] == "True" {
					ready++
				}
			case len(f) >= 1:
				noIP = append(noIP, f[0])
			}
		}
		if ready == free {
			return true, ""
		}
		// Full, and settled: Cilium allocates at the CNI ADD, before the
		// pod reports its address, so a full range with every addressed pod
		// Ready must hold for a while (pods still in their ADD show up).
		if n, size := c.ipamAllocated(agent); n >= size && ready == withIP {
			if withIP != settledAt || settledSince.IsZero() {
				settledAt, settledSince = withIP, time.Now()
			}
			if time.Since(settledSince) >= 20*time.Second {
				return true, ""
			}
		} else {
			settledSince = time.Time{}
		}
		return false, fmt.Sprintf("%d of %d Ready, %d with an address", ready, free, withIP)
	})
	if len(noIP) > 0 {
		c.t.Logf("%s: the range is full; %d pods got no address and are deleted: %v", name, len(noIP), noIP)
		c.must(5*time.Minute, "kubectl", append([]string{"-n", ns, "delete", "pod", "--wait=true"}, noIP...)...)
	}
	return c.podIPs(ns, "app="+app)
}

// waitReleased waits until Cilium's agent has none of ips allocated (other
// pods, CoreDNS, Cilium's health endpoint, take addresses meanwhile: a
// count would not say).
func (c *cluster) waitReleased(agent string, ips map[string]string) {
	c.t.Helper()
	eventually(c.t, c.ctx, 2*time.Minute, "Cilium ("+agent+") releases the deleted pods' addresses", func() (bool, string) {
		out := c.must(time.Minute, "kubectl", "-n", "kube-system", "exec", agent, "-c", "cilium-agent", "--", "cilium-dbg", "status", "--all-addresses")
		var held []string
		for ip, n := range countIPs(out, ips) {
			if n > 0 {
				held = append(held, ip)
			}
		}
		return len(held) == 0, fmt.Sprintf("still allocated: %v", held)
	})
}

// unchain pauses the ctscrub sidecar that re-chains it (SIGSTOP; a cleanup
// resumes it) and rewrites node's conflist without ctscrub. It returns the
// file, its original contents and the sidecar's PID in the node.
func (c *cluster) unchain(node string) (string, []byte, string) {
	c.t.Helper()
	file := c.runtimeConflist(node)
	orig := []byte(c.must(time.Minute, "docker", "exec", node, "cat", file))
	out, err := dropPlugin(orig, "ctscrub")
	if err != nil {
		c.t.Fatalf("%s on %s: %v", file, node, err)
	}
	pid := strings.TrimSpace(c.must(time.Minute, "docker", "exec", node, "sh", "-c",
		`id=$(crictl ps --name '^cni-conf$' --state running -q | head -n 1) && [ -n "$id" ] && `+
			`pid=$(crictl inspect --output go-template --template '{{.info.pid}}' "$id") && [ "$pid" -gt 1 ] && `+
			`kill -STOP "$pid" && echo "$pid"`))
	if _, err := strconv.Atoi(pid); err != nil {
		c.t.Fatalf("ctscrub's cni-conf sidecar on %s: PID %q", node, pid)
	}
	c.t.Cleanup(func() {
		// Whatever happened (the test's context may be over): the
		// original file back, the sidecar resumed.
		ctx := context.Background()
		if _, err := runCmd(ctx, time.Minute, c.env, c.root, "docker", writeNodeFileArgs(node, file, orig)...); err != nil {
			c.t.Errorf("restoring %s on %s: %v", file, node, err)
		}
		runCmd(ctx, time.Minute, c.env, c.root, "docker", "exec", node, "kill", "-CONT", pid)
	})
	eventually(c.t, c.ctx, 30*time.Second, "the cni-conf sidecar (PID "+pid+") stopped", func() (bool, string) {
		st, err := c.run(time.Minute, "docker", "exec", node, "grep", "^State:", "/proc/"+pid+"/status")
		return err == nil && strings.Contains(st, "stopped"), st
	})
	c.writeNodeFile(node, file, out)
	c.t.Logf("unchained %s on %s (cni-conf sidecar PID %s stopped):\n%s", file, node, pid, out)
	return file, orig, pid
}

// rechain writes node's original conflist back and resumes the sidecar.
func (c *cluster) rechain(node, file string, orig []byte, sidecar string) {
	c.t.Helper()
	c.writeNodeFile(node, file, orig)
	c.must(time.Minute, "docker", "exec", node, "kill", "-CONT", sidecar)
	c.t.Logf("chained %s on %s again (cni-conf sidecar PID %s resumed)", file, node, sidecar)
}

// runtimeConflist is the CNI config file the runtime uses on node: the
// first of /etc/cni/net.d by name (as scrubd's watch and containerd pick it).
func (c *cluster) runtimeConflist(node string) string {
	c.t.Helper()
	var names []string
	for _, n := range strings.Fields(c.must(time.Minute, "docker", "exec", node, "ls", "/etc/cni/net.d")) {
		if strings.HasSuffix(n, ".conflist") || strings.HasSuffix(n, ".conf") || strings.HasSuffix(n, ".json") {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	if len(names) == 0 {
		c.t.Fatalf("no CNI config in %s:/etc/cni/net.d", node)
	}
	return "/etc/cni/net.d/" + names[0]
}

// writeNodeFile replaces file on node with data through a temp file and a
// rename (the runtime never reads half a file).
func (c *cluster) writeNodeFile(node, file string, data []byte) {
	c.t.Helper()
	c.must(time.Minute, "docker", writeNodeFileArgs(node, file, data)...)
}

func writeNodeFileArgs(node, file string, data []byte) []string {
	return []string{"exec", node, "sh", "-c", `printf %s "$1" | base64 -d >"$2" && mv "$2" "$3"`,
		"sh", base64.StdEncoding.EncodeToString(data), file + ".ctscrub-e2e.tmp", file}
}

// dropPlugin is a conflist without its plugins of type typ.
func dropPlugin(conflist []byte, typ string) ([]byte, error) {
	var conf map[string]any
	if err := json.Unmarshal(conflist, &conf); err != nil {
		return nil, err
	}
	plugins, ok := conf["plugins"].([]any)
	if !ok {
		return nil, fmt.Errorf("no plugins list")
	}
	var kept []any
	for _, p := range plugins {
		if m, ok := p.(map[string]any); ok && m["type"] == typ {
			continue
		}
		kept = append(kept, p)
	}
	if len(kept) == len(plugins) {
		return nil, fmt.Errorf("no plugin of type %s to drop", typ)
	}
	conf["plugins"] = kept
	return json.MarshalIndent(conf, "", "  ")
}

// cniChained waits up to timeout for scrubd's ctscrub_cni_chained on node
// to be want, and returns its last value (-1: not exported).
func (c *cluster) cniChained(node string, want float64, timeout time.Duration) float64 {
	c.t.Helper()
	v := -1.0
	deadline := time.Now().Add(timeout)
	for {
		v = -1
		for _, l := range strings.Split(c.metrics(node), "\n") {
			if f := strings.Fields(l); len(f) == 2 && f[0] == "ctscrub_cni_chained" {
				v, _ = strconv.ParseFloat(f[1], 64)
			}
		}
		if v == want || time.Now().After(deadline) || c.ctx.Err() != nil {
			return v
		}
		time.Sleep(time.Second)
	}
}

var ipamRe = regexp.MustCompile(`IPv4:\s*(\d+)/(\d+) allocated`)

// ipamAllocated is the agent's IPv4 addresses allocated and the pool's size
// (`cilium-dbg status`: "IPv4: 5/30 allocated from 10.244.1.0/27").
func (c *cluster) ipamAllocated(agent string) (int, int) {
	c.t.Helper()
	out := c.must(time.Minute, "kubectl", "-n", "kube-system", "exec", agent, "-c", "cilium-agent", "--", "cilium-dbg", "status")
	n, size, err := parseIPAM(out)
	if err != nil {
		c.t.Fatalf("cilium-dbg status on %s: %v:\n%s", agent, err, out)
	}
	return n, size
}

func parseIPAM(status string) (int, int, error) {
	m := ipamRe.FindStringSubmatch(status)
	if m == nil {
		return 0, 0, fmt.Errorf("no \"IPv4: N/M allocated\"")
	}
	n, _ := strconv.Atoi(m[1])
	size, _ := strconv.Atoi(m[2])
	return n, size, nil
}

// podIPs is IP -> pod name of the pods with label sel that have an IP.
func (c *cluster) podIPs(ns, sel string) map[string]string {
	c.t.Helper()
	ips := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(c.kubectl("-n", ns, "get", "pods", "-l", sel,
		"-o", `jsonpath={range .items[*]}{.metadata.name} {.status.podIP}{"\n"}{end}`)), "\n") {
		if f := strings.Fields(l); len(f) == 2 {
			ips[f[1]] = f[0]
		}
	}
	return ips
}

// logMark is a place in the log of scrubd on a node.
type logMark struct {
	node, pod, restarts string
	lines               int
}

func (c *cluster) scrubdRestarts(pod string) string {
	c.t.Helper()
	return strings.TrimSpace(c.kubectl("-n", "kube-system", "get", "pod", pod, "-o",
		`jsonpath={.status.containerStatuses[?(@.name=="scrubd")].restartCount}`))
}

func (c *cluster) markScrubdLog(node string) logMark {
	c.t.Helper()
	pod := c.podOn("kube-system", "app.kubernetes.io/name=ctscrub", node)
	m := logMark{node: node, pod: pod, restarts: c.scrubdRestarts(pod)}
	m.lines = len(strings.Split(c.kubectl("-n", "kube-system", "logs", pod, "-c", "scrubd"), "\n")) - 1
	return m
}

// scrubdLogSince is scrubd's log on m's node from m on (a restarted scrubd:
// the rest of its previous log, then the new one).
func (c *cluster) scrubdLogSince(m logMark) string {
	c.t.Helper()
	pod := c.podOn("kube-system", "app.kubernetes.io/name=ctscrub", m.node)
	if pod != m.pod {
		c.t.Fatalf("ctscrub's pod on %s was replaced (%s, then %s): its log is gone", m.node, m.pod, pod)
	}
	from := func(log string, n int) string {
		lines := strings.Split(log, "\n")
		return strings.Join(lines[min(n, len(lines)):], "\n")
	}
	cur := c.kubectl("-n", "kube-system", "logs", pod, "-c", "scrubd")
	if c.scrubdRestarts(pod) == m.restarts {
		return from(cur, m.lines)
	}
	prev, _ := c.run(time.Minute, "kubectl", "-n", "kube-system", "logs", pod, "-c", "scrubd", "--previous")
	c.t.Logf("scrubd on %s restarted since the mark: its previous log and the current one", m.node)
	return from(prev, m.lines) + "\n" + cur
}

// scrubLinesOf is every "scrub" line of a scrubd log.
func scrubLinesOf(log string) []scrubLine {
	var found []scrubLine
	for _, l := range strings.Split(log, "\n") {
		var s scrubLine
		if json.Unmarshal([]byte(l), &s) == nil && s.Msg == "scrub" {
			found = append(found, s)
		}
	}
	return found
}

// delegateLine is scrubd's "delegate scrub" log line: one request of the
// delegate API and its answer per IP (scrubd/daemon/delegate.go).
type delegateLine struct {
	Msg        string `json:"msg"`
	Event      string `json:"event"`
	EndpointID int64  `json:"endpoint_id"`
	IPs        []struct {
		IP        string `json:"ip"`
		Complete  bool   `json:"complete"`
		CTDeleted int    `json:"ct_deleted"`
		Reason    string `json:"reason"`
	} `json:"ips"`
	Outcome string `json:"outcome"`
}

// waveAnswers counts, per event, the delegate's answers in log about the IPs
// of wave: "incomplete" (complete false), else the method of the scrub it
// ran ("index" or "sweep": the "scrub" line without a container ID, of that
// one IP, with the event's reason, logged last before the answer), or
// "unmatched" when no such line is found. detail has one line per answer.
func waveAnswers(log string, wave map[string]string) (map[string]map[string]int, []string) {
	byEvent := map[string]map[string]int{}
	var detail []string
	var scrubs []scrubLine // the delegate's scrub lines so far
	for _, l := range strings.Split(log, "\n") {
		var head struct {
			Msg string `json:"msg"`
		}
		if json.Unmarshal([]byte(l), &head) != nil {
			continue
		}
		switch head.Msg {
		case "scrub":
			var s scrubLine
			if json.Unmarshal([]byte(l), &s) == nil && s.ContainerID == "" && !s.DryRun && s.Backend == "cilium" && len(s.IPs) == 1 {
				scrubs = append(scrubs, s)
			}
		case "delegate scrub":
			var d delegateLine
			if json.Unmarshal([]byte(l), &d) != nil {
				continue
			}
			reason := "del"
			if d.Event == "endpoint-create" {
				reason = "add"
			}
			for _, a := range d.IPs {
				if wave[a.IP] == "" {
					continue
				}
				how := "incomplete"
				if a.Complete {
					how = "unmatched"
					for i := len(scrubs) - 1; i >= 0; i-- {
						if s := scrubs[i]; s.IPs[0] == a.IP && s.Reason == reason {
							how = s.Method
							break
						}
					}
				}
				if byEvent[d.Event] == nil {
					byEvent[d.Event] = map[string]int{}
				}
				byEvent[d.Event][how]++
				detail = append(detail, fmt.Sprintf("%s endpoint %d %s (was %s): %s, ct_deleted %d %s", d.Event, d.EndpointID, a.IP, wave[a.IP], how, a.CTDeleted, a.Reason))
			}
		}
	}
	return byEvent, detail
}

// TestParseUnseenWave runs everywhere (no cluster): the parsers of
// TestKindDelegateUnseenWave on scrubd's and Cilium's text.
func TestParseUnseenWave(t *testing.T) {
	log := strings.Join([]string{
		`{"time":"t","level":"INFO","msg":"scrub","ips":["10.244.1.7"],"reason":"del","backend":"cilium","method":"sweep","deleted":3,"result":"complete","dry_run":false,"container_id":"abc","swept_why":{"10.244.1.7":"owner"}}`,
		`{"time":"t","level":"INFO","msg":"scrub","ips":["10.244.1.7"],"reason":"del","backend":"cilium","method":"index","deleted":0,"result":"complete","dry_run":false,"container_id":""}`,
		`{"time":"t","level":"INFO","msg":"delegate scrub","caller":"cilium-agent","event":"endpoint-delete","endpoint_id":11,"ips":[{"ip":"10.244.1.7","complete":true,"ct_deleted":0,"nat_deleted":0,"reason":""}],"outcome":"complete"}`,
		`{"time":"t","level":"INFO","msg":"scrub","ips":["10.244.1.8"],"reason":"del","backend":"cilium","method":"sweep","deleted":4,"result":"complete","dry_run":false,"container_id":""}`,
		`{"time":"t","level":"INFO","msg":"delegate scrub","caller":"cilium-agent","event":"endpoint-delete","endpoint_id":12,"ips":[{"ip":"10.244.1.8","complete":true,"ct_deleted":4,"nat_deleted":1,"reason":""}],"outcome":"complete"}`,
		`{"time":"t","level":"INFO","msg":"scrub","ips":["10.244.1.7"],"reason":"add","backend":"cilium","method":"sweep","deleted":0,"result":"cancelled","dry_run":false,"container_id":""}`,
		`{"time":"t","level":"INFO","msg":"delegate scrub","caller":"cilium-agent","event":"endpoint-create","endpoint_id":13,"ips":[{"ip":"10.244.1.7","complete":false,"ct_deleted":0,"nat_deleted":0,"reason":"cancelled"}],"outcome":"incomplete"}`,
		`{"time":"t","level":"INFO","msg":"delegate scrub","caller":"cilium-agent","event":"endpoint-create","endpoint_id":14,"ips":[{"ip":"10.244.1.8","complete":true,"ct_deleted":0,"nat_deleted":0,"reason":""}],"outcome":"complete"}`,
		`{"time":"t","level":"INFO","msg":"delegate scrub","caller":"cilium-agent","event":"endpoint-create","endpoint_id":15,"ips":[{"ip":"10.244.1.9","complete":true,"ct_deleted":0,"nat_deleted":0,"reason":""}],"outcome":"complete"}`,
		`not json`,
	}, "\n")
	by, detail := waveAnswers(log, map[string]string{"10.244.1.7": "a", "10.244.1.8": "b"})
	want := map[string]map[string]int{
		"endpoint-delete": {"index": 1, "sweep": 1},
		"endpoint-create": {"incomplete": 1, "unmatched": 1},
	}
	if fmt.Sprint(by) != fmt.Sprint(want) {
		t.Errorf("waveAnswers: %v, want %v\n%s", by, want, strings.Join(detail, "\n"))
	}
	if len(detail) != 4 {
		t.Errorf("detail: %d lines, want 4:\n%s", len(detail), strings.Join(detail, "\n"))
	}
	if s := scrubLinesOf(log); len(s) != 4 || s[0].ContainerID != "abc" || s[0].SweptWhy["10.244.1.7"] != "owner" {
		t.Errorf("scrubLinesOf: %+v", s)
	}

	status := "KVStore:  Disabled\nKubernetes:  Ok  1.34 (v1.34.4) [linux/amd64]\nIPAM:   IPv4: 5/30 allocated from 10.244.1.0/27, \nRouting:  Network: Tunnel [vxlan]\n"
	if n, size, err := parseIPAM(status); err != nil || n != 5 || size != 30 {
		t.Errorf("parseIPAM: %d %d %v, want 5 30", n, size, err)
	}
	if _, _, err := parseIPAM("IPAM: disabled\n"); err == nil {
		t.Errorf("parseIPAM without a count: no error")
	}

	conf := []byte(`{"cniVersion":"0.3.1","name":"cilium","plugins":[{"type":"cilium-cni","enable-debug":false},{"type":"ctscrub","socket":"/run/ctscrub/scrubd.sock"}]}`)
	out, err := dropPlugin(conf, "ctscrub")
	if err != nil {
		t.Fatal(err)
	}
	var got struct {
		Name    string `json:"name"`
		Plugins []struct {
			Type string `json:"type"`
		} `json:"plugins"`
	}
	if err := json.Unmarshal(out, &got); err != nil || got.Name != "cilium" || len(got.Plugins) != 1 || got.Plugins[0].Type != "cilium-cni" {
		t.Errorf("dropPlugin: %s (%v)", out, err)
	}
	if _, err := dropPlugin(out, "ctscrub"); err == nil {
		t.Errorf("dropPlugin without the plugin: no error")
	}
}
