package index

import (
	"net/netip"
	"testing"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

func TestSnapshotRoundTrip(t *testing.T) {
	ix := New(Config{})
	a, b, c := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("fd00::2"), netip.MustParseAddr("10.0.0.3")
	remote := netip.MustParseAddr("192.0.2.9")
	ix.Track(a)
	ix.Hold(b)
	ix.Hold(c)
	for i := range 10 {
		ix.Add4(ctmap.NewKey4(a, remote, 80, uint16(1000+i), ctmap.ProtoTCP, ctmap.FlagOut))
	}
	ix.Add6(ctmap.NewKey6(b, netip.MustParseAddr("2001:db8::9"), 53, 999, ctmap.ProtoUDP, ctmap.FlagOut))
	ix.MarkIncomplete(c, ReasonLost)

	back := New(Config{})
	if err := back.Restore(ix.Snapshot()); err != nil {
		t.Fatal(err)
	}
	for _, ip := range []netip.Addr{a, b, c, remote} {
		if got, want := back.State(ip), ix.State(ip); got != want {
			t.Errorf("%s: restored %+v, want %+v", ip, got, want)
		}
	}
	if back.Keys() != ix.Keys() || back.IncompleteIPs() != ix.IncompleteIPs() {
		t.Errorf("counters: keys %d/%d, incomplete %d/%d", back.Keys(), ix.Keys(), back.IncompleteIPs(), ix.IncompleteIPs())
	}
	k4, _, st := back.Take(a)
	if len(k4) != 10 || !st.Complete {
		t.Errorf("take after restore: %d keys, %+v", len(k4), st)
	}
	if err := back.Restore(ix.Snapshot()); err == nil {
		t.Error("restore into a non-empty index accepted")
	}
}
