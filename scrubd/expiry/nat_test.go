package expiry

import (
	"context"
	"encoding/binary"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// The pass deletes the SNAT mappings of the expired OUT entries it deletes
// (forward and reverse; a DSR-internal entry's swapped key) and no other:
// left, they would wait for Cilium's orphan purge. The comparison with
// Cilium's own GC is e2e/ciliumgc.
func TestSweepDeletesSNATMappings(t *testing.T) {
	needRoot(t)
	kt, _ := nows(t)
	ct := newMap(t, ctmap.TCP4, 1024)
	nat, err := ebpf.NewMap(ctmap.NATSpec(false, 1024))
	if err != nil {
		t.Fatal(err)
	}
	defer nat.Close()
	pod, peer, node := netip.MustParseAddr("10.244.0.5"), netip.MustParseAddr("192.0.2.1"), netip.MustParseAddr("172.18.0.2")
	entry := func(lifetime uint32, flags uint16) []byte {
		v := make([]byte, ctmap.EntrySize)
		binary.LittleEndian.PutUint32(v[32:], lifetime)
		binary.LittleEndian.PutUint16(v[36:], flags)
		return v
	}
	mapping := func(to netip.Addr, port uint16) []byte {
		v := make([]byte, ctmap.NATEntrySize4)
		a := to.As4()
		copy(v[32:], a[:])
		binary.BigEndian.PutUint16(v[36:], port)
		return v
	}
	expired, live := kt-100, kt+3600
	put := func(m *ebpf.Map, k ctmap.CTKey4, v []byte) {
		if err := m.Put(k, v); err != nil {
			t.Fatal(err)
		}
	}
	// Expired OUT: forward and reverse go.
	put(ct, ctmap.NewKey4(pod, peer, 80, 40000, ctmap.ProtoTCP, ctmap.FlagOut), entry(expired, 0))
	gone := []ctmap.CTKey4{ctmap.NewKey4(peer, pod, 80, 40000, ctmap.ProtoTCP, ctmap.FlagOut), ctmap.NewKey4(node, peer, 50000, 80, ctmap.ProtoTCP, ctmap.FlagIn)}
	put(nat, gone[0], mapping(node, 50000))
	put(nat, gone[1], mapping(pod, 40000))
	// Expired DSR-internal OUT: the swapped key goes, a forward-looking key stays.
	put(ct, ctmap.NewKey4(pod, peer, 81, 40001, ctmap.ProtoTCP, ctmap.FlagOut), entry(expired, 1<<7))
	gone = append(gone, ctmap.NewKey4(pod, peer, 40001, 81, ctmap.ProtoTCP, ctmap.FlagOut))
	put(nat, gone[2], mapping(peer, 81))
	kept := []ctmap.CTKey4{ctmap.NewKey4(peer, pod, 81, 40001, ctmap.ProtoTCP, ctmap.FlagOut)}
	put(nat, kept[0], mapping(node, 1))
	// Live OUT: its mapping stays.
	put(ct, ctmap.NewKey4(pod, peer, 82, 40002, ctmap.ProtoTCP, ctmap.FlagOut), entry(live, 0))
	kept = append(kept, ctmap.NewKey4(peer, pod, 82, 40002, ctmap.ProtoTCP, ctmap.FlagOut))
	put(nat, kept[1], mapping(node, 2))
	// Expired IN: no mapping of its own.
	put(ct, ctmap.NewKey4(peer, pod, 8080, 40003, ctmap.ProtoTCP, ctmap.FlagIn), entry(expired, 0))
	kept = append(kept, ctmap.NewKey4(pod, peer, 8080, 40003, ctmap.ProtoTCP, ctmap.FlagIn))
	put(nat, kept[2], mapping(node, 3))

	cm, err := ctmap.FromMaps([ctmap.NumKinds]*ebpf.Map{ctmap.TCP4: ct})
	if err != nil {
		t.Fatal(err)
	}
	if err := cm.SetNAT(nat, nil); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	r, err := New(cm, Config{Mode: ModeSweep, Clock: ClockKtime}, Options{Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	rep, err := r.Pass(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if tot := rep.Total(); tot.Deleted != 3 || tot.NATDeleted != 3 {
		t.Errorf("deleted %d CT entries and %d SNAT mappings, want 3 and 3", tot.Deleted, tot.NATDeleted)
	}
	var v [ctmap.NATEntrySize4]byte
	for _, k := range gone {
		if nat.Lookup(k, &v) == nil {
			t.Errorf("SNAT mapping %s of an expired entry left", k)
		}
	}
	for _, k := range kept {
		if nat.Lookup(k, &v) != nil {
			t.Errorf("SNAT key %s deleted", k)
		}
	}
	var m dto.Metric
	if err := r.m.natDel.WithLabelValues(ctmap.TCP4.Name()).Write(&m); err != nil || m.GetCounter().GetValue() != 3 {
		t.Errorf("ctscrub_expiry_nat_deleted_total = %v (%v), want 3", m.GetCounter().GetValue(), err)
	}
}
