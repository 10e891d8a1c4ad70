package index

import (
	"net/netip"
	"testing"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// The service state's life outside Resolve (scrubd/recorder's
// resolve_test.go covers Resolve on real maps): what a scrub, a cancelled
// scrub, a snapshot and a restore do with it.

var (
	svcClient = netip.MustParseAddr("10.244.0.1")
	svcVIP    = netip.MustParseAddr("10.96.0.10")
	svcKey    = ctmap.NewKey4(svcVIP, svcClient, 40001, 53, ctmap.ProtoUDP, ctmap.FlagService)
	svcOut    = ctmap.NewKey4(svcClient, netip.MustParseAddr("10.245.0.5"), 53, 40001, ctmap.ProtoUDP, ctmap.FlagOut)
)

// resolved: a client whose flow's backend 7 was learnt (OUT key indexed).
func resolvedClient(t *testing.T) *Index {
	t.Helper()
	ix := New(Config{})
	ix.Hold(svcClient)
	ix.Track(svcClient)
	ix.ServiceRecord4(svcClient, svcKey, 0)
	s := ix.Services(svcClient)
	if len(s) != 1 || !s[0].Pending {
		t.Fatalf("after a record of a new flow: %+v, want one pending flow", s)
	}
	ix.Add4(svcOut)
	ix.ServiceResolved(svcClient, s[0], 7, false, false)
	return ix
}

// A scrub (Take) of a client whose every pick is resolved: complete, the
// SERVICE and OUT keys handed over, the state gone with them.
func TestTakeServiceResolved(t *testing.T) {
	ix := resolvedClient(t)
	k4, _, st := ix.Take(svcClient)
	if !st.Complete || len(k4) != 2 {
		t.Fatalf("Take: %+v, keys %v; want complete with SERVICE and OUT", st, k4)
	}
	if s := ix.Services(svcClient); s != nil {
		t.Fatalf("state kept after Take: %+v", s)
	}
}

// A pick not resolved when the scrub takes the keys (a read not resolved,
// or a pick pending): the state goes with the keys, so the scrub must not
// be called complete. Without the check in Take the client is complete
// with the read backend's OUT entry unknown.
func TestTakeServiceUnsettled(t *testing.T) {
	for name, f := range map[string]func(ix *Index){
		"read":    func(ix *Index) { ix.ServiceRecord4(svcClient, svcKey, 8) },
		"pending": func(ix *Index) { ix.ServiceRecord4(svcClient, svcKey, 0) },
	} {
		t.Run(name, func(t *testing.T) {
			ix := resolvedClient(t)
			f(ix)
			if _, _, st := ix.Take(svcClient); st.Incomplete != ReasonServiceUnresolved {
				t.Fatalf("Take: %+v, want incomplete (%s)", st, ReasonServiceUnresolved)
			}
		})
	}
}

// A cancelled scrub gives the keys back: a SERVICE key is pending again
// (what was learnt went with Take), so the next scrub resolves it anew.
func TestReturnServiceKeyPending(t *testing.T) {
	ix := resolvedClient(t)
	k4, k6, _ := ix.Take(svcClient)
	ix.Return(svcClient, k4, k6)
	s := ix.Services(svcClient)
	if len(s) != 1 || !s[0].Pending || s[0].K4 != svcKey {
		t.Fatalf("after Return: %+v, want the SERVICE key pending", s)
	}
}

// A snapshot keeps the keys and what was learnt of the service flows; a
// snapshot without the states (an earlier scrubd's) restores a SERVICE
// key pending; a client with a read not yet resolved is written
// incomplete (restored, that read's OUT entry would be missed).
func TestSnapshotServiceState(t *testing.T) {
	ix := resolvedClient(t)
	snap := ix.Snapshot()
	back := New(Config{})
	if err := back.Restore(snap); err != nil {
		t.Fatal(err)
	}
	if st := back.State(svcClient); !st.Complete || st.Keys != 2 {
		t.Fatalf("restored: %+v, want complete with 2 keys", st)
	}
	live := ix.Services(svcClient)
	if s := back.Services(svcClient); len(s) != 1 || s[0].Pending || s[0].ID != live[0].ID {
		t.Fatalf("restored state %+v, want it settled as before the snapshot (%+v)", s, live)
	}
	for i := range snap.IPs {
		snap.IPs[i].Svc = nil
	}
	back = New(Config{})
	if err := back.Restore(snap); err != nil {
		t.Fatal(err)
	}
	if s := back.Services(svcClient); len(s) != 1 || !s[0].Pending {
		t.Fatalf("restored without states: %+v, want the SERVICE key pending", s)
	}

	ix.ServiceRecord4(svcClient, svcKey, 8) // a re-pick read, not resolved
	snap = ix.Snapshot()
	back = New(Config{})
	if err := back.Restore(snap); err != nil {
		t.Fatal(err)
	}
	if st := back.State(svcClient); st.Incomplete != ReasonServiceUnresolved {
		t.Fatalf("restored: %+v, want incomplete (%s)", st, ReasonServiceUnresolved)
	}
	if st := ix.State(svcClient); !st.Complete {
		t.Fatalf("the snapshot marked the live index: %+v", st)
	}
}

// A snapshot the previous version wrote: its service clients were marked
// incomplete (ReasonService, no SERVICE key indexed); restored, they stay
// so until a sweep.
func TestRestorePreviousVersionServiceClient(t *testing.T) {
	ix := New(Config{})
	err := ix.Restore(Snapshot{IPs: []SnapshotIP{{IP: svcClient, Tracked: true, Incomplete: ReasonService}}})
	if err != nil {
		t.Fatal(err)
	}
	if st := ix.State(svcClient); st.Incomplete != ReasonService {
		t.Fatalf("restored: %+v, want incomplete (%s)", st, ReasonService)
	}
}

// A prune that removes a SERVICE key (its entry gone) forgets the flow's
// state when every pick was learnt, so the states of a pod's many short
// DNS flows do not pile up; an unsettled one stays for the next final
// resolution to mark.
func TestPruneServiceState(t *testing.T) {
	gone := func(ctmap.CTKey4) bool { return true }
	ix := resolvedClient(t)
	ix.Prune(svcClient, gone, nil)
	if s := ix.Services(svcClient); s != nil {
		t.Fatalf("settled state kept after its SERVICE key was pruned: %+v", s)
	}

	ix = resolvedClient(t)
	ix.ServiceRecord4(svcClient, svcKey, 8) // read, not resolved
	ix.Prune(svcClient, gone, nil)
	if s := ix.Services(svcClient); len(s) != 1 || len(s[0].Read) != 1 {
		t.Fatalf("unsettled state after the prune: %+v, want it kept", s)
	}
}
