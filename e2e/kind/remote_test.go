package kind

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestKindRemoteBackend (issue 37, docs/remote.md): a client on one node
// keeps a UDP flow, from one source port, to a one-replica Service whose
// backend runs on the other node; the backend is deleted and, once its
// address has left the EndpointSlice, replaced. On the client's node:
//
//   - remote_entries_left: the client's CT entries towards the old backend's
//     address 2 s after the test's own EndpointSlice watch saw the address
//     leave the slice (Cilium: `cilium-dbg bpf ct list global` in the node's
//     agent; CNI=kindnet: `conntrack -L` in the node). Must be 0 with the
//     watch on;
//   - remote_blackhole_s: from the replacement backend being ready in the
//     slice (the test's watch) to the client's first answer from it;
//   - the backend is deleted gracefully (agnhost --delay-shutdown): for
//     seconds the slice lists it terminating but serving. Its client flow
//     must keep its entries all that time (on nf_conntrack the same entry,
//     by its ID), and scrubd on the client's node must not act on the
//     address before it left the slice (its log line's time): the test
//     fails if the watch acts on a `serving: true` endpoint.
//
// Both measured twice, in this order: with ctscrub's remote-backend watch
// off (`helm upgrade --reuse-values --set
// config.remote_backends.enabled=false`: the chart as an operator turns it
// off, the DaemonSet rolled by the config's checksum; the keys
// *_without_ctscrub), then on again (the e2e install's setting, cluster.sh).
// ctscrub itself runs in both: without the watch it scrubs the backend's IP
// on the backend's node only, which is what leaves the client's node's
// entries behind. The phase with the watch off must show entries left, or
// the test proves nothing.
//
// The client (e2e/kind/probe udp-redial) sends "hostname" every 200 ms and
// opens a new socket from the same port after an error that is not a
// timeout: with Cilium's socket LB (the default kube-proxy replacement) the
// agent destroys connected UDP sockets whose backend was deleted, and the
// next connect() picks a backend again.
func TestKindRemoteBackend(t *testing.T) {
	e := getKindEnv(t)
	if e.probeImage == "" {
		t.Fatal("PROBE_IMAGE is not set (images/build.sh builds it, cluster.sh loads it)")
	}
	c := e.newCluster(t, 30*time.Minute)
	// Not CTSCRUB_INSTALLED: with CNI=kindnet TestKindBlackhole installs
	// ctscrub after run.sh read the cluster's variables.
	if _, err := c.run(time.Minute, "kubectl", "-n", "kube-system", "get", "ds", "ctscrub"); err != nil {
		t.Fatalf("ctscrub is not installed (CNI=kindnet: TestKindBlackhole installs it; run.sh runs it first): %v", err)
	}
	server := e.cluster + "-control-plane"
	found := false
	for _, n := range e.nodes {
		found = found || n == server
	}
	if !found || len(e.nodes) < 2 {
		t.Fatalf("nodes %v: want the worker %s and the control plane %s", e.nodes, e.worker, server)
	}

	watchOn := true
	t.Cleanup(func() {
		if !watchOn {
			// Leave the cluster as the install made it for the tests after.
			if _, err := runCmd(context.Background(), 8*time.Minute, c.env, c.root, "helm", c.remoteToggleArgs(true)...); err != nil {
				t.Errorf("turning the remote-backend watch on again: %v", err)
			}
			runCmd(context.Background(), 6*time.Minute, c.env, c.root, "kubectl", "-n", "kube-system", "rollout", "status", "ds/ctscrub", "--timeout=6m")
		}
	})
	c.remoteWatch(false)
	watchOn = false
	without := c.remotePhase("without", server, false)
	logJSON(t, "without the watch", without)
	c.remoteWatch(true)
	watchOn = true
	with := c.remotePhase("with", server, true)
	logJSON(t, "with the watch", with)

	result(t, "remote_entries_left_without_ctscrub", without.EntriesLeft)
	result(t, "remote_entries_left", with.EntriesLeft)
	result(t, "remote_blackhole_s_without_ctscrub", without.BlackholeS)
	result(t, "remote_blackhole_s", with.BlackholeS)
	result(t, "remote_serving_entries_kept", with.ServingKept)
	result(t, "remote_backend", map[string]rbResult{"without_ctscrub": without, "with_ctscrub": with})

	if without.EntriesLeft == 0 {
		t.Errorf("without the watch the client's node kept no entry towards the deleted backend 2 s after it left the slice (%+v): nothing here shows the watch deleting any", without)
	}
	if with.EntriesLeft != 0 {
		t.Errorf("with the watch the client's node still held %d entries towards the deleted backend %.1f s after it left the slice, want 0 at 2 s: %+v", with.EntriesLeft, with.LeftReadAtS, with)
	}
	if !with.ServingKept {
		t.Errorf("with the watch the client's flow to the terminating but serving backend lost its entries, or scrubd acted on its address before it left the slice: %+v", with)
	}
	if with.ScrubdDeleted <= 0 {
		t.Errorf("with the watch scrubd on the client's node reports no deletion of the backend's address (remote_backends.last %+v)", with.ScrubdLast)
	}
	if with.BlackholeS < 0 || without.BlackholeS < 0 {
		t.Errorf("the client never reached the replacement backend (remote_blackhole_s %v with, %v without)", with.BlackholeS, without.BlackholeS)
	}
}

// rbResult is one phase of TestKindRemoteBackend.
type rbResult struct {
	// The client's entries towards the old backend on its node before the
	// deletion (so the checks can fail).
	EntriesBefore int `json:"entries_before"`
	// The slice listed the old backend terminating and serving this long
	// (the test's watch).
	ServingWindowS float64 `json:"serving_window_s"`
	// Reads of the client's node's table during that window, the fewest
	// entries towards the backend one of them found, the answers the
	// client got from the old backend meanwhile, and (nf_conntrack) how
	// many distinct entry IDs the flow had.
	ServingReads      int  `json:"serving_reads"`
	ServingMinEntries int  `json:"serving_min_entries"`
	ServingReplies    int  `json:"serving_replies_from_old"`
	ServingEntryIDs   int  `json:"serving_entry_ids,omitempty"`
	ServingActedEarly bool `json:"scrubd_acted_while_listed"`
	ServingKept       bool `json:"serving_entries_kept"`
	// After the address left the slice: the entries left at the read that
	// began LeftReadAtS s after it (2 s), and the end of the first read
	// that found none (-1: none did before that read).
	EntriesLeft int     `json:"entries_left"`
	LeftReadAtS float64 `json:"left_read_at_s"`
	GoneByS     float64 `json:"entries_gone_by_s"`
	// scrubd's own account on the client's node (with the watch):
	// remote_backends.last for the address.
	ScrubdLast    json.RawMessage `json:"scrubd_last,omitempty"`
	ScrubdSeconds float64         `json:"scrubd_seconds,omitempty"`
	ScrubdDeleted int             `json:"scrubd_deleted,omitempty"`
	// From the replacement ready in the slice to the client's first answer
	// from it (-1: none within 90 s), and the requests that failed in
	// between.
	BlackholeS     float64        `json:"blackhole_s"`
	FailedAfterNew map[string]int `json:"failed_after_ready"`
	// What the client got from the deletion to the replacement's answer.
	Outcomes map[string]int `json:"outcomes"`
}

// remoteToggleArgs is the helm upgrade that turns the watch on or off and
// keeps every other value of the install.
func (c *cluster) remoteToggleArgs(on bool) []string {
	return []string{"upgrade", "ctscrub", filepath.Join(c.root, "conf/chart"), "-n", "kube-system", "--reuse-values",
		"--set", "config.remote_backends.enabled=" + strconv.FormatBool(on)}
}

// remoteWatch turns the watch on or off by helm upgrade and waits until
// scrubd on every node runs so (`scrubd status --json`: remote_backends
// present and synced, or absent).
func (c *cluster) remoteWatch(on bool) {
	t := c.t
	t.Logf("helm upgrade: config.remote_backends.enabled=%v", on)
	c.must(8*time.Minute, "helm", c.remoteToggleArgs(on)...)
	c.must(6*time.Minute, "kubectl", "-n", "kube-system", "rollout", "status", "ds/ctscrub", "--timeout=6m")
	for _, node := range c.e.nodes {
		eventually(t, c.ctx, 3*time.Minute, fmt.Sprintf("scrubd on %s runs with the remote-backend watch %v", node, on), func() (bool, string) {
			var details []string
			ok := true
			pods := c.podsOn("kube-system", "app.kubernetes.io/name=ctscrub", node)
			if len(pods) != 1 {
				return false, fmt.Sprintf("ctscrub pods %v", pods)
			}
			st, err := c.scrubdStatus(pods[0])
			if err != nil {
				return false, err.Error()
			}
			switch {
			case on && st.RemoteBackends == nil:
				ok = false
				details = append(details, pods[0]+": no remote_backends")
			case on && !st.RemoteBackends.Synced:
				ok = false
				details = append(details, pods[0]+": not synced")
			case !on && st.RemoteBackends != nil:
				ok = false
				details = append(details, pods[0]+": remote_backends still on")
			}
			return ok, strings.Join(details, "; ")
		})
	}
}

// scrubdStatusOut is what the test reads of `scrubd status --json`.
type scrubdStatusOut struct {
	RemoteBackends *struct {
		Synced         bool            `json:"synced"`
		Scrubbed       uint64          `json:"scrubbed"`
		EntriesDeleted uint64          `json:"entries_deleted"`
		Last           json.RawMessage `json:"last"`
	} `json:"remote_backends"`
}

type remoteLast struct {
	Addr    string    `json:"addr"`
	Service string    `json:"service"`
	Since   time.Time `json:"since"`
	Done    time.Time `json:"done"`
	Seconds float64   `json:"seconds"`
	Deleted int       `json:"deleted"`
	Error   string    `json:"error"`
}

func (c *cluster) scrubdStatus(pod string) (scrubdStatusOut, error) {
	var st scrubdStatusOut
	out, err := c.run(time.Minute, "kubectl", "-n", "kube-system", "exec", pod, "-c", "scrubd", "--",
		"/usr/local/bin/scrubd", "status", "--json")
	if err != nil {
		return st, err
	}
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		return st, fmt.Errorf("%v: %s", err, out)
	}
	return st, nil
}

// remoteEntries reads the client node's table: the client's entries
// towards addr (Cilium's dump: lines naming both; nf_conntrack: the
// client's UDP entries whose original destination or reply source is
// addr) and, on nf_conntrack, their IDs.
func (c *cluster) remoteEntries(node, client, addr string) (int, []string, []string) {
	c.t.Helper()
	if c.e.nfct() {
		lines, ids := nfctTowards(c.conntrackL(node, "-p", "udp", "--orig-src", client, "-o", "id"), addr)
		return len(lines), lines, ids
	}
	lines := ciliumBetween(c.ctDump(c.podOn("kube-system", "k8s-app=cilium", node)), client, addr)
	return len(lines), lines, nil
}

// nfctTowards picks the lines of `conntrack -L -o id` whose original
// destination or reply source (the second src=) is addr, and their IDs.
func nfctTowards(out, addr string) (lines, ids []string) {
	idRE := regexp.MustCompile(`\bid=(\d+)`)
	for _, l := range strings.Split(out, "\n") {
		f := strings.SplitN(l, "src=", 3)
		if len(f) < 3 {
			continue
		}
		if strings.Contains(f[1], "dst="+addr+" ") || strings.HasPrefix(f[2], addr+" ") {
			lines = append(lines, strings.TrimSpace(l))
			if m := idRE.FindStringSubmatch(l); m != nil {
				ids = append(ids, m[1])
			}
		}
	}
	return lines, ids
}

// ciliumBetween picks the lines of Cilium's CT dump that name both a and b
// (each whole, not a prefix of a longer address).
func ciliumBetween(dump, a, b string) []string {
	ra := regexp.MustCompile(`(^|[^0-9.])` + regexp.QuoteMeta(a) + `([^0-9]|$)`)
	rb := regexp.MustCompile(`(^|[^0-9.])` + regexp.QuoteMeta(b) + `([^0-9]|$)`)
	var lines []string
	for _, l := range strings.Split(dump, "\n") {
		if ra.MatchString(l) && rb.MatchString(l) {
			lines = append(lines, strings.TrimSpace(l))
		}
	}
	return lines
}

// TestRemoteEntryParsers runs everywhere (no cluster).
func TestRemoteEntryParsers(t *testing.T) {
	ct := `udp      17 29 src=10.244.1.5 dst=10.96.12.7 sport=40000 dport=8081 src=10.244.0.7 dst=10.244.1.5 sport=8081 dport=40000 [ASSURED] mark=0 use=1 id=3141592
udp      17 29 src=10.244.1.5 dst=10.244.0.7 sport=40001 dport=8081 src=10.244.0.7 dst=10.244.1.5 sport=8081 dport=40001 mark=0 use=1 id=27
udp      17 29 src=10.244.1.5 dst=10.96.12.7 sport=40002 dport=8081 src=10.244.0.70 dst=10.244.1.5 sport=8081 dport=40002 mark=0 use=1 id=28
udp      17 29 src=10.244.1.5 dst=10.96.0.10 sport=40003 dport=53 src=10.244.0.3 dst=10.244.1.5 sport=53 dport=40003 mark=0 use=1 id=29
conntrack v1.4.8 (conntrack-tools): 4 flow entries have been shown.`
	lines, ids := nfctTowards(ct, "10.244.0.7")
	if len(lines) != 2 || strings.Join(ids, ",") != "3141592,27" {
		t.Errorf("nfctTowards: %d lines, ids %v; want 2 (DNATed to it, sent to it), ids 3141592,27", len(lines), ids)
	}
	dump := `UDP OUT 10.244.1.5:40000 -> 10.244.0.7:8081 expires=23565 Packets=0 Bytes=0 RxFlagsSeen=0x00 LastRxReport=0 TxFlagsSeen=0x00 LastTxReport=23505 Flags=0x0000 [ ] RevNAT=0 SourceSecurityID=41328 BackendID=0
UDP OUT 10.244.1.5:40000 -> 10.244.0.70:8081 expires=23565 Packets=0 Bytes=0
UDP OUT 10.244.1.50:40000 -> 10.244.0.7:8081 expires=23565 Packets=0 Bytes=0
UDP IN 10.244.0.7:8081 -> 10.244.1.5:40000 expires=23565 Packets=0 Bytes=0`
	if got := ciliumBetween(dump, "10.244.1.5", "10.244.0.7"); len(got) != 2 {
		t.Errorf("ciliumBetween: %q, want the first and the last line", got)
	}
}

// remotePhase runs one phase of TestKindRemoteBackend in its own namespace.
func (c *cluster) remotePhase(phase, serverNode string, watch bool) rbResult {
	t, e, node := c.t, c.e, c.e.worker
	ns := "rb-" + phase
	var r rbResult
	c.kubectl("create", "namespace", ns)
	t.Cleanup(func() { c.run(3*time.Minute, "kubectl", "delete", "namespace", ns, "--wait=true", "--timeout=3m") })
	// --delay-shutdown: at SIGTERM netexec keeps serving 8 s, so the slice
	// lists it terminating and serving (its readiness unchanged) until the
	// pod is gone.
	const delay = 8
	backend := func(name string) string {
		return fmt.Sprintf(`---
apiVersion: v1
kind: Pod
metadata: {name: %[1]s, namespace: %[2]s, labels: {app: rb-srv}}
spec:
  nodeName: %[3]s
  terminationGracePeriodSeconds: %[5]d
  containers:
    - {name: server, image: %[4]s, imagePullPolicy: IfNotPresent, args: ["netexec", "--http-port=8080", "--udp-port=8081", "--delay-shutdown=%[6]d"]}
`, name, ns, serverNode, e.serverImage, delay+10, delay)
	}
	c.kubectl("apply", "-f", writeFile(t, t.TempDir(), "rb.yaml", fmt.Sprintf(`apiVersion: v1
kind: Service
metadata: {name: rb, namespace: %[1]s}
spec:
  selector: {app: rb-srv}
  ports:
    - {name: udp, port: 8081, protocol: UDP}
`, ns)+backend("rb-s1")))
	sw := c.watchSlices(ns, "rb")
	c.must(5*time.Minute, "kubectl", "-n", ns, "wait", "--for=condition=Ready", "pod/rb-s1", "--timeout=5m")
	vip := strings.TrimSpace(c.kubectl("-n", ns, "get", "svc", "rb", "-o", "jsonpath={.spec.clusterIP}"))
	podIP := func(pod string) string {
		return strings.TrimSpace(c.kubectl("-n", ns, "get", "pod", pod, "-o", "jsonpath={.status.podIP}"))
	}
	s1IP := podIP("rb-s1")
	c.kubectl("apply", "-f", writeFile(t, t.TempDir(), "probe.yaml", fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {name: probe, namespace: %[1]s}
spec:
  nodeName: %[2]s
  terminationGracePeriodSeconds: 1
  containers:
    - {name: udp, image: %[3]s, imagePullPolicy: IfNotPresent, args: ["udp-redial", %[4]q, "8081", "40000"]}
`, ns, node, e.probeImage, vip)))
	c.must(5*time.Minute, "kubectl", "-n", ns, "wait", "--for=condition=Ready", "pod/probe", "--timeout=5m")
	clientIP := podIP("probe")
	t.Logf("%s: client %s on %s, Service %s:8081/UDP, backend rb-s1 %s on %s", phase, clientIP, node, vip, s1IP, serverNode)
	eventually(t, c.ctx, 2*time.Minute, phase+": the client reaches rb-s1", func() (bool, string) {
		l := c.probeLog(ns, "udp")
		if len(l) == 0 {
			return false, "no line yet"
		}
		return l[len(l)-1].Reply == "rb-s1", fmt.Sprintf("last line %+v", l[len(l)-1])
	})
	eventually(t, c.ctx, time.Minute, phase+": the client's node holds entries of its flow to rb-s1", func() (bool, string) {
		n, lines, _ := c.remoteEntries(node, clientIP, s1IP)
		r.EntriesBefore = n
		return n > 0, fmt.Sprintf("%d lines: %v", n, lines)
	})
	scrubdPod := c.podOn("kube-system", "app.kubernetes.io/name=ctscrub", node)

	// The deletion: the slice lists rb-s1 terminating and serving, then
	// drops it.
	tDel := time.Now()
	c.kubectl("-n", ns, "delete", "pod", "rb-s1", "--wait=false")
	tTerm := sw.until(tDel, time.Minute, phase+": the slice lists rb-s1 terminating and serving", func(eps []sliceEP) bool {
		for _, ep := range eps {
			if ep.Pod == "rb-s1" && ep.Terminating && ep.Serving {
				return true
			}
		}
		return false
	})
	gone := func(eps []sliceEP) bool {
		for _, ep := range eps {
			if ep.Addr == s1IP {
				return false
			}
		}
		return true
	}
	ids := map[string]bool{}
	r.ServingMinEntries = -1
	for !sw.seen(tTerm, gone) {
		start := time.Now()
		n, lines, idl := c.remoteEntries(node, clientIP, s1IP)
		if sw.seen(tTerm, gone) {
			break // the read may have met the deletion
		}
		r.ServingReads++
		if r.ServingMinEntries < 0 || n < r.ServingMinEntries {
			r.ServingMinEntries = n
		}
		for _, id := range idl {
			ids[id] = true
		}
		t.Logf("%s: %.1f s into the serving window: %d entries towards %s: %v", phase, start.Sub(tTerm).Seconds(), n, s1IP, lines)
		time.Sleep(500 * time.Millisecond)
	}
	tGone := sw.until(tTerm, time.Minute, phase+": rb-s1's address leaves the slice", gone)
	r.ServingWindowS = round1(tGone.Sub(tTerm).Seconds())
	r.ServingEntryIDs = len(ids)

	// 2 s after the address left the slice: reads until then, then the
	// one that counts.
	r.GoneByS = -1
	due := tGone.Add(2 * time.Second)
	var last time.Duration
	// Stop early enough that the read that counts begins at 2 s, not
	// after a read that ran past it.
	for time.Until(due) > last*3/2+200*time.Millisecond {
		start := time.Now()
		n, _, _ := c.remoteEntries(node, clientIP, s1IP)
		last = time.Since(start)
		if n == 0 && r.GoneByS < 0 {
			r.GoneByS = round1(time.Since(tGone).Seconds())
		}
	}
	time.Sleep(time.Until(due))
	start := time.Now()
	n, lines, _ := c.remoteEntries(node, clientIP, s1IP)
	r.EntriesLeft, r.LeftReadAtS = n, round1(start.Sub(tGone).Seconds())
	if n == 0 && r.GoneByS < 0 {
		r.GoneByS = round1(time.Since(tGone).Seconds())
	}
	t.Logf("%s: %d entries towards %s on %s %.1f s after it left the slice: %v", phase, n, s1IP, node, r.LeftReadAtS, lines)

	// What scrubd on the client's node did about the address: never while
	// a slice listed it.
	if watch {
		var last remoteLast
		eventually(t, c.ctx, 30*time.Second, phase+": scrubd on "+node+" reports the address's deletion", func() (bool, string) {
			st, err := c.scrubdStatus(scrubdPod)
			if err != nil {
				return false, err.Error()
			}
			if st.RemoteBackends == nil || len(st.RemoteBackends.Last) == 0 {
				return false, "no remote_backends.last"
			}
			r.ScrubdLast = st.RemoteBackends.Last
			if err := json.Unmarshal(st.RemoteBackends.Last, &last); err != nil {
				return false, err.Error()
			}
			return last.Addr == s1IP, string(st.RemoteBackends.Last)
		})
		r.ScrubdSeconds, r.ScrubdDeleted = math.Round(last.Seconds*1000)/1000, last.Deleted
	}
	for _, a := range c.remoteActions(scrubdPod, s1IP) {
		t.Logf("%s: scrubd on %s: %s", phase, node, a.raw)
		if a.t.Before(tGone) {
			r.ServingActedEarly = true
		}
	}

	// The replacement.
	c.kubectl("apply", "-f", writeFile(t, t.TempDir(), "s2.yaml", backend("rb-s2")))
	tReady := sw.until(tGone, 5*time.Minute, phase+": the slice lists rb-s2 ready", func(eps []sliceEP) bool {
		for _, ep := range eps {
			if ep.Pod == "rb-s2" && ep.Ready {
				return true
			}
		}
		return false
	})
	r.BlackholeS = -1
	var probe []probeLine
	deadline := time.Now().Add(90 * time.Second)
	for {
		probe = c.probeLog(ns, "udp")
		for _, l := range probe {
			if l.T.After(tGone) && l.OK && l.Reply == "rb-s2" {
				r.BlackholeS = math.Max(0, round1(l.T.Sub(tReady).Seconds()))
				r.Outcomes = outcomes(probe, tDel, l.T.Add(time.Millisecond), nil)
				r.FailedAfterNew = map[string]int{}
				for _, m := range probe {
					if m.T.After(tReady) && !m.T.After(l.T) && !m.OK {
						r.FailedAfterNew["err:"+m.Err]++
					}
				}
				break
			}
		}
		if r.BlackholeS >= 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(2 * time.Second)
	}
	if r.Outcomes == nil {
		r.Outcomes = outcomes(probe, tDel, time.Now(), nil)
	}
	for _, l := range probe {
		if l.T.After(tTerm) && l.T.Before(tGone) && l.OK && l.Reply == "rb-s1" {
			r.ServingReplies++
		}
	}
	r.ServingKept = r.ServingReads > 0 && r.ServingMinEntries > 0 && r.ServingReplies > 0 && !r.ServingActedEarly &&
		(!e.nfct() || r.ServingEntryIDs == 1)
	sw.stop()
	c.must(4*time.Minute, "kubectl", "delete", "namespace", ns, "--wait=true", "--timeout=3m")
	return r
}

// logJSON logs v as its JSON (the phase's figures as the result line has them).
func logJSON(t *testing.T, what string, v any) {
	t.Helper()
	b, _ := json.Marshal(v)
	t.Logf("%s: %s", what, b)
}

func round1(f float64) float64 { return math.Round(f*10) / 10 }

// remoteAction is one "remote backend left the cluster" line of scrubd.
type remoteAction struct {
	t   time.Time
	raw string
}

// remoteActions are scrubd's log lines (pod's scrubd container) about
// deleting addr's entries as a remote backend.
func (c *cluster) remoteActions(pod, addr string) []remoteAction {
	c.t.Helper()
	var acts []remoteAction
	for _, l := range strings.Split(c.kubectl("-n", "kube-system", "logs", pod, "-c", "scrubd"), "\n") {
		var m struct {
			Time time.Time `json:"time"`
			Msg  string    `json:"msg"`
			Addr string    `json:"addr"`
		}
		if json.Unmarshal([]byte(l), &m) != nil || m.Addr != addr || !strings.HasPrefix(m.Msg, "remote backend") {
			continue
		}
		acts = append(acts, remoteAction{t: m.Time, raw: l})
	}
	return acts
}

// sliceEP is one endpoint of a Service's EndpointSlices as the test's watch
// saw it.
type sliceEP struct {
	Addr, Pod                   string
	Ready, Serving, Terminating bool
}

// sliceWatch follows one Service's EndpointSlices (`kubectl get -w`), and
// keeps, for each event, the time it arrived and every endpoint of every
// slice after it.
type sliceWatch struct {
	c      *cluster
	cancel context.CancelFunc
	done   chan struct{}

	mu     sync.Mutex
	slices map[string][]sliceEP
	snaps  []sliceSnap
	err    error
}

type sliceSnap struct {
	t   time.Time
	eps []sliceEP
}

func (c *cluster) watchSlices(ns, svc string) *sliceWatch {
	c.t.Helper()
	ctx, cancel := context.WithCancel(c.ctx)
	w := &sliceWatch{c: c, cancel: cancel, done: make(chan struct{}), slices: map[string][]sliceEP{}}
	cmd := exec.CommandContext(ctx, "kubectl", "-n", ns, "get", "endpointslices", "-l", "kubernetes.io/service-name="+svc,
		"-w", "-o", "json", "--output-watch-events")
	cmd.Env = append(os.Environ(), c.env...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		c.t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		c.t.Fatalf("%s: %v", strings.Join(cmd.Args, " "), err)
	}
	c.t.Cleanup(w.stop)
	go func() {
		defer close(w.done)
		dec := json.NewDecoder(bufio.NewReader(out))
		for {
			var ev struct {
				Type   string `json:"type"`
				Object struct {
					Metadata struct {
						Name string `json:"name"`
					} `json:"metadata"`
					Endpoints []struct {
						Addresses  []string `json:"addresses"`
						Conditions struct {
							Ready, Serving, Terminating *bool
						} `json:"conditions"`
						TargetRef struct {
							Name string `json:"name"`
						} `json:"targetRef"`
					} `json:"endpoints"`
				} `json:"object"`
			}
			if err := dec.Decode(&ev); err != nil {
				w.mu.Lock()
				w.err = err
				w.mu.Unlock()
				cmd.Wait()
				return
			}
			now := time.Now()
			var eps []sliceEP
			for _, ep := range ev.Object.Endpoints {
				cond := func(b *bool, def bool) bool {
					if b == nil {
						return def
					}
					return *b
				}
				for _, a := range ep.Addresses {
					eps = append(eps, sliceEP{Addr: a, Pod: ep.TargetRef.Name,
						Ready:       cond(ep.Conditions.Ready, true),
						Serving:     cond(ep.Conditions.Serving, true),
						Terminating: cond(ep.Conditions.Terminating, false)})
				}
			}
			w.mu.Lock()
			if ev.Type == "DELETED" {
				delete(w.slices, ev.Object.Metadata.Name)
			} else {
				w.slices[ev.Object.Metadata.Name] = eps
			}
			var all []sliceEP
			for _, s := range w.slices {
				all = append(all, s...)
			}
			w.snaps = append(w.snaps, sliceSnap{t: now, eps: all})
			w.mu.Unlock()
			w.c.t.Logf("EndpointSlice %s %s at %s: %+v", ev.Type, ev.Object.Metadata.Name, now.Format("15:04:05.000"), eps)
		}
	}()
	return w
}

// first is the time of the first state of the slices from after on (an
// event received at or after it) that pred holds for.
func (w *sliceWatch) first(after time.Time, pred func([]sliceEP) bool) (time.Time, bool, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, s := range w.snaps {
		if !s.t.Before(after) && pred(s.eps) {
			return s.t, true, nil
		}
	}
	return time.Time{}, false, w.err
}

// seen says whether the slices were, from after on, once in a state pred
// holds for.
func (w *sliceWatch) seen(after time.Time, pred func([]sliceEP) bool) bool {
	_, ok, _ := w.first(after, pred)
	return ok
}

// until waits for the first state from after on that pred holds for and
// returns its time.
func (w *sliceWatch) until(after time.Time, timeout time.Duration, what string, pred func([]sliceEP) bool) time.Time {
	w.c.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		t, ok, err := w.first(after, pred)
		if ok {
			return t
		}
		if err != nil {
			w.c.t.Fatalf("%s: the EndpointSlice watch ended: %v", what, err)
		}
		if time.Now().After(deadline) || w.c.ctx.Err() != nil {
			w.c.t.Fatalf("%s: not within %s", what, timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (w *sliceWatch) stop() {
	w.cancel()
	<-w.done
}
