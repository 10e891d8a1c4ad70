package nfct_test

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/e2e/internal/node"
)

func TestMain(m *testing.M) {
	code := m.Run()
	node.CleanupBuilds()
	os.Exit(code)
}

// The whole product on an nf_conntrack node: scrubd (backends nfct) runs in
// the node's network namespace, and the ctscrub CNI plugin is chained after
// bridge + host-local. When the Service's old backend pod is deleted through
// the chain, the plugin's DEL has scrubd scrub its IP, and the client's
// traffic reaches the new backend with nothing else done.
func TestScrubdChainEndsBlackhole(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: network namespaces, CNI plugins, iptables, conntrack")
	}
	plugin := node.Build(t, "./plugin", "ctscrub")
	node.Build(t, "./scrubd", "scrubd")
	var sd *node.Scrubd
	n := newBareNode(t, "10.50.1.10", func(nodePath string) *ctscrubPlugin {
		// scrubd started from a thread in the node's namespace lives there:
		// its nfct backend watches and scrubs the node's table.
		if err := node.Do(nodePath, func() error {
			sd = node.StartScrubd(t, node.Options{
				PodCIDRs: []string{podCIDR.String()},
				Args:     []string{"--backends", "nfct", "--metrics-addr", "off"},
			})
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		return &ctscrubPlugin{bin: plugin, socket: sd.Socket}
	})
	r := randHex(3)

	s1 := n.srv.add(t, "ctsp-s1-"+r)
	srv1 := startUDP(t, s1, 5353)
	run(t, n.path, "iptables", "-t", "nat", "-A", "PREROUTING", "-d", vip.String(), "-p", "udp", "--dport", "53",
		"-j", "DNAT", "--to-destination", s1.ip.String()+":5353")
	c := n.cli.add(t, "ctsp-c-"+r)
	startUDPClient(t, c)
	if !waitFor(5*time.Second, func() bool { return srv1.got.Load() > 0 }) {
		t.Fatal("s1 never received the client's traffic through the VIP: the setup is broken")
	}

	// The endpoint update moves the DNAT to s2 while s1 still runs
	// (terminating): the client's flow keeps going to s1.
	s2 := n.srv.add(t, "ctsp-s2-"+r)
	srv2 := startUDP(t, s2, 5353)
	run(t, n.path, "iptables", "-t", "nat", "-R", "PREROUTING", "1", "-d", vip.String(), "-p", "udp", "--dport", "53",
		"-j", "DNAT", "--to-destination", s2.ip.String()+":5353")
	if got := received(srv2, time.Second); got != 0 {
		t.Fatalf("s2 received %d datagrams while the stale entry still points at s1", got)
	}

	// s1's sandbox goes: CNI DEL through the chain, ctscrub included.
	n.srv.del(t, s1)
	srv1.conn.Close()
	if !waitFor(3*time.Second, func() bool { return srv2.got.Load() > 0 }) {
		t.Fatalf("s2 receives nothing after s1's DEL through the chain with ctscrub\nscrubd log:\n%s", sd.Log(t))
	}
	if e, ok := n.serviceEntry(t, 17, 53); !ok || e.Reply.Src != s2.ip {
		t.Errorf("the client's entry should now point at s2 %s; got %v", s2.ip, e.Reply)
	}
	log := sd.Log(t)
	if !strings.Contains(log, `"nfct"`) || !strings.Contains(log, s1.ip.String()) {
		t.Errorf("scrubd's log shows no nfct scrub of %s:\n%s", s1.ip, log)
	}
}
