package kind

import (
	"bufio"
	"fmt"
	"math"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The expiry sweep's default, decided on a running cluster (issue 25): what
// scrubd's expiry pass in `sweep` mode (the chart's default) does to
// Cilium's own GC and to the SNAT mappings Cilium's GC would have purged
// with the entries. The client pod sends DNS queries to a world address
// from expiryFlows source ports; BPF masquerade (day2.sh turns it on) gives each
// flow a CT OUT entry and SNAT mappings. Non-TCP CT entries live 60 s; the
// pass runs every 60 s. The step waits for the flows' CT entries to go, then
// counts the flows' SNAT mappings left (none may be: an expired entry
// deleted without its mapping would leave it to Cilium's orphan purge, which
// runs only when SNAT runs out of ports), and reads both sides' counters:
// who deleted the entries and mappings, how often Cilium's GC ran and its
// adaptive interval before and after.
const (
	expiryFlows     = 100
	expiryWorldAddr = "198.51.100.77"
)

func (d *day2) expirySweep(c *cluster) map[string]any {
	t := c.t
	agent := c.podOn("kube-system", "k8s-app=cilium", d.node)
	scrubBefore := promSums(c.metrics(d.node))
	agentBefore := promSums(c.agentMetrics(agent))
	start := time.Now()

	// The flows: DNS queries to a world address, each nslookup from its
	// own source port (busybox: its nc has no UDP).
	var script strings.Builder
	fmt.Fprintf(&script, "for i in $(seq %d); do timeout 1 nslookup x %s >/dev/null 2>&1 & done; wait; echo sent", expiryFlows, expiryWorldAddr)
	c.must(2*time.Minute, "kubectl", "-n", d.ns, "exec", "client", "-c", "client", "--", "sh", "-c", script.String())
	clientIP := d.podIP(c, "client")

	flowCT := func() (int, error) {
		dump, err := d.dumpQuiet(c.ctx)
		if err != nil {
			return 0, err
		}
		return len(expiryCT(dump, clientIP)), nil
	}
	nat := func() map[string]bool {
		return expiryNAT(c.natDump(agent), clientIP)
	}
	ct0, err := flowCT()
	if err != nil {
		t.Fatal(err)
	}
	nat0 := len(nat())
	t.Logf("expiry: %d flows sent from %s: %d CT OUT entries, %d SNAT mappings", expiryFlows, clientIP, ct0, nat0)
	if ct0 < expiryFlows/2 || nat0 < ct0 {
		t.Fatalf("expiry: %d CT entries and %d SNAT mappings (forward and reverse) of %d flows: without them the step measures nothing (is bpf.masquerade on?)", ct0, nat0, expiryFlows)
	}

	// Gone within the entries' 60 s, one 60 s interval, a pass's own time
	// and a margin: 4 min.
	var goneAfter time.Duration
	eventually(t, c.ctx, 4*time.Minute, "the flows' CT entries deleted", func() (bool, string) {
		n, err := flowCT()
		if err != nil {
			return false, err.Error()
		}
		goneAfter = time.Since(start)
		return n == 0, fmt.Sprintf("%d left", n)
	})
	left := nat()
	scrubAfter := promSums(c.metrics(d.node))
	agentAfter := promSums(c.agentMetrics(agent))
	obj := map[string]any{
		"flows":                  expiryFlows,
		"ct_entries_made":        ct0,
		"nat_mappings_made":      nat0,
		"ct_gone_s":              int(goneAfter.Seconds()),
		"nat_mappings_left":      len(left),
		"scrubd_expired_deleted": scrubAfter["ctscrub_expiry_deleted_total"] - scrubBefore["ctscrub_expiry_deleted_total"],
		"scrubd_nat_deleted":     scrubAfter["ctscrub_expiry_nat_deleted_total"] - scrubBefore["ctscrub_expiry_nat_deleted_total"],
		// Cilium counts each endpoint's scrub of a map as a GC run too:
		// with the churn going these are mostly those walks.
		"cilium_ct_walks":          agentAfter["cilium_datapath_conntrack_gc_runs_total"] - agentBefore["cilium_datapath_conntrack_gc_runs_total"],
		"cilium_gc_deleted_last":   agentAfter["cilium_datapath_conntrack_gc_entries{status=deleted}"],
		"cilium_gc_interval_s":     agentAfter["cilium_datapath_conntrack_gc_interval_seconds"],
		"cilium_gc_interval_s_was": agentBefore["cilium_datapath_conntrack_gc_interval_seconds"],
	}
	if len(left) > 0 {
		n := 0
		for k := range left {
			if n++; n > 5 {
				break
			}
			t.Logf("expiry: SNAT mapping left without its CT entry: %s", k)
		}
		t.Errorf("expiry: %d SNAT mappings of the flows left after their CT entries went: orphans until Cilium's orphan purge", len(left))
	}
	return obj
}

// expiryCT: the CT OUT entries (their tuples) of ip's flows to the world
// address in Cilium's CT dump.
func expiryCT(dump, ip string) map[string]bool {
	return matching(dump, `^UDP OUT `+regexp.QuoteMeta(ip)+`:\d+ -> `+regexp.QuoteMeta(expiryWorldAddr)+`:53 expires=`)
}

// expiryNAT: the SNAT mappings of ip's flows to the world address in
// Cilium's NAT dump, forward (pod -> world, XLATE_SRC) and reverse (world
// -> node, XLATE_DST to the pod).
func expiryNAT(dump, ip string) map[string]bool {
	fwd := matching(dump, `^UDP OUT `+regexp.QuoteMeta(ip)+`:\d+ -> `+regexp.QuoteMeta(expiryWorldAddr)+`:53 XLATE_SRC `)
	rev := matching(dump, `^UDP IN `+regexp.QuoteMeta(expiryWorldAddr)+`:53 -> \S+ XLATE_DST `+regexp.QuoteMeta(ip)+`:\d+ `)
	for k := range rev {
		fwd[k] = true
	}
	return fwd
}

// matching: the lines of dump that match expr, up to what expr matched.
func matching(dump, expr string) map[string]bool {
	re := regexp.MustCompile(expr)
	out := map[string]bool{}
	sc := bufio.NewScanner(strings.NewReader(dump))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		l := strings.TrimSpace(sc.Text())
		if m := re.FindString(l); m != "" {
			out[m] = true
		}
	}
	return out
}

// natDump is Cilium's SNAT table on the agent's node.
func (c *cluster) natDump(agent string) string {
	return c.must(2*time.Minute, "kubectl", "-n", "kube-system", "exec", agent, "-c", "cilium-agent", "--", "cilium-dbg", "bpf", "nat", "list")
}

// agentMetrics is Cilium's agent's metrics as `cilium-dbg metrics list`
// prints them (with or without its Prometheus endpoint), rewritten in the
// exposition format promSums reads: name{labels} value.
func (c *cluster) agentMetrics(agent string) string {
	return agentText(c.must(time.Minute, "kubectl", "-n", "kube-system", "exec", agent, "-c", "cilium-agent", "--", "cilium-dbg", "metrics", "list"))
}

// agentText rewrites `cilium-dbg metrics list` (name, label=value..., value).
func agentText(out string) string {
	var b strings.Builder
	for _, l := range strings.Split(out, "\n") {
		f := strings.Fields(l)
		if len(f) < 2 || !strings.HasPrefix(f[0], "cilium_") {
			continue
		}
		labels := []string{}
		for _, kv := range f[1 : len(f)-1] {
			if k, v, ok := strings.Cut(kv, "="); ok {
				labels = append(labels, fmt.Sprintf("%s=%q", k, v))
			}
		}
		fmt.Fprintf(&b, "%s{%s} %s\n", f[0], strings.Join(labels, ","), f[len(f)-1])
	}
	return b.String()
}

// promSums sums each metric of an exposition-format text over its labels
// (key: the name), and also per value of a status label (key:
// name{status=x}); histograms and summaries are skipped.
func promSums(text string) map[string]float64 {
	re := regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)$`)
	st := regexp.MustCompile(`(^|,)status="([^"]*)"`)
	out := map[string]float64{}
	for _, l := range strings.Split(text, "\n") {
		m := re.FindStringSubmatch(strings.TrimSpace(l))
		if m == nil || strings.HasPrefix(l, "#") {
			continue
		}
		v, err := strconv.ParseFloat(m[4], 64)
		if err != nil || math.IsNaN(v) {
			continue
		}
		out[m[1]] += v
		if s := st.FindStringSubmatch(m[3]); s != nil {
			out[m[1]+"{status="+s[2]+"}"] += v
		}
	}
	return out
}

// The dump and metrics parsers on lines as Cilium 1.18.8 prints them (taken
// from a kind run): a wrong pattern would make the step measure nothing.
func TestExpiryParsers(t *testing.T) {
	ct := `UDP OUT 10.244.0.47:43034 -> 198.51.100.77:53 expires=23565 Packets=0 Bytes=0 RxFlagsSeen=0x00 LastRxReport=0 TxFlagsSeen=0x00 LastTxReport=23505 Flags=0x0000 [ ] RevNAT=0 SourceSecurityID=41328 BackendID=0
UDP OUT 10.244.0.47:39934 -> 198.51.100.77:53 expires=23565 Packets=0 Bytes=0 RxFlagsSeen=0x00 LastRxReport=0 TxFlagsSeen=0x00 LastTxReport=23505 Flags=0x0000 [ ] RevNAT=0 SourceSecurityID=41328 BackendID=0
ICMP OUT 10.244.0.47:0 -> 198.51.100.77:0 related expires=23565 Packets=0 Bytes=0
UDP OUT 10.244.0.4:39934 -> 198.51.100.77:53 expires=23565 Packets=0 Bytes=0
`
	if got := expiryCT(ct, "10.244.0.47"); len(got) != 2 {
		t.Errorf("CT: %v, want the two UDP OUT entries of 10.244.0.47", got)
	}
	nat := `UDP IN 198.51.100.77:53 -> 172.19.0.4:43034 XLATE_DST 10.244.0.47:43034 Created=2sec ago NeedsCT=0
UDP OUT 10.244.0.47:43034 -> 198.51.100.77:53 XLATE_SRC 172.19.0.4:43034 Created=2sec ago NeedsCT=1
UDP IN 198.51.100.77:53 -> 172.19.0.4:35429 XLATE_DST 10.244.0.4:35429 Created=2sec ago NeedsCT=0
`
	if got := expiryNAT(nat, "10.244.0.47"); len(got) != 2 {
		t.Errorf("NAT: %v, want the forward and reverse mapping of 10.244.0.47's flow", got)
	}
	m := promSums(`# HELP x
ctscrub_expiry_deleted_total{map="cilium_ct4_global"} 3
ctscrub_expiry_deleted_total{map="cilium_ct_any4_global"} 4
`)
	if m["ctscrub_expiry_deleted_total"] != 7 {
		t.Errorf("promSums: %v", m)
	}
	list := `cilium_datapath_conntrack_gc_duration_seconds                            family=ipv4 protocol=TCP status=completed                                          2.5ms / 4.5ms / 4.95ms
cilium_datapath_conntrack_gc_entries                                     family=ipv4 protocol=TCP status=deleted                                            5.000000
cilium_datapath_conntrack_gc_entries                                     family=ipv4 protocol=non-TCP status=deleted                                        2.000000
cilium_datapath_conntrack_gc_entries                                     family=ipv4 protocol=TCP status=alive                                              9.000000
cilium_datapath_conntrack_gc_interval_seconds                            global=global                                                                      300.000000
cilium_datapath_conntrack_gc_runs_total                                  family=ipv4 protocol=TCP status=completed                                          3.000000
`
	a := promSums(agentText(list))
	if a["cilium_datapath_conntrack_gc_entries{status=deleted}"] != 7 || a["cilium_datapath_conntrack_gc_interval_seconds"] != 300 || a["cilium_datapath_conntrack_gc_runs_total"] != 3 {
		t.Errorf("agent metrics: %v", a)
	}
	if _, ok := a["cilium_datapath_conntrack_gc_duration_seconds"]; ok {
		t.Error("a histogram's summary line was read as a value")
	}
}

// The capability list day2 gives the previous Cilium is cluster.sh's.
func TestCiliumAgentCapsMatchClusterSh(t *testing.T) {
	sh := string(readFile(t, moduleRoot(t), "e2e/kind/cluster.sh"))
	if !strings.Contains(sh, `"`+ciliumAgentCaps+`"`) {
		t.Fatalf("cluster.sh does not set %s", ciliumAgentCaps)
	}
	if !oldCiliumCaps("ctscrub-kind/cilium:1.17.6-patched-ba0454f4b4a71328") || oldCiliumCaps("ctscrub-kind/cilium:1.18.8-9d42040558482804") {
		t.Fatal("oldCiliumCaps reads the version from the tag wrongly")
	}
}
