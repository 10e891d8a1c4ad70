package daemon

import (
	"context"
	"errors"
	"net/netip"
	"testing"

	"github.com/ctscrub/ctscrub/internal/testsupport/netpods"
	"github.com/ctscrub/ctscrub/internal/testsupport/standin"
	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// Cilium re-creates its IPv4 service map under a running scrubd: scrubd
// notices on its own, reloads the recorder over the new map, puts it on the
// indexed pod's interface, and marks the pod's IPs incomplete (flows to
// services the old map lacked were recorded by VIP). Its next scrub sweeps.
func TestServiceMapsRecreatedUnderDaemon(t *testing.T) {
	root, node, pod := standinPod(t, 1<<14)
	td := startDaemon(t, podConfig(t, root, node))
	ctx := context.Background()
	a := api.Attachment{ContainerID: "svcmaps", IfName: "eth0"}
	ips := []netip.Addr{pod.Addr4, pod.Addr6}
	if err := td.c.IndexStart(ctx, api.IndexStartRequest{Attachment: a, Netns: pod.Path, IPs: ips, Network: "pods", Scrub: true}); err != nil {
		t.Fatalf("index start: %v", err)
	}
	if err := pod.TCP(node.Remote.Addr4, netpods.EchoPort); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the pod's IPs to be complete and indexed", func() bool {
		st := td.Index().State(pod.Addr4)
		return st.Complete && st.Keys >= 2
	})
	ingress, _ := td.rec.(*recorder.Recorder).Programs()

	// Cilium re-creates its IPv4 service map.
	if err := standin.RecreateServiceMap4(root.dir); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "scrubd to notice the re-created service map", func() bool {
		st := td.Index().State(pod.Addr4)
		return !st.Complete && st.Incomplete == index.ReasonServiceMaps
	})
	if st := td.Index().State(pod.Addr6); st.Complete || st.Incomplete != index.ReasonServiceMaps {
		t.Errorf("%s after the re-create: %+v", pod.Addr6, st)
	}
	if got := counterValue(t, td, "ctscrub_service_maps_reloaded_total", nil); got != 1 {
		t.Errorf("ctscrub_service_maps_reloaded_total %v, want 1", got)
	}
	if in, _ := td.rec.(*recorder.Recorder).Programs(); in == ingress {
		t.Error("the recorder still uses the programs loaded over the old map")
	}
	if !recorderOn(t, pod.Path) {
		t.Error("the pod's interface lost the recorder")
	}
	// The DEL after it sweeps, and leaves nothing of the pod.
	resp, err := td.c.Scrub(ctx, api.ScrubRequest{IPs: ips, Reason: scrub.ReasonDel, ContainerID: a.ContainerID})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range resp.Results {
		if r.Method != scrub.MethodSweep || r.Outcome != scrub.Complete {
			t.Errorf("DEL scrub after the reload: %+v, want a complete sweep", r)
		}
	}
	if n := root.entriesOf(t, pod.Addr4); n != 0 {
		t.Errorf("%d entries of %s left", n, pod.Addr4)
	}
}

func recorderOn(t *testing.T, netns string) bool {
	t.Helper()
	on, err := recorder.Attached(netns, "eth0")
	if err != nil {
		t.Fatal(err)
	}
	return on
}

// failingReloader: Cilium's service maps changed and the recorder cannot
// reload its programs over them.
type failingReloader struct{}

func (failingReloader) ServiceMapsChanged() bool { return true }
func (failingReloader) ReloadPrograms() error    { return errors.New("reload refused") }

// While the recorder cannot follow changed service maps, its old programs
// read maps Cilium no longer fills: every indexed IP is marked incomplete
// at each try, so its scrub sweeps instead of trusting the index.
func TestServiceMapsReloadFailureMarksIncomplete(t *testing.T) {
	root := newCTRoot(t, 1<<16)
	td := startDaemon(t, testConfig(t, root))
	ip := mustAddr("10.244.3.3")
	indexFlows(td.Daemon, ip, podFlows(ip, 10))
	if st := td.Index().State(ip); !st.Complete {
		t.Fatalf("%s before the failed reload: %+v, want complete", ip, st)
	}
	td.followServiceMaps(failingReloader{})
	if st := td.Index().State(ip); st.Complete || st.Incomplete != index.ReasonServiceMaps {
		t.Errorf("%s after a failed reload: complete %v, reason %q; want incomplete for %q", ip, st.Complete, st.Incomplete, index.ReasonServiceMaps)
	}
}
