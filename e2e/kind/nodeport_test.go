package kind

import (
	"context"
	"encoding/json"
	"fmt"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"
)

// TestKindNodePortChurn (issue 35): a client off the cluster keeps sending
// to a NodePort Service whose backends, on the worker, are deleted and
// replaced by pods that take their addresses again.
//
// The client: npClients containers on kind's Docker network (not nodes, so
// no socket LB of Cilium's translates them at connect()), each running
// e2e/kind/probe's `udp` against the worker's address and the NodePort
// (one socket, one source port, a datagram every 200 ms). Their packets
// reach the worker's eth0, where bpf_host's NodePort path DNATs them to a
// local backend and creates the OUT entry {client, backend} (flag NodePort)
// before it hands the packet on (docs/recorder.md, "NodePort to a local
// backend"). Such a backend is what scrubd marks incomplete with feature
// nodeport_backends: the entries bpf_host makes for packets the pod never
// receives are in no index.
//
// The reuse: before the churn, pods fill every free address of the
// worker's pod CIDR (the ballast, kept to the end), so the addresses the
// deleted backends free are the only free ones, and the replacements must
// take them (Cilium's allocator picks at random).
//
// Per round (npRounds), with the client sending all along:
//   - every client flow is answered by one of the round's backends; the
//     entries of the backends' addresses naming a client address are
//     counted (nodeport_entries_before_del; those bpf_host made, flag
//     NodePort: nodeport_bpf_host_entries_before_del, must be > 0);
//   - the backends are deleted (all at once: the Service has none for a
//     few seconds); the test waits until the worker's agent no longer lists
//     their addresses as backends (`cilium-dbg service list`), after which
//     nothing can make an entry of them;
//   - Cilium's CT dump on the worker: every entry holding a deleted
//     backend's address is stale (nodeport_stale_entries_left, must be 0
//     within 30 s, as in the churn), except bpf_host's OUT entries, flag
//     NodePort, of a client flow, never answered (LastRxReport=0) and with
//     no IN entry in the dump: those are made after the DEL
//     (nodeport_entries_after_del), for packets that came between the
//     pod's endpoint going (the CNI DEL) and the agent dropping the
//     backend, and went nowhere. A delivered packet also makes bpf_lxc's
//     IN entry, gets an answer and is recorded, and the DEL's scrub
//     deletes all of it; stock Cilium's walk at the endpoint's deletion
//     runs before those packets too (measured 2026-12-03: every client
//     flow of a deleted backend left one, with or without the
//     nodeport_backends mark). They are what the reuse must not inherit;
//   - the replacements start outside the Service (label app=np-pending),
//     so no packet reaches them before the check: each one that took a
//     deleted backend's address must have no entry of it
//     (nodeport_inherited_entries, must be 0); then they are labelled into
//     the Service and are the next round's backends. Without the delegate
//     stock Cilium walks its CT at every endpoint create too, so only a
//     CILIUM_DELEGATE=1 run can find an inherited entry: there the agent
//     skips that walk when scrubd answers complete, and the entries made
//     after the DEL are gone only because the marked address's slot was
//     dropped, so the reuser's ADD swept. With the nodeport_backends
//     branch of scrubd's nodeReasonFor disabled (a scratch build, not
//     committed), CILIUM_DELEGATE=1 on 2026-12-03 found all 19 entries
//     made after the DELs inherited by the 6 reusing pods, every answer
//     from the index (docs/kind.md, "NodePort backends churned").
//
// How each deleted backend was scrubbed, from scrubd's log: the CNI DEL
// scrubs (nodeport_del_scrubs, by method: a marked backend sweeps), and
// with CILIUM_DELEGATE=1 the delegate's answers about the deleted
// addresses and the reusing pods (nodeport_delegate_answers, by event; a
// marked backend's endpoint-delete must be answered `incomplete`, so
// Cilium walks).
//
// Only with Cilium's NodePort on (kube-proxy replacement: CILIUM_LB=kpr or
// hostns); with CILIUM_LB=default kube-proxy serves NodePorts and Cilium
// has no NodePort path.
func TestKindNodePortChurn(t *testing.T) {
	e := getKindEnv(t)
	e.skipUnlessCilium(t)
	if e.ciliumLB == "default" {
		t.Skip("CILIUM_LB=default: kube-proxy serves NodePorts; Cilium's bpf_host has no NodePort path (ENABLE_NODEPORT off) to test")
	}
	if e.probeImage == "" {
		t.Fatal("PROBE_IMAGE is not set (images/build.sh builds it, cluster.sh loads it)")
	}
	c := e.newCluster(t, 15*time.Minute)
	const (
		ns        = "ctscrub-nodeport"
		npClients = 6
		npRounds  = 3
		perRound  = 2
		port      = "8081"
	)
	node := e.worker
	agent := c.podOn("kube-system", "k8s-app=cilium", node)
	c.kubectl("create", "namespace", ns)
	t.Cleanup(func() {
		c.run(3*time.Minute, "kubectl", "delete", "namespace", ns, "--wait=true", "--timeout=2m")
	})
	c.kubectl("apply", "-f", writeFile(t, t.TempDir(), "svc.yaml", fmt.Sprintf(`apiVersion: v1
kind: Service
metadata: {name: np, namespace: %s}
spec:
  type: NodePort
  selector: {app: np-backend}
  ports:
    - {name: udp, port: %s, protocol: UDP}
`, ns, port)))
	nodePort := strings.TrimSpace(c.kubectl("-n", ns, "get", "service", "np", "-o", "jsonpath={.spec.ports[0].nodePort}"))
	nodeIP := strings.TrimSpace(c.kubectl("get", "node", node, "-o", `jsonpath={.status.addresses[?(@.type=="InternalIP")].address}`))
	if nodePort == "" || nodeIP == "" {
		t.Fatalf("NodePort %q on node address %q", nodePort, nodeIP)
	}

	backends := func(gen int) string {
		var b strings.Builder
		for i := range perRound {
			fmt.Fprintf(&b, `apiVersion: v1
kind: Pod
metadata: {name: np-%[1]d-%[2]d, namespace: %[3]s, labels: {app: np-pending, gen: "%[1]d"}}
spec:
  nodeName: %[4]s
  terminationGracePeriodSeconds: 1
  containers:
    - {name: server, image: %[5]s, imagePullPolicy: IfNotPresent, args: ["netexec", "--http-port=8080", "--udp-port=%[6]s"]}
---
`, gen, i, ns, node, e.serverImage, port)
		}
		return b.String()
	}
	startGen := func(gen int) map[string]string {
		c.kubectl("apply", "-f", writeFile(t, t.TempDir(), fmt.Sprintf("gen%d.yaml", gen), backends(gen)))
		c.must(5*time.Minute, "kubectl", "-n", ns, "wait", "--for=condition=Ready", "pod", "-l", fmt.Sprintf("gen=%d", gen), "--timeout=5m")
		ips := c.podIPs(ns, fmt.Sprintf("gen=%d", gen))
		if len(ips) != perRound {
			t.Fatalf("generation %d: %d pod IPs (%v), want %d", gen, len(ips), ips, perRound)
		}
		return ips
	}
	join := func(gen int) {
		c.kubectl("-n", ns, "label", "pod", "-l", fmt.Sprintf("gen=%d", gen), "app=np-backend", "--overwrite")
	}

	cur := startGen(0)
	join(0)
	// The ballast: every other free address of the worker taken, so the
	// replacements take the deleted backends' addresses.
	ballast := c.fillPods(ns, "np-ballast", node, agent, e.clientImage)
	t.Logf("ballast: %d pods on %s", len(ballast), node)

	clients := c.startNodePortClients(npClients, nodeIP, nodePort)
	clientAddrs := map[string]bool{}
	for _, cl := range clients {
		clientAddrs[cl.addr] = true
	}

	var (
		churned, beforeDel, bpfHostBefore, afterDel, stale, inherited, reused int
		delScrubs                                                             = map[string]int{}
		answers                                                               = map[string]map[string]int{}
	)
	for r := range npRounds {
		gen := r
		// Every client flow answered by this round's backends.
		var served map[string]string // client -> backend pod
		eventually(t, c.ctx, 90*time.Second, fmt.Sprintf("round %d: every client flow answered by generation %d (%v)", r, gen, cur), func() (bool, string) {
			served = map[string]string{}
			for _, cl := range clients {
				if l := c.lastProbeLine(cl.name); l.OK && strings.HasPrefix(l.Reply, fmt.Sprintf("np-%d-", gen)) {
					served[cl.addr] = l.Reply
				}
			}
			return len(served) == len(clients), fmt.Sprintf("answered %v", served)
		})
		dump := c.ctDump(agent)
		n, k := nodePortBefore(dump, cur, clientAddrs)
		t.Logf("round %d: backends %v serve the clients %v; %d entries of theirs naming a client, %d of them bpf_host's (NodePort)", r, cur, served, n, k)
		if k == 0 {
			t.Errorf("round %d: no NodePort entry of the backends %v in Cilium's CT on %s while the clients send: the checks could not fail", r, cur, node)
		}
		beforeDel += n
		bpfHostBefore += k

		mark := c.markScrubdLog(node)
		c.must(5*time.Minute, "kubectl", "-n", ns, "delete", "pod", "-l", fmt.Sprintf("gen=%d", gen), "--wait=true", "--timeout=5m")
		churned += len(cur)
		// After the agent drops them as backends, nothing makes entries of
		// their addresses any more.
		eventually(t, c.ctx, time.Minute, fmt.Sprintf("round %d: Cilium's agent on %s lists none of %v as a backend", r, node, cur), func() (bool, string) {
			out := c.must(time.Minute, "kubectl", "-n", "kube-system", "exec", agent, "-c", "cilium-agent", "--", "cilium-dbg", "service", "list")
			var listed []string
			for ip, n := range countIPs(out, cur) {
				if n > 0 {
					listed = append(listed, ip)
				}
			}
			return len(listed) == 0, fmt.Sprintf("still listed: %v", listed)
		})
		var left map[string][]string
		var after int
		deadline := time.Now().Add(30 * time.Second)
		for {
			dump := c.ctDump(agent)
			left, after = map[string][]string{}, 0
			for ip := range cur {
				a, s := nodePortLeft(dump, ip, clientAddrs)
				after += len(a)
				if len(s) > 0 {
					left[ip] = s
				}
				for _, l := range a {
					t.Logf("round %d: made after the DEL of %s (%s): %s", r, ip, cur[ip], l)
				}
			}
			if len(left) == 0 || time.Now().After(deadline) {
				break
			}
			time.Sleep(2 * time.Second)
		}
		afterDel += after
		for ip, ls := range left {
			stale += len(ls)
			t.Errorf("round %d: %d CT entries of %s (deleted NodePort backend %s) left after its DEL:\n%s\nevidence:\n%s", r, len(ls), ip, cur[ip], strings.Join(ls, "\n"), c.evidence(node, ip))
		}

		// The replacements, on the freed addresses.
		c.waitReleased(agent, cur)
		next := startGen(gen + 1)
		reusers := map[string]string{}
		for ip, pod := range next {
			if cur[ip] != "" {
				reusers[ip] = pod
				t.Logf("round %d: %s has %s, NodePort backend %s before", r, pod, ip, cur[ip])
			}
		}
		if len(reusers) == 0 {
			t.Errorf("round %d: no replacement (%v) took an address of the deleted backends %v: the reuse was not tested", r, next, cur)
		}
		reused += len(reusers)
		for ip, k := range c.ctCount(node, reusers) {
			if k > 0 {
				inherited += k
				t.Errorf("round %d: %s (%s, NodePort backend %s before) has %d CT entries before its first packet; evidence:\n%s", r, reusers[ip], ip, cur[ip], k, c.evidence(node, ip))
			}
		}

		// How the deleted backends and the reusers were scrubbed.
		log := c.scrubdLogSince(mark)
		for _, s := range scrubLinesOf(log) {
			if s.ContainerID == "" || s.Reason != "del" || s.Backend != "cilium" || s.DryRun || !slices.ContainsFunc(s.IPs, func(ip string) bool { return cur[ip] != "" }) {
				continue
			}
			delScrubs[s.Method]++
			t.Logf("round %d: CNI DEL scrub of %v: method %s, deleted %d, result %s, swept_why %v", r, s.IPs, s.Method, s.Deleted, s.Result, s.SweptWhy)
		}
		if e.delegate {
			asked := map[string]string{}
			for ip, pod := range cur {
				asked[ip] = pod
			}
			var by map[string]map[string]int
			var detail []string
			// The agent asks at the endpoint deletes and the reusers'
			// creates; wait for an answer of each to be logged.
			deadline := time.Now().Add(time.Minute)
			for {
				by, detail = waveAnswers(c.scrubdLogSince(mark), asked)
				if sum(by["endpoint-delete"]) >= len(cur) && sum(by["endpoint-create"]) >= len(reusers) || time.Now().After(deadline) {
					break
				}
				time.Sleep(2 * time.Second)
			}
			t.Logf("round %d: delegate answers about %v: %v\n%s", r, cur, by, strings.Join(detail, "\n"))
			if sum(by["endpoint-delete"]) < len(cur) {
				t.Errorf("round %d: scrubd logged %d endpoint-delete answers about the %d deleted backends %v", r, sum(by["endpoint-delete"]), len(cur), cur)
			}
			if got := by["endpoint-delete"]["incomplete"]; got != sum(by["endpoint-delete"]) {
				t.Errorf("round %d: endpoint-delete answers about the deleted NodePort backends %v: %v, want all incomplete (nodeport_backends: Cilium walks)", r, cur, by["endpoint-delete"])
			}
			for ev, m := range by {
				if answers[ev] == nil {
					answers[ev] = map[string]int{}
				}
				for how, n := range m {
					answers[ev][how] += n
				}
			}
		}
		t.Logf("round %d: %d backends deleted, %d entries made after the DEL, %d stale, %d reused, inherited so far %d", r, len(cur), after, len(left), len(reusers), inherited)
		join(gen + 1)
		cur = next
	}

	result(t, "nodeport_client_flows", len(clients))
	result(t, "nodeport_backends_churned", churned)
	result(t, "nodeport_entries_before_del", beforeDel)
	result(t, "nodeport_bpf_host_entries_before_del", bpfHostBefore)
	result(t, "nodeport_entries_after_del", afterDel)
	result(t, "nodeport_stale_entries_left", stale)
	result(t, "nodeport_ips_reused", reused)
	result(t, "nodeport_inherited_entries", inherited)
	result(t, "nodeport_del_scrubs", delScrubs)
	if e.delegate {
		result(t, "nodeport_delegate_answers", answers)
	}
	if delScrubs["index"] > 0 {
		t.Errorf("CNI DEL scrubs of NodePort backends by method %v: a backend of a NodePort service must be marked nodeport_backends and swept, not scrubbed from the index", delScrubs)
	}
	if bpfHostBefore == 0 {
		t.Errorf("no bpf_host NodePort entry of any backend before its DEL: the test proves nothing")
	}
}

func sum(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

// npClient is one NodePort client: a container on kind's Docker network.
type npClient struct{ name, addr string }

// startNodePortClients runs n containers of the probe image on the kind
// nodes' Docker network, each sending UDP to addr:port from source port
// 41000+i, and removes them when the test ends (cluster.sh down removes
// any left, by label, before it deletes the network).
func (c *cluster) startNodePortClients(n int, addr, port string) []npClient {
	c.t.Helper()
	network := strings.TrimSpace(c.must(time.Minute, "docker", "inspect", c.e.worker, "-f",
		`{{range $k, $v := .NetworkSettings.Networks}}{{$k}} {{end}}`))
	if f := strings.Fields(network); len(f) != 1 {
		c.t.Fatalf("%s's Docker networks: %q, want one", c.e.worker, network)
	} else {
		network = f[0]
	}
	var out []npClient
	for i := range n {
		name := fmt.Sprintf("%s-npclient-%d", c.e.cluster, i)
		c.run(time.Minute, "docker", "rm", "-f", name)
		c.must(2*time.Minute, "docker", "run", "-d", "--name", name, "--network", network,
			"--label", "org.ctscrub.kind.cluster="+c.e.cluster,
			c.e.probeImage, "udp", addr, port, fmt.Sprint(41000+i))
		c.t.Cleanup(func() { runCmd(context.Background(), time.Minute, nil, c.root, "docker", "rm", "-f", name) })
		ip := strings.TrimSpace(c.must(time.Minute, "docker", "inspect", name, "-f",
			`{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}`))
		if ip == "" {
			c.t.Fatalf("client container %s has no address on %s", name, network)
		}
		out = append(out, npClient{name: name, addr: ip})
	}
	c.t.Logf("NodePort clients on Docker network %s: %v -> %s:%s", network, out, addr, port)
	return out
}

// lastProbeLine is the last line the probe in container name printed.
func (c *cluster) lastProbeLine(name string) probeLine {
	c.t.Helper()
	out, _ := c.run(time.Minute, "docker", "logs", "--tail", "3", name)
	var last probeLine
	for _, l := range strings.Split(out, "\n") {
		var p probeLine
		if json.Unmarshal([]byte(l), &p) == nil && !p.T.IsZero() {
			last = p
		}
	}
	return last
}

// ctLine is one line of `cilium-dbg bpf ct list global`:
// "UDP OUT 172.18.0.5:41000 -> 10.244.0.40:8081 expires=... [ NodePort ] ...".
type ctLine struct {
	proto, dir, src, dst string // src and dst are address:port
	nodePort, related    bool
	// answered: LastRxReport is not 0, the entry saw a packet of the
	// reverse direction (a reply from the backend).
	answered bool
}

var ctLineRe = regexp.MustCompile(`^(\S+) (IN|OUT|SVC|SERVICE) (\S+) -> (\S+)( related)?\s`)

func parseCTLine(l string) (ctLine, bool) {
	m := ctLineRe.FindStringSubmatch(l)
	if m == nil {
		return ctLine{}, false
	}
	return ctLine{proto: m[1], dir: m[2], src: m[3], dst: m[4], related: m[5] != "", nodePort: strings.Contains(l, "NodePort"),
		answered: !strings.Contains(l, " LastRxReport=0 ")}, true
}

func hostOf(addrPort string) string {
	if i := strings.LastIndexByte(addrPort, ':'); i >= 0 {
		return addrPort[:i]
	}
	return addrPort
}

// nodePortBefore counts the entries of a dump holding one of ips whose
// other end is a client address, and of those bpf_host's (flag NodePort).
func nodePortBefore(dump string, ips map[string]string, clients map[string]bool) (all, bpfHost int) {
	for _, l := range strings.Split(dump, "\n") {
		e, ok := parseCTLine(l)
		if !ok {
			continue
		}
		s, d := hostOf(e.src), hostOf(e.dst)
		if !(ips[s] != "" && clients[d] || ips[d] != "" && clients[s]) {
			continue
		}
		all++
		if e.nodePort {
			bpfHost++
		}
	}
	return all, bpfHost
}

// nodePortLeft sorts the lines of a dump holding ip into those bpf_host
// made after the backend's DEL (OUT, flag NodePort, from a client address,
// never answered (LastRxReport=0), and no IN entry of the same flow in the
// dump: no packet of it was delivered) and every other (stale).
func nodePortLeft(dump, ip string, clients map[string]bool) (afterDel, stale []string) {
	re := regexp.MustCompile(`(^|[^0-9.])` + regexp.QuoteMeta(ip) + `([^0-9]|$)`)
	in := map[string]bool{} // proto src dst of IN entries
	var lines []string
	for _, l := range strings.Split(dump, "\n") {
		if !re.MatchString(l) {
			continue
		}
		lines = append(lines, l)
		if e, ok := parseCTLine(l); ok && e.dir == "IN" && !e.related {
			in[e.proto+" "+e.src+" "+e.dst] = true
		}
	}
	for _, l := range lines {
		e, ok := parseCTLine(l)
		if ok && e.dir == "OUT" && e.nodePort && !e.related && !e.answered && clients[hostOf(e.src)] && hostOf(e.dst) == ip && !in[e.proto+" "+e.src+" "+e.dst] {
			afterDel = append(afterDel, l)
			continue
		}
		stale = append(stale, l)
	}
	sort.Strings(afterDel)
	sort.Strings(stale)
	return afterDel, stale
}

func TestNodePortEntries(t *testing.T) {
	clients := map[string]bool{"172.18.0.4": true, "172.18.0.5": true}
	ips := map[string]string{"10.244.0.57": "np-0-0", "10.244.0.53": "np-0-1"}
	before := `UDP OUT 172.18.0.4:41000 -> 10.244.0.57:8081 expires=22169 Packets=0 Bytes=0 RxFlagsSeen=0x00 LastRxReport=22109 TxFlagsSeen=0x00 LastTxReport=22109 Flags=0x0020 [ NodePort ] RevNAT=9 SourceSecurityID=2 BackendID=0 
UDP IN 172.18.0.4:41000 -> 10.244.0.57:8081 expires=22169 Packets=0 Bytes=0 RxFlagsSeen=0x00 LastRxReport=22109 TxFlagsSeen=0x00 LastTxReport=22109 Flags=0x0000 [ ] RevNAT=0 SourceSecurityID=2 BackendID=0 
ICMP IN 172.18.0.4:0 -> 10.244.0.57:0 related expires=22163 Packets=0 Bytes=0 RxFlagsSeen=0x00 LastRxReport=22103 TxFlagsSeen=0x00 LastTxReport=0 Flags=0x0000 [ ] RevNAT=0 SourceSecurityID=2 BackendID=0 
UDP OUT 172.18.0.5:41001 -> 10.244.0.53:8081 expires=22169 Packets=0 Bytes=0 RxFlagsSeen=0x00 LastRxReport=22106 TxFlagsSeen=0x00 LastTxReport=22106 Flags=0x0020 [ NodePort ] RevNAT=9 SourceSecurityID=2 BackendID=0 
UDP OUT 10.244.0.53:40000 -> 10.96.0.10:53 expires=22169 Packets=0 Bytes=0 Flags=0x0000 [ ] RevNAT=3 SourceSecurityID=2 BackendID=0 
UDP IN 172.18.0.9:41001 -> 10.244.0.99:8081 expires=22169 Packets=0 Bytes=0 Flags=0x0000 [ ] RevNAT=0 SourceSecurityID=2 BackendID=0 `
	if all, k := nodePortBefore(before, ips, clients); all != 4 || k != 2 {
		t.Errorf("nodePortBefore: %d entries, %d bpf_host's; want 4, 2", all, k)
	}
	// After the DEL: the OUT entry of 172.18.0.4:41000's flow alone is one
	// made after it.
	left := `UDP OUT 172.18.0.4:41000 -> 10.244.0.57:8081 expires=22178 Packets=0 Bytes=0 RxFlagsSeen=0x00 LastRxReport=0 TxFlagsSeen=0x00 LastTxReport=22118 Flags=0x0020 [ NodePort ] RevNAT=9
UDP OUT 172.18.0.5:41001 -> 10.244.0.57:8081 expires=22178 Packets=0 Bytes=0 RxFlagsSeen=0x00 LastRxReport=0 TxFlagsSeen=0x00 LastTxReport=22118 Flags=0x0020 [ NodePort ] RevNAT=9
UDP IN 172.18.0.5:41001 -> 10.244.0.57:8081 expires=22178 Packets=0 Bytes=0 RxFlagsSeen=0x00 LastRxReport=22118 TxFlagsSeen=0x00 LastTxReport=22118 Flags=0x0000 [ ] RevNAT=0
UDP OUT 172.18.0.4:41002 -> 10.244.0.57:8081 expires=22178 Packets=0 Bytes=0 RxFlagsSeen=0x00 LastRxReport=22110 TxFlagsSeen=0x00 LastTxReport=22110 Flags=0x0020 [ NodePort ] RevNAT=9
UDP OUT 10.244.0.57:40000 -> 10.96.0.10:53 expires=22169 Packets=0 Bytes=0 RxFlagsSeen=0x00 LastRxReport=0 TxFlagsSeen=0x00 LastTxReport=22110 Flags=0x0000 [ ] RevNAT=3
UDP OUT 172.18.0.4:41000 -> 10.244.0.570:8081 expires=22178 Packets=0 Bytes=0 RxFlagsSeen=0x00 LastRxReport=0 TxFlagsSeen=0x00 LastTxReport=22118 Flags=0x0020 [ NodePort ] RevNAT=9`
	after, stale := nodePortLeft(left, "10.244.0.57", clients)
	if len(after) != 1 || !strings.HasPrefix(after[0], "UDP OUT 172.18.0.4:41000 ") {
		t.Errorf("made after the DEL: %q, want the OUT entry of 172.18.0.4:41000", after)
	}
	// 172.18.0.5's OUT entry still has its IN twin, 172.18.0.4:41002's
	// was answered (a delivered flow's), and the DNS flow is the pod's own.
	if len(stale) != 4 {
		t.Errorf("stale: %q, want 4 lines", stale)
	}
	if a, s := nodePortLeft("", "10.244.0.57", clients); len(a)+len(s) != 0 {
		t.Errorf("empty dump: %q %q", a, s)
	}
}
