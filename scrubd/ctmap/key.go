// Package ctmap is the one place that knows Cilium's connection-tracking maps:
// their names, key and value layouts, key conventions and how to open them.
//
// Layouts follow Cilium v1.16 and 1.19+ (bpf/lib/common.h, bpf/lib/conntrack.h);
// see docs/cilium-ct.md for the conventions this package encodes.
package ctmap

import (
	"encoding/binary"
	"fmt"
	"net/netip"
)

// Tuple flags (TUPLE_F_*).
const (
	FlagOut     uint8 = 0
	FlagIn      uint8 = 1
	FlagRelated uint8 = 2
	FlagService uint8 = 4
)

// IP protocol numbers that decide the map a key lives in.
const (
	ProtoICMP   uint8 = 1
	ProtoTCP    uint8 = 6
	ProtoUDP    uint8 = 17
	ProtoICMPv6 uint8 = 58
)

// Key sizes of struct ipv4_ct_tuple and struct ipv6_ct_tuple (packed).
const (
	KeySize4 = 14
	KeySize6 = 38
)

// CTKey4 is struct ipv4_ct_tuple exactly as stored in the map: packed, network
// byte order. DAddr holds the initiator's address, SAddr the responder's, SPort
// the initiator's port, DPort the responder's (Cilium reverses the packet's
// tuple before it creates the entry).
type CTKey4 [KeySize4]byte

// CTKey6 is struct ipv6_ct_tuple, with the same conventions as CTKey4.
type CTKey6 [KeySize6]byte

// Tuple is the decoded form of either key, for code that is not on a hot path.
type Tuple struct {
	DAddr, SAddr netip.Addr
	DPort, SPort uint16 // host byte order
	NextHdr      uint8
	Flags        uint8
}

// NewKey4 builds a v4 key; ports are in host byte order.
func NewKey4(daddr, saddr netip.Addr, dport, sport uint16, nexthdr, flags uint8) CTKey4 {
	var k CTKey4
	d, s := daddr.As4(), saddr.As4()
	copy(k[0:4], d[:])
	copy(k[4:8], s[:])
	binary.BigEndian.PutUint16(k[8:10], dport)
	binary.BigEndian.PutUint16(k[10:12], sport)
	k[12] = nexthdr
	k[13] = flags
	return k
}

// NewKey6 builds a v6 key; ports are in host byte order.
func NewKey6(daddr, saddr netip.Addr, dport, sport uint16, nexthdr, flags uint8) CTKey6 {
	var k CTKey6
	d, s := daddr.As16(), saddr.As16()
	copy(k[0:16], d[:])
	copy(k[16:32], s[:])
	binary.BigEndian.PutUint16(k[32:34], dport)
	binary.BigEndian.PutUint16(k[34:36], sport)
	k[36] = nexthdr
	k[37] = flags
	return k
}

func (k CTKey4) DAddr() netip.Addr { return netip.AddrFrom4([4]byte(k[0:4])) }
func (k CTKey4) SAddr() netip.Addr { return netip.AddrFrom4([4]byte(k[4:8])) }
func (k CTKey4) DPort() uint16     { return binary.BigEndian.Uint16(k[8:10]) }
func (k CTKey4) SPort() uint16     { return binary.BigEndian.Uint16(k[10:12]) }
func (k CTKey4) NextHdr() uint8    { return k[12] }
func (k CTKey4) Flags() uint8      { return k[13] }

func (k CTKey6) DAddr() netip.Addr { return netip.AddrFrom16([16]byte(k[0:16])) }
func (k CTKey6) SAddr() netip.Addr { return netip.AddrFrom16([16]byte(k[16:32])) }
func (k CTKey6) DPort() uint16     { return binary.BigEndian.Uint16(k[32:34]) }
func (k CTKey6) SPort() uint16     { return binary.BigEndian.Uint16(k[34:36]) }
func (k CTKey6) NextHdr() uint8    { return k[36] }
func (k CTKey6) Flags() uint8      { return k[37] }

// Tuple decodes the key.
func (k CTKey4) Tuple() Tuple {
	return Tuple{k.DAddr(), k.SAddr(), k.DPort(), k.SPort(), k.NextHdr(), k.Flags()}
}

// Tuple decodes the key.
func (k CTKey6) Tuple() Tuple {
	return Tuple{k.DAddr(), k.SAddr(), k.DPort(), k.SPort(), k.NextHdr(), k.Flags()}
}

func (t Tuple) String() string {
	dir := "OUT"
	if t.Flags&FlagIn != 0 {
		dir = "IN"
	}
	if t.Flags&FlagService != 0 {
		dir = "SVC"
	}
	if t.Flags&FlagRelated != 0 {
		dir += "|REL"
	}
	return fmt.Sprintf("%s %s:%d -> %s:%d proto %d", dir, t.DAddr, t.SPort, t.SAddr, t.DPort, t.NextHdr)
}

func (k CTKey4) String() string { return k.Tuple().String() }
func (k CTKey6) String() string { return k.Tuple().String() }

// Related returns the "related" ICMP key Cilium creates beside every entry:
// same addresses, ports 0, protocol ICMP, flags | TUPLE_F_RELATED. It lives in
// the "any" map.
func (k CTKey4) Related() CTKey4 { MakeRelated(k[:]); return k }

// Related returns the ICMPv6 "related" key; see CTKey4.Related.
func (k CTKey6) Related() CTKey6 { MakeRelated(k[:]); return k }

// MakeRelated turns the bytes of a CT key (KeySize4 or KeySize6 long) into
// its related key's, in place: the one definition, for the keys' Related
// and for code that works on the bytes (index.Covered).
func MakeRelated(b []byte) {
	a := (len(b) - 6) / 2 // address size
	clear(b[2*a : 2*a+4])
	b[len(b)-2] = ProtoICMP
	if len(b) == KeySize6 {
		b[len(b)-2] = ProtoICMPv6
	}
	b[len(b)-1] |= FlagRelated
}

// WithFlags returns the key with its flags replaced, e.g. the IN twin of an
// OUT entry of same-node pod-to-pod traffic.
func (k CTKey4) WithFlags(f uint8) CTKey4 { k[13] = f; return k }

// WithFlags returns the key with its flags replaced.
func (k CTKey6) WithFlags(f uint8) CTKey6 { k[37] = f; return k }

// Kind tells which of the four global maps a key belongs in.
func (k CTKey4) Kind() Kind {
	if k.NextHdr() == ProtoTCP {
		return TCP4
	}
	return Any4
}

// Kind tells which of the four global maps a key belongs in.
func (k CTKey6) Kind() Kind {
	if k.NextHdr() == ProtoTCP {
		return TCP6
	}
	return Any6
}

// Has reports whether ip is one of the key's two addresses.
func (k CTKey4) Has(ip netip.Addr) bool {
	if !ip.Is4() {
		return false
	}
	a := ip.As4()
	return [4]byte(k[0:4]) == a || [4]byte(k[4:8]) == a
}

// Has reports whether ip is one of the key's two addresses.
func (k CTKey6) Has(ip netip.Addr) bool {
	if !ip.Is6() || ip.Is4In6() {
		return false
	}
	a := ip.As16()
	return [16]byte(k[0:16]) == a || [16]byte(k[16:32]) == a
}
