package daemon

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// ownedIP sets up one pod IP as ctscrub knows it: an attachment holding it
// (recorded directly: the recorder is not under test here), every flow in
// the index, the entries in the maps. The returned func runs the pod's DEL
// scrub and stop, as the plugin does.
func ownedIP(t *testing.T, td *testDaemon, root *ctRoot, ip netip.Addr, id string) (del func()) {
	t.Helper()
	a := api.Attachment{ContainerID: id, IfName: "eth0"}
	if _, err := td.startPod(api.IndexedPod{Attachment: a, IPs: []netip.Addr{ip}, Since: time.Now()}); err != nil {
		t.Fatal(err)
	}
	flows := podFlows(ip, 10)
	root.put4(t, flows)
	indexFlows(td.Daemon, ip, flows)
	return func() {
		t.Helper()
		res, err := td.c.Scrub(context.Background(), api.ScrubRequest{IPs: []netip.Addr{ip}, Reason: scrub.ReasonDel, ContainerID: id, IfName: "eth0"})
		if err != nil || res.Results[0].Method != scrub.MethodIndex {
			t.Fatalf("DEL scrub of %s: %+v, %v", ip, res, err)
		}
		if _, _, err := td.pods.stop(a); err != nil {
			t.Fatal(err)
		}
	}
}

// unseenFlows are entries a pod created outside the chain leaves: the
// recorder never saw them, the index does not hold them.
func unseenFlows(ip netip.Addr) []ctmap.CTKey4 {
	var out []ctmap.CTKey4
	for i := range 5 {
		k := ctmap.NewKey4(ip, mustAddr("198.51.100.7"), 443, uint16(30000+i), ctmap.ProtoTCP, ctmap.FlagOut)
		out = append(out, k, k.Related())
	}
	return out
}

func addScrub(t *testing.T, td *testDaemon, ip netip.Addr, id string) scrub.Result {
	t.Helper()
	res, err := td.c.Scrub(context.Background(), api.ScrubRequest{IPs: []netip.Addr{ip}, Reason: scrub.ReasonAdd, ContainerID: id, IfName: "eth0"})
	if err != nil {
		t.Fatalf("ADD scrub of %s: %v", ip, err)
	}
	return res.Results[0]
}

// A clean handover (DEL of an indexed pod, scrubbed completely) lets the next
// ADD trust the index; an IP that was never released does not.
func TestAddTrustsIndexOnlyAfterCleanHandover(t *testing.T) {
	root := newCTRoot(t, 1<<14)
	td := startDaemon(t, testConfig(t, root))
	x, y := mustAddr("10.244.0.20"), mustAddr("10.244.0.21")

	del := ownedIP(t, td, root, x, "old-x")
	del()
	if r := addScrub(t, td, x, "new-x"); r.Method != scrub.MethodIndex || r.Outcome != scrub.Complete {
		t.Errorf("ADD after a clean DEL: %+v, want the index", r)
	}

	// y is complete in the index but was never released by a DEL scrubd saw
	// (e.g. its last pod's index start failed under failurePolicy ignore):
	// a pod the recorder never saw may have used it.
	ownedIP(t, td, root, y, "old-y")
	unseen := unseenFlows(y)
	root.put4(t, unseen)
	if r := addScrub(t, td, y, "new-y"); r.Method != scrub.MethodSweep {
		t.Errorf("ADD of an IP no DEL released: method %s, want sweep", r.Method)
	}
	if n := root.present4(t, unseen); n != 0 {
		t.Errorf("%d entries of a pod ctscrub never saw left on %s", n, y)
	}
}

// After a DEL without prevResult of a pod scrubd never indexed (the plugin
// reports it with an index stop of the unknown attachment), no released IP
// is trusted: that pod may have held any of them.
func TestUnknownDelEndsReleases(t *testing.T) {
	root := newCTRoot(t, 1<<14)
	td := startDaemon(t, testConfig(t, root))
	x := mustAddr("10.244.0.30")
	ownedIP(t, td, root, x, "old")()

	// A pod created outside the chain gets x, creates flows, is deleted.
	unseen := unseenFlows(x)
	root.put4(t, unseen)
	if err := td.c.IndexStop(context.Background(), api.IndexStopRequest{Attachment: api.Attachment{ContainerID: "outside", IfName: "eth0"}}); err != nil {
		t.Fatal(err)
	}
	if r := addScrub(t, td, x, "new"); r.Method != scrub.MethodSweep {
		t.Errorf("ADD after a DEL of an unknown attachment: method %s, want sweep", r.Method)
	}
	if n := root.present4(t, unseen); n != 0 {
		t.Errorf("%d entries of the unseen pod left on %s", n, x)
	}
}

// A DEL with prevResult of a pod scrubd never indexed: its IPs sweep.
func TestDelOfUnknownAttachmentSweeps(t *testing.T) {
	root := newCTRoot(t, 1<<14)
	td := startDaemon(t, testConfig(t, root))
	x := mustAddr("10.244.0.35")
	ownedIP(t, td, root, x, "old")()
	unseen := unseenFlows(x)
	root.put4(t, unseen)
	res, err := td.c.Scrub(context.Background(), api.ScrubRequest{IPs: []netip.Addr{x}, Reason: scrub.ReasonDel, ContainerID: "outside", IfName: "eth0"})
	if err != nil || res.Results[0].Method != scrub.MethodSweep {
		t.Fatalf("DEL scrub of an unknown attachment: %+v, %v; want a sweep", res, err)
	}
	if n := root.present4(t, unseen); n != 0 {
		t.Errorf("%d entries of the unseen pod left on %s", n, x)
	}
	// Nothing that DEL touched is released: it is a sign of an unseen owner
	// (its index stop starts a new epoch), so the next ADD sweeps too.
	if r := addScrub(t, td, x, "new"); r.Method != scrub.MethodSweep {
		t.Errorf("ADD after the DEL of an unseen pod: method %s, want sweep", r.Method)
	}
}

// The conflist rewritten without ctscrub (Cilium's agent restarted and
// wrote its own): pods start unseen, released IPs are not trusted.
func TestConflistWithoutCtscrubEndsReleases(t *testing.T) {
	root := newCTRoot(t, 1<<14)
	cfg := testConfig(t, root)
	cfg.CNIConfDir = t.TempDir()
	conf := filepath.Join(cfg.CNIConfDir, "05-cilium.conflist")
	chained := `{"cniVersion":"1.0.0","name":"cilium","plugins":[{"type":"cilium-cni"},{"type":"ctscrub"}]}`
	if err := os.WriteFile(conf, []byte(chained), 0o644); err != nil {
		t.Fatal(err)
	}
	td := startDaemon(t, cfg)
	waitFor(t, "the conflist check", func() bool { return counterValue(t, td, "ctscrub_cni_chained", nil) == 1 })
	x := mustAddr("10.244.0.40")
	ownedIP(t, td, root, x, "old")()

	if err := os.WriteFile(conf, []byte(`{"cniVersion":"1.0.0","name":"cilium","plugins":[{"type":"cilium-cni"}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the conflist check to see ctscrub gone", func() bool { return counterValue(t, td, "ctscrub_cni_chained", nil) == 0 })
	unseen := unseenFlows(x)
	root.put4(t, unseen) // a pod created meanwhile
	if err := os.WriteFile(conf, []byte(chained), 0o644); err != nil {
		t.Fatal(err)
	}
	if r := addScrub(t, td, x, "new"); r.Method != scrub.MethodSweep {
		t.Errorf("ADD after the conflist lost ctscrub: method %s, want sweep", r.Method)
	}
	if n := root.present4(t, unseen); n != 0 {
		t.Errorf("%d entries of the unseen pod left on %s", n, x)
	}
}
