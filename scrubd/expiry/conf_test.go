package expiry

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"go.yaml.in/yaml/v3"
)

var metricRef = regexp.MustCompile(`ctscrub_[a-z0-9_]+`)

// exported lists the metric names scrubd exports: the expiry pass's (from a
// registry) and the daemon's (from its source, so the check follows it).
func exported(t *testing.T) []string {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	m, err := newMetrics(reg, nil, DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	// Vectors only appear in Gather once they have a child.
	m.entries.WithLabelValues("cilium", "m", "live")
	m.oldest.WithLabelValues("m")
	m.duration.WithLabelValues("m", "sweep")
	m.deleted.WithLabelValues("m")
	m.natDel.WithLabelValues("m")
	m.refreshed.WithLabelValues("m")
	m.passes.WithLabelValues("m", "swept")
	m.clock.WithLabelValues("ktime", "true")
	am, err := newAuditMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	am.missing.WithLabelValues("m", "out", "false", "tcp")
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, mf := range mfs {
		names = append(names, mf.GetName())
	}
	// Every quoted ctscrub_ name in the daemon's sources: metric names
	// appear as GaugeOpts Names and as NewDesc arguments.
	files, _ := filepath.Glob("../daemon/*.go")
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range regexp.MustCompile(`"(ctscrub_[a-z0-9_]+)"`).FindAllStringSubmatch(string(src), -1) {
			names = append(names, m[1])
		}
	}
	if len(files) == 0 {
		t.Log("daemon metrics not checked: no scrubd/daemon sources")
	}
	return names
}

// checkRefs fails for every ctscrub_ metric text refers to that scrubd does
// not export (histogram series resolve to their histogram).
func checkRefs(t *testing.T, what, text string, names []string) {
	t.Helper()
	for _, ref := range metricRef.FindAllString(text, -1) {
		base := ref
		for _, suf := range []string{"_bucket", "_sum", "_count"} {
			base = strings.TrimSuffix(base, suf)
		}
		if !slices.Contains(names, ref) && !slices.Contains(names, base) {
			t.Errorf("%s refers to %s, which scrubd does not export", what, ref)
		}
	}
}

// The operator's alert rules parse and use only metrics scrubd exports.
func TestAlertRulesUseExportedMetrics(t *testing.T) {
	data, err := os.ReadFile("../../conf/alerts.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var rules struct {
		Groups []struct {
			Name  string
			Rules []struct {
				Alert       string
				Expr        string
				For         string
				Labels      map[string]string
				Annotations map[string]string
			}
		}
	}
	if err := yaml.Unmarshal(data, &rules); err != nil {
		t.Fatalf("conf/alerts.yaml: %v", err)
	}
	names := exported(t)
	n := 0
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			n++
			if r.Alert == "" || r.Expr == "" || r.Labels["severity"] == "" || r.Annotations["summary"] == "" {
				t.Errorf("group %s: rule %q lacks alert, expr, severity or summary", g.Name, r.Alert)
			}
			checkRefs(t, "alert "+r.Alert, r.Expr, names)
		}
	}
	if n == 0 {
		t.Fatal("conf/alerts.yaml has no rules")
	}
	for _, want := range []string{"ctscrub_ct_entries", "ctscrub_ct_oldest_expired_seconds", "ctscrub_expiry_sweep_withheld"} {
		if !strings.Contains(string(data), want) {
			t.Errorf("no alert on %s", want)
		}
	}
}

// The dashboard is valid JSON, its panels query only metrics scrubd exports,
// and every expiry and scrub metric has a panel.
func TestDashboardCoversMetrics(t *testing.T) {
	data, err := os.ReadFile("../../conf/dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Title  string
		Panels []struct {
			Title   string
			Type    string
			Targets []struct{ Expr string }
		}
	}
	if err := json.Unmarshal(data, &dash); err != nil {
		t.Fatalf("conf/dashboard.json: %v", err)
	}
	names := exported(t)
	var all strings.Builder
	for _, p := range dash.Panels {
		if p.Type == "row" {
			continue
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			checkRefs(t, "panel "+p.Title, tg.Expr, names)
			all.WriteString(tg.Expr + "\n")
		}
	}
	for _, want := range []string{
		"ctscrub_ct_entries", "ctscrub_ct_oldest_expired_seconds", "ctscrub_expiry_sweep_duration_seconds",
		"ctscrub_expiry_deleted_total", "ctscrub_ct_clock", "ctscrub_expiry_sweep_withheld",
		"ctscrub_scrub_duration_seconds", "ctscrub_scrub_deleted_entries_total", "ctscrub_scrubs_in_flight",
		"ctscrub_index_keys", "ctscrub_index_incomplete_ips", "ctscrub_index_lost_total", "ctscrub_ct_max_entries",
	} {
		if !strings.Contains(all.String(), want) {
			t.Errorf("no panel queries %s", want)
		}
	}
}
