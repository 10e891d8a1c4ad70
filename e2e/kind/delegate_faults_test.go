package kind

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestKindDelegateFaults (issue 38): the patched agent in front of a
// delegate that fails, for real. On the worker, e2e/kind/fakedelegate
// (built here, CGO_ENABLED=0, `docker cp`'d into the node container and
// started with `docker exec -d`) takes the delegate socket from scrubd: it
// binds a socket next to scrubd's, with the same mode, root's, and renames
// it over /run/ctscrub-delegate/delegate.sock, so the agent's next
// connection reaches it. Two faults:
//
//  1. Hung: it accepts every connection, reads the request and never
//     answers. 10 pods are created on the worker one at a time (each Ready
//     before the next), then deleted: 20 scrubs, 4 times the breaker's
//     threshold of 5 consecutive failures. Checked: the agent's
//     ..._breaker_opens_total rose (breaker_open_count >= 1); its fallbacks
//     in the phase are only `timeout` (at least 5) and `breaker_open` (at
//     least 1) and one per scrub (hung_fallbacks); nothing was delegated;
//     the fake saw one request per timeout. max_wait_with_hung_delegate_s is
//     the longest the agent held one connection to the fake open: measured
//     by the fake, from accept to the agent's close (a connection still open
//     when the log is read counts up to then), i.e. how long one create or
//     delete waited on the delegate; it must not exceed the agent's timeout
//     (timeout_ms of its requests, at most 5 s) plus 0.5 s. The agent's own
//     view, coarser, must agree: every fallback observed in
//     ..._duration_seconds during the phase is in a bucket at most 5 s
//     (agent_wait_bucket_s), and so is every waitingForCTClean of the
//     phase's regenerations (ct_clean_wait_bucket_s; that histogram has no
//     per-regeneration values without the agent's debug log). Every pod
//     must get Ready.
//  2. Non-root: the same program binds the socket as root (so the file is
//     root's and passes the agent's owner and mode checks), drops to uid
//     and gid 65534 before listen() (so SO_PEERCRED names 65534), and
//     answers every request complete. 2 pods are created and deleted: the
//     agent must refuse it every time (untrusted_peer_refusals, at least one
//     per create and delete; no other cause but breaker_open), delegate
//     nothing, and send it no request (the fake counts connections and
//     requests); no pod may fail.
//
// After each fault the fake is SIGKILLed and its socket file removed;
// scrubd, which checks its socket's path every second, listens again on a
// new one (its log says so) in the same process, with its index: no scrubd
// restart, so the tests after this one find the node as it was. Then pods
// are created one at a time until the agent delegates a create again with
// its breaker closed (after the 30 s back-off its probe reaches scrubd).
// The test also starts with that wait: the churn before it kills scrubd on
// purpose. If the test stops early, a cleanup kills the fake, removes its
// socket and, if scrubd does not listen again within 30 s, deletes
// scrubd's pod so that the DaemonSet makes a new one.
//
// pods_failed counts the pods of both phases that did not get Ready or had a
// FailedCreatePodSandBox or FailedKillPod event. Runs only with
// CILIUM_DELEGATE=1. It sorts after TestKindChurn (churn_test.go) and
// before TestKindDelegateUnseenWave and TestKindUninstall.
func TestKindDelegateFaults(t *testing.T) {
	e := getKindEnv(t)
	e.skipUnlessCilium(t)
	if !e.delegate {
		t.Skip("CILIUM_DELEGATE=0: this test puts a hung and a non-root delegate in front of the agent's conntrack scrub delegate client, which only Cilium built with cilium/patches has (CILIUM_DELEGATE=1 make e2e-kind)")
	}
	c := e.newCluster(t, 25*time.Minute)
	const (
		ns          = "ctscrub-faults"
		hungPods    = 10
		nonrootPods = 2
	)
	node := e.worker
	c.kubectl("create", "namespace", ns)
	t.Cleanup(func() {
		c.run(3*time.Minute, "kubectl", "delete", "namespace", ns, "--wait=true", "--timeout=2m")
	})
	c.installFakeDelegate(node)
	details := map[string]any{}
	probes := map[string]int{}
	// From a delegating agent, breaker closed.
	probes["start"] = c.waitDelegating(node, ns, "start", 4*time.Minute)

	// 1. The hung delegate.
	before := c.ciliumCounts(node)
	hung := c.startFake(node, "hang", -1)
	var readyMax time.Duration
	var readyS []float64          // each hung-phase pod's, in creation order
	failed := map[string]string{} // pod -> why
	for i := range hungPods {
		pod := fmt.Sprintf("hung-%d", i)
		took, err := c.startPod(ns, pod, "faults-hung", node)
		if err != nil {
			failed[pod] = "not Ready"
			t.Errorf("pod %s with the delegate hung: %v", pod, err)
			continue
		}
		t.Logf("pod %s Ready %.1f s after its apply (hung delegate)", pod, took.Seconds())
		readyMax = max(readyMax, took)
		readyS = append(readyS, math.Round(took.Seconds()*10)/10)
	}
	delStart := time.Now()
	c.must(5*time.Minute, "kubectl", "-n", ns, "delete", "pod", "-l", "app=faults-hung", "--wait=true", "--timeout=4m")
	hungDelete := time.Since(delStart)
	// Every scrub of the phase falls back, once: wait for the last
	// deletes' to be counted.
	after := c.ciliumCountsAtLeast(node, before.fallbackTotal()+2*hungPods, 30*time.Second)
	conns := c.fakeConns(node, hung)
	c.stopFake(node, hung)
	probes["hung_restore"] = c.waitDelegating(node, ns, "hung-restore", 4*time.Minute)

	hungFallbacks := fallbackDelta(before, after)
	opens := int(after.breakerOpens - before.breakerOpens)
	timeouts, breakerOpen, other := 0, 0, 0
	for k, n := range hungFallbacks {
		switch {
		case strings.HasSuffix(k, "/timeout"):
			timeouts += n
		case strings.HasSuffix(k, "/breaker_open"):
			breakerOpen += n
		default:
			other += n
		}
	}
	asked, timeoutMs := 0, int64(0)
	var maxHeld float64
	for _, fc := range conns {
		if fc.Request {
			asked++
			timeoutMs = max(timeoutMs, fc.TimeoutMs)
		}
		if fc.Answered {
			t.Errorf("the hung fake answered connection %d", fc.Conn)
		}
		maxHeld = max(maxHeld, fc.HeldS)
		t.Logf("hung fake: connection %d %s endpoint %d %v: held %.3f s (open %v, request %v)", fc.Conn, fc.Event, fc.EndpointID, fc.IPs, fc.HeldS, fc.Open, fc.Request)
	}
	agentWait := after.waits["fallback"].sub(before.waits["fallback"])
	ctClean := after.ctClean.sub(before.ctClean)
	t.Logf("hung delegate: breaker opened %d times; fallbacks %v; the fake got %d connections, %d requests (timeout_ms %d), longest held %.3f s; the agent's fallback waits %v in all over %v, every one <= %v s; waitingForCTClean of %v regenerations <= %v s; pods Ready within %.1f s of their apply; deleted in %.1f s",
		opens, hungFallbacks, len(conns), asked, timeoutMs, maxHeld, agentWait.sum, agentWait.count, agentWait.maxBound(), ctClean.count, ctClean.maxBound(), readyMax.Seconds(), hungDelete.Seconds())
	if opens < 1 {
		t.Errorf("the agent's breaker did not open with the delegate hung for %d creates and %d deletes (breaker_opens_total %v -> %v)", hungPods, hungPods, before.breakerOpens, after.breakerOpens)
	}
	if timeouts < 5 || breakerOpen < 1 || other > 0 {
		t.Errorf("fallbacks with the delegate hung: %v; want only timeout (at least 5: the breaker's threshold) and breaker_open (at least 1)", hungFallbacks)
	}
	if n := timeouts + breakerOpen + other; n < 2*hungPods {
		t.Errorf("%d fallbacks for %d creates and %d deletes with the delegate hung: want one per scrub", n, hungPods, hungPods)
	}
	if d := deltaDelegated(before, after); d > 0 {
		t.Errorf("the agent counted %v scrubs delegated while the delegate never answered", d)
	}
	if asked != timeouts {
		t.Errorf("the hung fake got %d requests, the agent counted %d timeouts: want one request per timeout (the others not asked: breaker_open)", asked, timeouts)
	}
	bound := 5.0
	if timeoutMs <= 0 || timeoutMs > 5000 {
		t.Errorf("the agent's requests carry timeout_ms %d: want its timeout, at most 5000 (the patch's bound)", timeoutMs)
	} else {
		bound = float64(timeoutMs) / 1000
	}
	if maxHeld > bound+0.5 {
		t.Errorf("the agent held a connection to the hung delegate open %.3f s: more than its timeout %.3f s + 0.5 s", maxHeld, bound)
	}
	if b := agentWait.maxBound(); b > 5 {
		t.Errorf("the agent's ..._duration_seconds{outcome=\"fallback\"} during the phase has an observation above %v s (bucket bound %v s)", 5, b)
	}
	if b := ctClean.maxBound(); b > 5 {
		t.Errorf("waitingForCTClean during the phase has an observation above 5 s (bucket bound %v s)", b)
	}

	// 2. A socket root owns, served by uid 65534.
	before2 := c.ciliumCounts(node)
	nonroot := c.startFake(node, "answer", 65534)
	if nonroot.listening.UID != 65534 || nonroot.listening.EUID != 65534 || nonroot.listening.GID != 65534 {
		t.Fatalf("the non-root fake listens as uid %d euid %d gid %d: want 65534", nonroot.listening.UID, nonroot.listening.EUID, nonroot.listening.GID)
	}
	if nonroot.owner != "0 0" {
		t.Fatalf("the non-root fake's socket is owned by %q: want root's (0 0), so that only the peer check can refuse it", nonroot.owner)
	}
	for i := range nonrootPods {
		pod := fmt.Sprintf("nonroot-%d", i)
		if _, err := c.startPod(ns, pod, "faults-nonroot", node); err != nil {
			failed[pod] = "not Ready"
			t.Errorf("pod %s with a non-root delegate: %v", pod, err)
		}
	}
	c.must(5*time.Minute, "kubectl", "-n", ns, "delete", "pod", "-l", "app=faults-nonroot", "--wait=true", "--timeout=4m")
	after2 := c.ciliumCountsAtLeast(node, before2.fallbackTotal()+2*nonrootPods, 30*time.Second)
	conns2 := c.fakeConns(node, nonroot)
	c.stopFake(node, nonroot)
	probes["nonroot_restore"] = c.waitDelegating(node, ns, "nonroot-restore", 4*time.Minute)

	nonrootFallbacks := fallbackDelta(before2, after2)
	refusals, otherCause := 0, 0
	for k, n := range nonrootFallbacks {
		switch {
		case strings.HasSuffix(k, "/untrusted_peer"):
			refusals += n
		case strings.HasSuffix(k, "/breaker_open"):
		default:
			otherCause += n
		}
	}
	requests := 0
	for _, fc := range conns2 {
		if fc.Request {
			requests++
		}
	}
	t.Logf("non-root delegate: fallbacks %v; the fake got %d connections, %d requests", nonrootFallbacks, len(conns2), requests)
	if refusals < 2*nonrootPods || otherCause > 0 {
		t.Errorf("fallbacks with a socket served by uid 65534: %v; want untrusted_peer for each of %d creates and %d deletes (breaker_open aside), no other cause", nonrootFallbacks, nonrootPods, nonrootPods)
	}
	if d := deltaDelegated(before2, after2); d > 0 {
		t.Errorf("the agent counted %v scrubs delegated to a delegate served by uid 65534", d)
	}
	if len(conns2) == 0 {
		t.Errorf("the non-root fake got no connection: the agent did not get as far as the peer check")
	}
	if requests > 0 {
		t.Errorf("the agent sent %d requests to a delegate served by uid 65534: it must refuse the peer before sending", requests)
	}

	// Pods that failed on the way: a sandbox the runtime had to retry.
	for pod, why := range c.podFailureEvents(ns) {
		if strings.HasPrefix(pod, "hung-") || strings.HasPrefix(pod, "nonroot-") {
			if failed[pod] == "" {
				failed[pod] = why
			}
			t.Errorf("pod %s: %s", pod, why)
		}
	}

	result(t, "breaker_open_count", opens)
	result(t, "max_wait_with_hung_delegate_s", round3(maxHeld))
	result(t, "hung_fallbacks", hungFallbacks)
	result(t, "untrusted_peer_refusals", refusals)
	result(t, "pods_failed", len(failed))
	details["hung_pods"] = hungPods
	details["hung_scrubs_asked"] = asked
	details["delegate_timeout_s"] = float64(timeoutMs) / 1000
	details["agent_wait_bucket_s"] = jsonBound(agentWait.maxBound())
	details["ct_clean_wait_bucket_s"] = jsonBound(ctClean.maxBound())
	details["hung_pod_ready_max_s"] = round3(readyMax.Seconds())
	details["hung_pod_ready_s"] = readyS
	details["hung_delete_s"] = round3(hungDelete.Seconds())
	details["nonroot_pods"] = nonrootPods
	details["nonroot_fallbacks"] = nonrootFallbacks
	details["nonroot_connections"] = len(conns2)
	details["nonroot_requests"] = requests
	details["restore_probe_pods"] = probes
	result(t, "delegate_faults", details)
}

const (
	// delegateSocket is the delegate socket of cluster.sh's Cilium values
	// and of ctscrub's chart (docs/delegate-api.md).
	delegateSocket = "/run/ctscrub-delegate/delegate.sock"
	// fakeDelegateBin is where the test puts e2e/kind/fakedelegate in the
	// node container (a name of at most 15 characters: pgrep -x matches
	// it).
	fakeDelegateBin = "/usr/local/bin/fakedelegate"
)

// installFakeDelegate builds e2e/kind/fakedelegate (static) and copies it
// into node.
func (c *cluster) installFakeDelegate(node string) {
	c.t.Helper()
	bin := filepath.Join(c.t.TempDir(), "fakedelegate")
	if _, err := runCmd(c.ctx, 10*time.Minute, append(c.env, "CGO_ENABLED=0"), c.root,
		"nice", "-n", "10", "go", "build", "-o", bin, "./e2e/kind/fakedelegate"); err != nil {
		c.t.Fatalf("building the fake delegate: %v", err)
	}
	c.must(time.Minute, "docker", "cp", bin, node+":"+fakeDelegateBin)
}

// fakeListening is the fake's "listening" log line.
type fakeListening struct {
	Msg        string `json:"msg"`
	Socket     string `json:"socket"`
	Mode       string `json:"mode"`
	SocketPerm string `json:"socket_perm"`
	UID        int    `json:"uid"`
	EUID       int    `json:"euid"`
	GID        int    `json:"gid"`
	PID        int    `json:"pid"`
}

// fakeDelegate is one run of the fake in a node.
type fakeDelegate struct {
	node, mode, log string
	listening       fakeListening
	// inode of the fake's socket, and of scrubd's it replaced; owner is
	// its "uid gid".
	inode, scrubdInode, owner string
	stopped                   bool
}

// socketStat is "inode uid gid perm type" of the delegate socket in node.
func (c *cluster) socketStat(ctx context.Context, node string) (string, error) {
	out, err := runCmd(ctx, time.Minute, c.env, c.root, "docker", "exec", node, "stat", "-c", "%i %u %g %a %F", delegateSocket)
	return strings.TrimSpace(out), err
}

// startFake starts the fake in node in mode (with runAs >= 0: dropping to
// that uid before listen()), waits for it to listen, and checks it took the
// socket over: a new inode, the old one's mode. A cleanup stops it and
// gives scrubd its socket back if the test does not.
func (c *cluster) startFake(node, mode string, runAs int) *fakeDelegate {
	c.t.Helper()
	old, err := c.socketStat(c.ctx, node)
	if err != nil {
		c.t.Fatalf("scrubd's delegate socket on %s: %v", node, err)
	}
	f := &fakeDelegate{node: node, mode: mode, log: "/tmp/ctscrub-fakedelegate-" + mode + ".log"}
	of := strings.Fields(old)
	if len(of) < 4 || !strings.Contains(old, "socket") {
		c.t.Fatalf("%s on %s: %q, want a socket", delegateSocket, node, old)
	}
	f.scrubdInode = of[0]
	c.must(time.Minute, "docker", "exec", "-d", node, "sh", "-c", fmt.Sprintf("exec %s -socket %s -mode %s -run-as %d >%s 2>&1",
		fakeDelegateBin, delegateSocket, mode, runAs, f.log))
	c.t.Cleanup(func() { c.restoreDelegate(f) })
	eventually(c.t, c.ctx, 30*time.Second, "the fake delegate ("+mode+") listens on "+node, func() (bool, string) {
		out, err := c.run(time.Minute, "docker", "exec", node, "cat", f.log)
		if err != nil {
			return false, err.Error()
		}
		l, _, err := parseFakeLog(out, time.Now())
		if err != nil {
			return false, err.Error()
		}
		f.listening = l
		return true, ""
	})
	now, err := c.socketStat(c.ctx, node)
	if err != nil {
		c.t.Fatalf("the fake's socket on %s: %v", node, err)
	}
	nf := strings.Fields(now)
	if len(nf) < 4 || nf[0] == f.scrubdInode || nf[3] != of[3] {
		c.t.Fatalf("%s on %s after the fake started: %q (scrubd's was %q): want a new inode with scrubd's mode", delegateSocket, node, now, old)
	}
	f.inode, f.owner = nf[0], nf[1]+" "+nf[2]
	c.t.Logf("fake delegate (%s) on %s, PID %d, uid %d: %s took over %s from scrubd's %s", mode, node, f.listening.PID, f.listening.UID, now, delegateSocket, old)
	return f
}

// fakeConns reads the fake's connections from its log.
func (c *cluster) fakeConns(node string, f *fakeDelegate) []fakeConn {
	c.t.Helper()
	out := c.must(time.Minute, "docker", "exec", node, "cat", f.log)
	_, conns, err := parseFakeLog(out, time.Now())
	if err != nil {
		c.t.Fatalf("the fake's log on %s: %v", node, err)
	}
	return conns
}

// stopFake kills the fake and removes its socket file; scrubd then listens
// again on a new one, which the test waits for (its log says it).
func (c *cluster) stopFake(node string, f *fakeDelegate) {
	c.t.Helper()
	mark := c.markScrubdLog(node)
	if err := c.killFake(c.ctx, f); err != nil {
		c.t.Fatal(err)
	}
	f.stopped = true
	eventually(c.t, c.ctx, 30*time.Second, "scrubd on "+node+" listens again on "+delegateSocket, func() (bool, string) {
		st, err := c.socketStat(c.ctx, node)
		if err != nil {
			return false, err.Error()
		}
		log := c.scrubdLogSince(mark)
		relisten := false
		for _, l := range strings.Split(log, "\n") {
			if strings.Contains(l, "listening again") && strings.Contains(l, "ctscrub-delegate") {
				relisten = true
			}
		}
		fs := strings.Fields(st)
		return relisten && len(fs) > 0 && fs[0] != f.inode && fs[0] != f.scrubdInode, fmt.Sprintf("socket %q, scrubd logged re-listening: %v", st, relisten)
	})
}

// killFake SIGKILLs the fake (no cleanup of its own: it may have dropped
// root), waits for it to be gone, and removes its socket file: the file
// whose inode is the fake's, or, when the fake's is not known, any file
// there that is not scrubd's (scrubd makes a new one only when the path is
// empty).
func (c *cluster) killFake(ctx context.Context, f *fakeDelegate) error {
	pid := ""
	if f.listening.PID > 1 {
		pid = strconv.Itoa(f.listening.PID)
	}
	const script = `pids=$1 ino=$2 scrubd=$3 sock=$4
[ -n "$pids" ] || pids=$(pgrep -x "$5")
state() { sed -n 's/^State:[[:space:]]*//p' /proc/$1/status 2>/dev/null; }
for p in $pids; do kill -KILL "$p" 2>/dev/null; done
for p in $pids; do
	for i in $(seq 50); do case "$(state $p)" in ""|Z*) break;; esac; sleep 0.1; done
	case "$(state $p)" in ""|Z*) ;; *) echo "fake delegate $p still running"; exit 1;; esac
done
cur=$(stat -c %i "$sock" 2>/dev/null)
if [ -n "$cur" ] && { [ "$cur" = "$ino" ] || { [ -z "$ino" ] && [ "$cur" != "$scrubd" ]; }; }; then rm -f "$sock"; fi
rm -f "$sock.fake"`
	if _, err := runCmd(ctx, time.Minute, c.env, c.root, "docker", "exec", f.node, "sh", "-c", script, "sh",
		pid, f.inode, f.scrubdInode, delegateSocket, filepath.Base(fakeDelegateBin)); err != nil {
		return fmt.Errorf("stopping the fake delegate on %s: %v", f.node, err)
	}
	return nil
}

// restoreDelegate is startFake's cleanup: when the test stopped before
// stopFake, it kills the fake, removes its socket and waits up to 30 s for
// scrubd to listen again; failing that, it deletes scrubd's pod, whose
// replacement makes the socket.
func (c *cluster) restoreDelegate(f *fakeDelegate) {
	if f.stopped {
		return
	}
	ctx := context.Background()
	if err := c.killFake(ctx, f); err != nil {
		c.t.Errorf("%v", err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		// killFake left the path empty for scrubd, or never found the
		// fake's file there (then scrubd's is still there).
		if st, err := c.socketStat(ctx, f.node); err == nil && st != "" && !strings.HasPrefix(st, f.inode+" ") {
			c.t.Logf("cleanup: %s on %s is %s again (the fake's was %s)", delegateSocket, f.node, st, f.inode)
			return
		}
		time.Sleep(2 * time.Second)
	}
	out, _ := runCmd(ctx, time.Minute, c.env, c.root, "kubectl", "-n", "kube-system", "get", "pods", "-l", "app.kubernetes.io/name=ctscrub",
		"--field-selector", "spec.nodeName="+f.node, "-o", "jsonpath={.items[0].metadata.name}")
	if pod := strings.TrimSpace(out); pod != "" {
		c.t.Logf("cleanup: scrubd on %s did not listen again on %s within 30 s: deleting its pod %s", f.node, delegateSocket, pod)
		runCmd(ctx, 3*time.Minute, c.env, c.root, "kubectl", "-n", "kube-system", "delete", "pod", pod, "--wait=true")
		runCmd(ctx, 5*time.Minute, c.env, c.root, "kubectl", "-n", "kube-system", "rollout", "status", "ds/ctscrub", "--timeout=4m")
	}
}

// faultPod is a pod on node that sleeps.
func faultPod(ns, name, app, node, image string) string {
	return fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {name: %[2]s, namespace: %[1]s, labels: {app: %[3]s}}
spec:
  nodeName: %[4]s
  terminationGracePeriodSeconds: 1
  containers:
    - {name: sleep, image: %[5]s, imagePullPolicy: IfNotPresent, command: ["sleep", "36000"]}
`, ns, name, app, node, image)
}

// startPod creates one pod and waits for it to be Ready; it returns how long
// that took from before its apply.
func (c *cluster) startPod(ns, name, app, node string) (time.Duration, error) {
	c.t.Helper()
	start := time.Now()
	c.kubectl("apply", "-f", writeFile(c.t, c.t.TempDir(), name+".yaml", faultPod(ns, name, app, node, c.e.clientImage)))
	_, err := c.run(3*time.Minute, "kubectl", "-n", ns, "wait", "--for=condition=Ready", "pod/"+name, "--timeout=2m")
	return time.Since(start), err
}

// waitDelegating creates pods on node one at a time (each deleted before
// the next; its delete is a scrub too) until the agent has delegated a
// create again with its breaker closed, and returns how many it took. An
// open breaker asks the delegate again only 30 s after it opened.
func (c *cluster) waitDelegating(node, ns, name string, limit time.Duration) int {
	c.t.Helper()
	start := c.ciliumCounts(node)
	deadline := time.Now().Add(limit)
	for i := 1; ; i++ {
		pod := fmt.Sprintf("%s-%d", name, i)
		if _, err := c.startPod(ns, pod, "faults-probe", node); err != nil {
			c.t.Fatalf("probe pod %s: %v", pod, err)
		}
		d := c.ciliumCounts(node)
		c.must(3*time.Minute, "kubectl", "-n", ns, "delete", "pod", pod, "--wait=true", "--timeout=2m")
		if d.breakerOpen == 0 && d.delegated["endpoint-create"] > start.delegated["endpoint-create"] {
			c.t.Logf("%s: the agent on %s delegates again (breaker closed) after %d probe pods: delegated %v, fallbacks %v", name, node, i, d.delegated, d.fallbacks)
			return i
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("%s: the agent on %s did not delegate a create with its breaker closed within %s (%d probe pods): breaker_open %v, delegated %v, fallbacks %v", name, node, limit, i, d.breakerOpen, d.delegated, d.fallbacks)
		}
		select {
		case <-c.ctx.Done():
		case <-time.After(5 * time.Second):
		}
	}
}

// ciliumCountsAtLeast reads the agent's counters until its fallbacks reach
// want, for at most timeout, and returns the last reading.
func (c *cluster) ciliumCountsAtLeast(node string, want float64, timeout time.Duration) delegateCounts {
	c.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		d := c.ciliumCounts(node)
		if d.fallbackTotal() >= want || time.Now().After(deadline) {
			return d
		}
		time.Sleep(2 * time.Second)
	}
}

// podFailureEvents is pod -> the reasons of its FailedCreatePodSandBox and
// FailedKillPod events in ns.
func (c *cluster) podFailureEvents(ns string) map[string]string {
	c.t.Helper()
	out := c.kubectl("-n", ns, "get", "events", "-o", "json")
	failed, err := podFailuresOf(out)
	if err != nil {
		c.t.Fatalf("events of %s: %v", ns, err)
	}
	return failed
}

func podFailuresOf(eventsJSON string) (map[string]string, error) {
	var list struct {
		Items []struct {
			Reason         string `json:"reason"`
			Message        string `json:"message"`
			InvolvedObject struct {
				Kind string `json:"kind"`
				Name string `json:"name"`
			} `json:"involvedObject"`
		} `json:"items"`
	}
	if err := json.Unmarshal([]byte(eventsJSON), &list); err != nil {
		return nil, err
	}
	failed := map[string]string{}
	for _, ev := range list.Items {
		if ev.InvolvedObject.Kind == "Pod" && (ev.Reason == "FailedCreatePodSandBox" || ev.Reason == "FailedKillPod") && failed[ev.InvolvedObject.Name] == "" {
			failed[ev.InvolvedObject.Name] = ev.Reason + ": " + ev.Message
		}
	}
	return failed, nil
}

// fakeConn is one connection the fake accepted, from its log.
type fakeConn struct {
	Conn     int
	Accepted time.Time
	// HeldS is how long the connection was open: until the fake saw it
	// close, or until now for one still open.
	HeldS      float64
	Open       bool
	Request    bool
	Answered   bool
	Event      string
	EndpointID int64
	IPs        []string
	TimeoutMs  int64
}

// parseFakeLog reads the fake's log: its "listening" line, and its
// connections in the order it accepted them. Lines that are not JSON (a Go
// panic, a shell's error) are skipped; no "listening" line is an error.
func parseFakeLog(log string, now time.Time) (fakeListening, []fakeConn, error) {
	var listening fakeListening
	byConn := map[int]*fakeConn{}
	var order []int
	for _, l := range strings.Split(log, "\n") {
		var m struct {
			Msg        string   `json:"msg"`
			Conn       int      `json:"conn"`
			At         string   `json:"at"`
			Accepted   string   `json:"accepted"`
			HeldS      float64  `json:"held_s"`
			Request    bool     `json:"request"`
			Answered   bool     `json:"answered"`
			Event      string   `json:"event"`
			EndpointID int64    `json:"endpoint_id"`
			IPs        []string `json:"ips"`
			TimeoutMs  int64    `json:"timeout_ms"`
		}
		if json.Unmarshal([]byte(l), &m) != nil {
			continue
		}
		conn := func() *fakeConn {
			fc := byConn[m.Conn]
			if fc == nil {
				fc = &fakeConn{Conn: m.Conn}
				byConn[m.Conn] = fc
				order = append(order, m.Conn)
			}
			return fc
		}
		switch m.Msg {
		case "listening":
			if err := json.Unmarshal([]byte(l), &listening); err != nil {
				return listening, nil, err
			}
		case "accepted":
			fc := conn()
			t, err := time.Parse(time.RFC3339Nano, m.At)
			if err != nil {
				return listening, nil, fmt.Errorf("line %q: %v", l, err)
			}
			fc.Accepted, fc.Open = t, true
		case "closed":
			fc := conn()
			t, err := time.Parse(time.RFC3339Nano, m.Accepted)
			if err != nil {
				return listening, nil, fmt.Errorf("line %q: %v", l, err)
			}
			*fc = fakeConn{Conn: m.Conn, Accepted: t, HeldS: m.HeldS, Request: m.Request, Answered: m.Answered,
				Event: m.Event, EndpointID: m.EndpointID, IPs: m.IPs, TimeoutMs: m.TimeoutMs}
		}
	}
	if listening.Msg != "listening" {
		return listening, nil, fmt.Errorf("no \"listening\" line in the fake's log:\n%s", tail([]byte(log)))
	}
	sort.Ints(order)
	conns := make([]fakeConn, 0, len(order))
	for _, n := range order {
		fc := *byConn[n]
		if fc.Open {
			fc.HeldS = now.Sub(fc.Accepted).Seconds()
		}
		conns = append(conns, fc)
	}
	return listening, conns, nil
}

// fallbackDelta is the fallbacks ("event/cause" -> walks) counted between
// two readings of one agent.
func fallbackDelta(before, after delegateCounts) map[string]int {
	d := map[string]int{}
	for k, v := range after.fallbacks {
		if n := int(v - before.fallbacks[k]); n != 0 {
			d[k] = n
		}
	}
	return d
}

func deltaDelegated(before, after delegateCounts) float64 {
	var n float64
	for k, v := range after.delegated {
		n += v - before.delegated[k]
	}
	return n
}

func round3(x float64) float64 { return math.Round(x*1000) / 1000 }

// jsonBound is a histogram bound for the JSON line, which has no +Inf.
func jsonBound(b float64) any {
	if math.IsInf(b, 1) {
		return "+Inf"
	}
	return b
}

// TestParseFakeLog runs everywhere (no cluster): the fake's log as
// e2e/kind/fakedelegate writes it, and Kubernetes' events.
func TestParseFakeLog(t *testing.T) {
	log := strings.Join([]string{
		`{"euid":0,"gid":0,"mode":"hang","msg":"listening","pid":4242,"socket":"/run/ctscrub-delegate/delegate.sock","socket_perm":"0600","uid":0}`,
		`{"at":"2026-12-03T20:00:00.000000000Z","conn":1,"msg":"accepted"}`,
		`{"at":"2026-12-03T20:00:01.000000000Z","conn":2,"msg":"accepted"}`,
		`{"accepted":"2026-12-03T20:00:00.000000000Z","answered":false,"at":"2026-12-03T20:00:01.002Z","conn":1,"endpoint_id":310,"event":"endpoint-create","held_s":1.002,"ips":["10.244.1.7"],"method":"POST","msg":"closed","path":"/v1/conntrack/scrub","request":true,"timeout_ms":1000}`,
		`{"at":"2026-12-03T20:00:02.000000000Z","conn":3,"msg":"accepted"}`,
		`{"accepted":"2026-12-03T20:00:02.000000000Z","answered":false,"at":"2026-12-03T20:00:02.001Z","conn":3,"held_s":0.001,"msg":"closed","read_error":"EOF","request":false}`,
		`panic: something`,
	}, "\n")
	now := time.Date(2026, 12, 3, 20, 0, 4, 0, time.UTC)
	l, conns, err := parseFakeLog(log, now)
	if err != nil {
		t.Fatal(err)
	}
	if l.PID != 4242 || l.UID != 0 || l.Mode != "hang" || l.SocketPerm != "0600" {
		t.Errorf("listening %+v", l)
	}
	if len(conns) != 3 {
		t.Fatalf("conns %+v, want 3", conns)
	}
	if c := conns[0]; c.Conn != 1 || c.Open || !c.Request || c.HeldS != 1.002 || c.Event != "endpoint-create" || c.EndpointID != 310 || c.TimeoutMs != 1000 || len(c.IPs) != 1 {
		t.Errorf("conn 1: %+v", c)
	}
	if c := conns[1]; c.Conn != 2 || !c.Open || c.Request || c.HeldS != 3 {
		t.Errorf("conn 2 (still open, held until now): %+v", c)
	}
	if c := conns[2]; c.Conn != 3 || c.Open || c.Request || c.HeldS != 0.001 {
		t.Errorf("conn 3 (closed before a request): %+v", c)
	}
	if _, _, err := parseFakeLog("fakedelegate: bind: permission denied\n", now); err == nil {
		t.Errorf("a log without a listening line: no error")
	}

	events := `{"items":[
{"reason":"Scheduled","message":"x","involvedObject":{"kind":"Pod","name":"hung-1"}},
{"reason":"FailedCreatePodSandBox","message":"plugin type=\"cilium-cni\" failed","involvedObject":{"kind":"Pod","name":"hung-2"}},
{"reason":"FailedCreatePodSandBox","message":"again","involvedObject":{"kind":"Pod","name":"hung-2"}},
{"reason":"FailedKillPod","message":"y","involvedObject":{"kind":"Pod","name":"nonroot-0"}}]}`
	f, err := podFailuresOf(events)
	if err != nil {
		t.Fatal(err)
	}
	if len(f) != 2 || !strings.HasPrefix(f["hung-2"], "FailedCreatePodSandBox: plugin") || !strings.HasPrefix(f["nonroot-0"], "FailedKillPod") {
		t.Errorf("podFailuresOf: %v", f)
	}
	fd := fallbackDelta(delegateCounts{fallbacks: map[string]float64{"endpoint-create/timeout": 2}},
		delegateCounts{fallbacks: map[string]float64{"endpoint-create/timeout": 7, "endpoint-delete/breaker_open": 10}})
	if len(fd) != 2 || fd["endpoint-create/timeout"] != 5 || fd["endpoint-delete/breaker_open"] != 10 {
		t.Errorf("fallbackDelta: %v", fd)
	}
	if jsonBound(math.Inf(1)) != "+Inf" || jsonBound(2.5) != 2.5 || round3(1.00049) != 1 {
		t.Errorf("jsonBound, round3")
	}
}
