package kind

import (
	"bufio"
	"fmt"
	"math"
	"net"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The churn with Cilium built from cilium/patches and started with
// --conntrack-scrub-delegate on scrubd's socket (`CILIUM_DELEGATE=1 make
// e2e-kind`; docs/delegate-api.md, docs/upstream-delegate.md). The agent asks
// scrubd for each endpoint's scrub and skips its own walk only on a complete
// answer; TestKindChurn then also checks Cilium's NAT dump and the agent's
// delegate counters, and kills scrubd while a wave's pods start so the agent
// must fall back to its walk.

// worldAddr is where the churn's pods send their egress in delegate mode:
// TEST-NET-1 (RFC 5737), outside the cluster, so Cilium's BPF masquerade
// gives each flow an SNAT mapping on the pod's node. Nothing answers; the
// mapping and the CT entry exist from the first packet.
const worldAddr = "192.0.2.1"

// ciliumMetricsPort is the agent's Prometheus port (the chart's
// prometheus.port; cluster.sh turns prometheus.enabled on with the delegate).
const ciliumMetricsPort = "9962"

// delegateCounts is one agent's delegate counters and its waitingForCTClean
// histogram's sum and count, from its /metrics.
type delegateCounts struct {
	delegated map[string]float64 // event -> scrubs the delegate completed
	fallbacks map[string]float64 // "event/cause" -> walks after asking
	// cilium_endpoint_regeneration_time_stats_seconds{scope="waitingForCTClean"}
	// over every status: every regeneration observes it, the first (which
	// waits for the create scrub) and the later ones (which do not).
	ctCleanSum, ctCleanCount float64
	// The same histogram's buckets (ctClean.count is ctCleanCount).
	ctClean histogram
	// The breaker (issue 38's series): ..._breaker_opens_total and the
	// ..._breaker_open gauge (1 while the agent does not ask).
	breakerOpens, breakerOpen float64
	// ..._duration_seconds{event,outcome}, by outcome (complete, partial,
	// fallback) over both events: how long each scrub the delegate was
	// asked waited for it.
	waits map[string]histogram
}

// histogram is one Prometheus histogram's cumulative buckets (le -> the
// observations at most le), count and sum, summed over the series read.
type histogram struct {
	buckets    map[float64]float64
	count, sum float64
}

func (h *histogram) add(le string, v float64) error {
	b, err := strconv.ParseFloat(le, 64) // "+Inf" too
	if err != nil {
		return fmt.Errorf("le %q: %v", le, err)
	}
	if h.buckets == nil {
		h.buckets = map[float64]float64{}
	}
	h.buckets[b] += v
	return nil
}

// sub is h minus an earlier reading of the same agent.
func (h histogram) sub(o histogram) histogram {
	d := histogram{buckets: map[float64]float64{}, count: h.count - o.count, sum: h.sum - o.sum}
	for le, v := range h.buckets {
		d.buckets[le] = v - o.buckets[le]
	}
	return d
}

// maxBound is the smallest bucket bound every observation is at most: 0
// with no observation, +Inf when one is above the largest finite bound.
func (h histogram) maxBound() float64 {
	if h.count <= 0 {
		return 0
	}
	les := make([]float64, 0, len(h.buckets))
	for le := range h.buckets {
		les = append(les, le)
	}
	sort.Float64s(les)
	for _, le := range les {
		if h.buckets[le] >= h.count {
			return le
		}
	}
	return math.Inf(1)
}

func (d delegateCounts) fallbackTotal() float64 {
	var n float64
	for _, v := range d.fallbacks {
		n += v
	}
	return n
}

var seriesRe = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? ([^ ]+)`)
var labelRe = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"`)

// parseDelegateCounts reads the agent's Prometheus text. The delegate's
// counters are vectors: before their first scrub they have no series (0).
func parseDelegateCounts(text string) (delegateCounts, error) {
	d := delegateCounts{delegated: map[string]float64{}, fallbacks: map[string]float64{}, waits: map[string]histogram{}}
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	seen := false
	for sc.Scan() {
		l := sc.Text()
		if strings.HasPrefix(l, "#") || l == "" {
			continue
		}
		m := seriesRe.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		seen = true
		name, labels := m[1], map[string]string{}
		for _, lm := range labelRe.FindAllStringSubmatch(m[3], -1) {
			labels[lm[1]] = lm[2]
		}
		v, err := strconv.ParseFloat(m[4], 64)
		if err != nil {
			return d, fmt.Errorf("metrics line %q: %v", l, err)
		}
		switch name {
		// The names since issue 38 (beside the CT GC's), and before it.
		case "cilium_datapath_conntrack_scrub_delegate_delegated_total", "cilium_conntrack_scrub_delegate_delegated_total":
			d.delegated[labels["event"]] += v
		case "cilium_datapath_conntrack_scrub_delegate_fallbacks_total", "cilium_conntrack_scrub_delegate_fallbacks_total":
			// The patches pre-initialise every event and cause at 0.
			if v != 0 {
				d.fallbacks[labels["event"]+"/"+labels["cause"]] += v
			}
		case "cilium_endpoint_regeneration_time_stats_seconds_sum":
			if labels["scope"] == "waitingForCTClean" {
				d.ctCleanSum += v
				d.ctClean.sum += v
			}
		case "cilium_endpoint_regeneration_time_stats_seconds_count":
			if labels["scope"] == "waitingForCTClean" {
				d.ctCleanCount += v
				d.ctClean.count += v
			}
		case "cilium_endpoint_regeneration_time_stats_seconds_bucket":
			if labels["scope"] == "waitingForCTClean" {
				if err := d.ctClean.add(labels["le"], v); err != nil {
					return d, fmt.Errorf("metrics line %q: %v", l, err)
				}
			}
		case "cilium_datapath_conntrack_scrub_delegate_breaker_opens_total":
			d.breakerOpens += v
		case "cilium_datapath_conntrack_scrub_delegate_breaker_open":
			d.breakerOpen += v
		case "cilium_datapath_conntrack_scrub_delegate_duration_seconds_bucket",
			"cilium_datapath_conntrack_scrub_delegate_duration_seconds_sum",
			"cilium_datapath_conntrack_scrub_delegate_duration_seconds_count":
			h := d.waits[labels["outcome"]]
			switch strings.TrimPrefix(name, "cilium_datapath_conntrack_scrub_delegate_duration_seconds_") {
			case "bucket":
				if err := h.add(labels["le"], v); err != nil {
					return d, fmt.Errorf("metrics line %q: %v", l, err)
				}
			case "sum":
				h.sum += v
			case "count":
				h.count += v
			}
			d.waits[labels["outcome"]] = h
		}
	}
	if err := sc.Err(); err != nil {
		return d, err
	}
	if !seen {
		return d, fmt.Errorf("no metric in the agent's /metrics")
	}
	return d, nil
}

// ciliumCounts reads the delegate counters of the Cilium agent on node
// (hostNetwork, so on the node's IP), from inside the node's container.
func (c *cluster) ciliumCounts(node string) delegateCounts {
	c.t.Helper()
	ip := strings.TrimSpace(c.kubectl("get", "node", node, "-o", `jsonpath={.status.addresses[?(@.type=="InternalIP")].address}`))
	if ip == "" {
		c.t.Fatalf("node %s has no InternalIP", node)
	}
	out := c.must(time.Minute, "docker", "exec", node, "curl", "-sf", "http://"+net.JoinHostPort(ip, ciliumMetricsPort)+"/metrics")
	d, err := parseDelegateCounts(out)
	if err != nil {
		c.t.Fatalf("Cilium's /metrics on %s: %v", node, err)
	}
	return d
}

// agentCounts sums the delegate counters over every agent pod the test saw
// on a node: a restarted agent starts its counters at 0, so each pod's last
// reading is kept (read just before the pod is deleted).
type agentCounts map[string]delegateCounts

func (a agentCounts) read(c *cluster, node, agent string) delegateCounts {
	d := c.ciliumCounts(node)
	a[agent] = d
	return d
}

func (a agentCounts) total() delegateCounts {
	t := delegateCounts{delegated: map[string]float64{}, fallbacks: map[string]float64{}}
	for _, d := range a {
		for k, v := range d.delegated {
			t.delegated[k] += v
		}
		for k, v := range d.fallbacks {
			t.fallbacks[k] += v
		}
		t.ctCleanSum += d.ctCleanSum
		t.ctCleanCount += d.ctCleanCount
	}
	return t
}

// natCount counts, per IP, the lines of Cilium's NAT dump (`cilium-dbg bpf
// nat list`, every NAT map) that name it: a pod's SNAT mapping names its IP
// in the forward key and as the reverse entry's translation.
func (c *cluster) natCount(agent string, ips map[string]string) map[string]int {
	c.t.Helper()
	out := c.must(2*time.Minute, "kubectl", "-n", "kube-system", "exec", agent, "-c", "cilium-agent", "--",
		"cilium-dbg", "bpf", "nat", "list")
	return countIPs(out, ips)
}

// countIPs counts, per IP of ips, the lines of out that name it (the address
// alone: 10.244.1.5 is not counted in 10.244.1.50).
func countIPs(out string, ips map[string]string) map[string]int {
	counts := map[string]int{}
	keys := make([]string, 0, len(ips))
	for ip := range ips {
		keys = append(keys, ip)
		counts[ip] = 0
	}
	sort.Strings(keys)
	res := make([]*regexp.Regexp, len(keys))
	for i, ip := range keys {
		res[i] = regexp.MustCompile(`(^|[^0-9.])` + regexp.QuoteMeta(ip) + `([^0-9]|$)`)
	}
	for _, l := range strings.Split(out, "\n") {
		for i, re := range res {
			if re.MatchString(l) {
				counts[keys[i]]++
			}
		}
	}
	return counts
}

// snatMapPresent says whether the agent on a node has Cilium's IPv4 NAT map
// pinned (it exists with NodePort, which kube-proxy replacement turns on,
// and with BPF masquerade).
func (c *cluster) snatMapPresent(agent string) bool {
	c.t.Helper()
	_, err := c.run(time.Minute, "kubectl", "-n", "kube-system", "exec", agent, "-c", "cilium-agent", "--",
		"ls", "/sys/fs/bpf/tc/globals/cilium_snat_v4_external")
	return err == nil
}

// killScrubd SIGKILLs the scrubd container's process on node (found with
// crictl in the node), as a crash would: its socket file stays, nobody
// listens on it until the kubelet restarts the container.
func (c *cluster) killScrubd(node string) error {
	_, err := c.run(time.Minute, "docker", "exec", node, "sh", "-c",
		`id=$(crictl ps --name '^scrubd$' --state running -q | head -n 1) && [ -n "$id" ] && `+
			`pid=$(crictl inspect --output go-template --template '{{.info.pid}}' "$id") && [ "$pid" -gt 1 ] && kill -9 "$pid"`)
	return err
}

// TestParseDelegateCounts runs everywhere (no cluster): the agent's
// Prometheus text as Cilium 1.18.8 with cilium/patches writes it (one
// sample under the name the patches used before issue 38).
func TestParseDelegateCounts(t *testing.T) {
	text := `# HELP cilium_datapath_conntrack_scrub_delegate_delegated_total Number of endpoint conntrack scrubs the conntrack scrub delegate did for every IP
# TYPE cilium_datapath_conntrack_scrub_delegate_delegated_total counter
cilium_datapath_conntrack_scrub_delegate_delegated_total{event="endpoint-create"} 12
cilium_datapath_conntrack_scrub_delegate_delegated_total{event="endpoint-delete"} 10
cilium_datapath_conntrack_scrub_delegate_fallbacks_total{cause="connection_refused",event="endpoint-create"} 2
cilium_datapath_conntrack_scrub_delegate_fallbacks_total{cause="breaker_open",event="endpoint-create"} 0
cilium_conntrack_scrub_delegate_fallbacks_total{cause="connection_refused",event="endpoint-create"} 1
cilium_datapath_conntrack_scrub_delegate_fallbacks_total{cause="socket_absent",event="endpoint-delete"} 1
cilium_endpoint_regeneration_time_stats_seconds_sum{scope="waitingForCTClean",status="success"} 0.25
cilium_endpoint_regeneration_time_stats_seconds_count{scope="waitingForCTClean",status="success"} 20
cilium_endpoint_regeneration_time_stats_seconds_count{scope="waitingForCTClean",status="failure"} 2
cilium_endpoint_regeneration_time_stats_seconds_sum{scope="total",status="success"} 9
cilium_endpoint_regeneration_time_stats_seconds_bucket{scope="waitingForCTClean",status="success",le="+Inf"} 20
`
	d, err := parseDelegateCounts(text)
	if err != nil {
		t.Fatal(err)
	}
	if d.delegated["endpoint-create"] != 12 || d.delegated["endpoint-delete"] != 10 || len(d.delegated) != 2 {
		t.Errorf("delegated %v", d.delegated)
	}
	if d.fallbacks["endpoint-create/connection_refused"] != 3 || d.fallbacks["endpoint-delete/socket_absent"] != 1 || d.fallbackTotal() != 4 || len(d.fallbacks) != 2 {
		t.Errorf("fallbacks %v", d.fallbacks)
	}
	if d.ctCleanSum != 0.25 || d.ctCleanCount != 22 {
		t.Errorf("waitingForCTClean sum %v count %v, want 0.25 and 22", d.ctCleanSum, d.ctCleanCount)
	}
	if _, err := parseDelegateCounts("# only comments\n"); err == nil {
		t.Errorf("no metric at all: no error")
	}
	if got := countIPs("a 10.244.1.5:80 -> 1.2.3.4\nb 10.244.1.50:80\nc 10.244.1.5\n", map[string]string{"10.244.1.5": "p", "10.244.1.6": "q"}); got["10.244.1.5"] != 2 || got["10.244.1.6"] != 0 {
		t.Errorf("countIPs %v, want 10.244.1.5:2 10.244.1.6:0", got)
	}
}

// TestParseDelegateBreakerAndWaits runs everywhere (no cluster): the
// breaker's series and the two histograms TestKindDelegateFaults reads, as
// Cilium 1.18.8 with cilium/patches writes them, and the difference of two
// readings.
func TestParseDelegateBreakerAndWaits(t *testing.T) {
	before := `cilium_datapath_conntrack_scrub_delegate_breaker_opens_total 0
cilium_datapath_conntrack_scrub_delegate_breaker_open 0
cilium_datapath_conntrack_scrub_delegate_duration_seconds_bucket{event="endpoint-create",outcome="complete",le="0.001"} 2
cilium_datapath_conntrack_scrub_delegate_duration_seconds_bucket{event="endpoint-create",outcome="complete",le="0.0025"} 3
cilium_datapath_conntrack_scrub_delegate_duration_seconds_bucket{event="endpoint-create",outcome="complete",le="5"} 3
cilium_datapath_conntrack_scrub_delegate_duration_seconds_bucket{event="endpoint-create",outcome="complete",le="+Inf"} 3
cilium_datapath_conntrack_scrub_delegate_duration_seconds_sum{event="endpoint-create",outcome="complete"} 0.004
cilium_datapath_conntrack_scrub_delegate_duration_seconds_count{event="endpoint-create",outcome="complete"} 3
cilium_datapath_conntrack_scrub_delegate_duration_seconds_bucket{event="endpoint-create",outcome="fallback",le="1"} 1
cilium_datapath_conntrack_scrub_delegate_duration_seconds_bucket{event="endpoint-create",outcome="fallback",le="2.5"} 1
cilium_datapath_conntrack_scrub_delegate_duration_seconds_bucket{event="endpoint-create",outcome="fallback",le="5"} 1
cilium_datapath_conntrack_scrub_delegate_duration_seconds_bucket{event="endpoint-create",outcome="fallback",le="+Inf"} 1
cilium_datapath_conntrack_scrub_delegate_duration_seconds_sum{event="endpoint-create",outcome="fallback"} 0.001
cilium_datapath_conntrack_scrub_delegate_duration_seconds_count{event="endpoint-create",outcome="fallback"} 1
cilium_endpoint_regeneration_time_stats_seconds_bucket{scope="waitingForCTClean",status="success",le="0.005"} 40
cilium_endpoint_regeneration_time_stats_seconds_bucket{scope="waitingForCTClean",status="success",le="1"} 40
cilium_endpoint_regeneration_time_stats_seconds_bucket{scope="waitingForCTClean",status="success",le="2.5"} 40
cilium_endpoint_regeneration_time_stats_seconds_bucket{scope="waitingForCTClean",status="success",le="5"} 40
cilium_endpoint_regeneration_time_stats_seconds_bucket{scope="waitingForCTClean",status="success",le="+Inf"} 40
cilium_endpoint_regeneration_time_stats_seconds_sum{scope="waitingForCTClean",status="success"} 0.05
cilium_endpoint_regeneration_time_stats_seconds_count{scope="waitingForCTClean",status="success"} 40
cilium_endpoint_regeneration_time_stats_seconds_bucket{scope="total",status="success",le="5"} 1
`
	after := `cilium_datapath_conntrack_scrub_delegate_breaker_opens_total 1
cilium_datapath_conntrack_scrub_delegate_breaker_open 1
cilium_datapath_conntrack_scrub_delegate_duration_seconds_bucket{event="endpoint-create",outcome="complete",le="0.001"} 2
cilium_datapath_conntrack_scrub_delegate_duration_seconds_bucket{event="endpoint-create",outcome="complete",le="0.0025"} 3
cilium_datapath_conntrack_scrub_delegate_duration_seconds_bucket{event="endpoint-create",outcome="complete",le="5"} 3
cilium_datapath_conntrack_scrub_delegate_duration_seconds_bucket{event="endpoint-create",outcome="complete",le="+Inf"} 3
cilium_datapath_conntrack_scrub_delegate_duration_seconds_sum{event="endpoint-create",outcome="complete"} 0.004
cilium_datapath_conntrack_scrub_delegate_duration_seconds_count{event="endpoint-create",outcome="complete"} 3
cilium_datapath_conntrack_scrub_delegate_duration_seconds_bucket{event="endpoint-create",outcome="fallback",le="1"} 1
cilium_datapath_conntrack_scrub_delegate_duration_seconds_bucket{event="endpoint-create",outcome="fallback",le="2.5"} 6
cilium_datapath_conntrack_scrub_delegate_duration_seconds_bucket{event="endpoint-create",outcome="fallback",le="5"} 6
cilium_datapath_conntrack_scrub_delegate_duration_seconds_bucket{event="endpoint-create",outcome="fallback",le="+Inf"} 6
cilium_datapath_conntrack_scrub_delegate_duration_seconds_sum{event="endpoint-create",outcome="fallback"} 5.011
cilium_datapath_conntrack_scrub_delegate_duration_seconds_count{event="endpoint-create",outcome="fallback"} 6
cilium_datapath_conntrack_scrub_delegate_duration_seconds_bucket{event="endpoint-delete",outcome="fallback",le="1"} 0
cilium_datapath_conntrack_scrub_delegate_duration_seconds_bucket{event="endpoint-delete",outcome="fallback",le="2.5"} 1
cilium_datapath_conntrack_scrub_delegate_duration_seconds_bucket{event="endpoint-delete",outcome="fallback",le="5"} 1
cilium_datapath_conntrack_scrub_delegate_duration_seconds_bucket{event="endpoint-delete",outcome="fallback",le="+Inf"} 1
cilium_datapath_conntrack_scrub_delegate_duration_seconds_sum{event="endpoint-delete",outcome="fallback"} 1.002
cilium_datapath_conntrack_scrub_delegate_duration_seconds_count{event="endpoint-delete",outcome="fallback"} 1
cilium_endpoint_regeneration_time_stats_seconds_bucket{scope="waitingForCTClean",status="success",le="0.005"} 50
cilium_endpoint_regeneration_time_stats_seconds_bucket{scope="waitingForCTClean",status="success",le="1"} 50
cilium_endpoint_regeneration_time_stats_seconds_bucket{scope="waitingForCTClean",status="success",le="2.5"} 55
cilium_endpoint_regeneration_time_stats_seconds_bucket{scope="waitingForCTClean",status="success",le="5"} 55
cilium_endpoint_regeneration_time_stats_seconds_bucket{scope="waitingForCTClean",status="success",le="+Inf"} 55
cilium_endpoint_regeneration_time_stats_seconds_sum{scope="waitingForCTClean",status="success"} 5.3
cilium_endpoint_regeneration_time_stats_seconds_count{scope="waitingForCTClean",status="success"} 55
cilium_endpoint_regeneration_time_stats_seconds_bucket{scope="waitingForCTClean",status="failure",le="5"} 0
cilium_endpoint_regeneration_time_stats_seconds_bucket{scope="waitingForCTClean",status="failure",le="+Inf"} 1
cilium_endpoint_regeneration_time_stats_seconds_count{scope="waitingForCTClean",status="failure"} 1
cilium_endpoint_regeneration_time_stats_seconds_bucket{scope="total",status="success",le="5"} 9
`
	b, err := parseDelegateCounts(before)
	if err != nil {
		t.Fatal(err)
	}
	a, err := parseDelegateCounts(after)
	if err != nil {
		t.Fatal(err)
	}
	if a.breakerOpens-b.breakerOpens != 1 || a.breakerOpen != 1 || b.breakerOpen != 0 {
		t.Errorf("breaker: opens %v -> %v, open %v -> %v", b.breakerOpens, a.breakerOpens, b.breakerOpen, a.breakerOpen)
	}
	fb := a.waits["fallback"].sub(b.waits["fallback"])
	if fb.count != 6 || math.Abs(fb.sum-6.012) > 1e-9 || fb.maxBound() != 2.5 {
		t.Errorf("fallback waits during the phase: count %v sum %v bound %v, want 6, 6.012, 2.5", fb.count, fb.sum, fb.maxBound())
	}
	if cw := a.waits["complete"].sub(b.waits["complete"]); cw.count != 0 || cw.maxBound() != 0 {
		t.Errorf("complete waits during the phase: count %v bound %v, want 0 and 0", cw.count, cw.maxBound())
	}
	if b.waits["complete"].maxBound() != 0.0025 {
		t.Errorf("complete waits: bound %v, want 0.0025", b.waits["complete"].maxBound())
	}
	ct := a.ctClean.sub(b.ctClean)
	if ct.count != 16 || ct.maxBound() != math.Inf(1) || a.ctCleanCount != 56 {
		t.Errorf("waitingForCTClean during the phase: count %v bound %v (all: %v), want 16, +Inf (one failure above 5 s), 56", ct.count, ct.maxBound(), a.ctCleanCount)
	}
	if ok := b.ctClean.maxBound(); ok != 0.005 {
		t.Errorf("waitingForCTClean before: bound %v, want 0.005", ok)
	}
}
