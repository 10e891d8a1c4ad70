package conformance

import (
	"encoding/binary"
	"net/netip"
)

// Frames as they cross a pod's veth: Ethernet, IPv4 or IPv6, L4 with valid
// lengths and checksums.

// TCP flags.
const (
	FIN = 0x01
	SYN = 0x02
	RST = 0x04
	PSH = 0x08
	ACK = 0x10
)

// IP protocol numbers.
const (
	ProtoICMP   = 1
	ProtoTCP    = 6
	ProtoUDP    = 17
	ProtoICMPv6 = 58
	ProtoSCTP   = 132
)

var (
	podMAC  = [6]byte{0x0a, 0x58, 0, 0, 0, 1}
	nodeMAC = [6]byte{0x0a, 0x58, 0, 0, 0, 0xfe}
)

func csumAdd(sum uint32, b []byte) uint32 {
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(binary.BigEndian.Uint16(b[i:]))
	}
	if len(b)%2 == 1 {
		sum += uint32(b[len(b)-1]) << 8
	}
	return sum
}

func csumFold(sum uint32) uint16 {
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	return ^uint16(sum)
}

// ipPacket builds an IP packet (no Ethernet header) around an L4 segment
// whose checksum field sits at csumOff (-1: none; ICMPv4's checksum covers
// only the message). opts are IPv4 options (a multiple of 4 bytes) or IPv6
// extension headers (their first byte is replaced by the next header).
func ipPacket(src, dst netip.Addr, proto uint8, l4 []byte, csumOff int, opts []byte) []byte {
	if src.Is4() {
		h := make([]byte, 20+len(opts))
		h[0] = 0x40 | byte((20+len(opts))/4)
		binary.BigEndian.PutUint16(h[2:], uint16(len(h)+len(l4)))
		binary.BigEndian.PutUint16(h[4:], 0x1234)
		h[8] = 64
		h[9] = proto
		s, d := src.As4(), dst.As4()
		copy(h[12:], s[:])
		copy(h[16:], d[:])
		copy(h[20:], opts)
		binary.BigEndian.PutUint16(h[10:], csumFold(csumAdd(0, h)))
		if csumOff >= 0 {
			var sum uint32
			if proto != ProtoICMP {
				sum = csumAdd(sum, s[:])
				sum = csumAdd(sum, d[:])
				sum += uint32(proto) + uint32(len(l4))
			}
			binary.BigEndian.PutUint16(l4[csumOff:], csumFold(csumAdd(sum, l4)))
		}
		return append(h, l4...)
	}
	h := make([]byte, 40)
	h[0] = 0x60
	binary.BigEndian.PutUint16(h[4:], uint16(len(opts)+len(l4)))
	h[6] = proto
	if len(opts) > 0 {
		h[6] = 60 // destination options (the only extension header used here)
		opts[0] = proto
	}
	h[7] = 64
	s, d := src.As16(), dst.As16()
	copy(h[8:], s[:])
	copy(h[24:], d[:])
	if csumOff >= 0 {
		sum := csumAdd(0, s[:])
		sum = csumAdd(sum, d[:])
		sum += uint32(len(l4)) + uint32(proto)
		binary.BigEndian.PutUint16(l4[csumOff:], csumFold(csumAdd(sum, l4)))
	}
	return append(append(h, opts...), l4...)
}

func ether(ip []byte, v6 bool) []byte {
	f := make([]byte, 14, 14+len(ip))
	copy(f[0:], nodeMAC[:])
	copy(f[6:], podMAC[:])
	if v6 {
		binary.BigEndian.PutUint16(f[12:], 0x86dd)
	} else {
		binary.BigEndian.PutUint16(f[12:], 0x0800)
	}
	return append(f, ip...)
}

// TCPFrame is one TCP segment with the given flags and 8 bytes of payload.
func TCPFrame(src, dst netip.AddrPort, flags uint8) []byte {
	return ether(tcpPacket(src, dst, flags, nil), src.Addr().Is6())
}

func tcpPacket(src, dst netip.AddrPort, flags uint8, opts []byte) []byte {
	l4 := make([]byte, 20+8)
	binary.BigEndian.PutUint16(l4[0:], src.Port())
	binary.BigEndian.PutUint16(l4[2:], dst.Port())
	binary.BigEndian.PutUint32(l4[4:], 1000)
	if flags&ACK != 0 {
		binary.BigEndian.PutUint32(l4[8:], 2000)
	}
	l4[12] = 5 << 4
	l4[13] = flags
	binary.BigEndian.PutUint16(l4[14:], 65535)
	return ipPacket(src.Addr(), dst.Addr(), ProtoTCP, l4, 16, opts)
}

// UDPFrame is one UDP datagram with 8 bytes of payload.
func UDPFrame(src, dst netip.AddrPort) []byte {
	l4 := make([]byte, 8+8)
	binary.BigEndian.PutUint16(l4[0:], src.Port())
	binary.BigEndian.PutUint16(l4[2:], dst.Port())
	binary.BigEndian.PutUint16(l4[4:], uint16(len(l4)))
	return ether(ipPacket(src.Addr(), dst.Addr(), ProtoUDP, l4, 6, nil), src.Addr().Is6())
}

// SCTPFrame is an SCTP packet (common header and an empty INIT-like chunk;
// the CT only reads the ports).
func SCTPFrame(src, dst netip.AddrPort) []byte {
	l4 := make([]byte, 12+4)
	binary.BigEndian.PutUint16(l4[0:], src.Port())
	binary.BigEndian.PutUint16(l4[2:], dst.Port())
	l4[12] = 1 // INIT
	binary.BigEndian.PutUint16(l4[14:], 4)
	return ether(ipPacket(src.Addr(), dst.Addr(), ProtoSCTP, l4, -1, nil), src.Addr().Is6())
}

// ICMP message types used.
const (
	EchoRequest4 = 8
	EchoReply4   = 0
	Unreach4     = 3
	EchoRequest6 = 128
	EchoReply6   = 129
	Unreach6     = 1
	TooBig6      = 2
)

// EchoFrame is an ICMP or ICMPv6 echo request or reply.
func EchoFrame(src, dst netip.Addr, request bool, id uint16) []byte {
	l4 := make([]byte, 8+8)
	proto := uint8(ProtoICMP)
	switch {
	case src.Is4() && request:
		l4[0] = EchoRequest4
	case src.Is4():
		l4[0] = EchoReply4
	case request:
		l4[0], proto = EchoRequest6, ProtoICMPv6
	default:
		l4[0], proto = EchoReply6, ProtoICMPv6
	}
	binary.BigEndian.PutUint16(l4[4:], id)
	binary.BigEndian.PutUint16(l4[6:], 1)
	return ether(ipPacket(src, dst, proto, l4, 2, nil), src.Is6())
}

// ErrorFrame is an ICMP "destination unreachable" (IPv4: fragmentation
// needed; IPv6: packet too big) from src to dst quoting inner, an IP packet
// (without Ethernet header) that dst sent.
func ErrorFrame(src, dst netip.Addr, inner []byte) []byte {
	quote := inner
	if len(quote) > 64 {
		quote = quote[:64]
	}
	l4 := make([]byte, 8, 8+len(quote))
	proto := uint8(ProtoICMP)
	if src.Is4() {
		l4[0], l4[1] = Unreach4, 4 // fragmentation needed
		binary.BigEndian.PutUint16(l4[6:], 1400)
	} else {
		l4[0], proto = TooBig6, ProtoICMPv6
		binary.BigEndian.PutUint32(l4[4:], 1280)
	}
	l4 = append(l4, quote...)
	return ether(ipPacket(src, dst, proto, l4, 2, nil), src.Is6())
}

// IPOf strips the Ethernet header.
func IPOf(frame []byte) []byte { return frame[14:] }

// dsrOpt is the option Cilium's DSR (IP option / IPv6 extension header
// mode) puts on the client's packet at the load balancer: the service
// address and port. The IPv4 option carries both in host byte order (a
// wire format Cilium kept for compatibility).
func dsrOpt(svc netip.AddrPort) []byte {
	if svc.Addr().Is4() {
		o := make([]byte, 8)
		o[0], o[1] = 0x9a, 8 // IPOPT_COPY | 0x1a
		binary.LittleEndian.PutUint16(o[2:], svc.Port())
		a := svc.Addr().As4()
		binary.LittleEndian.PutUint32(o[4:], binary.BigEndian.Uint32(a[:]))
		return o
	}
	// struct dsr_opt_v6: ipv6_opt_hdr {nexthdr, hdrlen}, opt_type,
	// opt_len, addr[16], port, pad: 24 bytes.
	o := make([]byte, 24)
	o[1] = 2    // (24 - 8) / 8
	o[2] = 0x1b // DSR_IPV6_OPT_TYPE
	o[3] = 20   // sizeof - 4
	a := svc.Addr().As16()
	copy(o[4:], a[:])
	binary.BigEndian.PutUint16(o[20:], svc.Port())
	return o
}

// DSRFrame is the client's TCP segment as the LB node forwards it to the
// backend in DSR mode: addressed to the backend, with the service in an
// option.
func DSRFrame(client, backend, svc netip.AddrPort, flags uint8) []byte {
	return ether(tcpPacket(client, backend, flags, dsrOpt(svc)), client.Addr().Is6())
}
