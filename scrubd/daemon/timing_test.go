package daemon

import (
	"context"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/ctscrub/ctscrub/internal/testsupport/netpods"
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
	for _, want := range []string{"read", "decode", "check", "ownership", "handoff", "queue", "lock", "sync", "take", "delete", "backends", "wait", "release", "handler"} {
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

// An index start with Scrub set is a whole CNI ADD in one request: the
// previous owner's entries of the IP are gone before the recorder attaches.
func TestIndexStartScrubsFirst(t *testing.T) {
	root, _ := standinRoot(t, 1<<16)
	node := netpods.NewNode(t)
	pod := node.AddPod()
	td := startDaemon(t, podConfig(t, root, node))
	stale := podFlows(pod.Addr4, 30) // a previous owner's, never indexed
	root.put4(t, stale)
	c := client.New(td.cfg.Socket)
	c.Trace = true
	a := api.Attachment{ContainerID: "c0ffee", IfName: "eth0"}
	err := c.IndexStart(context.Background(), api.IndexStartRequest{Attachment: a, Netns: pod.Path, IPs: []netip.Addr{pod.Addr4}, Scrub: true})
	if err != nil {
		t.Fatal(err)
	}
	if n := root.present4(t, stale); n != 0 {
		t.Errorf("%d of the previous owner's %d entries left after the ADD", n, len(stale))
	}
	if _, ok := td.pods.get(a); !ok {
		t.Error("not attached after the ADD")
	}
	var names []string
	for _, s := range c.Timings[0].Server {
		names = append(names, s.Name)
	}
	// The scrub's steps, then the attach's.
	i := slices.Index(names, "sweep")
	j := slices.IndexFunc(names, func(n string) bool { return strings.HasPrefix(n, "attach.") })
	if i < 0 || j < i {
		t.Errorf("steps %v: want the sweep before the attach", names)
	}
}

// An index stop with Del set is a whole CNI DEL in one request: the pod's
// entries go, the attachment stops, a second DEL finds it stopped, and a
// DEL of an attachment scrubd never indexed leaves alone an IP that
// another attachment holds now.
func TestIndexStopIsWholeDel(t *testing.T) {
	root, _ := standinRoot(t, 1<<16)
	node := netpods.NewNode(t)
	pod := node.AddPod()
	td := startDaemon(t, podConfig(t, root, node))
	ctx := context.Background()
	a := api.Attachment{ContainerID: "c0ffee", IfName: "eth0"}
	if err := td.c.IndexStart(ctx, api.IndexStartRequest{Attachment: a, Netns: pod.Path, IPs: []netip.Addr{pod.Addr4}, Scrub: true}); err != nil {
		t.Fatal(err)
	}
	keys := podFlows(pod.Addr4, 40)
	root.put4(t, keys)
	indexFlows(td.Daemon, pod.Addr4, keys)

	// A repeated DEL of a pod scrubd never indexed, naming the live pod's IP.
	other := api.Attachment{ContainerID: "gone", IfName: "eth0"}
	resp, err := td.c.Del(ctx, api.IndexStopRequest{Attachment: other, Del: &api.CNIDel{IPs: []netip.Addr{pod.Addr4}, Scrub: true}})
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Skipped) != 1 || resp.Skipped[0].Owner != a || resp.Known {
		t.Errorf("DEL of an unknown attachment: %+v, want %s skipped as %v's", resp, pod.Addr4, a)
	}
	if n := root.present4(t, keys); n != len(keys) {
		t.Fatalf("the live pod lost %d entries to another attachment's DEL", len(keys)-n)
	}

	// The pod's DEL without prevResult: the IPs recorded at start.
	resp, err = td.c.Del(ctx, api.IndexStopRequest{Attachment: a, Netns: pod.Path, Del: &api.CNIDel{Scrub: true}})
	if err != nil {
		t.Fatal(err)
	}
	if !resp.Known || resp.AlreadyStopped || len(resp.Results) != 1 || resp.Results[0].Total < len(keys) {
		t.Errorf("DEL: %+v, want the pod's %d entries deleted", resp, len(keys))
	}
	if n := root.present4(t, keys); n != 0 {
		t.Errorf("%d of the pod's entries left after its DEL", n)
	}
	if rec, ok := td.pods.get(a); !ok || rec.Stopped.IsZero() {
		t.Errorf("not stopped after the DEL: %+v", rec)
	}
	resp, err = td.c.Del(ctx, api.IndexStopRequest{Attachment: a, Del: &api.CNIDel{Scrub: true}})
	if err != nil || !resp.AlreadyStopped || len(resp.Results) != 0 {
		t.Errorf("second DEL: %+v, %v; want already stopped, no scrub", resp, err)
	}
}
