package netnsnode

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"sync"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/net/icmp"
	"golang.org/x/net/ipv4"
	"golang.org/x/net/ipv6"
)

// Sockets belong to the network namespace they were created in, so each one
// is created inside its netns and then used from any goroutine.

// InNetns runs fn with the calling thread in the netns at path.
func InNetns(path string, fn func() error) error {
	return ns.WithNetNSPath(path, func(ns.NetNS) error { return fn() })
}

// Server answers TCP and UDP on one port of every address of its netns, so
// every pod and the outside host can be a peer.
type Server struct {
	tcp  net.Listener
	udp  net.PacketConn
	port int
	wg   sync.WaitGroup
}

const serverPort = 8080

// StartServer starts a Server in the netns at netnsPath.
func StartServer(netnsPath string) (*Server, error) {
	s := &Server{port: serverPort}
	err := InNetns(netnsPath, func() error {
		var err error
		if s.tcp, err = net.Listen("tcp", fmt.Sprintf("[::]:%d", serverPort)); err != nil {
			return err
		}
		s.udp, err = net.ListenPacket("udp", fmt.Sprintf("[::]:%d", serverPort))
		return err
	})
	if err != nil {
		s.Close()
		return nil, fmt.Errorf("start TCP/UDP server in %s: %w", netnsPath, err)
	}
	s.wg.Add(2)
	go func() {
		defer s.wg.Done()
		for {
			c, err := s.tcp.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(c, c); c.Close() }()
		}
	}()
	go func() {
		defer s.wg.Done()
		buf := make([]byte, 2048)
		for {
			n, from, err := s.udp.ReadFrom(buf)
			if err != nil {
				return
			}
			_, _ = s.udp.WriteTo(buf[:n], from)
		}
	}()
	return s, nil
}

// Close stops the server and waits for its goroutines.
func (s *Server) Close() {
	if s.tcp != nil {
		s.tcp.Close()
	}
	if s.udp != nil {
		s.udp.Close()
	}
	s.wg.Wait()
}

// TrafficCounts says how much of each kind of traffic one client sends to one
// peer address: each TCP connection and each UDP socket is one new flow.
type TrafficCounts struct {
	TCP, UDP, Ping int
}

// SendTraffic opens n.TCP connections, n.UDP UDP flows and n.Ping echo
// exchanges from the netns at from to dst, and waits for every answer: a
// flow counts only when the peer answered (so it crossed the datapath both
// ways). It returns the flows that completed.
func SendTraffic(ctx context.Context, from string, dst netip.Addr, n TrafficCounts) (int, error) {
	var conns []net.Conn
	var pcs []net.PacketConn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
		for _, c := range pcs {
			c.Close()
		}
	}()
	addr := netip.AddrPortFrom(dst, serverPort).String()
	d := net.Dialer{Timeout: 2 * time.Second}
	err := InNetns(from, func() error {
		for i := 0; i < n.TCP; i++ {
			c, err := d.DialContext(ctx, "tcp", addr)
			if err != nil {
				return fmt.Errorf("TCP to %s: %w", addr, err)
			}
			conns = append(conns, c)
		}
		for i := 0; i < n.UDP; i++ {
			c, err := d.DialContext(ctx, "udp", addr)
			if err != nil {
				return fmt.Errorf("UDP to %s: %w", addr, err)
			}
			conns = append(conns, c)
		}
		if n.Ping > 0 {
			network, laddr := "ip4:icmp", "0.0.0.0"
			if dst.Is6() {
				network, laddr = "ip6:ipv6-icmp", "::"
			}
			pc, err := icmp.ListenPacket(network, laddr)
			if err != nil {
				return fmt.Errorf("ICMP socket: %w", err)
			}
			pcs = append(pcs, pc)
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("traffic from %s: %w", from, err)
	}
	done := 0
	buf := make([]byte, 64)
	for _, c := range conns {
		_ = c.SetDeadline(time.Now().Add(2 * time.Second))
		if _, err := c.Write([]byte("ctscrub-demo")); err != nil {
			return done, fmt.Errorf("traffic from %s to %s: %w", from, addr, err)
		}
		if _, err := c.Read(buf); err != nil {
			return done, fmt.Errorf("traffic from %s to %s: no answer: %w", from, addr, err)
		}
		done++
	}
	if len(pcs) == 1 {
		got, err := ping(pcs[0].(*icmp.PacketConn), dst, n.Ping)
		done += got
		if err != nil {
			return done, fmt.Errorf("ping from %s to %s: %w", from, dst, err)
		}
	}
	return done, nil
}

// ping sends count echo requests with distinct identifiers (each one a new
// ICMP "flow" for Cilium's CT) and waits for every reply.
func ping(pc *icmp.PacketConn, dst netip.Addr, count int) (int, error) {
	typ, replyTyp, proto := icmp.Type(ipv4.ICMPTypeEcho), icmp.Type(ipv4.ICMPTypeEchoReply), 1
	if dst.Is6() {
		typ, replyTyp, proto = ipv6.ICMPTypeEchoRequest, ipv6.ICMPTypeEchoReply, 58
	}
	got := 0
	buf := make([]byte, 1500)
	for i := 0; i < count; i++ {
		id := (os.Getpid() + i*7919) & 0xffff
		msg := icmp.Message{Type: typ, Body: &icmp.Echo{ID: id, Seq: 1, Data: []byte("ctscrub-demo")}}
		b, err := msg.Marshal(nil)
		if err != nil {
			return got, err
		}
		if _, err := pc.WriteTo(b, &net.IPAddr{IP: dst.AsSlice()}); err != nil {
			return got, err
		}
		deadline := time.Now().Add(2 * time.Second)
		for {
			_ = pc.SetReadDeadline(deadline)
			n, _, err := pc.ReadFrom(buf)
			if err != nil {
				return got, fmt.Errorf("echo id %d: %w", id, err)
			}
			m, err := icmp.ParseMessage(proto, buf[:n])
			if err != nil {
				continue
			}
			if e, ok := m.Body.(*icmp.Echo); ok && m.Type == replyTyp && e.ID == id {
				got++
				break
			}
		}
	}
	if got < count {
		return got, errors.New("missing echo replies")
	}
	return got, nil
}
