package index

import (
	"math/rand/v2"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// TestKeySetMatchesMap drives one IP's set through random adds, re-adds,
// removals (Take/Return, Prune) and checks it against a Go map after every
// step, through growth, shrinking and wrap-around of the probe runs.
func TestKeySetMatchesMap(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	ix := New(Config{PodCIDRs: cidrs})
	ix.Hold(podA)
	want := map[ctmap.CTKey4]bool{}
	randKey := func() ctmap.CTKey4 {
		// Few distinct values so that adds hit present keys and removals
		// hit absent ones; both sides of the pod IP.
		peer := netip.AddrFrom4([4]byte{192, 0, 2, byte(rng.IntN(4))})
		if rng.IntN(2) == 0 {
			return ctmap.NewKey4(podA, peer, uint16(rng.IntN(64)), 443, ctmap.ProtoTCP, ctmap.FlagOut)
		}
		return ctmap.NewKey4(peer, podA, 80, uint16(rng.IntN(64)), ctmap.ProtoUDP, ctmap.FlagIn)
	}
	check := func(step int) {
		t.Helper()
		k4, _, st := ix.KeysOf(podA)
		if len(k4) != len(want) || st.Keys != len(want) || ix.Keys() != int64(len(want)) {
			t.Fatalf("step %d: %d keys listed, state %d, Keys() %d, want %d", step, len(k4), st.Keys, ix.Keys(), len(want))
		}
		for _, k := range k4 {
			if !want[k] {
				t.Fatalf("step %d: listed %v, not added", step, k)
			}
		}
	}
	for step := range 20000 {
		switch op := rng.IntN(100); {
		case op < 70:
			k := randKey()
			ix.Add4(k)
			want[k] = true
		case op < 98:
			// Remove a random half through Prune.
			drop := map[ctmap.CTKey4]bool{}
			for k := range want {
				if rng.IntN(2) == 0 {
					drop[k] = true
				}
			}
			n := ix.Prune(podA, func(k ctmap.CTKey4) bool { return drop[k] }, nil)
			if n != len(drop) {
				t.Fatalf("step %d: pruned %d, want %d", step, n, len(drop))
			}
			for k := range drop {
				delete(want, k)
			}
		default:
			k4, _, _ := ix.Take(podA)
			if len(k4) != len(want) {
				t.Fatalf("step %d: took %d, want %d", step, len(k4), len(want))
			}
			ix.Return(podA, k4[:len(k4)/2], nil)
			clear(want)
			for _, k := range k4[:len(k4)/2] {
				want[k] = true
			}
		}
		check(step)
	}
}

// TestKeySetBothSides: a key is indexed under each pod address it holds,
// and a key naming the IP on both sides is stored once and comes back whole.
func TestKeySetBothSides(t *testing.T) {
	ix := New(Config{PodCIDRs: cidrs})
	ix.Hold(podA)
	ix.Hold(podB)
	ix.Hold(netip.MustParseAddr("fd00:244::1"))
	self := ctmap.NewKey4(podA, podA, 80, 40000, ctmap.ProtoTCP, ctmap.FlagOut)
	pair := ctmap.NewKey4(podB, podA, 80, 40000, ctmap.ProtoTCP, ctmap.FlagOut)
	v6 := ctmap.NewKey6(netip.MustParseAddr("fd00:244::1"), netip.MustParseAddr("2001:db8::1"), 53, 999, ctmap.ProtoUDP, ctmap.FlagOut)
	ix.Add4(self)
	ix.Add4(self)
	ix.Add4(pair)
	ix.Add6(v6)
	if k4, _, _ := ix.KeysOf(podA); len(k4) != 2 || !(k4[0] == self && k4[1] == pair || k4[0] == pair && k4[1] == self) {
		t.Fatalf("podA keys %v", k4)
	}
	if k4, _, _ := ix.KeysOf(podB); len(k4) != 1 || k4[0] != pair {
		t.Fatalf("podB keys %v", k4)
	}
	if _, k6, _ := ix.KeysOf(v6.DAddr()); len(k6) != 1 || k6[0] != v6 {
		t.Fatalf("v6 keys %v", k6)
	}
	// Keys of the other family or without the IP are not returned into a set.
	ix.Return(podA, []ctmap.CTKey4{ctmap.NewKey4(remote, remote, 1, 2, ctmap.ProtoTCP, 0)}, []ctmap.CTKey6{v6})
	if st := ix.State(podA); st.Keys != 2 || ix.Keys() != 4 {
		t.Fatalf("Return of foreign keys changed the set: %+v, %d", st, ix.Keys())
	}
}

// TestPruneKeepsKeysAddedMeanwhile: gone runs without the IP's lock; a key
// judged gone but recorded again (Add) before Prune removes it stays, and
// Add for the IP completes while gone is blocked.
func TestPruneKeepsKeysAddedMeanwhile(t *testing.T) {
	ix := New(Config{PodCIDRs: cidrs})
	ix.Hold(podA)
	k1 := ctmap.NewKey4(podA, remote, 443, 40000, ctmap.ProtoTCP, ctmap.FlagOut)
	k2 := ctmap.NewKey4(podA, remote, 443, 40001, ctmap.ProtoTCP, ctmap.FlagOut)
	k3 := ctmap.NewKey4(podA, remote, 443, 40002, ctmap.ProtoTCP, ctmap.FlagOut)
	ix.Add4(k1)
	ix.Add4(k2)
	inGone, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	done := make(chan int)
	go func() {
		done <- ix.Prune(podA, func(ctmap.CTKey4) bool {
			once.Do(func() { close(inGone); <-release })
			return true
		}, nil)
	}()
	<-inGone
	added := make(chan struct{})
	go func() {
		ix.Add4(k1) // re-recorded during the prune: must stay
		ix.Add4(k3) // new during the prune: never judged, must stay
		close(added)
	}()
	select {
	case <-added:
	case <-time.After(10 * time.Second):
		t.Fatal("Add waited for the prune's gone callback (the IP's lock is held across it)")
	}
	close(release)
	if n := <-done; n != 1 {
		t.Fatalf("dropped %d, want 1 (k2 only)", n)
	}
	k4, _, _ := ix.KeysOf(podA)
	if len(k4) != 2 || ix.Keys() != 2 {
		t.Fatalf("after prune: %v (Keys %d), want k1 and k3", k4, ix.Keys())
	}
	for _, k := range k4 {
		if k != k1 && k != k3 {
			t.Fatalf("after prune: unexpected %v", k)
		}
	}
}

func TestRestoreRefusesMalformed(t *testing.T) {
	good, err := AppendRecord4(nil, podA, ctmap.NewKey4(podA, remote, 1, 2, ctmap.ProtoTCP, 0))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := AppendRecord4(nil, podB, ctmap.NewKey4(podA, remote, 1, 2, ctmap.ProtoTCP, 0)); err == nil {
		t.Fatal("record of a key without the IP accepted")
	}
	bad := append([]byte(nil), good...)
	bad[RecSize4-1] = 7
	for name, s := range map[string]Snapshot{
		"truncated":    {IPs: []SnapshotIP{{IP: podB}, {IP: podA, Recs4: good[:5]}}},
		"side byte":    {IPs: []SnapshotIP{{IP: podB, Recs4: good}, {IP: podA, Recs4: bad}}},
		"family":       {IPs: []SnapshotIP{{IP: podA, Recs6: make([]byte, RecSize6)}}},
		"invalid addr": {IPs: []SnapshotIP{{Recs4: good}}},
	} {
		ix := New(Config{})
		if err := ix.Restore(s); err == nil {
			t.Errorf("%s: accepted", name)
		}
		if ix.Keys() != 0 || len(ix.IPs()) != 0 || ix.IncompleteIPs() != 0 {
			t.Errorf("%s: refused snapshot left %d keys, %d IPs", name, ix.Keys(), len(ix.IPs()))
		}
	}
}
