package nfct

import (
	"net/netip"
	"testing"

	"golang.org/x/sys/unix"
)

// FuzzNetlink feeds arbitrary datagrams to the ctnetlink parser exactly as the
// event reader and the dump do (netlinkMessages, then parseEntry on each
// body past the nfgenmsg header): no input may panic or read past its
// message, and an accepted entry has both original addresses of one family.
// The seeds are messages the builder writes (the kernel's layout), so the
// fuzzer starts from well-formed ones and mutates lengths and nests.
func FuzzNetlink(f *testing.F) {
	for _, e := range []Entry{
		dnat("10.244.7.7", "10.96.0.10", "10.244.1.5", 40000, 53),
		tcp("fd00::1", "fd00::2", 1, 2),
		icmpEcho("10.244.1.5", "9.9.9.9", 77),
		icmpEcho("fd00::5", "fd00::9", 78),
	} {
		e.Zone, e.ID = 7, 0xdeadbeef
		var m msgBuf
		m.begin(msgType(msgCTNew), unix.NLM_F_REQUEST, 1, unix.AF_INET, 0)
		m.tuple(ctaTupleOrig, &e.Orig)
		m.tuple(ctaTupleReply, &e.Reply)
		m.be32(ctaID, e.ID)
		m.be16(ctaZone, e.Zone)
		m.end()
		m.begin(unix.NLMSG_DONE, 0, 1, 0, 0)
		m.end()
		f.Add(m.b)
	}
	f.Add([]byte{})
	f.Add(make([]byte, nlmsgHdrLen))
	f.Fuzz(func(t *testing.T, b []byte) {
		n := 0
		netlinkMessages(b, func(typ, flags uint16, seq uint32, body []byte) bool {
			n++
			if len(body) > len(b) {
				t.Fatalf("body of %d bytes from a %d-byte datagram", len(body), len(b))
			}
			if typ == unix.NLMSG_ERROR {
				_ = nlError(body)
			}
			if len(body) < nfgenLen {
				return true
			}
			e, ok := parseEntry(body[nfgenLen:])
			if ok && (!e.Orig.Src.IsValid() || !e.Orig.Dst.IsValid()) {
				t.Fatalf("accepted entry without original addresses: %+v", e)
			}
			return true
		})
		if n > len(b)/nlmsgHdrLen {
			t.Fatalf("%d messages in %d bytes", n, len(b))
		}
	})
}

// FuzzTupleRoundTrip: every tuple the builder writes parses back to itself
// (the delete-by-tuple requests and the parser agree on the wire format).
func FuzzTupleRoundTrip(f *testing.F) {
	f.Add([]byte{10, 244, 1, 5, 10, 96, 0, 10}, uint8(unix.IPPROTO_UDP), uint16(40000), uint16(53), uint16(7), uint32(1), true)
	f.Add([]byte{0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2}, uint8(unix.IPPROTO_ICMPV6), uint16(5), uint16(0x8000), uint16(0), uint32(9), false)
	f.Fuzz(func(t *testing.T, addrs []byte, proto uint8, sport, dport, zone uint16, id uint32, ports bool) {
		var e Entry
		switch {
		case len(addrs) >= 32:
			e.Orig.Src = addrFrom(addrs[0:16])
			e.Orig.Dst = addrFrom(addrs[16:32])
		case len(addrs) >= 8:
			e.Orig.Src = addrFrom(addrs[0:4])
			e.Orig.Dst = addrFrom(addrs[4:8])
		default:
			return
		}
		e.Orig.Proto, e.Orig.SPort, e.Orig.DPort = proto, sport, dport
		switch {
		case proto == unix.IPPROTO_ICMP || proto == unix.IPPROTO_ICMPV6:
			e.Orig.Ports = false
		case ports:
			e.Orig.Ports = true
		default:
			e.Orig.SPort, e.Orig.DPort = 0, 0
		}
		e.Reply = Tuple{Src: e.Orig.Dst, Dst: e.Orig.Src, Proto: proto, Ports: e.Orig.Ports, SPort: e.Orig.DPort, DPort: e.Orig.SPort}
		if !e.Orig.Ports && proto != unix.IPPROTO_ICMP && proto != unix.IPPROTO_ICMPV6 {
			e.Reply.SPort, e.Reply.DPort = 0, 0
		}
		if proto == unix.IPPROTO_ICMP || proto == unix.IPPROTO_ICMPV6 {
			e.Reply.SPort, e.Reply.DPort = e.Orig.SPort, e.Orig.DPort
		}
		e.Zone, e.ID = zone, id
		var m msgBuf
		m.begin(msgType(msgCTNew), unix.NLM_F_REQUEST, 1, unix.AF_INET, 0)
		m.tuple(ctaTupleOrig, &e.Orig)
		m.tuple(ctaTupleReply, &e.Reply)
		m.be32(ctaID, e.ID)
		m.be16(ctaZone, e.Zone)
		m.end()
		got, ok := parseEntry(m.b[nlmsgHdrLen+nfgenLen:])
		if !ok || got != e {
			t.Fatalf("round trip of %+v gave %+v (ok %v)", e, got, ok)
		}
	})
}

func addrFrom(b []byte) netip.Addr {
	a, _ := netip.AddrFromSlice(b)
	return a
}
