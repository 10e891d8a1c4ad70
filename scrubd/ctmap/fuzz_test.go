package ctmap

import (
	"bytes"
	"net/netip"
	"testing"
)

// FuzzKeyCodec decodes arbitrary bytes as both key layouts and checks that
// every accessor agrees with the bytes: rebuilding a key from its decoded
// fields gives the same bytes, Related is idempotent and lands in the "any"
// map, Has matches exactly the key's two addresses.
func FuzzKeyCodec(f *testing.F) {
	f.Add(bytes.Repeat([]byte{0}, KeySize6))
	k4 := NewKey4(netip.MustParseAddr("10.244.1.5"), netip.MustParseAddr("10.96.0.10"), 53, 40000, ProtoUDP, FlagOut)
	f.Add(k4[:])
	k6 := NewKey6(netip.MustParseAddr("fd00::5"), netip.MustParseAddr("fd00::9"), 443, 50000, ProtoTCP, FlagIn|FlagRelated)
	f.Add(k6[:])
	f.Add([]byte{1, 2, 3})
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) >= KeySize4 {
			k := CTKey4(b[:KeySize4])
			if got := NewKey4(k.DAddr(), k.SAddr(), k.DPort(), k.SPort(), k.NextHdr(), k.Flags()); got != k {
				t.Fatalf("v4 key %x rebuilt from its fields as %x", k[:], got[:])
			}
			r := k.Related()
			if r.Related() != r || r.Kind() != Any4 || r.Flags()&FlagRelated == 0 || r.DAddr() != k.DAddr() || r.SAddr() != k.SAddr() {
				t.Fatalf("related of %x: %x", k[:], r[:])
			}
			if !k.Has(k.DAddr()) || !k.Has(k.SAddr()) || k.Has(netip.IPv6Loopback()) {
				t.Fatalf("Has of %x", k[:])
			}
			if (k.NextHdr() == ProtoTCP) != (k.Kind() == TCP4) {
				t.Fatalf("kind of %x: %v", k[:], k.Kind())
			}
			_ = k.String()
		}
		if len(b) >= KeySize6 {
			k := CTKey6(b[:KeySize6])
			if got := NewKey6(k.DAddr(), k.SAddr(), k.DPort(), k.SPort(), k.NextHdr(), k.Flags()); got != k {
				t.Fatalf("v6 key %x rebuilt from its fields as %x", k[:], got[:])
			}
			r := k.Related()
			if r.Related() != r || r.Kind() != Any6 || r.Flags()&FlagRelated == 0 {
				t.Fatalf("related of %x: %x", k[:], r[:])
			}
			// An IPv4-mapped address in a v6 key is never a v4 pod's.
			for _, a := range []netip.Addr{k.DAddr(), k.SAddr()} {
				if k.Has(a) == a.Is4In6() {
					t.Fatalf("Has(%s) of %x = %v", a, k[:], k.Has(a))
				}
			}
			_ = k.String()
		}
	})
}

// FuzzEntryCodec: Decode then EncodeEntry gives back the very bytes, and the
// lifetime accessors agree with the decoded field.
func FuzzEntryCodec(f *testing.F) {
	f.Add(bytes.Repeat([]byte{0xff}, EntrySize))
	f.Add(make([]byte, EntrySize))
	f.Add([]byte("short"))
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) < EntrySize {
			return
		}
		e := Entry(b[:EntrySize])
		d := e.Decode()
		if got := EncodeEntry(d); got != e {
			t.Fatalf("entry %x re-encoded as %x", e[:], got[:])
		}
		if e.Lifetime() != d.Lifetime {
			t.Fatalf("Lifetime %d, decoded %d", e.Lifetime(), d.Lifetime)
		}
		e.SetLifetime(d.Lifetime + 1)
		if e.Lifetime() != d.Lifetime+1 || e.Decode().Packets != d.Packets {
			t.Fatal("SetLifetime changed another field or did not set it")
		}
	})
}
