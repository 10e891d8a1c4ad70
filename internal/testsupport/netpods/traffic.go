package netpods

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"time"

	"golang.org/x/net/icmp"
	"golang.org/x/net/ipv4"
	"golang.org/x/net/ipv6"
)

// Timeout bounds every exchange of the traffic helpers.
const Timeout = 3 * time.Second

var payload = []byte("ctscrub netpods")

// ServeEcho answers TCP and UDP on EchoPort, both families, inside the
// host's namespace until the test ends.
func (h *Host) ServeEcho() {
	h.t.Helper()
	var ln net.Listener
	var pc net.PacketConn
	err := h.Do(func() error {
		var err error
		if ln, err = net.Listen("tcp", fmt.Sprintf("[::]:%d", EchoPort)); err != nil {
			return err
		}
		pc, err = net.ListenPacket("udp", fmt.Sprintf("[::]:%d", EchoPort))
		return err
	})
	if err != nil {
		h.t.Fatalf("netpods: echo servers in %s: %v", h.Name, err)
	}
	h.t.Cleanup(func() { ln.Close(); pc.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				c.SetDeadline(time.Now().Add(Timeout))
				buf := make([]byte, 1500)
				n, err := c.Read(buf)
				if err == nil {
					c.Write(buf[:n])
				}
			}()
		}
	}()
	go func() {
		buf := make([]byte, 1500)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			pc.WriteTo(buf[:n], from)
		}
	}()
}

// TCP connects from the host to dst:port, sends a message, waits for the
// echo and closes: one complete TCP flow.
func (h *Host) TCP(dst netip.Addr, port uint16) error {
	var c net.Conn
	err := h.Do(func() error {
		var err error
		c, err = net.DialTimeout("tcp", netip.AddrPortFrom(dst, port).String(), Timeout)
		return err
	})
	if err != nil {
		return fmt.Errorf("tcp %s -> %s:%d: %w", h.Name, dst, port, err)
	}
	defer c.Close()
	return echo(c, fmt.Sprintf("tcp %s -> %s:%d", h.Name, dst, port))
}

// UDP sends one datagram from the host to dst:port and waits for the echo.
func (h *Host) UDP(dst netip.Addr, port uint16) error {
	c, err := h.dialUDP(dst, port)
	if err != nil {
		return err
	}
	defer c.Close()
	return echo(c, fmt.Sprintf("udp %s -> %s:%d", h.Name, dst, port))
}

// SendUDP sends one datagram from the host to dst:port and does not wait
// for an answer (e.g. to a service VIP nothing answers on).
func (h *Host) SendUDP(dst netip.Addr, port uint16) error {
	c, err := h.dialUDP(dst, port)
	if err != nil {
		return err
	}
	defer c.Close()
	if _, err := c.Write(payload); err != nil {
		return fmt.Errorf("udp %s -> %s:%d: %w", h.Name, dst, port, err)
	}
	return nil
}

func (h *Host) dialUDP(dst netip.Addr, port uint16) (net.Conn, error) {
	var c net.Conn
	err := h.Do(func() error {
		var err error
		c, err = net.Dial("udp", netip.AddrPortFrom(dst, port).String())
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("udp %s -> %s:%d: %w", h.Name, dst, port, err)
	}
	return c, nil
}

func echo(c net.Conn, what string) error {
	c.SetDeadline(time.Now().Add(Timeout))
	if _, err := c.Write(payload); err != nil {
		return fmt.Errorf("%s: write: %w", what, err)
	}
	buf := make([]byte, 1500)
	n, err := c.Read(buf)
	if err != nil {
		return fmt.Errorf("%s: read echo: %w", what, err)
	}
	if !bytes.Equal(buf[:n], payload) {
		return fmt.Errorf("%s: echo %q, sent %q", what, buf[:n], payload)
	}
	return nil
}

// Ping sends one ICMP (or ICMPv6) echo request from the host to dst and
// waits for the reply. It returns the identifier used, the "port" of the
// flow in Cilium's CT key.
func (h *Host) Ping(dst netip.Addr) (id uint16, err error) {
	id = uint16(rand.IntN(0xfff0) + 1)
	network, proto, reqType, repType := "ip4:icmp", 1, icmp.Type(ipv4.ICMPTypeEcho), icmp.Type(ipv4.ICMPTypeEchoReply)
	if dst.Is6() {
		network, proto, reqType, repType = "ip6:ipv6-icmp", 58, ipv6.ICMPTypeEchoRequest, ipv6.ICMPTypeEchoReply
	}
	var c *icmp.PacketConn
	err = h.Do(func() error {
		var err error
		c, err = icmp.ListenPacket(network, "")
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("ping %s -> %s: open raw socket: %w", h.Name, dst, err)
	}
	defer c.Close()
	msg := icmp.Message{Type: reqType, Body: &icmp.Echo{ID: int(id), Seq: 1, Data: payload}}
	b, err := msg.Marshal(nil) // the kernel fills in the ICMPv6 checksum
	if err != nil {
		return 0, err
	}
	if _, err := c.WriteTo(b, &net.IPAddr{IP: dst.AsSlice()}); err != nil {
		return 0, fmt.Errorf("ping %s -> %s: send: %w", h.Name, dst, err)
	}
	c.SetReadDeadline(time.Now().Add(Timeout))
	buf := make([]byte, 1500)
	for {
		n, _, err := c.ReadFrom(buf)
		if err != nil {
			return 0, fmt.Errorf("ping %s -> %s: no reply: %w", h.Name, dst, err)
		}
		m, err := icmp.ParseMessage(proto, buf[:n])
		if err != nil || m.Type != repType {
			continue
		}
		if e, ok := m.Body.(*icmp.Echo); ok && e.ID == int(id) {
			return id, nil
		}
	}
}
