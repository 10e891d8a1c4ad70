// Package qdiscbypass sends frames from inside a pod the way a process with
// CAP_NET_RAW can: through an AF_PACKET socket with PACKET_QDISC_BYPASS, which
// hands the frame to the driver (dev_direct_xmit) and skips the interface's
// tc egress hook, where the container-side recorder sits. TEST SUPPORT.
package qdiscbypass

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"

	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/internal/nsexec"
)

// SendUDP sends one UDP datagram src:sport -> dst:dport to dstMAC out of
// ifname in the network namespace at netnsPath, with PACKET_QDISC_BYPASS.
func SendUDP(netnsPath, ifname string, dstMAC net.HardwareAddr, src, dst netip.Addr, sport, dport uint16, payload []byte) error {
	err := nsexec.Do(netnsPath, func() error { return sendUDP(ifname, dstMAC, src, dst, sport, dport, payload) })
	if err != nil {
		return fmt.Errorf("qdiscbypass: udp %s:%d -> %s:%d on %s in %s: %w", src, sport, dst, dport, ifname, netnsPath, err)
	}
	return nil
}

// SendUDPHere is SendUDP in the calling thread's own network namespace: a
// process in a pod (the kind e2e's probe, with CAP_NET_RAW only).
func SendUDPHere(ifname string, dstMAC net.HardwareAddr, src, dst netip.Addr, sport, dport uint16, payload []byte) error {
	if err := sendUDP(ifname, dstMAC, src, dst, sport, dport, payload); err != nil {
		return fmt.Errorf("qdiscbypass: udp %s:%d -> %s:%d on %s: %w", src, sport, dst, dport, ifname, err)
	}
	return nil
}

func sendUDP(ifname string, dstMAC net.HardwareAddr, src, dst netip.Addr, sport, dport uint16, payload []byte) error {
	ifi, err := net.InterfaceByName(ifname)
	if err != nil {
		return err
	}
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("packet socket: %w", err)
	}
	defer unix.Close(fd)
	if err := unix.SetsockoptInt(fd, unix.SOL_PACKET, unix.PACKET_QDISC_BYPASS, 1); err != nil {
		return fmt.Errorf("PACKET_QDISC_BYPASS: %w", err)
	}
	frame := UDPFrame(ifi.HardwareAddr, dstMAC, src, dst, sport, dport, payload)
	proto := uint16(unix.ETH_P_IP)
	if src.Is6() {
		proto = unix.ETH_P_IPV6
	}
	to := &unix.SockaddrLinklayer{Ifindex: ifi.Index, Protocol: htons(proto), Halen: 6}
	copy(to.Addr[:], dstMAC)
	return unix.Sendto(fd, frame, 0, to)
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// UDPFrame is an Ethernet frame holding one UDP datagram, IPv4 or IPv6 by
// the addresses' family, with valid checksums.
func UDPFrame(srcMAC, dstMAC net.HardwareAddr, src, dst netip.Addr, sport, dport uint16, payload []byte) []byte {
	udp := make([]byte, 8+len(payload))
	binary.BigEndian.PutUint16(udp[0:], sport)
	binary.BigEndian.PutUint16(udp[2:], dport)
	binary.BigEndian.PutUint16(udp[4:], uint16(len(udp)))
	copy(udp[8:], payload)
	f := make([]byte, 14, 14+40+len(udp))
	copy(f[0:6], dstMAC)
	copy(f[6:12], srcMAC)
	s, d := src.AsSlice(), dst.AsSlice()
	var pseudo []byte
	if src.Is4() {
		binary.BigEndian.PutUint16(f[12:], unix.ETH_P_IP)
		ip := make([]byte, 20)
		ip[0], ip[8], ip[9] = 0x45, 64, unix.IPPROTO_UDP
		binary.BigEndian.PutUint16(ip[2:], uint16(20+len(udp)))
		copy(ip[12:], s)
		copy(ip[16:], d)
		binary.BigEndian.PutUint16(ip[10:], checksum(ip))
		f = append(f, ip...)
		pseudo = append(append(append([]byte{}, s...), d...), 0, unix.IPPROTO_UDP, byte(len(udp)>>8), byte(len(udp)))
	} else {
		binary.BigEndian.PutUint16(f[12:], unix.ETH_P_IPV6)
		ip := make([]byte, 40)
		ip[0], ip[6], ip[7] = 0x60, unix.IPPROTO_UDP, 64
		binary.BigEndian.PutUint16(ip[4:], uint16(len(udp)))
		copy(ip[8:], s)
		copy(ip[24:], d)
		f = append(f, ip...)
		pseudo = append(append(append([]byte{}, s...), d...), 0, 0, byte(len(udp)>>8), byte(len(udp)), 0, 0, 0, unix.IPPROTO_UDP)
	}
	c := checksum(append(pseudo, udp...))
	if c == 0 {
		c = 0xffff
	}
	binary.BigEndian.PutUint16(udp[6:], c)
	return append(f, udp...)
}

func checksum(b []byte) uint16 {
	var sum uint32
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(b[i])<<8 | uint32(b[i+1])
	}
	if len(b)%2 == 1 {
		sum += uint32(b[len(b)-1]) << 8
	}
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	return ^uint16(sum)
}
