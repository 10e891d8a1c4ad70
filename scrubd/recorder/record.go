package recorder

import (
	"encoding/binary"
	"fmt"
	"net/netip"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// Record kinds (REC_* in bpf/include/ctscrub.h).
const (
	RecFlow    uint8 = 0
	RecService uint8 = 1
	// RecForeign: a flow the pod sent from an address its interface does
	// not own. The key is the one Cilium would create if it let the
	// packet through; its daddr is the claimed source.
	RecForeign uint8 = 2
	// RecServiceEntry: a flow the pod sends to a VIP Cilium load-balances
	// per packet. The key is Cilium's SERVICE key (daddr = the VIP, saddr =
	// the pod); Backend the backend_id its entry held when the packet
	// passed (0: no entry yet). RecService is what older programs sent.
	RecServiceEntry uint8 = 3
	// RecL7LB: a flow the pod sends to an L7 load-balancer VIP
	// (SVC_FLAG_L7_LOADBALANCER). The key is the flow's plain OUT key to
	// the VIP, which Cilium with ENABLE_L7_LB keeps (no SERVICE entry, no
	// DNAT: bpf_lxc redirects the flow to Envoy). Apply indexes it as
	// RecFlow; the reader marks the pod incomplete
	// (ReasonL7LBUnconfirmed) unless Options.L7LB says the node's Cilium
	// has ENABLE_L7_LB.
	RecL7LB uint8 = 4
)

// ReasonL7LBUnconfirmed: the pod sent to an L7 load-balancer VIP and the
// node's Cilium was not seen with ENABLE_L7_LB (node_config.h unreadable,
// or the define absent): Cilium may then have load-balanced the flow per
// packet (SERVICE and OUT entries towards a backend the recorder did not
// read).
const ReasonL7LBUnconfirmed = "L7 load-balancer service: flow to its VIP recorded as a plain flow, but Cilium's ENABLE_L7_LB was not confirmed in node_config.h"

// RecordSize is sizeof(struct record); records of older programs (still in
// a pinned ring after an upgrade) are RecordSizeV1 long, without Backend.
const (
	RecordSize   = 56
	RecordSizeV1 = 48
)

// Record is struct record from bpf/include/ctscrub.h: one new flow as the
// recorder saw it on a pod interface.
type Record struct {
	Family  uint8
	Kind    uint8
	Ifindex uint32
	Key     [40]byte
	Backend uint32
	// At: RecServiceEntry, the packet's bpf_ktime_get_ns() >> SvcTimeShift
	// (48 bits; 0 from an older program).
	At uint64
}

// SvcTimeShift is the unit of Record.At and of a service flow's packet
// time in the flow caches (SVC_TIME_SHIFT in bpf/recorder.c): 2^20 ns.
const SvcTimeShift = 20

// AtNanos is At as CLOCK_MONOTONIC ns, rounded down (0: unknown).
func (r *Record) AtNanos() int64 { return int64(r.At << SvcTimeShift) }

// ParseRecord decodes one ring-buffer sample.
func ParseRecord(b []byte) (Record, error) {
	if len(b) < RecordSizeV1 {
		return Record{}, fmt.Errorf("recorder record: %d bytes, want %d (or an older program's %d)", len(b), RecordSize, RecordSizeV1)
	}
	r := Record{Family: b[0], Kind: b[1], Ifindex: binary.NativeEndian.Uint32(b[4:8])}
	copy(r.Key[:], b[8:48])
	// Shorter than RecordSize (an older program's record): backend 0,
	// which Apply reads as a pick nobody has read.
	if len(b) >= RecordSize {
		r.Backend = binary.NativeEndian.Uint32(b[48:52])
		r.At = uint64(binary.NativeEndian.Uint16(b[2:4]))<<32 | uint64(binary.NativeEndian.Uint32(b[52:56]))
	}
	if r.Family != 4 && r.Family != 6 {
		return Record{}, fmt.Errorf("recorder record: family %d", r.Family)
	}
	return r, nil
}

// Apply puts one record into the index. It is the single path from the
// recorder to the index (the benchmark's fill goes through it too).
//
// A flow's record carries the CT key Cilium creates for it (OUT when the pod
// initiated, IN when a peer did). Apply also indexes the "related" ICMP key
// Cilium creates beside it and, when both addresses are pod IPs (same-node
// pod-to-pod traffic creates both an OUT and an IN entry), the twin with the
// other direction. A key that turns out not to exist costs one failed delete.
//
// A foreign-source record files the key (and its related key) under the
// receiver only, and marks the claimed source incomplete
// (index.ReasonForeignSource). Whether Cilium dropped the packet (its
// source check, on unless disabled for the endpoint) or created entries
// with the claimed source, the recorder cannot see: the claimed IP's next
// scrub sweeps, and its set does not grow with what another pod claims.
// The receiver gains nothing a pod could not file under it with genuine
// traffic.
func Apply(ix *index.Index, r *Record) {
	switch r.Family {
	case 4:
		k := ctmap.CTKey4(r.Key[:ctmap.KeySize4])
		if r.Kind == RecForeign {
			if ix.Owns(k.DAddr()) {
				ix.MarkIncomplete(k.DAddr(), index.ReasonForeignSource)
			}
			ix.AddTo4(k.SAddr(), k)
			ix.AddTo4(k.SAddr(), k.Related())
			return
		}
		if r.Kind == RecServiceEntry {
			// The pod is saddr. Its OUT key names the backend Cilium
			// picked, which the pod never sees: Resolve learns it from
			// the SERVICE entry and Cilium's backends map.
			ix.ServiceRecordAt4(k.SAddr(), k, r.Backend, r.AtNanos())
			return
		}
		// RecL7LB: the plain flow to the VIP, as RecFlow (the VIP is
		// no pod IP: no twin).
		if r.Kind == RecService {
			// An older program's record (pod in daddr, no SERVICE key):
			// nothing to resolve from. An address outside the pod CIDRs
			// (a pod sending from a spoofed source) is never scrubbed:
			// marking it would only grow the index, one slot per address
			// (found by FuzzParseRecord).
			if ix.Owns(k.DAddr()) {
				ix.MarkIncomplete(k.DAddr(), index.ReasonService)
			}
			return
		}
		ix.Add4(k)
		ix.Add4(k.Related())
		if ix.Owns(k.DAddr()) && ix.Owns(k.SAddr()) {
			t := k.WithFlags(k.Flags() ^ ctmap.FlagIn)
			ix.Add4(t)
			ix.Add4(t.Related())
		}
	case 6:
		k := ctmap.CTKey6(r.Key[:ctmap.KeySize6])
		if r.Kind == RecForeign {
			if ix.Owns(k.DAddr()) {
				ix.MarkIncomplete(k.DAddr(), index.ReasonForeignSource)
			}
			ix.AddTo6(k.SAddr(), k)
			ix.AddTo6(k.SAddr(), k.Related())
			return
		}
		if r.Kind == RecServiceEntry {
			ix.ServiceRecordAt6(k.SAddr(), k, r.Backend, r.AtNanos())
			return
		}
		// RecL7LB: as RecFlow.
		if r.Kind == RecService {
			if ix.Owns(k.DAddr()) {
				ix.MarkIncomplete(k.DAddr(), index.ReasonService)
			}
			return
		}
		ix.Add6(k)
		ix.Add6(k.Related())
		if ix.Owns(k.DAddr()) && ix.Owns(k.SAddr()) {
			t := k.WithFlags(k.Flags() ^ ctmap.FlagIn)
			ix.Add6(t)
			ix.Add6(t.Related())
		}
	}
}

// Encode is ParseRecord's inverse (tests and benchmarks feed records through
// Apply exactly as the ring buffer reader does).
func (r *Record) Encode() []byte {
	b := make([]byte, RecordSize)
	b[0], b[1] = r.Family, r.Kind
	binary.NativeEndian.PutUint32(b[4:8], r.Ifindex)
	copy(b[8:48], r.Key[:])
	binary.NativeEndian.PutUint32(b[48:52], r.Backend)
	binary.NativeEndian.PutUint16(b[2:4], uint16(r.At>>32))
	binary.NativeEndian.PutUint32(b[52:56], uint32(r.At))
	return b
}

// addrs returns the two addresses of the record's key.
func (r *Record) addrs() [2]netip.Addr {
	if r.Family == 4 {
		k := ctmap.CTKey4(r.Key[:ctmap.KeySize4])
		return [2]netip.Addr{k.DAddr(), k.SAddr()}
	}
	k := ctmap.CTKey6(r.Key[:ctmap.KeySize6])
	return [2]netip.Addr{k.DAddr(), k.SAddr()}
}
