package cni

import (
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/e2e/internal/node"
	"github.com/ctscrub/ctscrub/internal/testsupport/qdiscbypass"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// A pod sending with PACKET_QDISC_BYPASS (a packet socket: CAP_NET_RAW, in
// the runtimes' default set) skips its eth0's tc egress, where the
// container-side recorder sits; the stand-in on the host-side veth makes
// the entry as Cilium's cil_from_container would. Through the real chain:
//   - host-side: scrubd knows the node's namespace, its host-side link
//     records the flow, and the DEL scrub, by the index, leaves nothing;
//   - no-host-side: scrubd cannot put the link on (the veth is in a
//     namespace it was not told of), so it must not vouch for the pod's
//     IP: the DEL sweeps, leaving nothing, and says why.
//
// Before host-side recording the DEL scrub went by the index and left the
// bypassed flow's entries behind.
func TestChainPacketQdiscBypass(t *testing.T) {
	node.RequireRoot(t)
	const ver = "1.0.0"
	ref := referencePlugins(t, ver)
	for _, tc := range []struct {
		name     string
		hostSide bool
		method   string
	}{
		{"host-side", true, "index"},
		{"no-host-side", false, "sweep"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newChain(t, ver, ref, tc.hostSide)
			a := c.add("a")
			gw, mac := c.gateway()
			const sport, dport = 46100, 9 // nothing listens: the node answers port unreachable
			if err := qdiscbypass.SendUDP(a.netns, "eth0", mac, a.ip, gw, sport, dport, []byte("bypass")); err != nil {
				t.Fatal(err)
			}
			key := ctmap.NewKey4(a.ip, gw, dport, sport, ctmap.ProtoUDP, ctmap.FlagOut)
			var v ctmap.Entry
			for deadline := time.Now().Add(5 * time.Second); c.maps.Map(ctmap.Any4).Lookup(key, &v) != nil; time.Sleep(20 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatalf("no entry %s: the bypassing frame did not reach the stand-in on %s", key, a.hostVeth)
				}
			}
			before := c.entries(a.ip)
			byMethod := map[string]string{"reason": "del", "method": tc.method}
			dels := c.scrubd.Metric(t, "ctscrub_scrub_duration_seconds_count", byMethod)
			c.del(a)
			if got := c.scrubd.Metric(t, "ctscrub_scrub_duration_seconds_count", byMethod); got != dels+1 {
				t.Errorf("DEL's scrub did not go by %s: %s del scrubs %v -> %v", tc.method, tc.method, dels, got)
			}
			if n := c.entries(a.ip); n != 0 {
				t.Fatalf("%d of %d CT entries of %s left after DEL (the bypassed flow's %s among them?)", n, before, a.ip, key)
			}
			if !tc.hostSide && !strings.Contains(c.scrubd.Log(t), "PACKET_QDISC_BYPASS") {
				t.Errorf("scrubd's log does not say why the pod's IP was not vouched for")
			}
			t.Logf("%s: %d entries of %s (the bypassed flow's included) before DEL, 0 after, DEL by %s", tc.name, before, a.ip, tc.method)
		})
	}
}

// gateway is the bridge's address and MAC: the pods' next hop.
func (c *chain) gateway() (netip.Addr, net.HardwareAddr) {
	c.t.Helper()
	var mac net.HardwareAddr
	err := node.Do(c.nodeNS, func() error {
		ifi, err := net.InterfaceByName("br" + c.sfx)
		if err == nil {
			mac = ifi.HardwareAddr
		}
		return err
	})
	if err != nil {
		c.t.Fatal(err)
	}
	return c.subnet.Addr().Next(), mac
}
