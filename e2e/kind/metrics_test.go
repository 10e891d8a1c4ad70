package kind

import (
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"
)

// promNamespace holds the test's Prometheus.
const promNamespace = "ctscrub-prometheus"

// The Prometheus Operator whose CRDs the chart's PodMonitor, ServiceMonitor
// and PrometheusRule are validated against (a Go module: its
// example/prometheus-operator-crd holds them).
var promOperatorModule = "github.com/prometheus-operator/prometheus-operator@" + envOr("PROMETHEUS_OPERATOR_VERSION", "v0.85.0")

// TestKindMetrics: a real Prometheus inside the cluster (Debian's package,
// e2e/kind/images/prometheus.sh) scrapes scrubd on every node the way the
// chart's ServiceMonitor says, through the chart's headless Service (turned
// into a dns_sd job: its Service's name and namespace, the port it names,
// its path and job label; Debian builds Prometheus without Kubernetes
// service discovery, so DNS, not the API, finds the endpoints; no Operator
// needed), with the chart's PrometheusRule loaded as its rules. The chart's
// PodMonitor, ServiceMonitor and PrometheusRule are first validated against
// the Operator's CRDs. Then: every node's target is up
// (prometheus_targets_up), every
// Grafana dashboard query (conf/dashboard.json) evaluates without error and
// names only metrics scrubd exports, the queries that return data are
// counted (dashboard_queries_with_data), and every alert rule evaluates with
// health "ok".
func TestKindMetrics(t *testing.T) {
	e := getKindEnv(t)
	e.skipUnlessCilium(t) // its dashboard queries and alert checks are the Cilium node's
	c := e.newCluster(t, 8*time.Minute)
	image := os.Getenv("PROMETHEUS_IMAGE")
	if image == "" {
		t.Fatal("PROMETHEUS_IMAGE is not set: e2e/kind/images/build.sh builds it (cluster.sh env prints it)")
	}

	// Every monitoring object the chart renders is valid against the
	// Operator's CRDs: a server-side dry run, whose field validation is
	// strict (an unknown or misspelt field is an error).
	monitoringOn := []string{"--set", "config.pod_cidrs={" + e.podSubnet + "}", "--set", "metrics.podMonitor.enabled=true",
		"--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.prometheusRule.enabled=true", "--set", "metrics.dashboard.enabled=true"}
	mod, err := runCmd(c.ctx, 5*time.Minute, []string{"GOFLAGS=-mod=mod"}, t.TempDir(), "go", "mod", "download", "-json", promOperatorModule)
	if err != nil {
		t.Fatal(err)
	}
	var modInfo struct{ Dir string }
	if err := json.Unmarshal([]byte(mod), &modInfo); err != nil || modInfo.Dir == "" {
		t.Fatalf("go mod download %s: %v: %s", promOperatorModule, err, mod)
	}
	for _, crd := range []string{"podmonitors", "servicemonitors", "prometheusrules"} {
		c.must(2*time.Minute, "kubectl", "apply", "--server-side", "-f", filepath.Join(modInfo.Dir, "example", "prometheus-operator-crd", "monitoring.coreos.com_"+crd+".yaml"))
		// kubectl wait fails at once, not waits, while a CRD just applied
		// has no status conditions yet ("accessor error: <nil>"): retried
		// within the same minute.
		for deadline := time.Now().Add(time.Minute); ; {
			out, err := c.run(time.Minute, "kubectl", "wait", "--for=condition=Established", "crd/"+crd+".monitoring.coreos.com", "--timeout=1m")
			if err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("CRD %s not Established within 1 min: %v: %s", crd, err, out)
			}
			time.Sleep(time.Second)
		}
	}
	rendered, err := helmTemplate(t, monitoringOn...)
	if err != nil {
		t.Fatal(err)
	}
	out := c.must(2*time.Minute, "kubectl", "apply", "--dry-run=server", "--validate=strict", "-f", writeFile(t, t.TempDir(), "monitoring.yaml", string(rendered)))
	for _, kind := range []string{"podmonitor", "servicemonitor", "prometheusrule"} {
		if !strings.Contains(out, kind+".monitoring.coreos.com/ctscrub") {
			t.Errorf("the server-side dry run did not take the chart's %s:\n%s", kind, out)
		}
	}

	// What the chart renders for monitoring, from the chart itself.
	objs := renderChart(t, monitoringOn...)
	pr := objs["PrometheusRule/ctscrub"]
	if pr == nil {
		t.Fatalf("the chart renders no PrometheusRule")
	}
	scrape, err := scrapeConfigOf(objs)
	if err != nil {
		t.Fatal(err)
	}
	// The release gets the Service the ServiceMonitor selects (nothing else
	// changes: the DaemonSet's template stays, no pod restarts).
	chart := filepath.Join(c.root, "conf", "chart")
	c.must(3*time.Minute, "helm", "upgrade", "ctscrub", chart, "--namespace", "kube-system", "--reuse-values", "--set", "metrics.service.enabled=true", "--wait")
	rules, err := yaml.Marshal(pr["spec"])
	if err != nil {
		t.Fatal(err)
	}
	promYAML := prometheusConfig(scrape, "/etc/prometheus/rules.yaml")

	// Prometheus needs no API access: DNS finds the targets.
	manifest := fmt.Sprintf(`apiVersion: v1
kind: Namespace
metadata: {name: %[1]s}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: prometheus, namespace: %[1]s}
data:
  prometheus.yml: %[2]q
  rules.yaml: %[3]q
---
apiVersion: v1
kind: Pod
metadata: {name: prometheus, namespace: %[1]s, labels: {app: prometheus}}
spec:
  automountServiceAccountToken: false
  nodeName: %[4]s
  terminationGracePeriodSeconds: 2
  containers:
    - name: prometheus
      image: %[5]s
      imagePullPolicy: IfNotPresent
      args: [--config.file=/etc/prometheus/prometheus.yml, --storage.tsdb.path=/prometheus, --web.listen-address=:9090]
      ports: [{name: web, containerPort: 9090}]
      readinessProbe: {httpGet: {path: /-/ready, port: web}, periodSeconds: 2}
      volumeMounts: [{name: config, mountPath: /etc/prometheus}]
  volumes: [{name: config, configMap: {name: prometheus}}]
`, promNamespace, promYAML, string(rules), e.worker, image)
	c.kubectl("apply", "-f", writeFile(t, t.TempDir(), "prometheus.yaml", manifest))
	t.Cleanup(func() { c.run(2*time.Minute, "kubectl", "delete", "namespace", promNamespace, "--wait=false") })
	c.must(3*time.Minute, "kubectl", "-n", promNamespace, "wait", "--for=condition=Ready", "pod/prometheus", "--timeout=3m")

	query := func(path string, v url.Values) (json.RawMessage, error) {
		raw := fmt.Sprintf("/api/v1/namespaces/%s/pods/prometheus:9090/proxy%s?%s", promNamespace, path, v.Encode())
		out, err := c.run(time.Minute, "kubectl", "get", "--raw", raw)
		if err != nil {
			return nil, err
		}
		var r struct {
			Status string          `json:"status"`
			Data   json.RawMessage `json:"data"`
			Error  string          `json:"error"`
		}
		if err := json.Unmarshal([]byte(out), &r); err != nil {
			return nil, fmt.Errorf("%v: %s", err, out)
		}
		if r.Status != "success" {
			return nil, fmt.Errorf("%s", r.Error)
		}
		return r.Data, nil
	}
	scalar := func(q string) (string, error) {
		d, err := query("/api/v1/query", url.Values{"query": {q}})
		if err != nil {
			return "", err
		}
		var r struct {
			Result []struct {
				Value [2]any `json:"value"`
			} `json:"result"`
		}
		if err := json.Unmarshal(d, &r); err != nil || len(r.Result) == 0 {
			return "", fmt.Errorf("%s: no result (%v): %s", q, err, d)
		}
		return fmt.Sprint(r.Result[0].Value[1]), nil
	}

	// Every node's scrubd is a target, up, and has been scraped twice.
	want := fmt.Sprint(len(e.nodes))
	up := ""
	eventually(t, c.ctx, 2*time.Minute, "Prometheus scrapes scrubd on every node", func() (bool, string) {
		var err error
		up, err = scalar(`count(up{job="ctscrub"} == 1)`)
		if err != nil {
			out, _ := c.run(time.Minute, "kubectl", "-n", promNamespace, "logs", "prometheus", "--tail=20")
			return false, fmt.Sprintf("%v\n%s", err, out)
		}
		twice, _ := scalar(`count(count by (instance) (count_over_time(ctscrub_ct_max_entries[1m]) >= 2))`)
		return up == want && twice == want, fmt.Sprintf("%s targets up, %s scraped twice, want %s", up, twice, want)
	})
	targets := 0
	fmt.Sscan(up, &targets)
	d, err := query("/api/v1/targets", url.Values{"state": {"active"}})
	if err != nil {
		t.Fatal(err)
	}
	var tg struct {
		ActiveTargets []struct {
			ScrapeURL string            `json:"scrapeUrl"`
			Labels    map[string]string `json:"labels"`
			Health    string            `json:"health"`
		} `json:"activeTargets"`
	}
	json.Unmarshal(d, &tg)
	for _, a := range tg.ActiveTargets {
		t.Logf("target %s job=%s: %s", a.ScrapeURL, a.Labels["job"], a.Health)
		if strings.Contains(a.ScrapeURL, "127.0.0.1") || strings.Contains(a.ScrapeURL, "0.0.0.0") {
			t.Errorf("target %s: scrubd should be scraped on its node's IP", a.ScrapeURL)
		}
	}

	// The metric names scrubd exports, from every node's /metrics.
	exported := map[string]bool{}
	for _, n := range e.nodes {
		for _, l := range strings.Split(c.metrics(n), "\n") {
			if f := strings.FieldsFunc(l, func(r rune) bool { return r == '{' || r == ' ' }); len(f) > 0 && !strings.HasPrefix(l, "#") {
				exported[f[0]] = true
			}
		}
	}

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
	if err := json.Unmarshal(readFile(t, c.root, "conf/dashboard.json"), &dash); err != nil {
		t.Fatal(err)
	}
	metricRe := regexp.MustCompile(`\bctscrub_[a-z_]+`)
	// Counters of faults, labelled by what failed: no series until the first
	// one happens, so a healthy node does not export them.
	eventOnly := map[string]bool{"ctscrub_audit_missing_keys_total": true}
	queries, withData := 0, 0
	var empty []string
	for _, p := range dash.Panels {
		for _, q := range p.Targets {
			expr := strings.NewReplacer("$instance", ".*", "${instance}", ".*", "$__rate_interval", "1m").Replace(q.Expr)
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
			} else {
				empty = append(empty, p.Title)
			}
		}
	}
	if queries == 0 {
		t.Fatal("conf/dashboard.json has no queries")
	}
	t.Logf("dashboard: %d queries evaluated, %d with data; without data: %q", queries, withData, empty)
	if withData == 0 {
		t.Errorf("no dashboard query returned data from %d nodes' scrubd", len(e.nodes))
	}

	// The alert rules evaluate (health ok) against the same series; wait for
	// one evaluation of every group.
	var rulesResp struct {
		Groups []struct {
			Name  string `json:"name"`
			Rules []struct {
				Name      string `json:"name"`
				Health    string `json:"health"`
				LastError string `json:"lastError"`
				State     string `json:"state"`
			} `json:"rules"`
		} `json:"groups"`
	}
	eventually(t, c.ctx, time.Minute, "every alert rule evaluated", func() (bool, string) {
		d, err := query("/api/v1/rules", url.Values{})
		if err != nil {
			return false, err.Error()
		}
		json.Unmarshal(d, &rulesResp)
		for _, g := range rulesResp.Groups {
			for _, r := range g.Rules {
				if r.Health == "unknown" {
					return false, "rule " + r.Name + " not evaluated yet"
				}
			}
		}
		return len(rulesResp.Groups) > 0, "no rule groups"
	})
	n := 0
	for _, g := range rulesResp.Groups {
		for _, r := range g.Rules {
			n++
			if r.Health != "ok" {
				t.Errorf("alert %s: health %q (%s)", r.Name, r.Health, r.LastError)
			}
			if r.State == "firing" || r.State == "pending" {
				t.Logf("alert %s is %s on the test cluster", r.Name, r.State)
			}
		}
	}
	if n == 0 {
		t.Error("Prometheus loaded no rule from the chart's PrometheusRule")
	}
	result(t, "prometheus_targets_up", targets)
	result(t, "dashboard_queries", queries)
	result(t, "dashboard_queries_with_data", withData)
	result(t, "alert_rules_ok", n)
}

// prometheusConfig is the test Prometheus's prometheus.yml.
func prometheusConfig(scrape, rules string) string {
	return fmt.Sprintf("global: {scrape_interval: 5s, evaluation_interval: 5s}\nrule_files: [%q]\nscrape_configs:\n%s", rules, scrape)
}

// TestPrometheusConfigOfChart runs without a cluster: the Prometheus config
// TestKindMetrics derives from the chart's ServiceMonitor and Service, with
// the chart's PrometheusRule as its rules, passes `promtool check config` of
// the Prometheus the test runs (Debian's: no kubernetes_sd).
func TestPrometheusConfigOfChart(t *testing.T) {
	objs := renderChart(t, "--set", exampleCIDRs, "--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.prometheusRule.enabled=true")
	scrape, err := scrapeConfigOf(objs)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(scrape, `"ctscrub-metrics.kube-system.svc.cluster.local"`) || !strings.Contains(scrape, "port: 9967") {
		t.Errorf("scrape config does not name the chart's Service and port:\n%s", scrape)
	}
	rules, _ := yaml.Marshal(objs["PrometheusRule/ctscrub"]["spec"])
	dir := t.TempDir()
	cfg := writeFile(t, dir, "prometheus.yml", prometheusConfig(scrape, writeFile(t, dir, "rules.yaml", string(rules))))
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatal("promtool is not installed: run scripts/setup.sh")
	}
	if out, err := exec.Command(promtool, "check", "config", cfg).CombinedOutput(); err != nil {
		b, _ := os.ReadFile(cfg)
		t.Errorf("promtool check config: %v\n%s\n%s", err, out, b)
	}
}

// scrapeConfigOf turns the chart's ServiceMonitor into a Prometheus scrape
// job that finds the same endpoints by DNS: the rendered Service its selector
// matches, in its namespace, on the Service port its endpoint names (the
// headless Service's A records are the scrubd pods' IPs, their nodes' own),
// its path, and the job label its jobLabel takes from the Service.
func scrapeConfigOf(objs map[string]map[string]any) (string, error) {
	type svc struct {
		Metadata struct {
			Name      string            `yaml:"name"`
			Namespace string            `yaml:"namespace"`
			Labels    map[string]string `yaml:"labels"`
		} `yaml:"metadata"`
		Spec struct {
			ClusterIP string `yaml:"clusterIP"`
			Ports     []struct {
				Name string `yaml:"name"`
				Port int    `yaml:"port"`
			} `yaml:"ports"`
		} `yaml:"spec"`
	}
	var m struct {
		Spec struct {
			JobLabel          string `yaml:"jobLabel"`
			NamespaceSelector struct {
				MatchNames []string `yaml:"matchNames"`
			} `yaml:"namespaceSelector"`
			Selector struct {
				MatchLabels map[string]string `yaml:"matchLabels"`
			} `yaml:"selector"`
			Endpoints []struct {
				Port string `yaml:"port"`
				Path string `yaml:"path"`
			} `yaml:"endpoints"`
		} `yaml:"spec"`
	}
	conv := func(in, out any) error {
		b, err := yaml.Marshal(in)
		if err != nil {
			return err
		}
		return yaml.Unmarshal(b, out)
	}
	sm := objs["ServiceMonitor/ctscrub"]
	if sm == nil {
		return "", fmt.Errorf("the chart renders no ServiceMonitor")
	}
	if err := conv(sm, &m); err != nil {
		return "", err
	}
	sp := m.Spec
	if len(sp.Endpoints) != 1 || sp.JobLabel == "" || len(sp.Selector.MatchLabels) == 0 || len(sp.NamespaceSelector.MatchNames) != 1 {
		return "", fmt.Errorf("the chart's ServiceMonitor: want one endpoint, a jobLabel, a selector and one namespace: %v", sm)
	}
	var found []svc
	for key, o := range objs {
		if !strings.HasPrefix(key, "Service/") {
			continue
		}
		var s svc
		if err := conv(o, &s); err != nil {
			return "", err
		}
		match := s.Metadata.Namespace == sp.NamespaceSelector.MatchNames[0]
		for k, v := range sp.Selector.MatchLabels {
			match = match && s.Metadata.Labels[k] == v
		}
		if match {
			found = append(found, s)
		}
	}
	if len(found) != 1 || found[0].Spec.ClusterIP != "None" {
		return "", fmt.Errorf("the chart's ServiceMonitor selects %d Services (%v); want one, headless", len(found), found)
	}
	s := found[0]
	port := 0
	for _, p := range s.Spec.Ports {
		if p.Name == sp.Endpoints[0].Port {
			port = p.Port
		}
	}
	job := s.Metadata.Labels[sp.JobLabel]
	if port == 0 || job == "" {
		return "", fmt.Errorf("Service %s: no port named %q or no label %q", s.Metadata.Name, sp.Endpoints[0].Port, sp.JobLabel)
	}
	return fmt.Sprintf("  - job_name: ctscrub-servicemonitor\n    metrics_path: %s\n"+
		"    dns_sd_configs: [{names: [%q], type: A, port: %d, refresh_interval: 5s}]\n"+
		"    relabel_configs: [{target_label: job, replacement: %q}]\n",
		sp.Endpoints[0].Path, s.Metadata.Name+"."+s.Metadata.Namespace+".svc.cluster.local", port, job), nil
}
