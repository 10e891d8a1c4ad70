package kind

import (
	"bufio"
	"fmt"
	"math"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// The expiry sweep's default, decided on a running cluster (issue 25): what
// scrubd's expiry pass in `sweep` mode (the chart's default) does to
// Cilium's own GC and to the SNAT mappings Cilium's GC would have purged
// with the entries. The client pod sends UDP to a world address from
// expiryFlows source ports; BPF masquerade (day2.sh turns it on) gives each
// flow a CT OUT entry and a SNAT mapping. Non-TCP CT entries live 60 s; the
// pass runs every 60 s. The step waits for the flows' CT entries to go, then
// counts the flows' SNAT mappings left (none may be: an expired entry
// deleted without its mapping would leave it to Cilium's orphan purge, which
// runs only when SNAT runs out of ports), and reads both sides' counters:
// who deleted the entries and mappings, how often Cilium's GC ran and its
// adaptive interval before and after.
const (
	expiryFlows     = 100
	expiryWorldAddr = "198.51.100.77"
	expiryBasePort  = 42000
)

func (d *day2) expirySweep(c *cluster) map[string]any {
	t := c.t
	agent := c.podOn("kube-system", "k8s-app=cilium", d.node)
	scrubBefore := promSums(c.metrics(d.node))
	agentBefore := promSums(c.agentMetrics(agent))
	start := time.Now()

	// The flows: one datagram per source port (busybox nc).
	var script strings.Builder
	for i := range expiryFlows {
		fmt.Fprintf(&script, "echo x | timeout 1 nc -u -p %d %s 9 & ", expiryBasePort+i, expiryWorldAddr)
	}
	script.WriteString("wait; echo sent")
	c.must(2*time.Minute, "kubectl", "-n", d.ns, "exec", "client", "-c", "client", "--", "sh", "-c", script.String())
	clientIP := d.podIP(c, "client")

	flowCT := func() (int, error) {
		dump, err := d.dumpQuiet(c.ctx)
		if err != nil {
			return 0, err
		}
		return len(expiryTuples(dump, clientIP, " expires=")), nil
	}
	nat := func() map[string]bool {
		return expiryTuples(c.natDump(agent), clientIP, " XLATE_SRC ")
	}
	ct0, err := flowCT()
	if err != nil {
		t.Fatal(err)
	}
	nat0 := len(nat())
	t.Logf("expiry: %d flows sent from %s: %d CT OUT entries, %d SNAT mappings", expiryFlows, clientIP, ct0, nat0)
	if ct0 < expiryFlows*9/10 || nat0 < expiryFlows*9/10 {
		t.Fatalf("expiry: %d CT entries and %d SNAT mappings of %d flows: without them the step measures nothing (is bpf.masquerade on?)", ct0, nat0, expiryFlows)
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
		"flows":                    expiryFlows,
		"ct_entries_made":          ct0,
		"nat_mappings_made":        nat0,
		"ct_gone_s":                int(goneAfter.Seconds()),
		"nat_mappings_left":        len(left),
		"scrubd_expired_deleted":   scrubAfter["ctscrub_expiry_deleted_total"] - scrubBefore["ctscrub_expiry_deleted_total"],
		"scrubd_nat_deleted":       scrubAfter["ctscrub_expiry_nat_deleted_total"] - scrubBefore["ctscrub_expiry_nat_deleted_total"],
		"cilium_gc_runs":           agentAfter["cilium_datapath_conntrack_gc_runs_total"] - agentBefore["cilium_datapath_conntrack_gc_runs_total"],
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

// expiryTuples: the "PROTO OUT src -> dst" tuples of lines (Cilium's CT or
// NAT dump) from ip to the world address, marked by sep after the tuple.
func expiryTuples(dump, ip, sep string) map[string]bool {
	re := regexp.MustCompile(`^UDP OUT ` + regexp.QuoteMeta(ip) + `:(\d+) -> ` + regexp.QuoteMeta(expiryWorldAddr) + `:9` + regexp.QuoteMeta(sep))
	out := map[string]bool{}
	sc := bufio.NewScanner(strings.NewReader(dump))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		l := strings.TrimSpace(sc.Text())
		if m := re.FindStringSubmatch(l); m != nil {
			if p, _ := strconv.Atoi(m[1]); p >= expiryBasePort && p < expiryBasePort+expiryFlows {
				out[l[:strings.Index(l, sep)]] = true
			}
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
	out := c.must(time.Minute, "kubectl", "-n", "kube-system", "exec", agent, "-c", "cilium-agent", "--", "cilium-dbg", "metrics", "list")
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

