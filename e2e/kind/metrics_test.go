package kind

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestKindMetrics: scrubd's metrics scraped from every node of the cluster,
// then the Grafana dashboard's queries (conf/dashboard.json) and the alert
// rules (conf/alerts.yaml) evaluated against them by a real Prometheus
// (Debian's prometheus package) that scrapes those snapshots; promtool
// checks the rules file. Every dashboard query must evaluate without error,
// every metric it names must be exported by scrubd, and every alert rule must
// evaluate with health "ok".
func TestKindMetrics(t *testing.T) {
	e := getKindEnv(t)
	c := e.newCluster(t, 5*time.Minute)
	root := c.root
	for _, tool := range []string{"prometheus", "promtool"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s is not installed: apt-get install prometheus (e2e/kind/install.sh does)", tool)
		}
	}
	if out, err := exec.Command("promtool", "check", "rules", filepath.Join(root, "conf", "alerts.yaml")).CombinedOutput(); err != nil {
		t.Fatalf("promtool check rules conf/alerts.yaml: %v\n%s", err, out)
	}

	// Snapshots of every node's /metrics, refreshed while Prometheus runs.
	var mu sync.Mutex
	snap := map[string]string{}
	scrape := func() {
		for _, n := range e.nodes {
			out, err := c.run(time.Minute, "docker", "exec", n, "curl", "-sf", "http://127.0.0.1:9967/metrics")
			if err != nil {
				continue
			}
			mu.Lock()
			snap[n] = out
			mu.Unlock()
		}
	}
	scrape()
	exported := map[string]bool{}
	for _, n := range e.nodes {
		if !strings.Contains(snap[n], "ctscrub_") {
			t.Fatalf("scrubd's /metrics on %s has no ctscrub_ series", n)
		}
		for _, l := range strings.Split(snap[n], "\n") {
			if f := strings.FieldsFunc(l, func(r rune) bool { return r == '{' || r == ' ' }); len(f) > 0 && !strings.HasPrefix(l, "#") {
				exported[f[0]] = true
			}
		}
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		fmt.Fprint(w, snap[strings.TrimPrefix(r.URL.Path, "/metrics/")])
	})}
	go srv.Serve(lis)
	t.Cleanup(func() { srv.Close() })
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop) })
	go func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(3 * time.Second):
				scrape()
			}
		}
	}()

	// Prometheus on a free loopback port, scraping each node's snapshot as
	// instance=<node>, with the alert rules loaded.
	tmp := t.TempDir()
	pl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	promAddr := pl.Addr().String()
	pl.Close()
	var cfg strings.Builder
	fmt.Fprintf(&cfg, "global: {scrape_interval: 1s, evaluation_interval: 1s}\nrule_files: [%q]\nscrape_configs:\n", filepath.Join(root, "conf", "alerts.yaml"))
	for _, n := range e.nodes {
		fmt.Fprintf(&cfg, "  - job_name: %q\n    metrics_path: /metrics/%s\n    static_configs: [{targets: [%q], labels: {instance: %q}}]\n", n, n, lis.Addr().String(), n)
	}
	cfgPath := writeFile(t, tmp, "prometheus.yml", cfg.String())
	prom := exec.Command("prometheus", "--config.file="+cfgPath, "--storage.tsdb.path="+filepath.Join(tmp, "data"),
		"--web.listen-address="+promAddr)
	promLog, _ := os.Create(filepath.Join(tmp, "prometheus.log"))
	prom.Stdout, prom.Stderr = promLog, promLog
	if err := prom.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { prom.Process.Kill(); prom.Wait() })
	query := func(path string, v url.Values) (json.RawMessage, error) {
		resp, err := http.Get("http://" + promAddr + path + "?" + v.Encode())
		if err != nil {
			return nil, err
		}
		defer resp.Body.Close()
		var r struct {
			Status string          `json:"status"`
			Data   json.RawMessage `json:"data"`
			Error  string          `json:"error"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
			return nil, err
		}
		if r.Status != "success" {
			return nil, fmt.Errorf("%s", r.Error)
		}
		return r.Data, nil
	}
	eventually(t, c.ctx, time.Minute, "Prometheus has scraped every node twice", func() (bool, string) {
		d, err := query("/api/v1/query", url.Values{"query": {`count(count by (instance) (count_over_time(ctscrub_ct_max_entries[1m]) >= 2))`}})
		if err != nil {
			b, _ := os.ReadFile(filepath.Join(tmp, "prometheus.log"))
			return false, fmt.Sprintf("%v\n%s", err, tail(b))
		}
		return strings.Contains(string(d), fmt.Sprintf(`"%d"`, len(e.nodes))), string(d)
	})

	// The dashboard's queries, with its variables as Grafana fills them for
	// "All" nodes.
	var dash struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(readFile(t, root, "conf/dashboard.json"), &dash); err != nil {
		t.Fatal(err)
	}
	metricRe := regexp.MustCompile(`\bctscrub_[a-z_]+`)
	// Counters of faults, labelled by what failed: no series until the first
	// one happens, so a healthy node does not export them.
	eventOnly := map[string]bool{"ctscrub_audit_missing_keys_total": true}
	queries, withData := 0, 0
	for _, p := range dash.Panels {
		for _, tg := range p.Targets {
			expr := strings.NewReplacer("$instance", ".*", "${instance}", ".*", "$__rate_interval", "1m").Replace(tg.Expr)
			queries++
			for _, m := range metricRe.FindAllString(expr, -1) {
				base := m
				for _, s := range []string{"_bucket", "_sum", "_count"} {
					if strings.HasSuffix(m, s) && !exported[m] && exported[strings.TrimSuffix(m, s)+"_count"] {
						base = strings.TrimSuffix(m, s) + "_count"
					}
				}
				if !exported[base] && !eventOnly[base] {
					t.Errorf("panel %q queries %s, which no node's scrubd exports", p.Title, m)
				}
			}
			d, err := query("/api/v1/query", url.Values{"query": {expr}})
			if err != nil {
				t.Errorf("panel %q: %s: %v", p.Title, expr, err)
				continue
			}
			var r struct {
				Result []json.RawMessage `json:"result"`
			}
			json.Unmarshal(d, &r)
			if len(r.Result) > 0 {
				withData++
			}
		}
	}
	if queries == 0 {
		t.Fatal("conf/dashboard.json has no queries")
	}
	t.Logf("dashboard: %d queries evaluated, %d with data", queries, withData)
	if withData == 0 {
		t.Errorf("no dashboard query returned data from %d nodes' metrics", len(e.nodes))
	}

	// The alert rules evaluate (health ok) against the same series.
	time.Sleep(3 * time.Second)
	d, err := query("/api/v1/rules", url.Values{})
	if err != nil {
		t.Fatal(err)
	}
	var rules struct {
		Groups []struct {
			Rules []struct {
				Name      string `json:"name"`
				Health    string `json:"health"`
				LastError string `json:"lastError"`
				State     string `json:"state"`
			} `json:"rules"`
		} `json:"groups"`
	}
	if err := json.Unmarshal(d, &rules); err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			n++
			if r.Health != "ok" {
				t.Errorf("alert %s: health %q (%s)", r.Name, r.Health, r.LastError)
			}
			if r.State == "firing" {
				t.Logf("alert %s is firing on the test cluster", r.Name)
			}
		}
	}
	if n == 0 {
		t.Error("Prometheus loaded no rule from conf/alerts.yaml")
	}
	result(t, "dashboard_queries", queries)
	result(t, "alert_rules_ok", n)
}
