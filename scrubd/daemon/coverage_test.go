package daemon

import (
	"context"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/cilium"
)

// A Cilium feature whose entries the index does not cover (here the host
// firewall, read from the agent's node_config.h while scrubd runs) is
// found by the continuous check without any scrub: the pod's IP is marked
// incomplete with the feature's reason, scrubd status and
// ctscrub_uncovered_feature list the feature, and the delegate answers
// incomplete naming it, so Cilium walks. Before, the features were read
// only by a scrub, the host firewall not at all, and the delegate answered
// complete.
func TestUncoveredFeatureThroughDaemon(t *testing.T) {
	root := newCTRoot(t, 1<<16)
	cfg := testConfig(t, root)
	cfg.MetricsAddr = "127.0.0.1:0"
	cfg.DelegateSocket = filepath.Join(t.TempDir(), "delegate", "delegate.sock")
	cfg.CNIConfDir = chainedConfDir(t)
	cfg.CiliumNodeConfig = filepath.Join(t.TempDir(), "node_config.h")
	if err := os.WriteFile(cfg.CiliumNodeConfig, []byte("#define ENABLE_IPV4 1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	td := startDaemon(t, cfg)
	ctx := context.Background()
	pod := mustAddr("10.244.3.11")
	flows := podFlows(pod, 10)
	root.put4(t, flows)
	indexFlows(td.Daemon, pod, flows)

	st, err := td.c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(st.UncoveredFeatures) != 0 {
		t.Fatalf("status lists %v uncovered before the host firewall is on", st.UncoveredFeatures)
	}
	if err := os.WriteFile(cfg.CiliumNodeConfig, []byte("#define ENABLE_IPV4 1\n#define ENABLE_HOST_FIREWALL 1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for td.Index().State(pod).Complete && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if s := td.Index().State(pod); s.Incomplete != cilium.ReasonHostFirewall {
		t.Fatalf("pod's IP %+v: want marked by the continuous check (%s)", s, cilium.ReasonHostFirewall)
	}
	if st, err = td.c.Status(ctx); err != nil || !slices.Equal(st.UncoveredFeatures, []string{"host_firewall"}) {
		t.Fatalf("status uncovered_features %v (%v), want [host_firewall]", st.UncoveredFeatures, err)
	}
	code, body := httpGet(t, "http://"+td.MetricsAddr()+"/metrics")
	if code != 200 {
		t.Fatalf("/metrics: %d", code)
	}
	for _, want := range []string{
		`ctscrub_uncovered_feature{backend="cilium",feature="host_firewall"} 1`,
		`ctscrub_uncovered_feature{backend="cilium",feature="nodeport_backends"} 0`,
		`ctscrub_uncovered_feature{backend="cilium",feature="l7_proxy"} 0`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	status, b, err := delegatePost(cfg.DelegateSocket, delegateBody(1, 5000, pod.String()))
	if err != nil || status != http.StatusOK {
		t.Fatalf("%d %s %v", status, b, err)
	}
	var resp api.DelegateResponse
	if err := json.Unmarshal(b, &resp); err != nil || len(resp.IPs) != 1 {
		t.Fatalf("answer %s: %v", b, err)
	}
	if got := resp.IPs[0]; got.Complete || !strings.Contains(got.Reason, cilium.ReasonHostFirewall) {
		t.Errorf("delegate answer %+v: want incomplete naming the host firewall", got)
	}
}
