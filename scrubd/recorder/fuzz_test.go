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
	f.Add(r4.Encode())
	f.Add(r6.Encode())
	f.Add(rf.Encode())
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
		want := make([]byte, RecordSize) // an older program's 48 bytes: backend 0
		copy(want, b[:min(len(b), RecordSize)])
		want[2], want[3] = 0, 0
		clear(want[52:])
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
		if r.Kind == RecForeign && a[0] != a[1] {
			if k4, k6, _ := ix.KeysOf(a[0]); len(k4)+len(k6) != 0 {
				t.Fatalf("foreign-source record filed %v %v under the claimed source %s", k4, k6, a[0])
			}
		}
	})
}
