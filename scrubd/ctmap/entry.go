package ctmap

import "encoding/binary"

// EntrySize is sizeof(struct ct_entry), identical in v1.16 and 1.19+.
const EntrySize = 56

// Entry is struct ct_entry as stored in the map (host byte order, 8-byte
// aligned, 56 bytes). Fields that 1.19+ reinterprets are named for both
// versions; the codec does not need to know which version wrote the value.
type Entry [EntrySize]byte

// Offsets inside struct ct_entry.
const (
	offReserved0   = 0  // v1.16 reserved0; 1.19+ union with the egress NAT address
	offBackendID   = 8  // v1.16 backend_id; 1.19+ union
	offPackets     = 16 //
	offBytes       = 24 //
	offLifetime    = 32 // u32, Cilium's monotonic clock (seconds of ktime or jiffies>>8)
	offFlags       = 36 // u16 flag bits
	offRevNAT      = 38 // u16 rev_nat_index
	offIfindexNAT  = 40 // u16 v1.16 ifindex; 1.19+ nat_port
	offTxFlagsSeen = 42
	offRxFlagsSeen = 43
	offSrcSecID    = 44 // u32
	offLastTx      = 48 // u32
	offLastRx      = 52 // u32
)

// EntryFields is the decoded form of an Entry.
type EntryFields struct {
	Reserved0, BackendID uint64 // 1.19+: bytes 0-15 are a union (NAT address or these)
	Packets, Bytes       uint64
	Lifetime             uint32
	Flags                uint16
	RevNATIndex          uint16
	IfindexOrNATPort     uint16 // v1.16 ifindex, 1.19+ nat_port
	TxFlagsSeen          uint8
	RxFlagsSeen          uint8
	SrcSecID             uint32
	LastTxReport         uint32
	LastRxReport         uint32
}

var le = binary.LittleEndian

// Lifetime is the entry's expiry in Cilium's BPF clock.
func (e *Entry) Lifetime() uint32 { return le.Uint32(e[offLifetime:]) }

// SetLifetime sets the entry's expiry in Cilium's BPF clock.
func (e *Entry) SetLifetime(v uint32) { le.PutUint32(e[offLifetime:], v) }

// Decode returns the entry's fields.
func (e *Entry) Decode() EntryFields {
	return EntryFields{
		Reserved0:        le.Uint64(e[offReserved0:]),
		BackendID:        le.Uint64(e[offBackendID:]),
		Packets:          le.Uint64(e[offPackets:]),
		Bytes:            le.Uint64(e[offBytes:]),
		Lifetime:         le.Uint32(e[offLifetime:]),
		Flags:            le.Uint16(e[offFlags:]),
		RevNATIndex:      le.Uint16(e[offRevNAT:]),
		IfindexOrNATPort: le.Uint16(e[offIfindexNAT:]),
		TxFlagsSeen:      e[offTxFlagsSeen],
		RxFlagsSeen:      e[offRxFlagsSeen],
		SrcSecID:         le.Uint32(e[offSrcSecID:]),
		LastTxReport:     le.Uint32(e[offLastTx:]),
		LastRxReport:     le.Uint32(e[offLastRx:]),
	}
}

// EncodeEntry builds an Entry from its fields.
func EncodeEntry(f EntryFields) Entry {
	var e Entry
	le.PutUint64(e[offReserved0:], f.Reserved0)
	le.PutUint64(e[offBackendID:], f.BackendID)
	le.PutUint64(e[offPackets:], f.Packets)
	le.PutUint64(e[offBytes:], f.Bytes)
	le.PutUint32(e[offLifetime:], f.Lifetime)
	le.PutUint16(e[offFlags:], f.Flags)
	le.PutUint16(e[offRevNAT:], f.RevNATIndex)
	le.PutUint16(e[offIfindexNAT:], f.IfindexOrNATPort)
	e[offTxFlagsSeen] = f.TxFlagsSeen
	e[offRxFlagsSeen] = f.RxFlagsSeen
	le.PutUint32(e[offSrcSecID:], f.SrcSecID)
	le.PutUint32(e[offLastTx:], f.LastTxReport)
	le.PutUint32(e[offLastRx:], f.LastRxReport)
	return e
}
