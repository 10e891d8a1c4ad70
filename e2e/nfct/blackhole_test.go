// Package nfct_test reproduces the blackhole that stale nf_conntrack entries
// cause after a Service's backend pod goes away, and shows ctscrub's nfct
// backend ending it. Everything is real: a "node" network namespace with two
// CNI networks made by Debian's bridge + host-local plugins through libcni, a
// DNAT rule in iptables as kube-proxy writes for a Service, pods as network
// namespaces, and the kernel's conntrack creating the entries from packets.
//
// Two networks (clients, servers) on two bridges: a client and its server on
// one bridge would exchange replies bridged, past the node's conntrack, unless
// br_netfilter's bridge-nf-call-iptables were on, a host-wide setting this
// test leaves alone.
package nfct_test

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/nfct"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

var (
	vip     = netip.MustParseAddr("10.96.0.10")
	podCIDR = netip.MustParsePrefix("10.50.0.0/16")
	srvNet  = netip.MustParsePrefix("10.50.1.0/24")
	cliNet  = netip.MustParsePrefix("10.50.2.0/24")
)

type testNode struct {
	path     string
	srv, cli *network
	ct       *nfct.NFCT
	table    *nfct.Table
}

// newNode builds the node. srvLast bounds the servers' address range: with
// two addresses, the third server pod gets the first one's IP back.
func newNode(t *testing.T, srvLast string) *testNode {
	t.Helper()
	n := newBareNode(t, srvLast, nil)
	var err error
	n.ct, err = nfct.New(nfct.Config{PodCIDRs: []netip.Prefix{podCIDR}, Netns: n.path})
	if err != nil {
		t.Fatalf("start the nfct backend in the node's netns: %v", err)
	}
	t.Cleanup(func() { n.ct.Close() })
	return n
}

// newBareNode builds the node without a backend; ctscrub, when set, is
// chained in the servers' network.
func newBareNode(t *testing.T, srvLast string, ctscrub func(nodePath string) *ctscrubPlugin) *testNode {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: network namespaces, CNI plugins, iptables, conntrack")
	}
	if _, err := exec.LookPath("iptables"); err != nil {
		t.Skip("iptables missing (apt-get install iptables; scripts/setup.sh): the Service's DNAT needs it")
	}
	r := randHex(3)
	n := &testNode{path: addNetns(t, "ctsn-"+r)}
	var plugin *ctscrubPlugin
	if ctscrub != nil {
		plugin = ctscrub(n.path)
	}
	n.srv = newNetwork(t, n.path, "ctsn-srv-"+r, "ctsbs"+r, srvNet,
		netip.MustParseAddr("10.50.1.2"), netip.MustParseAddr(srvLast), plugin)
	n.cli = newNetwork(t, n.path, "ctsn-cli-"+r, "ctsbc"+r, cliNet,
		netip.MustParseAddr("10.50.2.2"), netip.MustParseAddr("10.50.2.20"), nil)
	var err error
	n.table, err = nfct.OpenTable(n.path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.table.Close() })
	return n
}

// serviceEntry finds the conntrack entry of the client's flow to the VIP.
func (n *testNode) serviceEntry(t *testing.T, proto uint8, port uint16) (nfct.Entry, bool) {
	t.Helper()
	var found nfct.Entry
	ok := false
	if err := n.table.Dump(func(e nfct.Entry) {
		if e.Orig.Dst == vip && e.Orig.Proto == proto && e.Orig.DPort == port {
			found, ok = e, true
		}
	}); err != nil {
		t.Fatalf("dump the node's conntrack table: %v", err)
	}
	return found, ok
}

// udpServer counts the datagrams a pod receives on port.
type udpServer struct {
	got  atomic.Int64
	conn *net.UDPConn
}

func startUDP(t *testing.T, p *pod, port int) *udpServer {
	t.Helper()
	s := &udpServer{}
	if err := inNetns(p.netns, func() error {
		var err error
		s.conn, err = net.ListenUDP("udp4", &net.UDPAddr{Port: port})
		return err
	}); err != nil {
		t.Fatalf("UDP server in pod %s: %v", p.name, err)
	}
	go func() {
		buf := make([]byte, 1500)
		for {
			if _, _, err := s.conn.ReadFromUDP(buf); err != nil {
				return
			}
			s.got.Add(1)
		}
	}()
	t.Cleanup(func() { s.conn.Close() })
	return s
}

// startUDPClient sends to VIP:53 from one socket (port 40000) every 20 ms
// until the test ends.
func startUDPClient(t *testing.T, c *pod) {
	t.Helper()
	var client *net.UDPConn
	if err := inNetns(c.netns, func() error {
		var err error
		client, err = net.DialUDP("udp4", &net.UDPAddr{Port: 40000}, &net.UDPAddr{IP: vip.AsSlice(), Port: 53})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop); client.Close() })
	go func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
				client.Write([]byte("query"))
			}
		}
	}()
}

func waitFor(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if cond() {
			return true
		}
		time.Sleep(20 * time.Millisecond)
	}
	return cond()
}

// received reports whether s receives anything during d.
func received(s *udpServer, d time.Duration) int64 {
	before := s.got.Load()
	time.Sleep(d)
	return s.got.Load() - before
}

func TestUDPBlackholeAfterBackendMoves(t *testing.T) {
	n := newNode(t, "10.50.1.3") // two server addresses: the third pod reuses the first's
	r := randHex(3)

	// A Service: VIP:53/udp DNAT'd to server pod s1.
	s1 := n.srv.add(t, "ctsp-s1-"+r)
	srv1 := startUDP(t, s1, 5353)
	run(t, n.path, "iptables", "-t", "nat", "-A", "PREROUTING", "-d", vip.String(), "-p", "udp", "--dport", "53",
		"-j", "DNAT", "--to-destination", s1.ip.String()+":5353")

	// A client pod sending to the VIP from one socket, every 20 ms (a DNS
	// client reusing its source port, a metrics or syslog stream...).
	c := n.cli.add(t, "ctsp-c-"+r)
	startUDPClient(t, c)
	if !waitFor(5*time.Second, func() bool { return srv1.got.Load() > 0 }) {
		t.Fatal("s1 never received the client's traffic through the VIP: the setup is broken")
	}

	// The backend moves: s2 starts, the Service's DNAT now targets it (the
	// endpoint update), then s1's sandbox is torn down (CNI DEL).
	s2 := n.srv.add(t, "ctsp-s2-"+r)
	srv2 := startUDP(t, s2, 5353)
	run(t, n.path, "iptables", "-t", "nat", "-R", "PREROUTING", "1", "-d", vip.String(), "-p", "udp", "--dport", "53",
		"-j", "DNAT", "--to-destination", s2.ip.String()+":5353")
	n.srv.del(t, s1)
	srv1.conn.Close()

	// Without ctscrub: the client's entry still says s1; s2 gets nothing.
	if got := received(srv2, 1500*time.Millisecond); got != 0 {
		t.Fatalf("s2 received %d datagrams without a scrub: the stale entry should blackhole them", got)
	}
	e, ok := n.serviceEntry(t, 17, 53)
	if !ok || e.Reply.Src != s1.ip {
		t.Fatalf("want the client's entry still pointing at the deleted pod %s; got %v (found %v)", s1.ip, e.Reply, ok)
	}
	t.Logf("blackhole: client %s:40000 -> %s:53 still DNAT'd to deleted pod %s; s2 (%s) received nothing for 1.5 s",
		c.ip, vip, s1.ip, s2.ip)

	// A new pod gets s1's IP. Without ctscrub the stale entry now delivers
	// the Service's traffic to this unrelated pod (the node's neighbour
	// cache, which would take up to a minute to forget s1's MAC, is flushed
	// here to show it at once).
	s3 := n.srv.add(t, "ctsp-s3-"+r)
	if s3.ip != s1.ip {
		t.Fatalf("host-local gave s3 %s, want s1's %s back (range of two)", s3.ip, s1.ip)
	}
	srv3 := startUDP(t, s3, 5353)
	run(t, n.path, "ip", "neigh", "flush", "all")
	if !waitFor(3*time.Second, func() bool { return srv3.got.Load() > 0 }) {
		t.Fatal("without a scrub the new pod with the reused IP should receive the stale flow")
	}
	t.Logf("misdelivery: new pod s3 (%s) receives the Service traffic meant for s2", s3.ip)
	if srv2.got.Load() != 0 {
		t.Fatalf("s2 received traffic before any scrub")
	}

	// With ctscrub: the scrub of the reused IP at s3's ADD (what the ctscrub
	// CNI plugin asks scrubd for) removes the stale entry by index; the
	// client's next datagram is DNAT'd afresh, to s2.
	res, err := n.ct.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{s1.ip}, Reason: scrub.ReasonAdd})
	if err != nil {
		t.Fatalf("scrub %s: %v", s1.ip, err)
	}
	if res.Method != scrub.MethodIndex || res.Deleted[nfct.MapName] < 1 {
		t.Fatalf("scrub of %s: want an index scrub deleting the stale entry, got %+v", s1.ip, res)
	}
	if !waitFor(2*time.Second, func() bool { return srv2.got.Load() > 0 }) {
		t.Fatal("s2 still receives nothing after the scrub")
	}
	time.Sleep(100 * time.Millisecond)
	if got := received(srv3, 500*time.Millisecond); got != 0 {
		t.Errorf("s3 still receives the Service's traffic after the scrub (%d datagrams)", got)
	}
	if e, ok := n.serviceEntry(t, 17, 53); !ok || e.Reply.Src != s2.ip {
		t.Errorf("after the scrub the client's entry should point at s2 %s; got %v", s2.ip, e.Reply)
	}
	t.Logf("with ctscrub: %d entry deleted in %v by index; s2 receives the traffic", res.Deleted[nfct.MapName], res.Duration)
}

func TestTCPBlackholeAfterBackendMoves(t *testing.T) {
	n := newNode(t, "10.50.1.10")
	r := randHex(3)

	s1 := n.srv.add(t, "ctsp-s1-"+r)
	l1 := listenTCP(t, s1, 8080)
	run(t, n.path, "iptables", "-t", "nat", "-A", "PREROUTING", "-d", vip.String(), "-p", "tcp", "--dport", "80",
		"-j", "DNAT", "--to-destination", s1.ip.String()+":8080")
	c := n.cli.add(t, "ctsp-c-"+r)

	var conn net.Conn
	if err := inNetns(c.netns, func() error {
		var err error
		conn, err = net.DialTimeout("tcp4", vip.String()+":80", 3*time.Second)
		return err
	}); err != nil {
		t.Fatalf("connect to the VIP: %v", err)
	}
	t.Cleanup(func() { conn.Close() })
	if err := echo(conn); err != nil {
		t.Fatalf("echo through the VIP to s1: %v", err)
	}

	s2 := n.srv.add(t, "ctsp-s2-"+r)
	l2 := listenTCP(t, s2, 8080)
	run(t, n.path, "iptables", "-t", "nat", "-R", "PREROUTING", "1", "-d", vip.String(), "-p", "tcp", "--dport", "80",
		"-j", "DNAT", "--to-destination", s2.ip.String()+":8080")
	n.srv.del(t, s1)
	l1.Close()

	// Without ctscrub: the connection's segments still go to the dead pod;
	// no answer, no reset: the client hangs (for TCP's retransmission
	// timeout, ~15 minutes by default).
	if err := echo(conn); err == nil || !isTimeout(err) {
		t.Fatalf("without a scrub the old connection should hang (timeout), got %v", err)
	}
	if e, ok := n.serviceEntry(t, 6, 80); !ok || e.Reply.Src != s1.ip {
		t.Fatalf("want the connection's entry still pointing at the deleted pod %s; got %v (found %v)", s1.ip, e.Reply, ok)
	}
	t.Logf("blackhole: the client's TCP connection is still DNAT'd to deleted pod %s and hangs", s1.ip)

	res, err := n.ct.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{s1.ip}, Reason: scrub.ReasonDel})
	if err != nil || res.Method != scrub.MethodIndex || res.Deleted[nfct.MapName] < 1 {
		t.Fatalf("scrub of %s: %+v, %v", s1.ip, res, err)
	}
	// With ctscrub: the next retransmission is picked up as a new flow,
	// DNAT'd to s2, which resets it: the client learns at once and reconnects.
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	buf := make([]byte, 16)
	_, err = conn.Read(buf)
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("after the scrub the old connection should be reset by s2, got %v", err)
	}
	var conn2 net.Conn
	if err := inNetns(c.netns, func() error {
		var err error
		conn2, err = net.DialTimeout("tcp4", vip.String()+":80", 3*time.Second)
		return err
	}); err != nil {
		t.Fatalf("reconnect to the VIP: %v", err)
	}
	defer conn2.Close()
	if err := echo(conn2); err != nil {
		t.Fatalf("echo through the VIP to s2: %v", err)
	}
	if l2.accepted.Load() < 1 {
		t.Fatal("s2 accepted no connection")
	}
}

type tcpServer struct {
	l        net.Listener
	accepted atomic.Int64
}

func (s *tcpServer) Close() { s.l.Close() }

// listenTCP runs an echo server in the pod.
func listenTCP(t *testing.T, p *pod, port int) *tcpServer {
	t.Helper()
	s := &tcpServer{}
	if err := inNetns(p.netns, func() error {
		var err error
		s.l, err = net.ListenTCP("tcp4", &net.TCPAddr{Port: port})
		return err
	}); err != nil {
		t.Fatalf("TCP server in pod %s: %v", p.name, err)
	}
	go func() {
		for {
			c, err := s.l.Accept()
			if err != nil {
				return
			}
			s.accepted.Add(1)
			go func() {
				defer c.Close()
				buf := make([]byte, 64)
				for {
					k, err := c.Read(buf)
					if err != nil {
						return
					}
					c.Write(buf[:k])
				}
			}()
		}
	}()
	t.Cleanup(s.Close)
	return s
}

func echo(c net.Conn) error {
	c.SetDeadline(time.Now().Add(1500 * time.Millisecond))
	if _, err := c.Write([]byte("ping")); err != nil {
		return err
	}
	buf := make([]byte, 4)
	if _, err := c.Read(buf); err != nil {
		return err
	}
	if string(buf) != "ping" {
		return errors.New("echo mismatch")
	}
	return nil
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
