package ctmap

import (
	"net/netip"
	"testing"
)

func TestKey4Layout(t *testing.T) {
	d, s := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.2")
	k := NewKey4(d, s, 80, 40000, ProtoTCP, FlagOut)
	want := [KeySize4]byte{10, 0, 0, 1, 10, 0, 0, 2, 0, 80, 0x9c, 0x40, 6, 0}
	if [KeySize4]byte(k) != want {
		t.Fatalf("key bytes % x, want % x", k[:], want[:])
	}
	tu := k.Tuple()
	if tu.DAddr != d || tu.SAddr != s || tu.DPort != 80 || tu.SPort != 40000 || tu.NextHdr != ProtoTCP || tu.Flags != FlagOut {
		t.Fatalf("decoded %+v", tu)
	}
	if k.Kind() != TCP4 {
		t.Fatalf("kind %v", k.Kind())
	}
	r := k.Related()
	if r.NextHdr() != ProtoICMP || r.Flags() != FlagRelated || r.DPort() != 0 || r.SPort() != 0 || r.DAddr() != d || r.SAddr() != s {
		t.Fatalf("related %v", r)
	}
	if r.Kind() != Any4 {
		t.Fatalf("related kind %v", r.Kind())
	}
	if !k.Has(d) || !k.Has(s) || k.Has(netip.MustParseAddr("10.0.0.3")) || k.Has(netip.MustParseAddr("::1")) {
		t.Fatal("Has")
	}
	if in := k.WithFlags(FlagIn); in.Flags() != FlagIn || in.DAddr() != d {
		t.Fatal("WithFlags")
	}
}

func TestKey6Layout(t *testing.T) {
	d, s := netip.MustParseAddr("fd00::1"), netip.MustParseAddr("fd00::2")
	k := NewKey6(d, s, 53, 1234, ProtoUDP, FlagIn)
	if k[15] != 1 || k[31] != 2 || k[32] != 0 || k[33] != 53 || k[34] != 0x04 || k[35] != 0xd2 || k[36] != ProtoUDP || k[37] != FlagIn {
		t.Fatalf("key bytes % x", k[:])
	}
	if k.Kind() != Any6 || k.Related().NextHdr() != ProtoICMPv6 || k.Related().Flags() != FlagIn|FlagRelated {
		t.Fatal("kind/related")
	}
	if !k.Has(d) || k.Has(netip.MustParseAddr("10.0.0.1")) {
		t.Fatal("Has")
	}
	if k.Tuple().String() == "" {
		t.Fatal("String")
	}
}

func TestEntryRoundTrip(t *testing.T) {
	f := EntryFields{Reserved0: 1, BackendID: 2, Packets: 3, Bytes: 4, Lifetime: 5, Flags: 6, RevNATIndex: 7,
		IfindexOrNATPort: 8, TxFlagsSeen: 9, RxFlagsSeen: 10, SrcSecID: 11, LastTxReport: 12, LastRxReport: 13}
	e := EncodeEntry(f)
	if got := e.Decode(); got != f {
		t.Fatalf("round trip %+v != %+v", got, f)
	}
	if e[32] != 5 || e.Lifetime() != 5 {
		t.Fatal("lifetime must be the u32 at offset 32")
	}
	e.SetLifetime(99)
	if e.Decode().Lifetime != 99 {
		t.Fatal("SetLifetime")
	}
}
