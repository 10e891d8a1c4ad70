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

// What was learnt of an IP's service flows survives a clean restart: a
// settled flow restores settled (its IP's scrub stays on the index even
// when the SERVICE entry has gone since), a pending one pending. Found on
// kind (CILIUM_LB=default): after the DaemonSet roll every restored
// SERVICE key was pending, and each whose entry had closed swept its IP.
func TestSnapshotKeepsServiceStates(t *testing.T) {
	ix := New(Config{})
	a := netip.MustParseAddr("10.0.0.1")
	vip := netip.MustParseAddr("10.96.0.10")
	backend := netip.MustParseAddr("10.0.1.7")
	ix.Hold(a)
	ix.Track(a)
	settled := ctmap.NewKey4(vip, a, 40001, 80, ctmap.ProtoTCP, ctmap.FlagService)
	pending := ctmap.NewKey4(vip, a, 40002, 80, ctmap.ProtoTCP, ctmap.FlagService)
	ix.ServiceRecordAt4(a, settled, 0, 100)
	ix.ServiceRecordAt4(a, pending, 0, 200)
	for _, s := range ix.Services(a) {
		if s.K4 == settled {
			ix.Add4(ctmap.NewKey4(a, backend, 8080, 40001, ctmap.ProtoTCP, ctmap.FlagOut))
			ix.ServiceResolved(a, s, 7, false, false)
		}
	}
	want := map[ctmap.CTKey4]SvcState{}
	for _, s := range ix.Services(a) {
		want[s.K4] = s.SvcState
	}
	if want[settled].Pending || want[settled].ID != 7 || !want[pending].Pending {
		t.Fatalf("set-up: %+v", want)
	}

	back := New(Config{})
	if err := back.Restore(ix.Snapshot()); err != nil {
		t.Fatal(err)
	}
	got := back.Services(a)
	if len(got) != 2 {
		t.Fatalf("restored %d service states, want 2", len(got))
	}
	for _, s := range got {
		w := want[s.K4]
		if s.ID != w.ID || s.Pending != w.Pending || s.NoEntry != w.NoEntry || s.Since != w.Since || s.Repick != w.Repick {
			t.Errorf("%v: restored %+v, want %+v", s.K4, s.SvcState, w)
		}
	}

	// A state under a key of another IP is refused as a whole.
	snap := ix.Snapshot()
	for i := range snap.IPs {
		for j := range snap.IPs[i].Svc {
			k := ctmap.NewKey4(vip, netip.MustParseAddr("10.0.0.2"), 40001, 80, ctmap.ProtoTCP, ctmap.FlagService)
			snap.IPs[i].Svc[j].Key = k[:]
		}
	}
	if err := New(Config{}).Restore(snap); err == nil {
		t.Error("a service state under another IP's key was restored")
	}
}
