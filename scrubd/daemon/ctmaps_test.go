package daemon

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/internal/testsupport/netpods"
	"github.com/ctscrub/ctscrub/internal/testsupport/standin"
	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// recreateCTMaps does what a Cilium agent restart that re-creates its CT maps
// does: the datapath is detached, every CT map is unpinned and a new, empty
// one with Cilium's spec pinned in its place, and the datapath comes back on
// the new maps. The test's own handles move to the new maps.
func recreateCTMaps(t *testing.T, root *ctRoot, dp *standin.Datapath, entries uint32, hostVeths []string, node *netpods.Node) *standin.Datapath {
	t.Helper()
	if err := dp.Close(); err != nil {
		t.Fatalf("detach the stand-in: %v", err)
	}
	for _, k := range ctmap.Kinds {
		path := filepath.Join(root.dir, k.Name())
		if err := os.Remove(path); err != nil {
			t.Fatalf("unpin %s: %v", k.Name(), err)
		}
		m, err := ebpf.NewMap(k.Spec(entries))
		if err != nil {
			t.Fatalf("re-create %s: %v", k.Name(), err)
		}
		if err := m.Pin(path); err != nil {
			t.Fatalf("pin %s: %v", k.Name(), err)
		}
		root.maps[k].Close()
		root.maps[k] = m
	}
	ndp, err := standin.Load(root.dir, nil)
	if err != nil {
		t.Fatalf("reload the stand-in on the new maps: %v", err)
	}
	t.Cleanup(func() { ndp.Close() })
	for _, v := range hostVeths {
		if err := node.Do(func() error { return ndp.AttachHostSide(v) }); err != nil {
			t.Fatal(err)
		}
	}
	return ndp
}

// Cilium's CT maps unpinned and re-created under a running daemon: scrubd
// notices on its own (periodic check), marks every indexed IP incomplete with
// the named reason, and scrubs the new maps: the next DEL sweeps them and
// leaves nothing of the pod, including an entry whose flow the recorder had
// seen before the restart (so never recorded again), and the cycle after that
// goes through the index again, on the new maps. Before the daemon re-opened
// re-created maps, it kept scrubbing the orphaned old ones and the DEL left the
// pod's new entries behind.
func TestCTMapsRecreatedUnderDaemon(t *testing.T) {
	const entries = 1 << 14
	root, dp := standinRoot(t, entries)
	node, pod := standinNode(t, dp)
	cfg := podConfig(t, root, node)
	cfg.Expiry.Mode = "report" // its programs move to the new maps too
	td := startDaemon(t, cfg)
	ctx := context.Background()
	a := api.Attachment{ContainerID: "recreate", IfName: "eth0"}
	ips := []netip.Addr{pod.Addr4, pod.Addr6}
	if err := td.c.IndexStart(ctx, api.IndexStartRequest{Attachment: a, Netns: pod.Path, IPs: ips, Network: "pods"}); err != nil {
		t.Fatalf("index start: %v", err)
	}
	if _, err := td.c.Scrub(ctx, api.ScrubRequest{IPs: ips, Reason: scrub.ReasonAdd, ContainerID: a.ContainerID}); err != nil {
		t.Fatalf("ADD scrub: %v", err)
	}
	traffic := func() {
		t.Helper()
		for _, f := range []func() error{
			func() error { return pod.TCP(node.Remote.Addr4, netpods.EchoPort) },
			func() error { return pod.UDP(node.Remote.Addr6, netpods.EchoPort) },
		} {
			if err := f(); err != nil {
				t.Fatalf("traffic: %v", err)
			}
		}
	}
	traffic()
	waitFor(t, "the recorder to index the pod's flows", func() bool {
		s4, err4 := td.c.IndexIP(ctx, pod.Addr4)
		s6, err6 := td.c.IndexIP(ctx, pod.Addr6)
		return err4 == nil && err6 == nil && s4.Keys >= 2 && s6.Keys >= 2 && s4.Complete && s6.Complete
	})
	// A flow the recorder has seen: its key, as the old maps hold it.
	var seen ctmap.CTKey4
	var v ctmap.Entry
	for it := root.maps[ctmap.TCP4].Iterate(); it.Next(&seen, &v); {
		if seen.Has(pod.Addr4) {
			break
		}
	}
	if !seen.Has(pod.Addr4) {
		t.Fatal("no TCP entry of the pod in the old map")
	}

	recreateCTMaps(t, root, dp, entries, []string{pod.HostVeth}, node)

	// No scrub yet: the periodic check alone must notice.
	waitFor(t, "scrubd to notice the re-created CT maps", func() bool {
		st := td.Index().State(pod.Addr4)
		return !st.Complete && st.Incomplete == index.ReasonCTMaps
	})
	if st := td.Index().State(pod.Addr6); st.Complete || st.Incomplete != index.ReasonCTMaps {
		t.Errorf("%s after the re-create: complete %v, reason %q; want incomplete for %q", pod.Addr6, st.Complete, st.Incomplete, index.ReasonCTMaps)
	}
	// The counter goes up once the switch is done, just after the marks.
	waitFor(t, "ctscrub_ct_maps_reopened_total to count the re-open", func() bool {
		return counterValue(t, td, "ctscrub_ct_maps_reopened_total", nil) >= 1
	})
	if n := counterValue(t, td, "ctscrub_ct_maps_reopened_total", nil); n != 1 {
		t.Errorf("ctscrub_ct_maps_reopened_total %v, want 1", n)
	}
	if n := counterValue(t, td, "ctscrub_index_marked_incomplete_total", map[string]string{"reason": ReasonLabelCTMaps}); n < 2 {
		t.Errorf("ctscrub_index_marked_incomplete_total{reason=%s} %v, want >= 2", ReasonLabelCTMaps, n)
	}
	// The recorder's programs read SERVICE entries in the CT maps: they
	// follow the new maps once the CT watch handed them over, and the
	// IPs keep the CT maps' reason.
	waitFor(t, "the recorder to reload its programs over the new CT maps", func() bool {
		return counterValue(t, td, "ctscrub_service_maps_reloaded_total", nil) >= 1
	})
	if st := td.Index().State(pod.Addr4); st.Incomplete != index.ReasonCTMaps {
		t.Errorf("%s after the recorder's reload: %+v, want the CT maps' reason kept", pod.Addr4, st)
	}

	// New flows in the new maps, and the flow seen before the restart going
	// on in them (Cilium re-creates its entry; the recorder does not record
	// it again).
	traffic()
	if err := root.maps[ctmap.TCP4].Put(seen, ctmap.Entry{}); err != nil {
		t.Fatal(err)
	}
	if n := root.entriesOf(t, pod.Addr4) + root.entriesOf(t, pod.Addr6); n < 3 {
		t.Fatalf("%d entries of the pod in the new maps, want >= 3", n)
	}
	del, err := td.c.Scrub(ctx, api.ScrubRequest{IPs: ips, Reason: scrub.ReasonDel, ContainerID: a.ContainerID})
	if err != nil {
		t.Fatalf("DEL scrub: %v", err)
	}
	if m := del.Results[0].Method; m != scrub.MethodSweep {
		t.Errorf("DEL after the re-create used %s, want sweep (the IPs are incomplete)", m)
	}
	if left := root.entriesOf(t, pod.Addr4) + root.entriesOf(t, pod.Addr6); left != 0 {
		t.Errorf("%d CT entries of the pod left in the re-created maps after its DEL scrub", left)
	}

	// Scrubbing goes on on the new maps, through the index again.
	if _, err := td.c.Scrub(ctx, api.ScrubRequest{IPs: ips, Reason: scrub.ReasonAdd, ContainerID: a.ContainerID}); err != nil {
		t.Fatalf("second ADD scrub: %v", err)
	}
	traffic()
	waitFor(t, "the recorder to index the pod's new flows", func() bool {
		s4 := td.Index().State(pod.Addr4)
		s6 := td.Index().State(pod.Addr6)
		return s4.Keys >= 2 && s6.Keys >= 2 && s4.Complete && s6.Complete
	})
	before := root.entriesOf(t, pod.Addr4) + root.entriesOf(t, pod.Addr6)
	del, err = td.c.Scrub(ctx, api.ScrubRequest{IPs: ips, Reason: scrub.ReasonDel, ContainerID: a.ContainerID})
	if err != nil {
		t.Fatalf("second DEL scrub: %v", err)
	}
	if r := del.Results[0]; r.Method != scrub.MethodIndex || r.Total != before {
		t.Errorf("second DEL: %s deleted %d, want index and %d", r.Method, r.Total, before)
	}
	if left := root.entriesOf(t, pod.Addr4) + root.entriesOf(t, pod.Addr6); left != 0 {
		t.Errorf("%d CT entries of the pod left after the second DEL", left)
	}
}
