package daemon

import (
	"context"
	"net/netip"
	"slices"
	"testing"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/client"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// Every API answer says where its time went (api.TimingHeader), and the
// same steps land in ctscrub_api_step_seconds: what `make bench-cni`
// breaks an ADD and a DEL down by.
func TestAPIStepsTimed(t *testing.T) {
	requireRoot(t)
	root := newCTRoot(t, 1<<16)
	td := startDaemon(t, testConfig(t, root))
	pod := mustAddr("10.244.3.9")
	keys := podFlows(pod, 50)
	root.put4(t, keys)
	indexFlows(td.Daemon, pod, keys)

	c := client.New(td.cfg.Socket)
	c.Trace = true
	if _, err := c.Scrub(context.Background(), api.ScrubRequest{IPs: []netip.Addr{pod}, Reason: scrub.ReasonDel}); err != nil {
		t.Fatal(err)
	}
	if len(c.Timings) != 1 {
		t.Fatalf("%d timings, want 1", len(c.Timings))
	}
	tm := c.Timings[0]
	var names []string
	for _, s := range tm.Server {
		names = append(names, s.Name)
	}
	// The request's own steps, the flight's and the Cilium backend's.
	for _, want := range []string{"read", "decode", "check", "ownership", "handoff", "queue", "lock", "sync", "take", "delete", "backends", "wait", "log", "release", "handler"} {
		if !slices.Contains(names, want) {
			t.Errorf("server steps %v: no %q", names, want)
		}
	}
	if tm.Total <= 0 || tm.Dial <= 0 || tm.Dial > tm.Total {
		t.Errorf("client timing: dial %v of total %v", tm.Dial, tm.Total)
	}
	if tm.Path != api.PathScrub {
		t.Errorf("path %q", tm.Path)
	}
	if n := counterValue(t, td, "ctscrub_api_step_seconds", map[string]string{"path": api.PathScrub, "step": "delete"}); n != 1 {
		t.Errorf("ctscrub_api_step_seconds{path=%s,step=delete}: %v observations, want 1", api.PathScrub, n)
	}
	c.IndexIP(context.Background(), pod)
	if n := counterValue(t, td, "ctscrub_api_step_seconds", map[string]string{"path": api.PathIndexIP, "step": "handler"}); n != 1 {
		t.Errorf("index ip steps: %v observations, want 1", n)
	}
}
