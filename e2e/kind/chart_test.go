package kind

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

// helmBinary is helm on PATH or where scripts/setup.sh and
// e2e/kind/install.sh put it. Missing helm fails the test: the chart checks
// are part of `make test`, whose set-up installs it.
func helmBinary(t *testing.T) string {
	t.Helper()
	if p, err := exec.LookPath("helm"); err == nil {
		return p
	}
	p := "/opt/ctscrub-kind/bin/helm"
	if _, err := os.Stat(p); err == nil {
		return p
	}
	t.Fatal("helm is not installed: run scripts/setup.sh (`make test` does; it builds helm.sh/helm/v3 into /opt/ctscrub-kind/bin)")
	return ""
}

// exampleCIDRs is conf/scrubd.yaml's example pod_cidrs: the chart has no
// default, and conf/ holds its rendering with this value.
const exampleCIDRs = "config.pod_cidrs={10.0.0.0/8}"

// renderChart runs `helm template` on conf/chart and returns its objects by
// kind/name.
func renderChart(t *testing.T, args ...string) map[string]map[string]any {
	t.Helper()
	out, err := helmTemplate(t, args...)
	if err != nil {
		t.Fatal(err)
	}
	objs := map[string]map[string]any{}
	dec := yaml.NewDecoder(bytes.NewReader(out))
	for {
		var o map[string]any
		if err := dec.Decode(&o); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("helm template output: %v\n%s", err, out)
		}
		if o == nil {
			continue
		}
		md, _ := o["metadata"].(map[string]any)
		objs[fmt.Sprintf("%v/%v", o["kind"], md["name"])] = o
	}
	return objs
}

// helmTemplate runs `helm template` on conf/chart in namespace kube-system
// (args may name another) and returns its output.
func helmTemplate(t *testing.T, args ...string) ([]byte, error) {
	t.Helper()
	cmd := exec.Command(helmBinary(t), append([]string{"template", "ctscrub", filepath.Join(moduleRoot(t), "conf", "chart"), "--namespace", "kube-system"}, args...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return out, fmt.Errorf("helm template %s: %v\n%s", strings.Join(args, " "), err, stderr.String())
	}
	return out, nil
}

// yamlDocs reads every object of a multi-document file of conf/ by kind/name.
func yamlDocs(t *testing.T, rel string) map[string]map[string]any {
	t.Helper()
	objs := map[string]map[string]any{}
	dec := yaml.NewDecoder(bytes.NewReader(readFile(t, moduleRoot(t), rel)))
	for {
		var o map[string]any
		if err := dec.Decode(&o); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("%s: %v", rel, err)
		}
		if o != nil {
			md, _ := o["metadata"].(map[string]any)
			objs[fmt.Sprintf("%v/%v", o["kind"], md["name"])] = o
		}
	}
	return objs
}

// podTemplate is a DaemonSet's spec.template.
func podTemplate(ds map[string]any) map[string]any {
	return ds["spec"].(map[string]any)["template"].(map[string]any)
}

func yamlFile(t *testing.T, rel string) map[string]any {
	t.Helper()
	var o map[string]any
	if err := yaml.Unmarshal(readFile(t, moduleRoot(t), rel), &o); err != nil {
		t.Fatalf("%s: %v", rel, err)
	}
	return o
}

// TestChartMatchesConf: conf/chart with its default values (and
// conf/scrubd.yaml's example pod_cidrs, which the chart requires) renders
// exactly what conf/ holds, object by object (compared as data, so comments
// and key order do not matter): the DaemonSet (conf/daemonset.yaml), the
// ConfigMap ctscrub-config of conf/scrubd.yaml, Cilium's CNI ConfigMap
// (conf/cilium-cni-configmap.yaml) and the uninstall's ServiceAccount, Role
// and RoleBinding (conf/rbac.yaml), and nothing else. The pod template's
// config checksum is the chart's alone (conf/ users restart by hand): it is
// checked to be there, then left out of the comparison.
func TestChartMatchesConf(t *testing.T) {
	objs := renderChart(t, "--set", exampleCIDRs)
	want := map[string]map[string]any{
		"DaemonSet/ctscrub":            yamlFile(t, "conf/daemonset.yaml"),
		"ConfigMap/cilium-cni-ctscrub": yamlFile(t, "conf/cilium-cni-configmap.yaml"),
		"ConfigMap/ctscrub-config": {
			"apiVersion": "v1", "kind": "ConfigMap",
			"metadata": map[string]any{"name": "ctscrub-config", "namespace": "kube-system"},
			"data":     map[string]any{"scrubd.yaml": string(readFile(t, moduleRoot(t), "conf/scrubd.yaml"))},
		},
	}
	for k, o := range yamlDocs(t, "conf/rbac.yaml") {
		want[k] = o
	}
	if ds, ok := objs["DaemonSet/ctscrub"]; ok {
		md := podTemplate(ds)["metadata"].(map[string]any)
		ann, _ := md["annotations"].(map[string]any)
		if sum, _ := ann["checksum/config"].(string); !regexp.MustCompile(`^[0-9a-f]{64}$`).MatchString(sum) {
			t.Errorf("the DaemonSet's pod template has no config checksum (annotation checksum/config %q)", sum)
		}
		delete(ann, "checksum/config")
		if len(ann) == 0 {
			delete(md, "annotations")
		}
	}
	for key := range objs {
		if _, ok := want[key]; !ok {
			t.Errorf("the chart renders %s, which conf/ does not hold", key)
		}
	}
	for key, w := range want {
		got, ok := objs[key]
		if !ok {
			t.Errorf("the chart does not render %s", key)
			continue
		}
		// The files inside ConfigMaps compare as data too.
		for file, decode := range map[string]func(string) (any, error){
			"scrubd.yaml": func(s string) (any, error) { var v any; return v, yaml.Unmarshal([]byte(s), &v) },
			"cni-config":  func(s string) (any, error) { var v any; return v, json.Unmarshal([]byte(s), &v) },
		} {
			for _, o := range []map[string]any{got, w} {
				if d, ok := o["data"].(map[string]any); ok {
					if s, ok := d[file].(string); ok {
						v, err := decode(s)
						if err != nil {
							t.Fatalf("%s: %s: %v", key, file, err)
						}
						d[file] = v
					}
				}
			}
		}
		if !reflect.DeepEqual(got, w) {
			g, _ := yaml.Marshal(got)
			ww, _ := yaml.Marshal(w)
			t.Errorf("%s: the chart renders\n%s\nconf/ holds\n%s", key, g, ww)
		}
	}
}

// TestChartValues: the values the kind e2e sets reach every container and
// scrubd's config.
func TestChartValues(t *testing.T) {
	objs := renderChart(t, "--set", "image.repository=example/ctscrub", "--set", "image.tag=t1",
		"--set", "image.pullPolicy=IfNotPresent", "--set", "config.pod_cidrs={10.244.0.0/16}")
	ds := objs["DaemonSet/ctscrub"]
	spec := podTemplate(ds)["spec"].(map[string]any)
	n := 0
	for _, list := range []string{"initContainers", "containers"} {
		for _, c := range spec[list].([]any) {
			c := c.(map[string]any)
			n++
			if c["image"] != "example/ctscrub:t1" || c["imagePullPolicy"] != "IfNotPresent" {
				t.Errorf("container %v: image %v, pull policy %v; want example/ctscrub:t1, IfNotPresent", c["name"], c["image"], c["imagePullPolicy"])
			}
		}
	}
	if n != 3 {
		t.Errorf("%d containers, want 3 (install-cni, scrubd, cni-conf)", n)
	}
	var conf struct {
		PodCIDRs []string `yaml:"pod_cidrs"`
	}
	cm := objs["ConfigMap/ctscrub-config"]["data"].(map[string]any)["scrubd.yaml"].(string)
	if err := yaml.Unmarshal([]byte(cm), &conf); err != nil || !reflect.DeepEqual(conf.PodCIDRs, []string{"10.244.0.0/16"}) {
		t.Errorf("scrubd.yaml pod_cidrs %v (%v), want [10.244.0.0/16]:\n%s", conf.PodCIDRs, err, cm)
	}
}

// TestChartRequiredAndRestarts: no pod_cidrs is refused with what to set; a
// config change changes the pod template (helm upgrade restarts scrubd) and
// an unrelated value does not; the namespace lands where it must.
func TestChartRequiredAndRestarts(t *testing.T) {
	if _, err := helmTemplate(t); err == nil || !strings.Contains(err.Error(), "config.pod_cidrs is required") {
		t.Errorf("rendering without pod_cidrs: %v; want the required-value error naming config.pod_cidrs", err)
	}
	if _, err := helmTemplate(t, "--set", exampleCIDRs, "--set", "config.pod_cidr=10.1.0.0/16"); err == nil {
		t.Errorf("a misspelt config key rendered; the schema must refuse it (scrubd would refuse to start)")
	}
	// The delegate needs the conflist watch (scrubd refuses it without).
	if _, err := helmTemplate(t, "--set", exampleCIDRs, "--set", "config.cni_conf_dir="); err == nil || !strings.Contains(err.Error(), "config.cni_conf_dir is empty") {
		t.Errorf("rendering the delegate socket without cni_conf_dir: %v; want the error naming config.cni_conf_dir", err)
	}
	if _, err := helmTemplate(t, "--set", exampleCIDRs, "--set", "config.cni_conf_dir=", "--set", "config.delegate_socket="); err != nil {
		t.Errorf("no delegate, no cni_conf_dir: %v", err)
	}
	sum := func(args ...string) string {
		ds := renderChart(t, append([]string{"--set", exampleCIDRs}, args...)...)["DaemonSet/ctscrub"]
		return fmt.Sprint(podTemplate(ds)["metadata"].(map[string]any)["annotations"])
	}
	base := sum()
	if sum("--set", "config.log_level=debug") == base {
		t.Errorf("config.log_level changed and the pod template's checksum did not: helm upgrade would not restart scrubd")
	}
	if sum("--set", "resources.cniConf.requests.cpu=10m") != base {
		t.Errorf("the checksum changed with a value outside scrubd's config")
	}
	objs := renderChart(t, "--set", exampleCIDRs, "--namespace", "ctscrub-system", "--set", "ciliumCNIConfigMap.namespace=cilium")
	if ns := objs["ConfigMap/cilium-cni-ctscrub"]["metadata"].(map[string]any)["namespace"]; ns != "cilium" {
		t.Errorf("Cilium's CNI ConfigMap in namespace %v, want ciliumCNIConfigMap.namespace (cilium)", ns)
	}
	cmd := fmt.Sprint(podTemplate(objs["DaemonSet/ctscrub"])["spec"].(map[string]any)["containers"].([]any)[0].(map[string]any)["command"])
	if !strings.Contains(cmd, "--daemonset=ctscrub-system/ctscrub") {
		t.Errorf("scrubd's command %s: want --daemonset=ctscrub-system/ctscrub (the release's namespace)", cmd)
	}
	if _, ok := objs["Role/ctscrub"]; !ok {
		t.Errorf("no Role for the uninstall's watch")
	}
	off := renderChart(t, "--set", exampleCIDRs, "--set", "uninstallWithRelease=false")
	if _, ok := off["Role/ctscrub"]; ok || strings.Contains(fmt.Sprint(off["DaemonSet/ctscrub"]), "--daemonset") {
		t.Errorf("uninstallWithRelease=false still renders the Role or --daemonset")
	}
}

// TestChartFilesMatchConf: the chart's copies of the alert rules and the
// dashboard (Helm packages nothing outside the chart) are conf/'s files,
// byte for byte.
func TestChartFilesMatchConf(t *testing.T) {
	root := moduleRoot(t)
	for _, f := range []string{"alerts.yaml", "dashboard.json"} {
		if !bytes.Equal(readFile(t, root, "conf/"+f), readFile(t, root, "conf/chart/files/"+f)) {
			t.Errorf("conf/chart/files/%s differs from conf/%[1]s: edit conf/%[1]s, then cp conf/%[1]s conf/chart/files/", f)
		}
	}
}

// TestChartMonitoring: with every monitoring template on, the PodMonitor and
// ServiceMonitor scrape the port named metrics with job "ctscrub", the
// Service behind the ServiceMonitor is headless on that port, the
// PrometheusRule holds conf/alerts.yaml's groups and the dashboard ConfigMap
// conf/dashboard.json with Grafana's sidecar label; `helm lint --strict`
// passes. TestKindMetrics applies them to a cluster.
func TestChartMonitoring(t *testing.T) {
	on := []string{"--set", exampleCIDRs, "--set", "metrics.podMonitor.enabled=true", "--set", "metrics.serviceMonitor.enabled=true",
		"--set", "metrics.prometheusRule.enabled=true", "--set", "metrics.dashboard.enabled=true"}
	if off := renderChart(t, "--set", exampleCIDRs); len(off) != 6 {
		t.Errorf("defaults render %d objects, want the 6 of conf/ (monitoring off by default)", len(off))
	}
	objs := renderChart(t, on...)
	for _, kind := range []string{"PodMonitor", "ServiceMonitor"} {
		o, ok := objs[kind+"/ctscrub"]
		if !ok {
			t.Errorf("no %s", kind)
			continue
		}
		spec := o["spec"].(map[string]any)
		eps, _ := spec["podMetricsEndpoints"].([]any)
		if kind == "ServiceMonitor" {
			eps, _ = spec["endpoints"].([]any)
		}
		if o["apiVersion"] != "monitoring.coreos.com/v1" || spec["jobLabel"] != "app.kubernetes.io/name" || len(eps) != 1 || eps[0].(map[string]any)["port"] != "metrics" {
			t.Errorf("%s: %v", kind, o)
		}
	}
	svc := objs["Service/ctscrub-metrics"]
	if svc == nil || svc["spec"].(map[string]any)["clusterIP"] != "None" ||
		fmt.Sprint(svc["spec"].(map[string]any)["ports"]) != "[map[name:metrics port:9967 protocol:TCP targetPort:metrics]]" {
		t.Errorf("metrics Service: %v; want headless, port metrics 9967", svc)
	}
	var ports []any
	for _, c := range podTemplate(objs["DaemonSet/ctscrub"])["spec"].(map[string]any)["containers"].([]any) {
		if c := c.(map[string]any); c["name"] == "scrubd" {
			ports, _ = c["ports"].([]any)
		}
	}
	if fmt.Sprint(ports) != "[map[containerPort:9967 name:metrics protocol:TCP]]" {
		t.Errorf("scrubd's ports %v; want metrics 9967, the port of config.metrics_addr", ports)
	}
	var rules any
	if err := yaml.Unmarshal(readFile(t, moduleRoot(t), "conf/alerts.yaml"), &rules); err != nil {
		t.Fatal(err)
	}
	if pr := objs["PrometheusRule/ctscrub"]; pr == nil || pr["apiVersion"] != "monitoring.coreos.com/v1" || !reflect.DeepEqual(pr["spec"], rules) {
		t.Errorf("the PrometheusRule's spec is not conf/alerts.yaml")
	}
	dash := objs["ConfigMap/ctscrub-dashboard"]
	if dash == nil {
		t.Fatal("no dashboard ConfigMap")
	}
	if l := dash["metadata"].(map[string]any)["labels"].(map[string]any); l["grafana_dashboard"] != "1" {
		t.Errorf("dashboard labels %v: want grafana_dashboard: \"1\" (Grafana's sidecar default)", l)
	}
	var got, want any
	if err := json.Unmarshal([]byte(dash["data"].(map[string]any)["ctscrub.json"].(string)), &got); err != nil {
		t.Fatalf("dashboard ConfigMap: %v", err)
	}
	json.Unmarshal(readFile(t, moduleRoot(t), "conf/dashboard.json"), &want)
	if !reflect.DeepEqual(got, want) {
		t.Errorf("the dashboard ConfigMap is not conf/dashboard.json")
	}
	lint := exec.Command(helmBinary(t), append([]string{"lint", "--strict", filepath.Join(moduleRoot(t), "conf", "chart")}, on...)...)
	if out, err := lint.CombinedOutput(); err != nil {
		t.Errorf("helm lint --strict: %v\n%s", err, out)
	}
}

// TestAlertsUseExportedMetrics: every ctscrub_* series an alert rule reads
// is one scrubd defines (its metric names in scrubd's Go source; a
// histogram's _bucket/_sum/_count by its base name), so a renamed metric
// cannot leave an alert that never fires.
func TestAlertsUseExportedMetrics(t *testing.T) {
	root := moduleRoot(t)
	defined := map[string]bool{}
	nameRe := regexp.MustCompile(`"(ctscrub_[a-z0-9_]+)"`)
	err := filepath.WalkDir(filepath.Join(root, "scrubd"), func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
			return err
		}
		for _, m := range nameRe.FindAllSubmatch(readFile(t, "", p), -1) {
			defined[string(m[1])] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	var rules struct {
		Groups []struct {
			Rules []struct {
				Alert string `yaml:"alert"`
				Expr  string `yaml:"expr"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	if err := yaml.Unmarshal(readFile(t, root, "conf/alerts.yaml"), &rules); err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			n++
			for _, m := range regexp.MustCompile(`\bctscrub_[a-z0-9_]+`).FindAllString(r.Expr, -1) {
				base := regexp.MustCompile(`_(bucket|sum|count)$`).ReplaceAllString(m, "")
				if !defined[m] && !defined[base] {
					t.Errorf("alert %s reads %s, which scrubd does not define", r.Alert, m)
				}
			}
		}
	}
	if n == 0 {
		t.Fatal("conf/alerts.yaml has no rules")
	}
}

// TestAlertRules: promtool checks conf/alerts.yaml and unit-tests the alerts
// on scrubd itself against made-up series: each fires on its condition and
// stays quiet on a healthy node.
func TestAlertRules(t *testing.T) {
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatal("promtool is not installed: run scripts/setup.sh (`make test` does; Debian's prometheus package)")
	}
	rules := filepath.Join(moduleRoot(t), "conf", "alerts.yaml")
	if out, err := exec.Command(promtool, "check", "rules", rules).CombinedOutput(); err != nil {
		t.Fatalf("promtool check rules: %v\n%s", err, out)
	}
	tests := writeFile(t, t.TempDir(), "alerts_test.yaml", fmt.Sprintf(`rule_files: [%q]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - {series: 'up{job="ctscrub",instance="n1:9967"}', values: '1 1 0 0 0 0 0 0 0 0'}
      - {series: 'up{job="ctscrub",instance="n2:9967"}', values: '1 1 1 1 1 1 1 1 1 1'}
      - {series: 'ctscrub_cni_chained{job="ctscrub",instance="n1:9967"}', values: '1 0 0 0 0 0 0 0 0 0'}
      - {series: 'ctscrub_cni_chained{job="ctscrub",instance="n2:9967"}', values: '1 1 1 1 1 1 1 1 1 1'}
      - {series: 'ctscrub_ready{job="ctscrub",instance="n1:9967"}', values: '1 0 0 0 0 0 0 0 0 0'}
      - {series: 'ctscrub_ready{job="ctscrub",instance="n2:9967"}', values: '1 1 1 1 1 1 1 1 1 1'}
      - {series: 'ctscrub_scrub_duration_seconds_count{job="ctscrub",instance="n1:9967",backend="cilium",method="index",reason="add",result="error"}', values: '0 0 1 2 3 3 3 3 3 3'}
      - {series: 'ctscrub_scrub_duration_seconds_count{job="ctscrub",instance="n2:9967",backend="cilium",method="index",reason="add",result="complete"}', values: '0 5 10 15 20 25 30 35 40 45'}
    # ALERTS, not alert_rule_test: the latter compares the annotations too,
    # which would copy conf/alerts.yaml's text here.
    promql_expr_test:
      - eval_time: 8m
        expr: ALERTS{alertstate="firing", alertname=~"Ctscrub.*"}
        exp_samples:
          - {labels: 'ALERTS{alertname="CtscrubDown", alertstate="firing", severity="critical", job="ctscrub", instance="n1:9967"}', value: 1}
          - {labels: 'ALERTS{alertname="CtscrubChainLost", alertstate="firing", severity="warning", job="ctscrub", instance="n1:9967"}', value: 1}
          - {labels: 'ALERTS{alertname="CtscrubNotReady", alertstate="firing", severity="warning", job="ctscrub", instance="n1:9967"}', value: 1}
          - {labels: 'ALERTS{alertname="CtscrubScrubsFailing", alertstate="firing", severity="warning", instance="n1:9967", backend="cilium", reason="add", result="error"}', value: 1}
  - interval: 1m
    input_series:
      - {series: 'ctscrub_delegate_requests_total{job="ctscrub",instance="n1:9967",caller="cilium-agent",event="endpoint-create",outcome="incomplete"}', values: '0+10x30'}
      - {series: 'ctscrub_delegate_requests_total{job="ctscrub",instance="n1:9967",caller="cilium-agent",event="endpoint-create",outcome="complete"}', values: '0+1x30'}
      - {series: 'ctscrub_delegate_requests_total{job="ctscrub",instance="n2:9967",caller="cilium-agent",event="endpoint-create",outcome="complete"}', values: '0+10x30'}
      - {series: 'up{job="ctscrub",instance="n1:9967"}', values: '1x30'}
      - {series: 'up{job="ctscrub",instance="n2:9967"}', values: '1x30'}
    promql_expr_test:
      - eval_time: 28m
        expr: ALERTS{alertstate="firing", alertname="CtscrubDelegateFallingBack"}
        exp_samples:
          - {labels: 'ALERTS{alertname="CtscrubDelegateFallingBack", alertstate="firing", severity="info", instance="n1:9967"}', value: 1}
  - interval: 1m
    input_series:
      - {series: 'up{job="other"}', values: '1x30'}
    promql_expr_test:
      - eval_time: 20m
        expr: ALERTS{alertstate="firing"}
        exp_samples:
          - {labels: 'ALERTS{alertname="CtscrubAbsent", alertstate="firing", severity="warning", job="ctscrub"}', value: 1}
`, rules))
	if out, err := exec.Command(promtool, "test", "rules", tests).CombinedOutput(); err != nil {
		t.Errorf("promtool test rules: %v\n%s", err, out)
	}
}
