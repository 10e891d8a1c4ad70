package main

import (
	"net/http/httptest"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// exposition renders what the counters hold as a /metrics endpoint does
// (client_golang's own text encoder, as Cilium's agent and scrubd serve it).
func exposition(t *testing.T, cs ...prometheus.Collector) string {
	t.Helper()
	reg := prometheus.NewRegistry()
	reg.MustRegister(cs...)
	w := httptest.NewRecorder()
	promhttp.HandlerFor(reg, promhttp.HandlerOpts{}).ServeHTTP(w, httptest.NewRequest("GET", "/metrics", nil))
	return w.Body.String()
}

func TestParseAgentCounters(t *testing.T) {
	gc := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "cilium_datapath_conntrack_gc_runs_total"}, []string{"family", "protocol", "status"})
	gc.WithLabelValues("ipv4", "TCP", "completed").Add(3)
	gc.WithLabelValues("ipv4", "non-TCP", "completed").Add(3)
	gcEntries := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "cilium_datapath_conntrack_gc_runs_total_not_this"}, []string{"x"})
	gcEntries.WithLabelValues("y").Set(100)
	del := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "cilium_datapath_conntrack_scrub_delegate_delegated_total"}, []string{"event"})
	del.WithLabelValues("endpoint-create").Add(19)
	del.WithLabelValues("endpoint-delete").Add(20)
	fb := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "cilium_datapath_conntrack_scrub_delegate_fallbacks_total"}, []string{"event", "cause"})
	fb.WithLabelValues("endpoint-create", "incomplete").Add(1)
	fb.WithLabelValues("endpoint-create", `odd "cause"`).Add(2)
	// The name the patches used before issue 38.
	fbOld := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "cilium_conntrack_scrub_delegate_fallbacks_total"}, []string{"event", "cause"})
	fbOld.WithLabelValues("endpoint-create", "incomplete").Add(3)
	c := parseAgentCounters(exposition(t, gc, gcEntries, del, fb, fbOld))
	if c.gcRuns != 6 || c.delegated != 39 {
		t.Errorf("gc runs %v, delegated %v; want 6 and 39", c.gcRuns, c.delegated)
	}
	if len(c.fallbacks) != 2 || c.fallbacks["endpoint-create/incomplete"] != 4 || c.fallbacks[`endpoint-create/odd "cause"`] != 2 {
		t.Errorf("fallbacks %v", c.fallbacks)
	}
	// A stock agent has no delegate counters: zeros, not an error.
	if c := parseAgentCounters(exposition(t, gc)); c.delegated != 0 || len(c.fallbacks) != 0 || c.gcRuns != 6 ||
		c.scrubRequests != 0 || c.scrubWalks != 0 || c.scrubPending != 0 {
		t.Errorf("stock agent: %+v", c)
	}

	// The coalesce series' agent.
	req := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "cilium_datapath_conntrack_scrub_requests_total"}, []string{"outcome"})
	req.WithLabelValues("success").Add(38)
	req.WithLabelValues("fail").Add(2)
	walks := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "cilium_datapath_conntrack_scrub_walks_total"}, []string{"outcome"})
	walks.WithLabelValues("success").Add(5)
	walks.WithLabelValues("fail").Add(1)
	pending := prometheus.NewGauge(prometheus.GaugeOpts{Name: "cilium_datapath_conntrack_scrub_pending_requests"})
	pending.Set(3)
	dur := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "cilium_datapath_conntrack_scrub_walk_duration_seconds"}, []string{"outcome"})
	dur.WithLabelValues("success").Observe(2)
	c = parseAgentCounters(exposition(t, gc, req, walks, pending, dur))
	if c.scrubRequests != 40 || c.scrubWalks != 6 || c.scrubPending != 3 || c.gcRuns != 6 {
		t.Errorf("coalesced agent: requests %v walks %v pending %v gc runs %v; want 40, 6, 3, 6", c.scrubRequests, c.scrubWalks, c.scrubPending, c.gcRuns)
	}
}

func TestCoalescedVariantConfig(t *testing.T) {
	for k, v := range map[string]string{"VARIANTS": "cilium_only,cilium_coalesced", "CTSCRUB_IMAGE": "ctscrub", "CLIENT_IMAGE": "busybox",
		"CILIUM_CHART": "/chart", "CILIUM_VALUES": "/values.yaml", "CILIUM_IMAGE": "ctscrub-kind/cilium:1.18.8-aaaa"} {
		t.Setenv(k, v)
	}
	t.Setenv("CILIUM_COALESCED_IMAGE", "")
	if _, err := loadConfig(); err == nil || !strings.Contains(err.Error(), "CILIUM_COALESCED_IMAGE") {
		t.Fatalf("cilium_coalesced without CILIUM_COALESCED_IMAGE: %v, want an error naming it", err)
	}
	t.Setenv("CILIUM_COALESCED_IMAGE", "ctscrub-kind/cilium:1.18.8-coalesced-cccc")
	cfg, err := loadConfig()
	if err != nil {
		t.Fatal(err)
	}
	only, coal := setupFor(cfg, "cilium_only"), setupFor(cfg, "cilium_coalesced")
	if coal.Image != cfg.coalescedImage || coal.GCInterval != only.GCInterval || coal.Delegate {
		t.Errorf("cilium_coalesced runs %+v, want cilium_only's %+v with the coalesced image", coal, only)
	}
	if usesCtscrub("cilium_coalesced") || isDelegate("cilium_coalesced") || variantPrefix["cilium_coalesced"] == "" {
		t.Error("cilium_coalesced: no ctscrub, no delegate, a pod prefix of its own")
	}
}

func TestScrubdDeltas(t *testing.T) {
	h := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "ctscrub_scrub_duration_seconds"}, []string{"backend", "method", "reason", "result"})
	d := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ctscrub_delegate_requests_total"}, []string{"caller", "event", "outcome"})
	h.WithLabelValues("cilium", "index", "add", "complete").Observe(0.001)
	h.WithLabelValues("nfct", "index", "add", "complete").Observe(0.001)
	d.WithLabelValues("cilium-agent", "endpoint-create", "complete").Inc()
	before := exposition(t, h, d)
	for range 3 {
		h.WithLabelValues("cilium", "index", "add", "complete").Observe(0.001)
		d.WithLabelValues("cilium-agent", "endpoint-create", "complete").Inc()
	}
	h.WithLabelValues("cilium", "sweep", "add", "complete").Observe(0.5)
	h.WithLabelValues("nfct", "index", "add", "complete").Observe(0.001)
	d.WithLabelValues("cilium-agent", "endpoint-create", "incomplete").Inc()
	after := exposition(t, h, d)
	sc := scrubCounts(before, after)
	if len(sc) != 2 || sc["add/index"] != 3 || sc["add/sweep"] != 1 {
		t.Errorf("scrubCounts = %v, want add/index 3, add/sweep 1 (the Cilium backend's only)", sc)
	}
	da := delegateAnswers(before, after)
	if len(da) != 2 || da["endpoint-create/complete"] != 3 || da["endpoint-create/incomplete"] != 1 {
		t.Errorf("delegateAnswers = %v", da)
	}
	// scrubd not running before (installed in the window): all of after.
	if sc := scrubCounts("", after); sc["add/index"] != 4 {
		t.Errorf("scrubCounts from nothing = %v, want add/index 4", sc)
	}
}

func TestFreeIn(t *testing.T) {
	// cilium-dbg status -o json's ipam part (Cilium 1.18 models.IPAMStatus).
	st := `{"ipam":{"allocations":{"10.244.1.1":"router","10.244.1.7":"health","10.244.1.9":"ctscrub-bench/traffic-server"},
		"ipv4":["10.244.1.1","10.244.1.7","10.244.1.9","10.244.1.12"],"status":"4/30 allocated from 10.244.1.0/27"}}`
	free, err := freeIn("10.244.1.0/27", st)
	if err != nil {
		t.Fatal(err)
	}
	if len(free) != 30-4 {
		t.Errorf("%d free, want 26: %v", len(free), free)
	}
	for _, a := range free {
		switch a.String() {
		case "10.244.1.0", "10.244.1.31", "10.244.1.1", "10.244.1.7", "10.244.1.9", "10.244.1.12":
			t.Errorf("%s listed free", a)
		}
		if !netip.MustParsePrefix("10.244.1.0/27").Contains(a) {
			t.Errorf("%s outside the range", a)
		}
	}
	for _, bad := range []struct{ cidr, st string }{
		{"", st}, {"fd00::/120", st}, {"10.244.1.0/27", `{"ipam":{}}`}, {"10.244.1.0/27", `not json`},
	} {
		if _, err := freeIn(bad.cidr, bad.st); err == nil {
			t.Errorf("freeIn(%q, %q): no error", bad.cidr, bad.st)
		}
	}
}

// The setups' values, layered on run.sh's as the upgrade layers them,
// rendered by Helm with Cilium 1.18.8's own chart: the agent gets the image,
// the GC interval, and (delegate) the flag and the socket's directory.
func TestSetupValuesRender(t *testing.T) {
	helm, err := exec.LookPath("helm")
	if err != nil {
		if _, err := os.Stat("/opt/ctscrub-kind/bin/helm"); err != nil {
			t.Skip("no helm (e2e/kind/install.sh installs it)")
		}
		helm = "/opt/ctscrub-kind/bin/helm"
	}
	out, err := exec.Command("go", "mod", "download", "-json", "github.com/cilium/cilium@v1.18.8").Output()
	if err != nil {
		t.Skipf("Cilium 1.18.8's module (its chart) not available: %v", err)
	}
	dir := between(string(out), `"Dir": "`, `"`)
	chart := filepath.Join(dir, "install/kubernetes/cilium")
	if _, err := os.Stat(filepath.Join(chart, "Chart.yaml")); err != nil {
		t.Skip("no chart in the module:", err)
	}
	// run.sh's values, as it writes them (its heredoc, with example values).
	sh, err := os.ReadFile("run.sh")
	if err != nil {
		t.Fatal(err)
	}
	doc := between(string(sh), `cat >"$CILIUM_VALUES" <<EOF`+"\n", "\nEOF\n")
	if doc == "" {
		t.Fatal("run.sh: no values heredoc (cat >\"$CILIUM_VALUES\" <<EOF)")
	}
	vars := map[string]string{"CILIUM_IMAGE": "ctscrub-kind/cilium:1.18.8-aaaa", "op_repo": "ctscrub-kind/cilium-operator", "op_tag": "1.18.8-opop",
		"cp_ip": "172.18.0.2", "POD_CIDR": "10.244.0.0/16", "NODE_CIDR_MASK": "27", "CT_MAX": "4194304", "CT_GC_INTERVAL": "12h"}
	doc = os.Expand(doc, func(v string) string {
		if _, ok := vars[v]; !ok {
			t.Fatalf("run.sh's values use $%s: add it to this test", v)
		}
		return vars[v]
	})
	base := filepath.Join(t.TempDir(), "base.yaml")
	if err := os.WriteFile(base, []byte(doc), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := config{ciliumImage: "ctscrub-kind/cilium:1.18.8-aaaa", delegateImage: "ctscrub-kind/cilium:1.18.8-delegate-bbbb",
		coalescedImage: "ctscrub-kind/cilium:1.18.8-coalesced-cccc", gcInterval: "12h"}
	render := func(variant string) string {
		t.Helper()
		over := filepath.Join(t.TempDir(), "over.yaml")
		if err := os.WriteFile(over, []byte(setupFor(cfg, variant).values()), 0o644); err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command(helm, "template", "cilium", chart, "--namespace", "kube-system", "--kube-version", "1.34.4", "-f", base, "-f", over).CombinedOutput()
		if err != nil {
			t.Fatalf("helm template (%s): %v\n%s", variant, err, out)
		}
		return string(out)
	}
	only, gc60, deleg, coal := render("cilium_only"), render("cilium_gc60"), render("ctscrub_delegate"), render("cilium_coalesced")
	// The agent reads its ConfigMap only at start: a new GC interval must
	// change the pods' template (rollOutCiliumPods' checksum), or the
	// upgrade leaves the agents running with the old one.
	sum := func(out string) string { return between(out, "cilium.io/cilium-configmap-checksum: ", "\n") }
	if sum(only) == "" || sum(only) == sum(gc60) {
		t.Errorf("the agent's template does not change with the GC interval (configmap checksum %q and %q): the agents would not restart", sum(only), sum(gc60))
	}
	for _, c := range []struct {
		name, out string
		has       []string
		hasNot    []string
	}{
		{"cilium_only", only,
			[]string{`image: "ctscrub-kind/cilium:1.18.8-aaaa"`, `conntrack-gc-interval: "12h"`, `ipam: "cluster-pool"`, `cluster-pool-ipv4-mask-size: "27"`},
			[]string{"conntrack-scrub-delegate", "delegate-bbbb"}},
		{"cilium_gc60", gc60,
			[]string{`image: "ctscrub-kind/cilium:1.18.8-aaaa"`, `conntrack-gc-interval: "60s"`},
			[]string{"conntrack-scrub-delegate", `conntrack-gc-interval: "12h"`}},
		{"cilium_coalesced", coal,
			[]string{`image: "ctscrub-kind/cilium:1.18.8-coalesced-cccc"`, `conntrack-gc-interval: "12h"`},
			[]string{"conntrack-scrub-delegate", `1.18.8-aaaa"`, "delegate-bbbb"}},
		{"ctscrub_delegate", deleg,
			[]string{`image: "ctscrub-kind/cilium:1.18.8-delegate-bbbb"`, `conntrack-gc-interval: "12h"`,
				`- --conntrack-scrub-delegate=/run/ctscrub-delegate/delegate.sock`,
				"mountPath: /run/ctscrub-delegate", "path: /run/ctscrub-delegate", "mountPropagation: HostToContainer"},
			[]string{`1.18.8-aaaa"`}},
	} {
		for _, s := range c.has {
			if !strings.Contains(c.out, s) {
				t.Errorf("%s: rendered chart lacks %q", c.name, s)
			}
		}
		for _, s := range c.hasNot {
			if strings.Contains(c.out, s) {
				t.Errorf("%s: rendered chart has %q", c.name, s)
			}
		}
	}
}

func between(s, a, b string) string {
	i := strings.Index(s, a)
	if i < 0 {
		return ""
	}
	s = s[i+len(a):]
	if j := strings.Index(s, b); j >= 0 {
		return s[:j]
	}
	return s
}

// delegateWithin reads the histogram's cumulative buckets per event.
func TestDelegateWithin(t *testing.T) {
	before := `ctscrub_delegate_request_duration_seconds_bucket{caller="cilium-agent",event="endpoint-create",le="0.01"} 1
ctscrub_delegate_request_duration_seconds_bucket{caller="cilium-agent",event="endpoint-create",le="0.1"} 1
ctscrub_delegate_request_duration_seconds_bucket{caller="cilium-agent",event="endpoint-create",le="+Inf"} 1
`
	after := `ctscrub_delegate_request_duration_seconds_bucket{caller="cilium-agent",event="endpoint-create",le="0.005"} 9
ctscrub_delegate_request_duration_seconds_bucket{caller="cilium-agent",event="endpoint-create",le="0.01"} 18
ctscrub_delegate_request_duration_seconds_bucket{caller="cilium-agent",event="endpoint-create",le="0.1"} 20
ctscrub_delegate_request_duration_seconds_bucket{caller="cilium-agent",event="endpoint-create",le="+Inf"} 21
`
	got := delegateWithin(before, after)
	want := map[string]float64{"endpoint-create le=0.01": 17, "endpoint-create le=0.1": 19, "endpoint-create le=+Inf": 20}
	if len(got) != len(want) {
		t.Fatalf("delegateWithin = %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %v, want %v", k, got[k], v)
		}
	}
}
