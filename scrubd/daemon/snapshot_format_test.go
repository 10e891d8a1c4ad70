package daemon

import (
	"bytes"
	"encoding/gob"
	"net/netip"
	"slices"
	"testing"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/owner"
)

// A version 1 snapshot (whole keys) is still read after the upgrade to
// version 2 (the index's records); both restore the same index.
func TestSnapshotFormatVersions(t *testing.T) {
	pod, peer := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("192.0.2.9")
	pod6 := netip.MustParseAddr("fd00::1")
	ix := index.New(index.Config{})
	ix.Track(pod)
	ix.Hold(pod6)
	var v1 []snapshotIP
	o4 := snapshotIP{IP: pod, Tracked: true}
	for i := range 100 {
		k := ctmap.NewKey4(pod, peer, 80, uint16(1000+i), ctmap.ProtoTCP, ctmap.FlagOut)
		ix.Add4(k)
		o4.Keys4 = append(o4.Keys4, k[:]...)
	}
	k6 := ctmap.NewKey6(netip.MustParseAddr("2001:db8::1"), pod6, 53, 999, ctmap.ProtoUDP, ctmap.FlagIn)
	ix.Add6(k6)
	v1 = append(v1, o4, snapshotIP{IP: pod6, Keys6: k6[:]})

	for version, ips := range map[int][]snapshotIP{1: v1, 2: encodeIndex(ix.Snapshot())} {
		// Through gob, as on disk.
		var buf bytes.Buffer
		if err := gob.NewEncoder(&buf).Encode(snapshotFile{Version: version, IPs: ips}); err != nil {
			t.Fatal(err)
		}
		var f snapshotFile
		if err := gob.NewDecoder(&buf).Decode(&f); err != nil {
			t.Fatal(err)
		}
		snap, err := decodeIndex(f.Version, f.IPs)
		if err != nil {
			t.Fatalf("version %d: %v", version, err)
		}
		back := index.New(index.Config{})
		if err := back.Restore(snap); err != nil {
			t.Fatalf("version %d: %v", version, err)
		}
		for _, ip := range []netip.Addr{pod, pod6} {
			if got, want := back.State(ip), ix.State(ip); got != want {
				t.Errorf("version %d, %s: %+v, want %+v", version, ip, got, want)
			}
		}
		if _, got6, _ := back.KeysOf(pod6); len(got6) != 1 || got6[0] != k6 {
			t.Errorf("version %d: IPv6 keys %v", version, got6)
		}
	}

	// A version 1 key that does not contain its IP is refused, not indexed.
	bad := []snapshotIP{{IP: netip.MustParseAddr("10.9.9.9"), Keys4: o4.Keys4[:ctmap.KeySize4]}}
	if _, err := decodeIndex(1, bad); err == nil {
		t.Error("version 1 key without its IP accepted")
	}
	if _, err := decodeIndex(2, []snapshotIP{{IP: pod, Recs4: make([]byte, index.RecSize4+1)}}); err == nil {
		t.Error("truncated version 2 records accepted")
	}
}

// The service states added to version 2 go both ways through gob: this
// scrubd restores them, and an earlier one (its snapshotIP had no Svc; the
// type below is that struct as it was) reads the same file, dropping them.
func TestSnapshotServiceStatesCompatible(t *testing.T) {
	pod, vip := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.96.0.10")
	ix := index.New(index.Config{})
	ix.Hold(pod)
	ix.Track(pod)
	svc := ctmap.NewKey4(vip, pod, 40001, 80, ctmap.ProtoTCP, ctmap.FlagService)
	ix.ServiceRecordAt4(pod, svc, 0, 100)
	for _, s := range ix.Services(pod) {
		ix.Add4(ctmap.NewKey4(pod, netip.MustParseAddr("10.0.1.7"), 8080, 40001, ctmap.ProtoTCP, ctmap.FlagOut))
		ix.ServiceResolved(pod, s, 7, false, false)
	}
	var buf bytes.Buffer
	if err := gob.NewEncoder(&buf).Encode(snapshotFile{Version: snapshotVersion, IPs: encodeIndex(ix.Snapshot())}); err != nil {
		t.Fatal(err)
	}
	raw := buf.Bytes()

	var f snapshotFile
	if err := gob.NewDecoder(bytes.NewReader(raw)).Decode(&f); err != nil {
		t.Fatal(err)
	}
	snap, err := decodeIndex(f.Version, f.IPs)
	if err != nil {
		t.Fatal(err)
	}
	back := index.New(index.Config{})
	if err := back.Restore(snap); err != nil {
		t.Fatal(err)
	}
	if s := back.Services(pod); len(s) != 1 || s[0].Pending || s[0].ID != 7 {
		t.Fatalf("restored %+v, want the flow settled on backend 7", s)
	}

	type earlierIP struct {
		IP                         netip.Addr
		Tracked                    bool
		Incomplete                 string
		Recs4, Recs6, Keys4, Keys6 []byte
	}
	var old struct {
		Version int
		IPs     []earlierIP
	}
	if err := gob.NewDecoder(bytes.NewReader(raw)).Decode(&old); err != nil {
		t.Fatalf("an earlier scrubd cannot read the file: %v", err)
	}
	if len(old.IPs) != 1 || len(old.IPs[0].Recs4) != 2*index.RecSize4 {
		t.Fatalf("an earlier scrubd read %+v", old.IPs)
	}
}

// The ownership rule's state added to version 2 goes both ways through
// gob: this scrubd reads its releases and creates back, an earlier one
// (snapshotFile without Rule) reads the same file's index, this one reads
// an earlier file with no release kept, and a rule state of an unknown
// format keeps none.
func TestSnapshotRuleStateCompatible(t *testing.T) {
	pod := netip.MustParseAddr("10.0.0.1")
	ix := index.New(index.Config{})
	ix.Track(pod)
	rel, cr := []netip.Addr{pod}, []netip.Addr{netip.MustParseAddr("10.0.0.2")}
	var buf bytes.Buffer
	if err := gob.NewEncoder(&buf).Encode(snapshotFile{Version: snapshotVersion, IPs: encodeIndex(ix.Snapshot()),
		Rule: encodeRule(owner.State{Released: rel, Created: cr})}); err != nil {
		t.Fatal(err)
	}
	raw := buf.Bytes()
	var f snapshotFile
	if err := gob.NewDecoder(bytes.NewReader(raw)).Decode(&f); err != nil {
		t.Fatal(err)
	}
	if st := decodeRule(f.Rule); st == nil || !slices.Equal(st.Released, rel) || !slices.Equal(st.Created, cr) {
		t.Fatalf("rule state read back: %+v", st)
	}

	var old struct { // snapshotFile as an earlier scrubd has it
		Version int
		IPs     []snapshotIP
	}
	if err := gob.NewDecoder(bytes.NewReader(raw)).Decode(&old); err != nil || len(old.IPs) != 1 {
		t.Fatalf("an earlier scrubd reads %+v, %v", old.IPs, err)
	}
	buf.Reset()
	if err := gob.NewEncoder(&buf).Encode(old); err != nil {
		t.Fatal(err)
	}
	f = snapshotFile{}
	if err := gob.NewDecoder(&buf).Decode(&f); err != nil || len(f.IPs) != 1 {
		t.Fatalf("an earlier scrubd's file: %+v, %v", f, err)
	}
	if st := decodeRule(f.Rule); st != nil {
		t.Errorf("releases kept from a file that has none: %+v", st)
	}
	if st := decodeRule(&snapshotRule{Version: ruleStateVersion + 1, Released: rel}); st != nil {
		t.Errorf("releases kept from a rule state of an unknown format: %+v", st)
	}
}
