package nfct

// The ctnetlink wire format, written by hand for the three things the Go
// libraries do not offer: zero-allocation event and dump parsing (the index
// ingests tens of thousands of events a second), batched deletes by exact tuple
// with one ACK per entry, and the filtered flush (CTA_FILTER on
// IPCTNL_MSG_CT_DELETE without a tuple, Linux 6.12+).
//
// Numbers are from include/uapi/linux/netfilter/nfnetlink_conntrack.h.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"runtime"
	"sync/atomic"
	"unsafe"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

const (
	nfnlSubsysCTNetlink = 1
	msgCTNew            = 0
	msgCTGet            = 1
	msgCTDelete         = 2

	nfnlGrpConntrackNew     = 1
	nfnlGrpConntrackDestroy = 3

	ctaTupleOrig  = 1
	ctaTupleReply = 2
	ctaID         = 12
	ctaZone       = 18
	ctaFilter     = 25

	ctaTupleIP    = 1
	ctaTupleProto = 2
	ctaTupleZone  = 3

	ctaIPv4Src = 1
	ctaIPv4Dst = 2
	ctaIPv6Src = 3
	ctaIPv6Dst = 4

	ctaProtoNum      = 1
	ctaProtoSrcPort  = 2
	ctaProtoDstPort  = 3
	ctaProtoICMPID   = 4
	ctaProtoICMPType = 5
	ctaProtoICMPCode = 6
	ctaProtoICMP6ID  = 7
	ctaProtoICMP6Typ = 8
	ctaProtoICMP6Cod = 9

	ctaFilterOrigFlags  = 1
	ctaFilterReplyFlags = 2
	filterFlagIPSrc     = 1 << 0
	filterFlagIPDst     = 1 << 1

	nlaFNested = 1 << 15
	nlaTypeMsk = ^uint16(nlaFNested | 1<<14)

	nlmsgHdrLen = 16
	nfgenLen    = 4
)

func msgType(m uint16) uint16 { return nfnlSubsysCTNetlink<<8 | m }

// socket is one NETLINK_NETFILTER socket, created inside a network namespace.
type socket struct {
	fd  int
	seq atomic.Uint32
}

// openSocket creates a netfilter netlink socket in the network namespace at
// nsPath ("" = the caller's). A socket stays in the namespace it was created
// in, so only the creation runs on a thread moved into nsPath.
func openSocket(nsPath string) (*socket, error) {
	create := func() (int, error) {
		fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
		if err != nil {
			return -1, fmt.Errorf("open netfilter netlink socket: %w", err)
		}
		if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
			unix.Close(fd)
			return -1, fmt.Errorf("bind netfilter netlink socket: %w", err)
		}
		return fd, nil
	}
	var fd int
	var err error
	if nsPath == "" {
		fd, err = create()
	} else {
		fd, err = inNetns(nsPath, create)
	}
	if err != nil {
		return nil, err
	}
	s := &socket{fd: fd}
	// Small error ACKs (no echo of the request) and no extended ACK TLVs:
	// thousands of ACKs per scrub must fit the receive buffer.
	_ = unix.SetsockoptInt(fd, unix.SOL_NETLINK, unix.NETLINK_CAP_ACK, 1)
	return s, nil
}

// inNetns runs fn on a locked OS thread moved into the namespace at path. It
// runs on a goroutine of its own: if the thread cannot be moved back, it stays
// locked and the runtime discards it when that goroutine ends, so no other
// code ever runs in the wrong namespace.
func inNetns(path string, fn func() (int, error)) (int, error) {
	target, err := netns.GetFromPath(path)
	if err != nil {
		return -1, fmt.Errorf("open network namespace %s: %w (does it exist?)", path, err)
	}
	defer target.Close()
	type result struct {
		fd  int
		err error
	}
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			done <- result{-1, fmt.Errorf("get current network namespace: %w", err)}
			return
		}
		defer orig.Close()
		if err := netns.Set(target); err != nil {
			runtime.UnlockOSThread()
			done <- result{-1, fmt.Errorf("enter network namespace %s: %w", path, err)}
			return
		}
		fd, ferr := fn()
		if err := netns.Set(orig); err != nil {
			done <- result{fd, errors.Join(ferr, fmt.Errorf("leave network namespace %s: %w", path, err))}
			return // thread stays locked: discarded with this goroutine
		}
		runtime.UnlockOSThread()
		done <- result{fd, ferr}
	}()
	r := <-done
	if r.err != nil && r.fd >= 0 {
		unix.Close(r.fd)
		r.fd = -1
	}
	return r.fd, r.err
}

func (s *socket) close() error { return unix.Close(s.fd) }

// setRcvBuf sets the receive buffer, forcing past net.core.rmem_max when
// the process may (CAP_NET_ADMIN), and returns the size the kernel granted.
func (s *socket) setRcvBuf(bytes int) int {
	if unix.SetsockoptInt(s.fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, bytes) != nil {
		_ = unix.SetsockoptInt(s.fd, unix.SOL_SOCKET, unix.SO_RCVBUF, bytes)
	}
	v, _ := unix.GetsockoptInt(s.fd, unix.SOL_SOCKET, unix.SO_RCVBUF)
	return v
}

func (s *socket) meminfo() (mi [unix.SK_MEMINFO_VARS]uint32, ok bool) {
	l := uint32(unsafe.Sizeof(mi))
	_, _, e := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(s.fd), unix.SOL_SOCKET, unix.SO_MEMINFO,
		uintptr(unsafe.Pointer(&mi[0])), uintptr(unsafe.Pointer(&l)), 0)
	return mi, e == 0
}

// drops is the socket's count of messages the kernel dropped because the
// receive buffer was full (sk_drops, SK_MEMINFO_DROPS): for an event socket,
// the exact number of lost events.
func (s *socket) drops() uint64 {
	mi, _ := s.meminfo()
	return uint64(mi[unix.SK_MEMINFO_DROPS])
}

// queued is the number of bytes waiting in the receive queue.
func (s *socket) queued() uint32 {
	mi, _ := s.meminfo()
	return mi[unix.SK_MEMINFO_RMEM_ALLOC]
}

// msgBuf builds netlink messages, one after another, in one buffer.
type msgBuf struct {
	b     []byte
	start int   // offset of the message being built
	nests []int // offsets of open nested attributes
}

func (m *msgBuf) begin(typ, flags uint16, seq uint32, family uint8, version uint8) {
	m.start = len(m.b)
	var h [nlmsgHdrLen + nfgenLen]byte
	binary.NativeEndian.PutUint16(h[4:], typ)
	binary.NativeEndian.PutUint16(h[6:], flags)
	binary.NativeEndian.PutUint32(h[8:], seq)
	h[16] = family
	h[17] = version
	m.b = append(m.b, h[:]...)
}

func (m *msgBuf) end() {
	binary.NativeEndian.PutUint32(m.b[m.start:], uint32(len(m.b)-m.start))
}

func (m *msgBuf) attr(typ uint16, data []byte) {
	l := 4 + len(data)
	var h [4]byte
	binary.NativeEndian.PutUint16(h[0:], uint16(l))
	binary.NativeEndian.PutUint16(h[2:], typ)
	m.b = append(m.b, h[:]...)
	m.b = append(m.b, data...)
	for l%4 != 0 {
		m.b = append(m.b, 0)
		l++
	}
}

func (m *msgBuf) u8(typ uint16, v uint8) { m.attr(typ, []byte{v}) }
func (m *msgBuf) be16(typ uint16, v uint16) {
	m.attr(typ, binary.BigEndian.AppendUint16(nil, v))
}
func (m *msgBuf) be32(typ uint16, v uint32) {
	m.attr(typ, binary.BigEndian.AppendUint32(nil, v))
}

func (m *msgBuf) nest(typ uint16) {
	m.nests = append(m.nests, len(m.b))
	m.attr(typ|nlaFNested, nil)
}

func (m *msgBuf) endNest() {
	off := m.nests[len(m.nests)-1]
	m.nests = m.nests[:len(m.nests)-1]
	binary.NativeEndian.PutUint16(m.b[off:], uint16(len(m.b)-off))
}

// tuple appends a CTA_TUPLE_ORIG/REPLY nest for t.
func (m *msgBuf) tuple(typ uint16, t *Tuple) {
	m.nest(typ)
	m.nest(ctaTupleIP)
	if t.Src.Is4() {
		a, b := t.Src.As4(), t.Dst.As4()
		m.attr(ctaIPv4Src, a[:])
		m.attr(ctaIPv4Dst, b[:])
	} else {
		a, b := t.Src.As16(), t.Dst.As16()
		m.attr(ctaIPv6Src, a[:])
		m.attr(ctaIPv6Dst, b[:])
	}
	m.endNest()
	m.nest(ctaTupleProto)
	m.u8(ctaProtoNum, t.Proto)
	switch {
	case t.Proto == unix.IPPROTO_ICMP:
		m.be16(ctaProtoICMPID, t.SPort)
		m.u8(ctaProtoICMPType, uint8(t.DPort>>8))
		m.u8(ctaProtoICMPCode, uint8(t.DPort))
	case t.Proto == unix.IPPROTO_ICMPV6:
		m.be16(ctaProtoICMP6ID, t.SPort)
		m.u8(ctaProtoICMP6Typ, uint8(t.DPort>>8))
		m.u8(ctaProtoICMP6Cod, uint8(t.DPort))
	case t.Ports:
		m.be16(ctaProtoSrcPort, t.SPort)
		m.be16(ctaProtoDstPort, t.DPort)
	}
	m.endNest()
	m.endNest()
}

// Tuple is one direction of a conntrack entry. For ICMP and ICMPv6, SPort is
// the echo ID and DPort is type<<8|code, as the kernel keys them.
type Tuple struct {
	Src, Dst     netip.Addr
	Proto        uint8
	Ports        bool // the protocol carries ports (TCP, UDP, SCTP, DCCP, UDP-Lite, GRE keys)
	SPort, DPort uint16
}

// Entry is what the index needs of one conntrack entry.
type Entry struct {
	Orig, Reply Tuple
	Zone        uint16 // zone of the original direction
	ID          uint32 // CTA_ID: tells a flow from a newer one reusing its tuple
}

// attrs iterates over netlink attributes in b.
func attrs(b []byte, fn func(typ uint16, data []byte)) {
	for len(b) >= 4 {
		l := int(binary.NativeEndian.Uint16(b[0:]))
		typ := binary.NativeEndian.Uint16(b[2:]) & nlaTypeMsk
		if l < 4 || l > len(b) {
			return
		}
		fn(typ, b[4:l])
		al := (l + 3) &^ 3
		if al > len(b) {
			return
		}
		b = b[al:]
	}
}

func parseTuple(b []byte, t *Tuple, zone *uint16, hasZone *bool) {
	attrs(b, func(typ uint16, d []byte) {
		switch typ {
		case ctaTupleIP:
			attrs(d, func(typ uint16, d []byte) {
				switch typ {
				case ctaIPv4Src, ctaIPv6Src:
					t.Src, _ = netip.AddrFromSlice(d)
				case ctaIPv4Dst, ctaIPv6Dst:
					t.Dst, _ = netip.AddrFromSlice(d)
				}
			})
		case ctaTupleProto:
			attrs(d, func(typ uint16, d []byte) {
				switch typ {
				case ctaProtoNum:
					if len(d) >= 1 {
						t.Proto = d[0]
					}
				case ctaProtoSrcPort, ctaProtoICMPID, ctaProtoICMP6ID:
					if len(d) >= 2 {
						t.SPort = binary.BigEndian.Uint16(d)
						t.Ports = typ == ctaProtoSrcPort
					}
				case ctaProtoDstPort:
					if len(d) >= 2 {
						t.DPort = binary.BigEndian.Uint16(d)
					}
				case ctaProtoICMPType, ctaProtoICMP6Typ:
					if len(d) >= 1 {
						t.DPort = t.DPort&0xff | uint16(d[0])<<8
					}
				case ctaProtoICMPCode, ctaProtoICMP6Cod:
					if len(d) >= 1 {
						t.DPort = t.DPort&0xff00 | uint16(d[0])
					}
				}
			})
		case ctaTupleZone:
			if len(d) >= 2 && zone != nil {
				*zone = binary.BigEndian.Uint16(d)
				*hasZone = true
			}
		}
	})
}

// parseEntry decodes a ctnetlink message body (after the nfgenmsg header).
func parseEntry(b []byte) (Entry, bool) {
	var e Entry
	var zone, origZone uint16
	var hasZone, hasOrigZone bool
	attrs(b, func(typ uint16, d []byte) {
		switch typ {
		case ctaTupleOrig:
			parseTuple(d, &e.Orig, &origZone, &hasOrigZone)
		case ctaTupleReply:
			parseTuple(d, &e.Reply, nil, nil)
		case ctaID:
			if len(d) >= 4 {
				e.ID = binary.BigEndian.Uint32(d)
			}
		case ctaZone:
			if len(d) >= 2 {
				zone = binary.BigEndian.Uint16(d)
				hasZone = true
			}
		}
	})
	// The lookup by original tuple uses the zone of the original direction: a
	// directional zone comes in the tuple, a plain one as CTA_ZONE.
	switch {
	case hasOrigZone:
		e.Zone = origZone
	case hasZone:
		e.Zone = zone
	}
	return e, e.Orig.Src.IsValid() && e.Orig.Dst.IsValid()
}

// netlinkMessages iterates over the netlink messages in one datagram.
func netlinkMessages(b []byte, fn func(typ, flags uint16, seq uint32, body []byte) bool) {
	for len(b) >= nlmsgHdrLen {
		l := int(binary.NativeEndian.Uint32(b[0:]))
		if l < nlmsgHdrLen || l > len(b) {
			return
		}
		typ := binary.NativeEndian.Uint16(b[4:])
		flags := binary.NativeEndian.Uint16(b[6:])
		seq := binary.NativeEndian.Uint32(b[8:])
		if !fn(typ, flags, seq, b[nlmsgHdrLen:l]) {
			return
		}
		al := (l + 3) &^ 3
		if al > len(b) {
			return
		}
		b = b[al:]
	}
}

// errno of an NLMSG_ERROR body (0 for an ACK).
func nlError(body []byte) unix.Errno {
	if len(body) < 4 {
		return unix.EINVAL
	}
	return unix.Errno(-int32(binary.NativeEndian.Uint32(body)))
}

var errDumpInterrupted = errors.New("conntrack dump interrupted (the table changed under it)")

// dump walks the whole table of the socket's namespace (family 0: v4 and v6),
// calling fn for every entry without collecting them: a 1M-entry table never
// sits in memory as a slice. When filter is set it is appended to the request
// (CTA_FILTER and friends for a kernel-side filter).
func (s *socket) dump(family uint8, filter func(m *msgBuf), fn func(Entry)) error {
	var m msgBuf
	seq := s.seq.Add(1)
	m.begin(msgType(msgCTGet), unix.NLM_F_REQUEST|unix.NLM_F_DUMP, seq, family, 0)
	if filter != nil {
		filter(&m)
	}
	m.end()
	if err := unix.Sendto(s.fd, m.b, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return fmt.Errorf("send conntrack dump request: %w", err)
	}
	buf := make([]byte, 1<<20)
	for {
		n, _, err := unix.Recvfrom(s.fd, buf, 0)
		if err != nil {
			if err == unix.EINTR {
				continue
			}
			return fmt.Errorf("read conntrack dump: %w", err)
		}
		done := false
		var derr error
		netlinkMessages(buf[:n], func(typ, flags uint16, mseq uint32, body []byte) bool {
			if mseq != seq {
				return true
			}
			switch typ {
			case unix.NLMSG_DONE:
				done = true
				return false
			case unix.NLMSG_ERROR:
				if e := nlError(body); e != 0 {
					derr = fmt.Errorf("conntrack dump: %w", e)
				}
				done = true
				return false
			}
			if flags&unix.NLM_F_DUMP_INTR != 0 {
				derr = errDumpInterrupted
			}
			if len(body) >= nfgenLen {
				if e, ok := parseEntry(body[nfgenLen:]); ok {
					fn(e)
				}
			}
			return true
		})
		if done {
			return derr
		}
	}
}

// exchange sends the requests in m (numbered first..first+n-1, each with
// NLM_F_ACK) in one sendmsg and collects their n ACKs.
func (s *socket) exchange(m *msgBuf, first uint32, n int, onAck func(idx int, errno unix.Errno)) error {
	if err := unix.Sendto(s.fd, m.b, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return fmt.Errorf("send conntrack requests: %w", err)
	}
	buf := make([]byte, 64<<10)
	got := 0
	for got < n {
		nr, _, err := unix.Recvfrom(s.fd, buf, 0)
		if err != nil {
			if err == unix.EINTR {
				continue
			}
			return fmt.Errorf("read conntrack ACKs (%d of %d received): %w", got, n, err)
		}
		netlinkMessages(buf[:nr], func(typ, _ uint16, seq uint32, body []byte) bool {
			if typ != unix.NLMSG_ERROR {
				return true
			}
			idx := int(seq - first)
			if idx < 0 || idx >= n {
				return true
			}
			got++
			onAck(idx, nlError(body))
			return true
		})
	}
	return nil
}
