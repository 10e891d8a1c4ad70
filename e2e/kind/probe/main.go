// Command probe is the client of the kind e2e's blackhole test
// (e2e/kind/blackhole_test.go): it runs in a pod and keeps one flow open
// the way the clients that meet the blackhole do, logging one JSON line per
// attempt on stdout for the test to read back:
//
//	probe udp ADDR PORT SRCPORT   "hostname" to agnhost netexec's UDP server
//	                              from one socket, bound to SRCPORT
//	probe dns SERVER NAME SRCPORT A queries for NAME from one socket, bound
//	                              to SRCPORT (resolvers that keep their port)
//	probe tcp ADDR PORT           GET /hostname on one kept-alive HTTP
//	                              connection; a new one only after it failed
//	probe bypass ADDR PORT        five UDP datagrams from source port 40404,
//	                              sent through an AF_PACKET socket with
//	                              PACKET_QDISC_BYPASS (they skip the pod's tc
//	                              egress, where ctscrub's container-side
//	                              recorder sits: the churn's bypass sidecar,
//	                              issue 35), then it exits
//	probe idle                    waits to be stopped (the bypass sidecar,
//	                              which the test execs `probe bypass` in)
//	probe udp-redial ADDR PORT SRCPORT   as udp, but after an error other
//	                              than a timeout the socket is closed and
//	                              dialled again from SRCPORT on the next
//	                              tick, as a client that handles an aborted
//	                              socket does (Cilium's socket LB destroys
//	                              connected UDP sockets whose backend was
//	                              deleted: ECONNABORTED, then EDESTADDRREQ
//	                              on every write of the old socket)
//
// Every 200 ms. A line: {"t":"<RFC 3339>","proto":"udp","ok":true,
// "reply":"<hostname>"} or {"t":...,"ok":false,"err":"<error>"}: a timeout
// is "timeout" (nothing came back), other errors as the kernel gave them
// (connection refused from an ICMP port unreachable, connection reset,
// EOF, ...). The same source port every time is the point: a conntrack
// entry lives as long as its flow's packets keep coming.
package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/net/dns/dnsmessage"

	"github.com/ctscrub/ctscrub/internal/testsupport/qdiscbypass"
)

const (
	every   = 200 * time.Millisecond
	timeout = 300 * time.Millisecond
)

type line struct {
	T     string `json:"t"`
	Proto string `json:"proto"`
	OK    bool   `json:"ok"`
	Reply string `json:"reply,omitempty"`
	Err   string `json:"err,omitempty"`
}

func emit(proto, reply string, err error) {
	l := line{T: time.Now().UTC().Format(time.RFC3339Nano), Proto: proto, OK: err == nil, Reply: reply}
	if err != nil {
		l.Err = errText(err)
	}
	b, _ := json.Marshal(l)
	fmt.Println(string(b))
}

func emitErr(proto, text string) {
	b, _ := json.Marshal(line{T: time.Now().UTC().Format(time.RFC3339Nano), Proto: proto, Err: text})
	fmt.Println(string(b))
}

func errText(err error) string {
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return "timeout"
	}
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return "EOF"
	}
	// The kernel's words (connection refused, connection reset by peer,
	// no route to host), without Go's "read udp a->b:" prefix.
	s := err.Error()
	if i := strings.LastIndex(s, ": "); i >= 0 {
		s = s[i+2:]
	}
	return s
}

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	var err error
	switch a := os.Args[2:]; os.Args[1] {
	case "udp":
		if len(a) != 3 {
			usage()
		}
		err = runUDP(a[0], a[1], a[2])
	case "dns":
		if len(a) != 3 {
			usage()
		}
		err = runDNS(a[0], a[1], a[2])
	case "udp-redial":
		if len(a) != 3 {
			usage()
		}
		err = runUDPRedial(a[0], a[1], a[2])
	case "tcp":
		if len(a) != 2 {
			usage()
		}
		runTCP(net.JoinHostPort(a[0], a[1]))
	case "bypass":
		if len(a) != 2 {
			usage()
		}
		err = runBypass(a[0], a[1])
	case "idle":
		// A sidecar that runs `probe bypass` when the test execs it; it
		// stops with the pod.
		stop := make(chan os.Signal, 1)
		signal.Notify(stop, syscall.SIGTERM, os.Interrupt)
		<-stop
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "probe:", err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: probe udp|udp-redial ADDR PORT SRCPORT | probe dns SERVER NAME SRCPORT | probe tcp ADDR PORT")
	os.Exit(2)
}

// dial opens the one UDP socket, from srcPort.
func dial(addr, port, srcPort string) (*net.UDPConn, error) {
	sp, err := strconv.Atoi(srcPort)
	if err != nil {
		return nil, fmt.Errorf("source port %q: %v", srcPort, err)
	}
	raddr, err := net.ResolveUDPAddr("udp4", net.JoinHostPort(addr, port))
	if err != nil {
		return nil, err
	}
	return net.DialUDP("udp4", &net.UDPAddr{Port: sp}, raddr)
}

func runUDP(addr, port, srcPort string) error {
	c, err := dial(addr, port, srcPort)
	if err != nil {
		return err
	}
	buf := make([]byte, 1500)
	for range time.Tick(every) {
		if _, err := c.Write([]byte("hostname")); err != nil {
			emit("udp", "", err)
			continue
		}
		c.SetReadDeadline(time.Now().Add(timeout))
		n, err := c.Read(buf)
		emit("udp", strings.TrimSpace(string(buf[:n])), err)
	}
	return nil
}

// runUDPRedial is runUDP with a new socket, from the same port, after an
// error that is not a timeout. Its lines have proto "udp".
func runUDPRedial(addr, port, srcPort string) error {
	if _, err := strconv.Atoi(srcPort); err != nil {
		return fmt.Errorf("source port %q: %v", srcPort, err)
	}
	var c *net.UDPConn
	buf := make([]byte, 1500)
	for range time.Tick(every) {
		if c == nil {
			var err error
			if c, err = dial(addr, port, srcPort); err != nil {
				emitErr("udp", "connect: "+errText(err))
				c = nil
				continue
			}
		}
		_, err := c.Write([]byte("hostname"))
		n := 0
		if err == nil {
			c.SetReadDeadline(time.Now().Add(timeout))
			n, err = c.Read(buf)
		}
		emit("udp", strings.TrimSpace(string(buf[:n])), err)
		var ne net.Error
		if err != nil && !(errors.As(err, &ne) && ne.Timeout()) {
			c.Close()
			c = nil
		}
	}
	return nil
}

func runDNS(server, name, srcPort string) error {
	c, err := dial(server, "53", srcPort)
	if err != nil {
		return err
	}
	qn, err := dnsmessage.NewName(strings.TrimSuffix(name, ".") + ".")
	if err != nil {
		return fmt.Errorf("name %q: %v", name, err)
	}
	buf := make([]byte, 1500)
	id := uint16(0)
	for range time.Tick(every) {
		id++
		q := dnsmessage.Message{
			Header:    dnsmessage.Header{ID: id, RecursionDesired: true},
			Questions: []dnsmessage.Question{{Name: qn, Type: dnsmessage.TypeA, Class: dnsmessage.ClassINET}},
		}
		b, _ := q.Pack()
		if _, err := c.Write(b); err != nil {
			emit("dns", "", err)
			continue
		}
		c.SetReadDeadline(time.Now().Add(timeout))
		// Read until our ID: a late answer to an earlier query is skipped.
		var reply string
		for {
			n, err := c.Read(buf)
			if err != nil {
				emit("dns", "", err)
				break
			}
			var m dnsmessage.Message
			if err := m.Unpack(buf[:n]); err != nil {
				emit("dns", "", fmt.Errorf("not a DNS answer (%d bytes: %q): %v", n, buf[:min(n, 40)], err))
				break
			}
			if m.ID != id {
				continue
			}
			reply = m.RCode.String()
			for _, a := range m.Answers {
				if r, ok := a.Body.(*dnsmessage.AResource); ok {
					reply += " " + net.IP(r.A[:]).String()
				}
			}
			emit("dns", reply, nil)
			break
		}
	}
	return nil
}

// runTCP keeps one HTTP/1.1 connection and asks agnhost netexec's
// /hostname on it; after an error it dials again on the next tick.
func runTCP(addr string) {
	var c net.Conn
	var r *bufio.Reader
	for range time.Tick(every) {
		if c == nil {
			var err error
			c, err = net.DialTimeout("tcp4", addr, timeout)
			if err != nil {
				emitErr("tcp", "connect: "+errText(err))
				c = nil
				continue
			}
			r = bufio.NewReader(c)
		}
		c.SetDeadline(time.Now().Add(timeout))
		_, err := io.WriteString(c, "GET /hostname HTTP/1.1\r\nHost: probe\r\n\r\n")
		var body []byte
		if err == nil {
			var resp *http.Response
			resp, err = http.ReadResponse(r, nil)
			if err == nil {
				body, err = io.ReadAll(resp.Body)
				resp.Body.Close()
			}
		}
		if err != nil {
			emit("tcp", "", err)
			c.Close()
			c = nil
			continue
		}
		emit("tcp", strings.TrimSpace(string(body)), nil)
	}
}

// bypassSport is the bypass datagrams' source port: the churn test finds
// their CT entries by it.
const bypassSport = 40404

// runBypass sends five datagrams to dst:port from eth0's IPv4 address with
// PACKET_QDISC_BYPASS, to the default gateway's MAC (resolved by one plain
// datagram to the gateway's discard port first).
func runBypass(dst, port string) error {
	d, err := netip.ParseAddr(dst)
	if err != nil || !d.Is4() {
		return fmt.Errorf("bypass: %q is not an IPv4 address", dst)
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil {
		return fmt.Errorf("bypass: port %q: %w", port, err)
	}
	ifi, err := net.InterfaceByName("eth0")
	if err != nil {
		return err
	}
	addrs, err := ifi.Addrs()
	if err != nil {
		return err
	}
	var src netip.Addr
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(n.IP); ok && ip.Unmap().Is4() {
				src = ip.Unmap()
				break
			}
		}
	}
	if !src.IsValid() {
		return errors.New("bypass: eth0 has no IPv4 address")
	}
	gw, err := defaultGateway4("/proc/net/route")
	if err != nil {
		return err
	}
	mac, err := gatewayMAC(gw)
	if err != nil {
		return err
	}
	for i := range 5 {
		err := qdiscbypass.SendUDPHere("eth0", mac, src, d, bypassSport, uint16(p), []byte("ctscrub bypass"))
		emit("bypass", fmt.Sprintf("%s:%d -> %s:%d via %s (%s), %d", src, bypassSport, d, p, gw, mac, i), err)
		if err != nil {
			return err
		}
		time.Sleep(every)
	}
	return nil
}

// defaultGateway4 reads the IPv4 default route's gateway from
// /proc/net/route (little-endian hex).
func defaultGateway4(path string) (netip.Addr, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return netip.Addr{}, err
	}
	for _, l := range strings.Split(string(b), "\n")[1:] {
		f := strings.Fields(l)
		if len(f) < 3 || f[1] != "00000000" {
			continue
		}
		v, err := strconv.ParseUint(f[2], 16, 32)
		if err != nil || v == 0 {
			continue
		}
		return netip.AddrFrom4([4]byte{byte(v), byte(v >> 8), byte(v >> 16), byte(v >> 24)}), nil
	}
	return netip.Addr{}, fmt.Errorf("bypass: no IPv4 default gateway in %s", path)
}

// gatewayMAC makes the kernel resolve gw (one datagram to its discard
// port, through the normal path) and reads its MAC from /proc/net/arp.
func gatewayMAC(gw netip.Addr) (net.HardwareAddr, error) {
	deadline := time.Now().Add(5 * time.Second)
	for {
		if c, err := net.Dial("udp", net.JoinHostPort(gw.String(), "9")); err == nil {
			c.Write([]byte{0})
			c.Close()
		}
		b, err := os.ReadFile("/proc/net/arp")
		if err == nil {
			for _, l := range strings.Split(string(b), "\n")[1:] {
				f := strings.Fields(l)
				if len(f) >= 4 && f[0] == gw.String() && f[3] != "00:00:00:00:00:00" {
					return net.ParseMAC(f[3])
				}
			}
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("bypass: no ARP entry for the gateway %s after 5 s", gw)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
