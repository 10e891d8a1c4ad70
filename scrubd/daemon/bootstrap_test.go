package daemon

import (
	"context"
	"strings"
	"testing"

	"github.com/ctscrub/ctscrub/scrubd/bootstrap"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// A bootstrap pass run with the daemon's Progress shows in `scrubd status`
// and /metrics: nothing before it, its figures after.
func TestBootstrapPassInStatusAndMetrics(t *testing.T) {
	root := newCTRoot(t, 1<<12)
	cfg := testConfig(t, root)
	cfg.MetricsAddr = "127.0.0.1:0"
	td := startDaemon(t, cfg)
	if st, err := td.c.Status(context.Background()); err != nil || st.Bootstrap != nil {
		t.Fatalf("status before any pass: %+v, %v", st, err)
	}
	ip := mustAddr("10.244.8.8")
	root.put4(t, podFlows(ip, 10))
	maps, err := ctmap.Open(root.dir)
	if err != nil {
		t.Fatal(err)
	}
	defer maps.Close()
	res, err := bootstrap.Run(context.Background(), td.Index(), maps, bootstrap.Options{Progress: td.BootstrapProgress()})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Addrs) != 1 || res.Addrs[0] != ip || res.Pairs != 20 {
		t.Fatalf("pass: vouched %v, %d pairs; want [%v], 20 (10 flows and their RELATED keys)", res.Addrs, res.Pairs, ip)
	}
	st, err := td.c.Status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if b := st.Bootstrap; b == nil || b.Running || b.Passes != 1 || b.Keys != 20 || b.Visited != 20 || b.Addresses != 1 || b.Error != "" {
		t.Fatalf("status after the pass: %+v", st.Bootstrap)
	}
	_, body := httpGet(t, "http://"+td.MetricsAddr()+"/metrics")
	for _, want := range []string{
		"\nctscrub_bootstrap_running 0\n",
		"\nctscrub_bootstrap_keys_total 20\n",
		"\nctscrub_bootstrap_entries_total 20\n",
		"\nctscrub_bootstrap_duration_seconds ",
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	// The daemon's index vouches for nothing until its rule says so.
	if td.Index().State(ip).Complete {
		t.Fatalf("%v complete without TrackFiled", ip)
	}
}
