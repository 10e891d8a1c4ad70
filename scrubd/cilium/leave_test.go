package cilium

import (
	"context"
	"errors"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// Callers that leave a running pass (issue #34, item 5). The agent's create
// times out on a first sweep of a big table and Cilium walks and loads the
// pod's program; another caller keeps the pass alive. The pass must not go
// on deleting the left IP's entries, which from then on are the new pod's.
// The runner is held at its hooks, so the caller leaves at a known point of
// the pass (before its first or its second map) whatever the machine's load.

var (
	leaverX = netip.MustParseAddr("10.244.0.20")
	leaverY = netip.MustParseAddr("10.244.0.21")
	leaverZ = netip.MustParseAddr("10.244.0.22") // the blocker's
	snatTo  = netip.MustParseAddr("172.18.0.2")  // the node's address
)

// leaveWorld is a world with Cilium's IPv4 SNAT map: every OUT entry of a
// pod has its forward and reverse mapping, as BPF masquerading makes them.
type leaveWorld struct {
	*world
	nat  *ebpf.Map
	port uint16 // the next translated source port
}

func newLeaveWorld(t *testing.T) (*leaveWorld, *Backend) {
	t.Helper()
	needRoot(t)
	maps, nat := natMaps(t)
	ix := newIndex()
	lw := &leaveWorld{world: newWorld(t, maps, ix), nat: nat, port: 30000}
	return lw, newCilium(t, maps, ix)
}

// addPod adds n flows of each kind for ip (addFlows) and the SNAT mappings of
// their OUT entries; it returns the new CT keys and the mappings' keys.
func (lw *leaveWorld) addPod(ip netip.Addr, n int) (ct, mappings []ctmap.CTKey4) {
	lw.t.Helper()
	before := make(map[ctmap.CTKey4]bool, len(lw.all4))
	for k := range lw.all4 {
		before[k] = true
	}
	lw.addFlows(ip, remote4, n, false)
	for k := range lw.all4 {
		if before[k] {
			continue
		}
		ct = append(ct, k)
		if k.Flags() != ctmap.FlagOut || k.DAddr() != ip {
			continue
		}
		// nat_purge4 (bpf/include/ctscrub_nat.h): the forward mapping is the
		// CT key with its addresses swapped; the reverse one is keyed by the
		// translated address and port.
		lw.port++
		fwd := ctmap.NewKey4(k.SAddr(), k.DAddr(), k.DPort(), k.SPort(), k.NextHdr(), ctmap.FlagOut)
		rev := ctmap.NewKey4(snatTo, k.SAddr(), lw.port, k.DPort(), k.NextHdr(), ctmap.FlagIn)
		for mk, v := range map[ctmap.CTKey4][]byte{fwd: natValue(snatTo, lw.port), rev: natValue(ip, k.SPort())} {
			if err := lw.nat.Put(mk, v); err != nil {
				lw.t.Fatalf("put SNAT mapping %s: %v", mk, err)
			}
		}
		mappings = append(mappings, fwd, rev)
	}
	return ct, mappings
}

// present reports which of keys are in their CT map (nat false) or in the
// SNAT map (nat true).
func (lw *leaveWorld) present(keys []ctmap.CTKey4, nat bool) (in, out []ctmap.CTKey4) {
	lw.t.Helper()
	for _, k := range keys {
		m := lw.maps.Map(k.Kind())
		if nat {
			m = lw.nat
		}
		v := make([]byte, m.ValueSize())
		switch err := m.Lookup(k, v); {
		case err == nil:
			in = append(in, k)
		case errors.Is(err, ebpf.ErrKeyNotExist):
			out = append(out, k)
		default:
			lw.t.Fatalf("look up %s: %v", k, err)
		}
	}
	return in, out
}

type answer struct {
	r   SweepResult
	err error
}

func sweepAsync(sw *Sweeper, ctx context.Context, ip netip.Addr) chan answer {
	ch := make(chan answer, 1)
	go func() {
		r, err := sw.Sweep(ctx, []netip.Addr{ip}, false)
		ch <- answer{r, err}
	}()
	return ch
}

// sharedPass starts a blocker's pass (for leaverZ) and holds it while the
// callers of ips join the pending set, so they share the next pass; it
// returns their answers' channels and releases the blocker.
func sharedPass(t *testing.T, sw *Sweeper, hold chan struct{}, ctxs []context.Context, ips []netip.Addr) []chan answer {
	t.Helper()
	blocker := sweepAsync(sw, context.Background(), leaverZ)
	waitFor(t, func() bool { _, r := sw.Waiting(); return r == 1 })
	var chs []chan answer
	for i, ip := range ips {
		chs = append(chs, sweepAsync(sw, ctxs[i], ip))
	}
	waitFor(t, func() bool { p, _ := sw.Waiting(); return p == len(ips) })
	close(hold)
	if a := <-blocker; a.err != nil || !a.r.Complete {
		t.Fatalf("the blocker's pass: %+v, %v", a.r, a.err)
	}
	return chs
}

func countOf(keys []ctmap.CTKey4, k ctmap.Kind) int {
	n := 0
	for _, key := range keys {
		if key.Kind() == k {
			n++
		}
	}
	return n
}

// X's caller leaves the pass it shares with Y's; X's new pod then makes flows
// (with SNAT mappings). The rest of the pass must delete all of Y's entries
// and none of X's new ones; X's caller is answered incomplete.
func TestSweepLeaverLeavesTheSet(t *testing.T) {
	for _, leaveAt := range []int{1, 2} {
		name := map[int]string{1: "before_TCP4", 2: "before_Any4"}[leaveAt]
		t.Run(name, func(t *testing.T) {
			lw, c := newLeaveWorld(t)
			sw := c.Sweeper()
			oldX, _ := lw.addPod(leaverX, 5)
			oldY, natY := lw.addPod(leaverY, 5)
			oldZ, _ := lw.addPod(leaverZ, 2)

			ctxX, cancelX := context.WithCancel(context.Background())
			defer cancelX()
			hold := make(chan struct{})
			ansX := make(chan chan answer, 1) // X's answer, handed to the hook
			var left answer
			var freshX, freshNAT []ctmap.CTKey4
			takes, walks := 0, 0
			setHooks(sw, hooks{
				onTaken: func() {
					if takes++; takes == 1 {
						<-hold
					}
				},
				onWalking: func() {
					if takes != 2 {
						return
					}
					if walks++; walks != leaveAt {
						return
					}
					cancelX()
					left = <-<-ansX // X's caller has had its answer: it left
					freshX, freshNAT = lw.addPod(leaverX, 3)
				},
			})
			defer setHooks(sw, nil)
			chs := sharedPass(t, sw, hold, []context.Context{ctxX, context.Background()}, []netip.Addr{leaverX, leaverY})
			ansX <- chs[0]
			a := <-chs[1]
			setHooks(sw, nil)

			if a.err != nil || !a.r.Complete {
				t.Fatalf("Y's caller, who stayed: %+v, %v", a.r, a.err)
			}
			if got, want := a.r.Deleted[ctmap.TCP4]+a.r.Deleted[ctmap.Any4], len(oldY); got != want || a.r.NATDeleted[0] != len(natY) {
				t.Errorf("Y: deleted %d CT entries and %d SNAT mappings, want %d and %d", got, a.r.NATDeleted[0], want, len(natY))
			}
			if !errors.Is(left.err, context.Canceled) || left.r.Complete {
				t.Errorf("X's caller, who left: %+v, %v; want incomplete and cancelled", left.r, left.err)
			}
			if walks < leaveAt {
				t.Fatalf("the pass walked %d maps; the test leaves before map %d", walks, leaveAt)
			}

			// The new pod's entries and mappings survive the rest of the pass.
			_, gone := lw.present(freshX, false)
			for _, k := range gone {
				t.Errorf("a new entry of X deleted after its caller left: %s", k)
			}
			_, goneNAT := lw.present(freshNAT, true)
			for _, k := range goneNAT {
				t.Errorf("a new SNAT mapping of X deleted after its caller left: %s", k)
			}
			if len(gone)+len(goneNAT) > 0 {
				t.Errorf("%d of %d new CT entries and %d of %d new SNAT mappings of X deleted after its caller left", len(gone), len(freshX), len(goneNAT), len(freshNAT))
			}
			// So do X's old entries in the maps the pass walked after X left;
			// those of the maps walked before went, and X's answer counts them.
			wantX := [ctmap.NumKinds]int{}
			for _, k := range ctmap.Kinds[:leaveAt-1] {
				wantX[k] = countOf(oldX, k)
			}
			if left.r.Deleted != wantX {
				t.Errorf("X's answer counts %v deleted, want %v", left.r.Deleted, wantX)
			}
			in, out := lw.present(oldX, false)
			for _, k := range in {
				if int(k.Kind()) < leaveAt-1 {
					t.Errorf("an old entry of X left in a map walked before X left: %s", k)
				}
			}
			for _, k := range out {
				if int(k.Kind()) >= leaveAt-1 {
					t.Errorf("an old entry of X deleted in a map walked after X left: %s", k)
				}
			}
			if in, _ := lw.present(append(oldY, oldZ...), false); len(in) > 0 {
				t.Errorf("%d entries of Y and Z left, e.g. %s", len(in), in[0])
			}
			setEmpty(t, sw)
		})
	}
}

// Two callers for X share the pass; one leaves. X stays in the set for the
// other: every entry of X goes, also those made after the first one left.
func TestSweepLeaverKeepsSharedIP(t *testing.T) {
	lw, c := newLeaveWorld(t)
	sw := c.Sweeper()
	oldX, natX := lw.addPod(leaverX, 5)
	lw.addPod(leaverY, 5)
	lw.addPod(leaverZ, 2)

	ctx1, cancel1 := context.WithCancel(context.Background())
	defer cancel1()
	hold := make(chan struct{})
	ans1 := make(chan chan answer, 1)
	var left answer
	var freshX, freshNAT []ctmap.CTKey4
	takes, walks := 0, 0
	setHooks(sw, hooks{
		onTaken: func() {
			if takes++; takes == 1 {
				<-hold
			}
		},
		onWalking: func() {
			if takes != 2 {
				return
			}
			if walks++; walks != 1 {
				return
			}
			cancel1()
			left = <-<-ans1
			freshX, freshNAT = lw.addPod(leaverX, 3)
		},
	})
	defer setHooks(sw, nil)
	bg := context.Background()
	chs := sharedPass(t, sw, hold, []context.Context{ctx1, bg, bg}, []netip.Addr{leaverX, leaverX, leaverY})
	ans1 <- chs[0]
	a2, aY := <-chs[1], <-chs[2]
	setHooks(sw, nil)

	if !errors.Is(left.err, context.Canceled) || left.r.Complete {
		t.Errorf("X's caller who left: %+v, %v; want incomplete and cancelled", left.r, left.err)
	}
	if aY.err != nil || !aY.r.Complete {
		t.Errorf("Y's caller: %+v, %v", aY.r, aY.err)
	}
	if a2.err != nil || !a2.r.Complete {
		t.Fatalf("X's caller who stayed: %+v, %v", a2.r, a2.err)
	}
	all, allNAT := append(oldX, freshX...), append(natX, freshNAT...)
	if got := a2.r.Deleted[ctmap.TCP4] + a2.r.Deleted[ctmap.Any4]; got != len(all) || a2.r.NATDeleted[0] != len(allNAT) {
		t.Errorf("X's staying caller: %d CT entries and %d SNAT mappings deleted, want %d and %d", got, a2.r.NATDeleted[0], len(all), len(allNAT))
	}
	if in, _ := lw.present(all, false); len(in) > 0 {
		t.Errorf("%d entries of X left though a caller of the pass still wanted X, e.g. %s", len(in), in[0])
	}
	if in, _ := lw.present(allNAT, true); len(in) > 0 {
		t.Errorf("%d SNAT mappings of X left, e.g. %s", len(in), in[0])
	}
	setEmpty(t, sw)
}

// X's caller leaves and asks again at once: it joins the next pass, which
// deletes X's entries, the new ones included; the pass it left deleted none.
func TestSweepLeaverRejoins(t *testing.T) {
	lw, c := newLeaveWorld(t)
	sw := c.Sweeper()
	oldX, natX := lw.addPod(leaverX, 5)
	lw.addPod(leaverY, 5)
	lw.addPod(leaverZ, 2)

	ctxX, cancelX := context.WithCancel(context.Background())
	defer cancelX()
	hold, hold3 := make(chan struct{}), make(chan struct{})
	ansX := make(chan chan answer, 1)
	var again chan answer
	var left answer
	var freshX, freshNAT []ctmap.CTKey4
	takes, walks := 0, 0
	setHooks(sw, hooks{
		onTaken: func() {
			switch takes++; takes {
			case 1:
				<-hold
			case 3:
				<-hold3
			}
		},
		onWalking: func() {
			if takes != 2 {
				return
			}
			if walks++; walks != 1 {
				return
			}
			cancelX()
			left = <-<-ansX
			freshX, freshNAT = lw.addPod(leaverX, 3)
			again = sweepAsync(sw, context.Background(), leaverX)
			waitFor(t, func() bool { p, _ := sw.Waiting(); return p == 1 })
		},
	})
	defer setHooks(sw, nil)
	chs := sharedPass(t, sw, hold, []context.Context{ctxX, context.Background()}, []netip.Addr{leaverX, leaverY})
	ansX <- chs[0]
	aY := <-chs[1]
	if aY.err != nil || !aY.r.Complete {
		t.Errorf("Y's caller: %+v, %v", aY.r, aY.err)
	}
	if !errors.Is(left.err, context.Canceled) || left.r.Complete {
		t.Errorf("X's caller who left: %+v, %v; want incomplete and cancelled", left.r, left.err)
	}
	all, allNAT := append(oldX, freshX...), append(natX, freshNAT...)
	// Between the passes: the pass X left deleted nothing of X.
	if _, out := lw.present(all, false); len(out) > 0 {
		t.Errorf("the pass X's caller left deleted %d entries of X, e.g. %s", len(out), out[0])
	}
	close(hold3)
	a := <-again
	setHooks(sw, nil)
	if a.err != nil || !a.r.Complete {
		t.Fatalf("X's caller who came back: %+v, %v", a.r, a.err)
	}
	if got := a.r.Deleted[ctmap.TCP4] + a.r.Deleted[ctmap.Any4]; got != len(all) || a.r.NATDeleted[0] != len(allNAT) {
		t.Errorf("X's second sweep: %d CT entries and %d SNAT mappings deleted, want %d and %d", got, a.r.NATDeleted[0], len(all), len(allNAT))
	}
	if in, _ := lw.present(all, false); len(in) > 0 {
		t.Errorf("%d entries of X left after its second sweep, e.g. %s", len(in), in[0])
	}
	if in, _ := lw.present(allNAT, true); len(in) > 0 {
		t.Errorf("%d SNAT mappings of X left after its second sweep, e.g. %s", len(in), in[0])
	}
	setEmpty(t, sw)
}

// The same with the leave landing while the program walks a big map in the
// kernel (the hooks cannot stop it there). Whatever the timing, no entry of
// X made after its caller had its answer may go: from the removal on, the
// program's set lookups miss X, and the one entry it may still delete (the
// delayed delete of one matched just before) existed before. When the walk
// ended before the cancel landed, the test is only weaker, and says so.
func TestSweepLeaverMidWalk(t *testing.T) {
	w, c := bigWorld(t, 1<<20)
	sw := c.Sweeper()
	x := netip.AddrFrom4([4]byte{10, 244, 0, 10})
	y := netip.AddrFrom4([4]byte{10, 244, 0, 11})
	hold := make(chan struct{})
	g := 0
	setHooks(sw, hooks{onTaken: func() {
		if g++; g == 1 {
			<-hold
		}
	}})
	defer setHooks(sw, nil)
	ctxX, cancelX := context.WithCancel(context.Background())
	defer cancelX()
	chs := sharedPass(t, sw, hold, []context.Context{ctxX, context.Background()}, []netip.Addr{x, y})
	waitFor(t, sw.inProg.Load)
	cancelX()
	left := <-chs[0]
	before := make(map[ctmap.CTKey4]bool, len(w.all4))
	for k := range w.all4 {
		before[k] = true
	}
	w.addFlows(x, remote4, 20, false) // the new pod's flows, while the pass walks
	midWalk := sw.inProg.Load()
	a := <-chs[1]
	if a.err != nil || !a.r.Complete {
		t.Fatalf("Y's caller: %+v, %v", a.r, a.err)
	}
	if !errors.Is(left.err, context.Canceled) || left.r.Complete {
		t.Errorf("X's caller who left: %+v, %v; want incomplete and cancelled", left.r, left.err)
	}
	st := sw.lastStats()
	t.Logf("new flows made while the program walked: %v; X's answer: %v deleted; pass: %d+%d entries visited", midWalk, left.r.Deleted, st[ctmap.TCP4].Visited, st[ctmap.Any4].Visited)
	k4, _ := dump(t, w.maps)
	n, lost := 0, 0
	for k := range w.all4 {
		if before[k] {
			continue
		}
		n++
		if !k4[k] {
			lost++
			t.Errorf("a new entry of X deleted after its caller left: %s", k)
		}
	}
	if lost > 0 {
		t.Errorf("%d of %d new entries of X deleted after its caller left", lost, n)
	}
	for k := range k4 {
		if k.Has(y) {
			t.Errorf("an entry of Y left: %s", k)
		}
	}
	setEmpty(t, sw)
}
