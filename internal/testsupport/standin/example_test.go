package standin_test

import (
	"fmt"
	"net/netip"
	"testing"

	"github.com/ctscrub/ctscrub/internal/testsupport/netpods"
	"github.com/ctscrub/ctscrub/internal/testsupport/standin"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// A test node whose pods' real traffic creates CT entries in Cilium's
// layout. (Compiled, not run: it needs root and a *testing.T.)
func Example() {
	var t *testing.T // the test's

	node := netpods.NewNode(t) // node netns, bridge, remote host
	pod := node.AddPod()

	dir := standin.TempDir(t) // private bpffs dir, removed after the test
	if err := standin.CreateMaps(dir, 65536); err != nil {
		t.Fatal(err)
	}
	dp, err := standin.Load(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer dp.Close()
	// The host-side veth lives in the node namespace.
	if err := node.Do(func() error { return dp.AttachHostSide(pod.HostVeth) }); err != nil {
		t.Fatal(err)
	}
	// A service VIP with one backend: traffic to it creates SERVICE entries.
	vip := netip.MustParseAddrPort("10.96.0.10:53")
	if err := dp.AddService(ctmap.ProtoUDP, vip, netip.AddrPortFrom(pod.Addr4, netpods.EchoPort)); err != nil {
		t.Fatal(err)
	}

	node.Remote.ServeEcho()
	if err := pod.TCP(node.Remote.Addr4, netpods.EchoPort); err != nil {
		t.Fatal(err)
	}
	maps, err := dp.Maps() // the CT maps, as ctmap.Open(dir) opens them
	if err != nil {
		t.Fatal(err)
	}
	defer maps.Close()
	fmt.Println(maps.Map(ctmap.TCP4).MaxEntries())
}
