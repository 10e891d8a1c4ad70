package index

import (
	"encoding/binary"
	"errors"
	"math/bits"
	"math/rand/v2"
	"slices"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// One IP's keys of one family are stored as fixed-size records in a single
// []byte used as an open-addressing hash table (linear probing, backward-shift
// deletion, no tombstones). A record holds a key relative to the IP it is
// indexed under: every key of an IP's set contains that IP as its daddr or
// saddr, so the record keeps only the other address, the ports, the protocol
// and the flags, plus one byte saying which side the IP was:
//
//	IPv4: other address (4) | dport sport nexthdr flags (6) | side (1) = 11 bytes
//	IPv6: other address (16) | dport sport nexthdr flags (6) | side (1) = 23 bytes
//
// A full CT key is 14 (38) bytes and a Go map[CTKey4]struct{} costs 32-33
// bytes per key; a table kept between 2/3 and 7/8 full costs 12.6-16.5 bytes
// per IPv4 key (docs/design.md has the measured figure).
//
// The side byte is recSideDAddr or recSideSAddr; 0 marks an empty slot, so
// no key value needs to be reserved. A key whose two addresses are both the
// IP is stored as recSideDAddr (the form is canonical, so it is stored once).
// The same records are the snapshot's on-disk form (Snapshot, Restore).
const (
	recSideDAddr = 1 // the IP is the key's daddr; the record holds its saddr
	recSideSAddr = 3 // the IP is the key's saddr; the record holds its daddr

	// RecSize4 and RecSize6 are the sizes of one record (SnapshotIP.Recs4/6).
	RecSize4 = 4 + 6 + 1
	RecSize6 = 16 + 6 + 1

	maxRec     = RecSize6
	minSlots   = 8
	loadMaxNum = 7 // grow past 7/8 full ...
	loadMaxDen = 8
	growNum    = 3 // ... to 3/2 of the keys (2/3 full)
	growDen    = 2
)

// hashSeed makes slot positions unpredictable to whoever picks the ports of
// a pod's flows (math/rand/v2's global source is randomly seeded).
var hashSeed = rand.Uint64()

// keySet is one family's table. alen is the address length (4 or 16); the
// record size is alen+7. The zero keySet is empty.
type keySet struct {
	slots []byte
	n     int
}

func recSize(alen int) int { return alen + 7 }

// pack writes key's record relative to ip (as alen bytes) into rec and
// reports whether key contains ip at all.
func pack(rec, ip, key []byte, alen int) bool {
	switch {
	case string(key[:alen]) == string(ip):
		copy(rec, key[alen:2*alen])
		rec[alen+6] = recSideDAddr
	case string(key[alen:2*alen]) == string(ip):
		copy(rec, key[:alen])
		rec[alen+6] = recSideSAddr
	default:
		return false
	}
	copy(rec[alen:alen+6], key[2*alen:2*alen+6])
	return true
}

// unpack is pack's inverse.
func unpack(key, ip, rec []byte, alen int) {
	if rec[alen+6] == recSideSAddr {
		copy(key[:alen], rec[:alen])
		copy(key[alen:2*alen], ip)
	} else {
		copy(key[:alen], ip)
		copy(key[alen:2*alen], rec[:alen])
	}
	copy(key[2*alen:2*alen+6], rec[alen:alen+6])
}

func validRec(rec []byte) bool {
	side := rec[len(rec)-1]
	return side == recSideDAddr || side == recSideSAddr
}

func hashRec(rec []byte) uint64 {
	h := hashSeed
	for len(rec) >= 8 {
		h = mix(h, binary.LittleEndian.Uint64(rec))
		rec = rec[8:]
	}
	var t uint64
	for i, c := range rec {
		t |= uint64(c) << (8 * i)
	}
	return mix(h, t)
}

func mix(h, v uint64) uint64 {
	hi, lo := bits.Mul64(h^v, 0xa0761d6478bd642f)
	return hi ^ lo ^ 0xe7037ed1a0b428db
}

func (s *keySet) cap(rs int) int { return len(s.slots) / rs }

func (s *keySet) home(rec []byte, c int) int {
	hi, _ := bits.Mul64(hashRec(rec), uint64(c))
	return int(hi)
}

// find returns rec's slot, or the empty slot where it would go and false.
func (s *keySet) find(rec []byte) (int, bool) {
	rs := len(rec)
	c := s.cap(rs)
	i := s.home(rec, c)
	if rs == RecSize4 {
		return s.find4(rec, c, i)
	}
	for {
		slot := s.slots[i*rs : i*rs+rs]
		if slot[rs-1] == 0 {
			return i, false
		}
		if string(slot) == string(rec) {
			return i, true
		}
		if i++; i == c {
			i = 0
		}
	}
}

// find4 is find for IPv4 records (11 bytes), compared as two words (bytes
// 0-7 and 7-10) rather than through a byte comparison's call per probe: a
// table kept up to 7/8 full probes many slots per miss (issue 36's
// bootstrap pass inserts 16 M keys through it). BenchmarkKeySetAdd4, user
// CPU of 3.3 M inserts, three runs alternating on a loaded machine: 0.67-
// 0.79 s before, 0.52-0.67 s after.
func (s *keySet) find4(rec []byte, c, i int) (int, bool) {
	le := binary.LittleEndian
	lo, hi := le.Uint64(rec[0:8]), le.Uint32(rec[7:RecSize4])
	slots := s.slots[:c*RecSize4]
	for {
		slot := slots[i*RecSize4 : i*RecSize4+RecSize4 : i*RecSize4+RecSize4]
		if slot[RecSize4-1] == 0 {
			return i, false
		}
		if le.Uint64(slot[0:8]) == lo && le.Uint32(slot[7:RecSize4]) == hi {
			return i, true
		}
		if i++; i == c {
			i = 0
		}
	}
}

// add inserts rec; false when it was already there.
func (s *keySet) add(rec []byte) bool {
	rs := len(rec)
	if c := s.cap(rs); (s.n+1)*loadMaxDen > c*loadMaxNum {
		s.resize(rs, (s.n+1)*growNum/growDen)
	}
	i, ok := s.find(rec)
	if ok {
		return false
	}
	copy(s.slots[i*rs:], rec)
	s.n++
	return true
}

// del removes rec; false when it was not there.
func (s *keySet) del(rec []byte) bool {
	if s.n == 0 {
		return false
	}
	rs := len(rec)
	i, ok := s.find(rec)
	if !ok {
		return false
	}
	c := s.cap(rs)
	// Backward shift: pull later records of the run into the hole when their
	// home slot does not lie (cyclically) after the hole.
	for j := i; ; {
		if j++; j == c {
			j = 0
		}
		slot := s.slots[j*rs : j*rs+rs]
		if slot[rs-1] == 0 {
			break
		}
		h := s.home(slot, c)
		if (j > i && (h <= i || h > j)) || (j < i && h <= i && h > j) {
			copy(s.slots[i*rs:i*rs+rs], slot)
			i = j
		}
	}
	clear(s.slots[i*rs : i*rs+rs])
	s.n--
	if s.n == 0 {
		s.slots = nil
	} else if c > minSlots && s.n*4 < c {
		s.resize(rs, s.n*growNum/growDen)
	}
	return true
}

// resize rehashes into a table of at least want slots (the allocator's size
// class may give a few more, which are used).
func (s *keySet) resize(rs, want int) {
	want = max(want, minSlots)
	old := s.slots
	s.slots = append([]byte(nil), make([]byte, want*rs)...)
	s.slots = s.slots[:cap(s.slots)/rs*rs]
	for off := 0; off < len(old); off += rs {
		rec := old[off : off+rs]
		if rec[rs-1] != 0 {
			i, _ := s.find(rec)
			copy(s.slots[i*rs:], rec)
		}
	}
}

// each calls f with every record (f must not keep it or change the set).
func (s *keySet) each(rs int, f func(rec []byte)) {
	for off := 0; off < len(s.slots); off += rs {
		if rec := s.slots[off : off+rs]; rec[rs-1] != 0 {
			f(rec)
		}
	}
}

// records appends every record to dst.
func (s *keySet) records(dst []byte, rs int) []byte {
	s.each(rs, func(rec []byte) { dst = append(dst, rec...) })
	return dst
}

// find0 is find that also works on an empty set.
func (s *keySet) find0(rec []byte) (int, bool) {
	if s.n == 0 {
		return -1, false
	}
	return s.find(rec)
}

// keys4 and keys6 append the set's keys, made whole again with ip, to dst.
func (s *keySet) keys4(ip *[4]byte, dst []ctmap.CTKey4) []ctmap.CTKey4 {
	dst = slices.Grow(dst, s.n)
	s.each(RecSize4, func(rec []byte) {
		var k ctmap.CTKey4
		unpack(k[:], ip[:], rec, 4)
		dst = append(dst, k)
	})
	return dst
}

func (s *keySet) keys6(ip *[16]byte, dst []ctmap.CTKey6) []ctmap.CTKey6 {
	dst = slices.Grow(dst, s.n)
	s.each(RecSize6, func(rec []byte) {
		var k ctmap.CTKey6
		unpack(k[:], ip[:], rec, 16)
		dst = append(dst, k)
	})
	return dst
}

var errBadRecord = errors.New("malformed key record")

// restore adds recs (a snapshot's records, rs bytes each) to the set.
func (s *keySet) restore(recs []byte, rs int) (added int, err error) {
	if len(recs)%rs != 0 {
		return 0, errBadRecord
	}
	if n := len(recs) / rs; n > 0 {
		s.resize(rs, (s.n+n)*growNum/growDen)
	}
	for off := 0; off < len(recs); off += rs {
		rec := recs[off : off+rs]
		if !validRec(rec) {
			return added, errBadRecord
		}
		if s.add(rec) {
			added++
		}
	}
	return added, nil
}
