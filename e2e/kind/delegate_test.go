package kind

import (
	"bufio"
	"fmt"
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
	d := delegateCounts{delegated: map[string]float64{}, fallbacks: map[string]float64{}}
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
			}
		case "cilium_endpoint_regeneration_time_stats_seconds_count":
			if labels["scope"] == "waitingForCTClean" {
				d.ctCleanCount += v
			}
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
