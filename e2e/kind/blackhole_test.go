package kind

import (
	"encoding/json"
	"fmt"
	"math"
	"net/netip"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"
)

// TestKindBlackhole (CNI=kindnet: bridge + host-local, kube-proxy): the
// blackhole that stale nf_conntrack entries cause, as e2e/nfct reproduces it
// in network namespaces, here with real pods, the kubelet, the CNI chain and
// kube-proxy's own rules and conntrack cleanup; first without ctscrub, then
// with it (the test installs it: `cluster.sh install-ctscrub`).
//
// On the worker, a client pod (e2e/kind/probe) keeps three flows, each from
// one socket: UDP to a Service whose one backend is an agnhost pod, DNS
// queries to the cluster DNS Service (CoreDNS, one replica, moved to the
// worker for the test), and a kept-alive HTTP connection to the Service.
// Both backends are then deleted (the Service pod; CoreDNS scaled to 0), and
// the node's address range is filled with new pods until both freed
// addresses are held again (host-local hands addresses out in turn). For
// 6 s the client's flows are watched, then a new backend of each Service is
// started and the time until the client reaches it is measured.
//
// A blackhole is counted from what the client received and from the node's
// table (`conntrack -L` in the node), never from ctscrub's word: a reply to
// the client's Service traffic from the pod that took the deleted backend's
// address, or an entry of the client's Service flow still translated to the
// deleted backend's address (now another pod's) after the reuse. kube-proxy
// deletes the UDP entries of a Service's gone endpoints itself, but only
// while the Service has a serving endpoint (pkg/proxy/conntrack in
// Kubernetes 1.34: "a Service without endpoints does not require to clean
// the conntrack entries"): a Service whose one backend is replaced keeps the
// stale entry until its new backend is up. The TCP flow is reported as it
// really behaves (tcp_outcomes), not judged.
func TestKindBlackhole(t *testing.T) {
	e := getKindEnv(t)
	if !e.nfct() {
		t.Skip("CNI=kindnet only: the blackhole is nf_conntrack's (kube-proxy); Cilium's LB keeps its own CT")
	}
	if e.ctscrubInstalled {
		t.Fatal("the cluster runs ctscrub already: this test measures without it first (CTSCRUB=0 e2e/kind/cluster.sh up; run.sh does so for CNI=kindnet)")
	}
	if e.probeImage == "" {
		t.Fatal("PROBE_IMAGE is not set (images/build.sh builds it)")
	}
	c := e.newCluster(t, 30*time.Minute)

	// CoreDNS on the client's node, one replica: the client's DNAT entry
	// lives on its own node, and only the node where a pod ran scrubs its IP.
	c.kubectl("-n", "kube-system", "patch", "deploy", "coredns", "-p",
		fmt.Sprintf(`{"spec":{"replicas":1,"template":{"spec":{"nodeSelector":{"kubernetes.io/hostname":%q}}}}}`, e.worker))
	t.Cleanup(func() {
		c.run(time.Minute, "kubectl", "-n", "kube-system", "patch", "deploy", "coredns", "-p",
			`{"spec":{"replicas":2,"template":{"spec":{"nodeSelector":{"kubernetes.io/hostname":null}}}}}`)
		c.run(5*time.Minute, "kubectl", "-n", "kube-system", "rollout", "status", "deploy/coredns", "--timeout=5m")
	})
	c.must(5*time.Minute, "kubectl", "-n", "kube-system", "rollout", "status", "deploy/coredns", "--timeout=5m")

	without := c.blackhole("without")
	t.Logf("without ctscrub: %+v", without)
	c.must(10*time.Minute, filepath.Join(c.root, "e2e/kind/cluster.sh"), "install-ctscrub")
	with := c.blackhole("with")
	t.Logf("with ctscrub: %+v", with)

	result(t, "blackhole_without_ctscrub", without.Blackhole)
	result(t, "blackhole_with_ctscrub", with.Blackhole)
	result(t, "blackhole", map[string]bhResult{"without_ctscrub": without, "with_ctscrub": with})
	if !without.Blackhole {
		t.Errorf("without ctscrub the repro showed no blackhole (%+v): nothing here shows ctscrub ending one", without)
	}
	if with.Blackhole {
		t.Errorf("with ctscrub the client's Service traffic still went to the deleted backend's address: %+v", with)
	}
}

// bhResult is one phase of TestKindBlackhole.
type bhResult struct {
	Blackhole bool `json:"blackhole"`
	// What the client received in the 6 s after both addresses were taken
	// again (outcome -> count): reply:reuser is the new holder of the
	// deleted backend's address answering; err:... what the socket said.
	UDP map[string]int `json:"udp_outcomes"`
	DNS map[string]int `json:"dns_outcomes"`
	// The kept-alive HTTP connection from the deletion to the window's end.
	TCP map[string]int `json:"tcp_outcomes"`
	// Entries of the client's Service flows in the node's table translated
	// to the deleted backends' addresses, after the reuse.
	UDPStale int `json:"udp_entries_to_reused_ip"`
	DNSStale int `json:"dns_entries_to_reused_ip"`
	// Seconds from the new backends' creation to the client reaching them
	// (-1: not within 2 min).
	UDPRecoverS float64 `json:"udp_recover_s"`
	DNSRecoverS float64 `json:"dns_recover_s"`
	TCPRecoverS float64 `json:"tcp_recover_s"`
}

// probeLine is one line of e2e/kind/probe's output.
type probeLine struct {
	T     time.Time `json:"t"`
	Proto string    `json:"proto"`
	OK    bool      `json:"ok"`
	Reply string    `json:"reply"`
	Err   string    `json:"err"`
}

func (c *cluster) probeLog(ns, container string) []probeLine {
	c.t.Helper()
	var lines []probeLine
	for _, l := range strings.Split(c.kubectl("-n", ns, "logs", "probe", "-c", container), "\n") {
		var p probeLine
		if json.Unmarshal([]byte(l), &p) == nil && !p.T.IsZero() {
			lines = append(lines, p)
		}
	}
	return lines
}

// outcomes counts the probe's lines in [from, to); who names pods by role.
func outcomes(lines []probeLine, from, to time.Time, who map[string]string) map[string]int {
	m := map[string]int{}
	for _, l := range lines {
		if l.T.Before(from) || !l.T.Before(to) {
			continue
		}
		switch {
		case !l.OK:
			m["err:"+l.Err]++
		case who[l.Reply] != "":
			m["reply:"+who[l.Reply]]++
		default:
			m["reply:"+l.Reply]++
		}
	}
	return m
}

// firstAfter is the seconds from t0 to the first line after t0 that ok says
// is the new backend's answer; -1 when none.
func firstAfter(lines []probeLine, t0 time.Time, ok func(probeLine) bool) float64 {
	for _, l := range lines {
		if l.T.After(t0) && l.OK && ok(l) {
			return math.Round(l.T.Sub(t0).Seconds()*10) / 10
		}
	}
	return -1
}

// staleEntries counts the node's conntrack entries of proto to vip:port
// whose reply source (the backend the entry translates to) is ip.
func (c *cluster) staleEntries(node, proto, vip, port, ip string) (int, []string) {
	c.t.Helper()
	out := c.conntrackL(node, "-p", proto, "--orig-dst", vip, "--dport", port)
	n := 0
	var all []string
	for _, l := range strings.Split(out, "\n") {
		if l = strings.TrimSpace(l); l == "" {
			continue
		}
		all = append(all, l)
		// The second src= is the reply tuple's source.
		if f := strings.SplitN(l, "src=", 3); len(f) == 3 && strings.HasPrefix(f[2], ip+" ") {
			n++
		}
	}
	return n, all
}

// blackhole runs one phase (see TestKindBlackhole) in its own namespace.
func (c *cluster) blackhole(phase string) bhResult {
	t, e, node := c.t, c.e, c.e.worker
	ns := "bh-" + phase
	c.kubectl("create", "namespace", ns)
	t.Cleanup(func() { c.run(3*time.Minute, "kubectl", "delete", "namespace", ns, "--wait=true", "--timeout=3m") })
	server := func(name string) string {
		return fmt.Sprintf(`---
apiVersion: v1
kind: Pod
metadata: {name: %[1]s, namespace: %[2]s, labels: {app: bh-srv}}
spec:
  nodeName: %[3]s
  terminationGracePeriodSeconds: 1
  containers:
    - {name: server, image: %[4]s, imagePullPolicy: IfNotPresent, args: ["netexec", "--http-port=8080", "--udp-port=8081"]}
`, name, ns, node, e.serverImage)
	}
	c.kubectl("apply", "-f", writeFile(t, t.TempDir(), "bh.yaml", fmt.Sprintf(`apiVersion: v1
kind: Service
metadata: {name: bh, namespace: %[1]s}
spec:
  selector: {app: bh-srv}
  ports:
    - {name: tcp, port: 8080, protocol: TCP}
    - {name: udp, port: 8081, protocol: UDP}
`, ns)+server("bh-s1")))
	c.must(5*time.Minute, "kubectl", "-n", ns, "wait", "--for=condition=Ready", "pod/bh-s1", "--timeout=5m")
	vip := strings.TrimSpace(c.kubectl("-n", ns, "get", "svc", "bh", "-o", "jsonpath={.spec.clusterIP}"))
	dnsVIP := strings.TrimSpace(c.kubectl("-n", "kube-system", "get", "svc", "kube-dns", "-o", "jsonpath={.spec.clusterIP}"))
	dnsPod := c.podOn("kube-system", "k8s-app=kube-dns", node)
	podIP := func(ns, pod string) string {
		return strings.TrimSpace(c.kubectl("-n", ns, "get", "pod", pod, "-o", "jsonpath={.status.podIP}"))
	}
	s1IP, dnsIP := podIP(ns, "bh-s1"), podIP("kube-system", dnsPod)
	name := "bh." + ns + ".svc.cluster.local"
	c.kubectl("apply", "-f", writeFile(t, t.TempDir(), "probe.yaml", fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {name: probe, namespace: %[1]s}
spec:
  nodeName: %[2]s
  terminationGracePeriodSeconds: 1
  containers:
    - {name: udp, image: %[3]s, imagePullPolicy: IfNotPresent, args: ["udp", %[4]q, "8081", "40000"]}
    - {name: dns, image: %[3]s, imagePullPolicy: IfNotPresent, args: ["dns", %[5]q, %[6]q, "40001"]}
    - {name: tcp, image: %[3]s, imagePullPolicy: IfNotPresent, args: ["tcp", %[4]q, "8080"]}
`, ns, node, e.probeImage, vip, dnsVIP, name)))
	c.must(5*time.Minute, "kubectl", "-n", ns, "wait", "--for=condition=Ready", "pod/probe", "--timeout=5m")
	eventually(t, c.ctx, 2*time.Minute, phase+": the client reaches bh-s1 over UDP and TCP, and CoreDNS answers "+name, func() (bool, string) {
		u, d, p := c.probeLog(ns, "udp"), c.probeLog(ns, "dns"), c.probeLog(ns, "tcp")
		last := func(l []probeLine) probeLine {
			if len(l) == 0 {
				return probeLine{}
			}
			return l[len(l)-1]
		}
		lu, ld, lt := last(u), last(d), last(p)
		return lu.Reply == "bh-s1" && lt.Reply == "bh-s1" && ld.Reply == "RCodeSuccess "+vip,
			fmt.Sprintf("last lines: udp %+v, dns %+v, tcp %+v", lu, ld, lt)
	})
	// The entries the deletion must not leave behind exist now, so the
	// checks below can fail.
	if n, all := c.staleEntries(node, "udp", vip, "8081", s1IP); n == 0 {
		t.Fatalf("%s: no conntrack entry of the client's UDP flow to %s:8081 translated to bh-s1 (%s) on %s:\n%s", phase, vip, s1IP, node, strings.Join(all, "\n"))
	}
	if n, all := c.staleEntries(node, "udp", dnsVIP, "53", dnsIP); n == 0 {
		t.Fatalf("%s: no conntrack entry of the client's DNS flow to %s:53 translated to CoreDNS (%s) on %s:\n%s", phase, dnsVIP, dnsIP, node, strings.Join(all, "\n"))
	}

	// Both backends go.
	tDel := time.Now()
	t.Logf("%s: deleting bh-s1 (%s) and CoreDNS %s (%s)", phase, s1IP, dnsPod, dnsIP)
	c.kubectl("-n", ns, "delete", "pod", "bh-s1", "--wait=false")
	c.kubectl("-n", "kube-system", "scale", "deploy/coredns", "--replicas=0")
	c.must(3*time.Minute, "kubectl", "-n", ns, "wait", "--for=delete", "pod/bh-s1", "--timeout=3m")
	c.must(3*time.Minute, "kubectl", "-n", "kube-system", "wait", "--for=delete", "pod/"+dnsPod, "--timeout=3m")

	// Take the freed addresses again: host-local hands out the free
	// addresses after the last one it gave, in turn (wrapping), one ADD at a
	// time under its lock, so the first n new pods get the first n free
	// addresses in that order; n is where the later of the two freed ones
	// comes.
	cidr := netip.MustParsePrefix(strings.TrimSpace(c.kubectl("get", "node", node, "-o", "jsonpath={.spec.podCIDR}")))
	var held map[string]bool
	var last string
	eventually(t, c.ctx, time.Minute, phase+": host-local released "+s1IP+" and "+dnsIP, func() (bool, string) {
		out := c.must(time.Minute, "docker", "exec", node, "sh", "-c", "cd /var/lib/cni/networks/bridge && ls && cat last_reserved_ip.0")
		held = map[string]bool{}
		f := strings.Fields(out)
		for _, x := range f[:len(f)-1] {
			if _, err := netip.ParseAddr(x); err == nil {
				held[x] = true
			}
		}
		last = f[len(f)-1]
		return !held[s1IP] && !held[dnsIP], fmt.Sprintf("held %v, last given %s", held, last)
	})
	fill := hostLocalTurn(cidr, netip.MustParseAddr(last), held, s1IP, dnsIP)
	if fill < 0 {
		t.Fatalf("%s: %s or %s not among the free addresses of %s (held %v)", phase, s1IP, dnsIP, cidr, held)
	}
	if fill > 40 {
		t.Fatalf("%s: %d pods to start before host-local gives %s and %s again: the node's podCIDR %s is too wide (cluster.sh NODE_CIDR_MASK=27 in make e2e-kind)", phase, fill, s1IP, dnsIP, cidr)
	}
	var b strings.Builder
	for i := range fill {
		// UDP 8081 as the Service's backend served it, and UDP 53 (agnhost
		// ignores what it cannot parse: a DNS query gets no answer, where a
		// closed port would answer with an ICMP error).
		fmt.Fprintf(&b, `---
apiVersion: v1
kind: Pod
metadata: {name: fill-%[1]d, namespace: %[2]s, labels: {role: fill}}
spec:
  nodeName: %[3]s
  terminationGracePeriodSeconds: 1
  containers:
    - {name: a, image: %[4]s, imagePullPolicy: IfNotPresent, args: ["netexec", "--http-port=8080", "--udp-port=8081"]}
    - {name: b, image: %[4]s, imagePullPolicy: IfNotPresent, args: ["netexec", "--http-port=8082", "--udp-port=53"]}
`, i, ns, node, e.serverImage)
	}
	t.Logf("%s: %d addresses of %s held on %s, the last given %s: %d pods take the freed two again", phase, len(held), cidr, node, last, fill)
	c.kubectl("apply", "-f", writeFile(t, t.TempDir(), "fill.yaml", b.String()))
	c.must(8*time.Minute, "kubectl", "-n", ns, "wait", "--for=condition=Ready", "pod", "-l", "role=fill", "--timeout=8m")
	tReuse := time.Now()
	holder := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(c.kubectl("-n", ns, "get", "pods", "-l", "role=fill",
		"-o", `jsonpath={range .items[*]}{.metadata.name} {.status.podIP}{"\n"}{end}`)), "\n") {
		if f := strings.Fields(l); len(f) == 2 {
			holder[f[1]] = f[0]
		}
	}
	reuser, dnsReuser := holder[s1IP], holder[dnsIP]
	if reuser == "" || dnsReuser == "" {
		t.Fatalf("%s: the freed addresses were not taken again (%s by %q, %s by %q): %v", phase, s1IP, reuser, dnsIP, dnsReuser, holder)
	}
	t.Logf("%s: %s took bh-s1's %s, %s took CoreDNS's %s", phase, reuser, s1IP, dnsReuser, dnsIP)
	var others []string
	for _, p := range holder {
		if p != reuser && p != dnsReuser {
			others = append(others, "pod/"+p)
		}
	}
	sort.Strings(others)
	if len(others) > 0 {
		c.kubectl(append([]string{"-n", ns, "delete", "--wait=false"}, others...)...)
	}

	time.Sleep(6 * time.Second)
	tEnd := time.Now()
	var r bhResult
	var udpAll, dnsAll []string
	r.UDPStale, udpAll = c.staleEntries(node, "udp", vip, "8081", s1IP)
	r.DNSStale, dnsAll = c.staleEntries(node, "udp", dnsVIP, "53", dnsIP)
	t.Logf("%s: the node's entries of the client's UDP flow to %s:8081:\n%s\nand of its DNS flow to %s:53:\n%s",
		phase, vip, strings.Join(udpAll, "\n"), dnsVIP, strings.Join(dnsAll, "\n"))
	who := map[string]string{"bh-s1": "s1", "bh-s2": "s2", reuser: "reuser", dnsReuser: "dns-reuser"}
	r.UDP = outcomes(c.probeLog(ns, "udp"), tReuse, tEnd, who)
	r.DNS = outcomes(c.probeLog(ns, "dns"), tReuse, tEnd, who)
	r.TCP = outcomes(c.probeLog(ns, "tcp"), tDel, tEnd, who)
	r.Blackhole = r.UDP["reply:reuser"] > 0 || r.UDPStale > 0 || r.DNSStale > 0

	// New backends: the time until the client reaches them.
	if len(others) > 0 {
		c.must(3*time.Minute, "kubectl", append([]string{"-n", ns, "wait", "--for=delete", "--timeout=3m"}, others...)...)
	}
	tNew := time.Now()
	c.kubectl("apply", "-f", writeFile(t, t.TempDir(), "s2.yaml", server("bh-s2")))
	c.kubectl("-n", "kube-system", "scale", "deploy/coredns", "--replicas=1")
	c.must(5*time.Minute, "kubectl", "-n", ns, "wait", "--for=condition=Ready", "pod/bh-s2", "--timeout=5m")
	c.must(5*time.Minute, "kubectl", "-n", "kube-system", "rollout", "status", "deploy/coredns", "--timeout=5m")
	deadline := time.Now().Add(2 * time.Minute)
	for {
		r.UDPRecoverS = firstAfter(c.probeLog(ns, "udp"), tNew, func(l probeLine) bool { return l.Reply == "bh-s2" })
		r.DNSRecoverS = firstAfter(c.probeLog(ns, "dns"), tNew, func(l probeLine) bool { return l.Reply == "RCodeSuccess "+vip })
		r.TCPRecoverS = firstAfter(c.probeLog(ns, "tcp"), tNew, func(l probeLine) bool { return l.Reply == "bh-s2" })
		if (r.UDPRecoverS >= 0 && r.DNSRecoverS >= 0 && r.TCPRecoverS >= 0) || time.Now().After(deadline) {
			break
		}
		time.Sleep(2 * time.Second)
	}
	c.must(4*time.Minute, "kubectl", "delete", "namespace", ns, "--wait=true", "--timeout=3m")
	return r
}

// hostLocalTurn is how many new pods host-local must give addresses to
// before both a and b are given out again: it gives the free addresses of
// cidr after last, in turn, from the one after the gateway (the first
// address) to the one before the broadcast, wrapping, skipping held ones.
// -1 when a or b is not among them.
func hostLocalTurn(cidr netip.Prefix, last netip.Addr, held map[string]bool, a, b string) int {
	net := cidr.Masked().Addr()
	first := net.Next().Next()
	end := first // the address before the broadcast
	for range 1<<(32-cidr.Bits()) - 4 {
		end = end.Next()
	}
	next := func(ip netip.Addr) netip.Addr {
		if ip.Less(first) || !ip.Less(end) {
			return first
		}
		return ip.Next()
	}
	n, found := 0, 0
	ip := last
	for range 1<<(32-cidr.Bits()) - 3 {
		ip = next(ip)
		if held[ip.String()] {
			continue
		}
		n++
		if s := ip.String(); s == a || s == b {
			if found++; found == 2 {
				return n
			}
		}
	}
	return -1
}

// TestHostLocalTurn runs everywhere (no cluster).
func TestHostLocalTurn(t *testing.T) {
	cidr := netip.MustParsePrefix("10.244.1.0/27") // 10.244.1.2 .. 10.244.1.30
	held := map[string]bool{"10.244.1.5": true, "10.244.1.29": true}
	for _, c := range []struct {
		last, a, b string
		want       int
	}{
		{"10.244.1.6", "10.244.1.7", "10.244.1.8", 2},
		{"10.244.1.6", "10.244.1.8", "10.244.1.7", 2},
		{"10.244.1.27", "10.244.1.30", "10.244.1.2", 3}, // .28, (.29 held), .30, wrap to .2
		{"10.244.1.30", "10.244.1.3", "10.244.1.2", 2},
		{"10.244.1.6", "10.244.1.4", "10.244.1.7", 26}, // .7 .. .30 (24 less .29 = 23), .2 .3 .4
		{"10.244.1.6", "10.244.1.5", "10.244.1.7", -1}, // .5 is held
	} {
		if got := hostLocalTurn(cidr, netip.MustParseAddr(c.last), held, c.a, c.b); got != c.want {
			t.Errorf("last %s, freed %s and %s: %d pods, want %d", c.last, c.a, c.b, got, c.want)
		}
	}
}
