package daemon

import (
	"context"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/cilium"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// A Cilium feature that keeps an IP's entries out of the index's reach
// (here a per-endpoint CT map, pinned under Cilium's name beside the global
// maps) shows through the daemon: the scrub sweeps, and afterwards the IP is
// incomplete with the feature's reason in GET /v1/ip, counted by
// ctscrub_index_incomplete_ips and ctscrub_index_feature_marks_total{reason},
// where without the map the swept IP is complete.
func TestFeatureReasonInAPIAndMetrics(t *testing.T) {
	root := newCTRoot(t, 1<<12)
	cfg := testConfig(t, root)
	cfg.MetricsAddr = "127.0.0.1:0"
	td := startDaemon(t, cfg)
	ctx := context.Background()
	plain, featured := mustAddr("10.244.8.8"), mustAddr("10.244.8.9")

	scrubAndState := func(ip netip.Addr) *api.IPState {
		t.Helper()
		td.Index().Hold(ip) // a pod of this node, as after its ADD
		root.put4(t, podFlows(ip, 5))
		resp, err := td.c.Scrub(ctx, api.ScrubRequest{IPs: []netip.Addr{ip}, Reason: scrub.ReasonDel})
		if err != nil {
			t.Fatal(err)
		}
		if r := resp.Results[0]; r.Outcome != scrub.Complete || r.PerIP[ip.String()] != scrub.MethodSweep {
			t.Fatalf("scrub of %s: %+v, want complete through the sweep", ip, r)
		}
		st, err := td.c.IndexIP(ctx, ip)
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	if st := scrubAndState(plain); !st.Complete {
		t.Fatalf("%s after its sweep, no Cilium feature on: %+v, want complete", plain, st)
	}

	spec := ctmap.TCP4.Spec(64000)
	spec.Name = "cilium_ct4_00042"
	m, err := ebpf.NewMap(spec)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.Pin(filepath.Join(root.dir, "cilium_ct4_00042")); err != nil {
		t.Fatal(err)
	}
	if st := scrubAndState(featured); st.Complete || st.Incomplete != cilium.ReasonLocalCT {
		t.Fatalf("%s after its sweep with a per-endpoint CT map pinned: %+v, want incomplete (%s)", featured, st, cilium.ReasonLocalCT)
	}
	code, body := httpGet(t, "http://"+td.MetricsAddr()+"/metrics")
	if code != 200 {
		t.Fatalf("/metrics: %d", code)
	}
	for _, want := range []string{
		`ctscrub_index_incomplete_ips{backend="cilium"} 1`,
		`ctscrub_index_feature_marks_total{backend="cilium",reason="endpoint_ct_maps"} 1`,
		`ctscrub_index_feature_marks_total{backend="cilium",reason="l7_proxy"} 0`,
		`ctscrub_index_feature_marks_total{backend="cilium",reason="per_cluster_ct_maps"} 0`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}
