package recorder_test

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"

	"github.com/ctscrub/ctscrub/internal/testsupport/netpods"
	"github.com/ctscrub/ctscrub/internal/testsupport/qdiscbypass"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
)

// gatewayMAC is the node bridge's address: the next hop of a pod's frames.
func gatewayMAC(t *testing.T, n *netpods.Node) net.HardwareAddr {
	t.Helper()
	var mac net.HardwareAddr
	if err := n.Do(func() error {
		l, err := netlink.LinkByName(n.Bridge)
		if err == nil {
			mac = l.Attrs().HardwareAddr
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return mac
}

// bypassUDP sends one UDP datagram per family from pod p to the remote host
// with PACKET_QDISC_BYPASS (the container-side egress filter never sees
// it) and waits for the stand-in, on the host-side veth, to make both
// entries. It returns the OUT keys Cilium would hold.
func bypassUDP(t *testing.T, w *world, p *netpods.Pod, sport uint16) (ctmap.CTKey4, ctmap.CTKey6) {
	t.Helper()
	remote, mac := w.node.Remote, gatewayMAC(t, w.node)
	for _, pair := range [][2]netip.Addr{{p.Addr4, remote.Addr4}, {p.Addr6, remote.Addr6}} {
		if err := qdiscbypass.SendUDP(p.Path, "eth0", mac, pair[0], pair[1], sport, silentPort, []byte("bypass")); err != nil {
			t.Fatal(err)
		}
	}
	k4 := ctmap.NewKey4(p.Addr4, remote.Addr4, silentPort, sport, ctmap.ProtoUDP, ctmap.FlagOut)
	k6 := ctmap.NewKey6(p.Addr6, remote.Addr6, silentPort, sport, ctmap.ProtoUDP, ctmap.FlagOut)
	for deadline := time.Now().Add(5 * time.Second); !lookup4(t, w.ct.Map(ctmap.Any4), k4) || !lookup6(t, w.ct.Map(ctmap.Any6), k6); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("stand-in made no entry %s / %s: the bypassing frames did not reach the host side", k4, k6)
		}
	}
	if err := w.ix.Sync(context.Background()); err != nil {
		t.Fatal(err)
	}
	return k4, k6
}

// A pod sending with PACKET_QDISC_BYPASS skips its eth0's tc egress; the
// host-side link records its flows. The container side alone misses them
// (the miss this closes: issue 35).
func TestPacketQdiscBypassIndexed(t *testing.T) {
	w := newWorld(t, 1)
	p := w.pods[0]
	ips := []netip.Addr{p.Addr4, p.Addr6}
	w.ix.TrackAll(ips)
	k4, k6 := bypassUDP(t, w, p, 46000)
	w.requireIndexed(t, ips, 4)
	ks4, _, _ := w.ix.KeysOf(p.Addr4)
	_, ks6, _ := w.ix.KeysOf(p.Addr6)
	if !containsKey(ks4, k4) || !containsKey(ks6, k6) {
		t.Fatalf("bypassed flows not indexed: v4 %v, v6 %v", ks4, ks6)
	}
	for _, ip := range ips {
		if st := w.ix.State(ip); st.Incomplete != "" {
			t.Errorf("%s: %+v, want complete", ip, st)
		}
	}
	if n := w.rec.ForeignSources(); n != 0 {
		t.Errorf("the pod's own bypassed frames counted %d foreign sources, want 0", n)
	}
}

// Without the host-side link (the recorder before it), the bypassed flows
// are in Cilium's maps and not in the index: what TestPacketQdiscBypassIndexed
// guards against.
func TestPacketQdiscBypassMissedContainerSideOnly(t *testing.T) {
	w := newWorldOpts(t, 1, func(o *recorder.Options) { o.ContainerSideOnly = true })
	p := w.pods[0]
	k4, k6 := bypassUDP(t, w, p, 46001)
	time.Sleep(200 * time.Millisecond)
	ks4, _, _ := w.ix.KeysOf(p.Addr4)
	_, ks6, _ := w.ix.KeysOf(p.Addr6)
	if containsKey(ks4, k4) || containsKey(ks6, k6) {
		t.Fatalf("container side only indexed the bypassed flows (v4 %v, v6 %v): the frames did not bypass tc egress, the test above proves nothing", ks4, ks6)
	}
}

// A frame the pod sends from another pod's address, bypassing its
// filters, is still taken for forged on the host side: the owner entry
// names each address's host-side veth.
func TestPacketQdiscBypassForgedSource(t *testing.T) {
	w := newWorld(t, 2)
	a, b, remote := w.pods[0], w.pods[1], w.node.Remote
	w.ix.TrackAll([]netip.Addr{a.Addr4})
	before := w.rec.ForeignSources()
	if err := qdiscbypass.SendUDP(b.Path, "eth0", gatewayMAC(t, w.node), a.Addr4, remote.Addr4, 46002, silentPort, []byte("forged")); err != nil {
		t.Fatal(err)
	}
	forged := ctmap.NewKey4(a.Addr4, remote.Addr4, silentPort, 46002, ctmap.ProtoUDP, ctmap.FlagOut)
	for deadline := time.Now().Add(5 * time.Second); !lookup4(t, w.ct.Map(ctmap.Any4), forged); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("stand-in made no entry for the forged frame")
		}
	}
	if err := w.ix.Sync(context.Background()); err != nil {
		t.Fatal(err)
	}
	if st := w.ix.State(a.Addr4); st.Incomplete != index.ReasonForeignSource {
		t.Errorf("%s after a forged bypassing frame: %+v, want incomplete (%s)", a.Addr4, st, index.ReasonForeignSource)
	}
	if n := w.rec.ForeignSources() - before; n != 1 {
		t.Errorf("foreign-source counter moved by %d, want 1", n)
	}
}

// The host-side link sits at the head of the veth's tcx ingress, ahead of
// a datapath attached at the tail as Cilium does; a second Attach (restart,
// reload) swaps its program in place; Detach removes it; a pin whose veth
// went is pruned.
func TestHostLinkLifecycle(t *testing.T) {
	w := newWorld(t, 1)
	p := w.pods[0]
	order := func() []ebpf.ProgramID {
		var ids []ebpf.ProgramID
		if err := w.node.Do(func() error {
			l, err := netlink.LinkByName(p.HostVeth)
			if err != nil {
				return err
			}
			res, err := link.QueryPrograms(link.QueryOptions{Target: l.Attrs().Index, Attach: ebpf.AttachTCXIngress})
			if err != nil {
				return err
			}
			for _, pr := range res.Programs {
				ids = append(ids, pr.ID)
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		return ids
	}
	hostID := func() ebpf.ProgramID {
		info, err := w.rec.HostProgram().Info()
		if err != nil {
			t.Fatal(err)
		}
		id, _ := info.ID()
		return id
	}
	ids := order()
	if len(ids) != 2 || ids[0] != hostID() {
		t.Fatalf("tcx ingress of %s: programs %v, want the recorder's (%d) first and the stand-in's behind it", p.HostVeth, ids, hostID())
	}
	if !w.rec.HostAttached(p.Path, "eth0") {
		t.Fatal("HostAttached: false after Attach")
	}
	if _, err := w.rec.Attach(p.Path, "eth0"); err != nil {
		t.Fatal(err)
	}
	if again := order(); len(again) != 2 || again[0] != ids[0] {
		t.Fatalf("after a second Attach: %v, want %v (the same link, in place)", again, ids)
	}
	// New programs (Cilium's service maps changed): Attach swaps the
	// link's program in place; it stays ahead of the stand-in.
	if err := w.rec.ReloadPrograms(); err != nil {
		t.Fatal(err)
	}
	if _, err := w.rec.Attach(p.Path, "eth0"); err != nil {
		t.Fatal(err)
	}
	if again := order(); len(again) != 2 || again[0] != hostID() || again[0] == ids[0] || again[1] != ids[1] {
		t.Fatalf("after ReloadPrograms and Attach: %v, want the reloaded host program (%d) first, then the stand-in's %d", again, hostID(), ids[1])
	}
	ids = order()
	if err := w.rec.Detach(p.Path, "eth0"); err != nil {
		t.Fatal(err)
	}
	if after := order(); len(after) != 1 || after[0] == ids[0] || w.rec.HostAttached(p.Path, "eth0") {
		t.Fatalf("after Detach: %v, want the stand-in's alone", after)
	}
	// Attached again, then the veth goes (the pod is deleted): the pin
	// stays until PruneHostLinks finds its link without a device.
	if _, err := w.rec.Attach(p.Path, "eth0"); err != nil {
		t.Fatal(err)
	}
	if err := w.node.Do(func() error {
		l, err := netlink.LinkByName(p.HostVeth)
		if err != nil {
			return err
		}
		return netlink.LinkDel(l)
	}); err != nil {
		t.Fatal(err)
	}
	if n := w.rec.PruneHostLinks(); n != 1 {
		t.Fatalf("PruneHostLinks after the veth went: %d, want 1", n)
	}
}

// A pod whose peer is not in the node's namespace cannot get the host-side
// link: Attach puts the filters on and says so with ErrHostSide.
func TestHostSideNotFound(t *testing.T) {
	w := newWorldOpts(t, 0, func(o *recorder.Options) { o.NodeNetns = "" })
	p := w.node.AddPod()
	_, err := w.rec.Attach(p.Path, "eth0")
	if !errors.Is(err, recorder.ErrHostSide) || !strings.Contains(err.Error(), "node's namespace") {
		t.Fatalf("Attach with the peer outside the node's namespace: %v, want ErrHostSide", err)
	}
	if ok, err := recorder.Attached(p.Path, "eth0"); err != nil || !ok {
		t.Fatalf("filters after ErrHostSide: %v %v, want on", ok, err)
	}
	if err := w.rec.Detach(p.Path, "eth0"); err != nil {
		t.Fatal(err)
	}
}

// The host-side link is pinned: frames a pod sends past its tc egress
// while scrubd is down are recorded into the pinned ring and read by the
// next instance, whose Attach keeps the same link.
func TestHostLinkRecordsWhileDown(t *testing.T) {
	w := newWorld(t, 1)
	p := w.pods[0]
	w.stop()
	w.stop = nil
	if err := w.rec.Close(); err != nil {
		t.Fatal(err)
	}
	remote, mac := w.node.Remote, gatewayMAC(t, w.node)
	if err := qdiscbypass.SendUDP(p.Path, "eth0", mac, p.Addr4, remote.Addr4, 46003, silentPort, []byte("down")); err != nil {
		t.Fatal(err)
	}
	key := ctmap.NewKey4(p.Addr4, remote.Addr4, silentPort, 46003, ctmap.ProtoUDP, ctmap.FlagOut)
	for deadline := time.Now().Add(5 * time.Second); !lookup4(t, w.ct.Map(ctmap.Any4), key); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("stand-in made no entry for the bypassed frame")
		}
	}
	w.rec = w.loadRecorder(t, w.ct.Root)
	w.ix = w.newIndex()
	w.run(t)
	if !w.rec.HostAttached(p.Path, "eth0") {
		t.Fatal("host-side link gone with the recorder instance")
	}
	if _, err := w.rec.Attach(p.Path, "eth0"); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		ks, _, _ := w.ix.KeysOf(p.Addr4)
		if containsKey(ks, key) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the bypassed flow sent while down is not indexed after restart: %v", ks)
		}
	}
}
