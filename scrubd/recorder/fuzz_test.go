package recorder

import (
	"bytes"
	"net/netip"
	"testing"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// FuzzParseRecord feeds arbitrary ring-buffer samples to ParseRecord and what
// it accepts to Apply, the reader's path into the index: no sample may panic;
// a short sample or an unknown family is refused; an accepted record
// re-encodes to the sample's bytes (the two padding bytes aside); Apply
// indexes only keys of the record's own addresses, within the pod CIDR, and
// for a foreign-source record none under the claimed source.
func FuzzParseRecord(f *testing.F) {
	k4 := ctmap.NewKey4(netip.MustParseAddr("10.244.1.5"), netip.MustParseAddr("10.244.1.9"), 80, 40000, ctmap.ProtoTCP, ctmap.FlagOut)
	r4 := Record{Family: 4, Kind: RecFlow, Ifindex: 7}
	copy(r4.Key[:], k4[:])
	k6 := ctmap.NewKey6(netip.MustParseAddr("fd00::5"), netip.MustParseAddr("fd00::9"), 53, 50000, ctmap.ProtoUDP, ctmap.FlagIn)
	r6 := Record{Family: 6, Kind: RecService, Ifindex: 9}
	copy(r6.Key[:], k6[:])
	rf := Record{Family: 4, Kind: RecForeign, Ifindex: 7}
	copy(rf.Key[:], k4[:])
	ks4 := ctmap.NewKey4(netip.MustParseAddr("10.96.0.10"), netip.MustParseAddr("10.244.1.9"), 40000, 53, ctmap.ProtoUDP, ctmap.FlagService)
	rs4 := Record{Family: 4, Kind: RecServiceEntry, Ifindex: 7, Backend: 12}
	copy(rs4.Key[:], ks4[:])
	ks6 := ctmap.NewKey6(netip.MustParseAddr("fd00:96::a"), netip.MustParseAddr("fd00::9"), 40000, 80, ctmap.ProtoTCP, ctmap.FlagService)
	rs6 := Record{Family: 6, Kind: RecServiceEntry, Ifindex: 9}
	copy(rs6.Key[:], ks6[:])
	f.Add(r4.Encode())
	f.Add(r6.Encode())
	f.Add(rf.Encode())
	f.Add(rs4.Encode())
	f.Add(rs6.Encode())
	f.Add(rs4.Encode()[:RecordSizeV1]) // an older program's length
	f.Add(make([]byte, RecordSize-1))
	f.Add(bytes.Repeat([]byte{0xff}, RecordSize+8))
	pods := []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16"), netip.MustParsePrefix("fd00::/64")}
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := ParseRecord(b)
		if err != nil {
			if len(b) >= RecordSizeV1 && (b[0] == 4 || b[0] == 6) {
				t.Fatalf("refused a well-sized record of family %d: %v", b[0], err)
			}
			return
		}
		if len(b) < RecordSizeV1 || (r.Family != 4 && r.Family != 6) {
			t.Fatalf("accepted %d bytes, family %d", len(b), r.Family)
		}
		enc := r.Encode()
		// Shorter than RecordSize: read as an older program's 48 bytes,
		// backend 0 (a pick pending, never a backend made of a partial
		// field; found by the fuzzer with 49 bytes).
		// A full record round-trips whole: bytes 2-3 and 52-55 carry At
		// (the packet's time, issue 23's no-entry rule).
		want := make([]byte, RecordSize)
		if len(b) >= RecordSize {
			copy(want, b[:RecordSize])
		} else {
			copy(want, b[:RecordSizeV1])
			want[2], want[3] = 0, 0
		}
		if !bytes.Equal(enc, want) {
			t.Fatalf("record %x re-encoded as %x", want, enc)
		}
		ix := index.New(index.Config{PodCIDRs: pods})
		Apply(ix, &r)
		a := r.addrs()
		for _, ip := range ix.IPs() {
			if ip != a[0] && ip != a[1] {
				t.Fatalf("record of %s/%s indexed %s", a[0], a[1], ip)
			}
			if !pods[0].Contains(ip) && !pods[1].Contains(ip) {
				t.Fatalf("indexed %s outside the pod CIDRs", ip)
			}
		}
		if r.Kind == RecServiceEntry {
			// With the pod's slot held: the SERVICE key and its flow's
			// state go under the sender (saddr) only, the read backend
			// noted (0: a pick pending).
			held := index.New(index.Config{PodCIDRs: pods})
			for _, ip := range a {
				if held.Owns(ip) {
					held.Hold(ip)
				}
			}
			Apply(held, &r)
			if held.Owns(a[1]) {
				svcs := held.Services(a[1])
				if len(svcs) != 1 {
					t.Fatalf("service record of %s: %d flows noted", a[1], len(svcs))
				}
				if s := svcs[0]; (r.Backend == 0) != s.Pending || (r.Backend != 0 && (len(s.Read) != 1 || s.Read[0] != r.Backend)) {
					t.Fatalf("service record, backend %d: state %+v", r.Backend, s.SvcState)
				}
			}
			if a[0] != a[1] && held.Services(a[0]) != nil {
				t.Fatalf("service record filed a flow under the VIP %s", a[0])
			}
		}
		if r.Kind == RecForeign && a[0] != a[1] {
			if k4, k6, _ := ix.KeysOf(a[0]); len(k4)+len(k6) != 0 {
				t.Fatalf("foreign-source record filed %v %v under the claimed source %s", k4, k6, a[0])
			}
		}
	})
}
