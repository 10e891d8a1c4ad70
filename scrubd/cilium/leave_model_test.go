package cilium

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"strings"
	"testing"

	"github.com/ctscrub/ctscrub/internal/testsupport/ownermodel"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// A seeded random walk over the real sweeper (real maps, the real sweep
// program, the runner held at its hooks) against a small model of which
// callers wait for which IP and which entries are a new pod's (issue #34,
// item 5, which the ownership walk cannot reach: it is sequential, and
// this window needs a caller to leave a pass that goes on).
//
// Each trial is one shared pass on a fresh world: 1-4 IPs, each with 1-2
// callers; each caller leaves at a random point (the pass taken, before the
// first map, before the second map) or stays; once every caller of an IP
// has left, the IP's new pod may make flows at the next point (its create
// was answered, Cilium walked, the pod started). The model, independent of
// the sweeper, says after the pass:
//   - no entry made after its IP's last caller left is gone;
//   - a caller answered complete has no entry of its IP left from before;
//   - a caller that left is not answered complete;
//   - no entry of an IP outside the pass is gone.
//
// `make model` runs it long; a violation prints the seed and the trial.

var (
	leaveModelTrials = flag.Int("model.leave.trials", ownermodel.EnvInt("CTSCRUB_MODEL_LEAVE_TRIALS", 15), "passes per seed of the sweeper's leave walk")
	leaveModelSeeds  = flag.Int("model.leave.seeds", ownermodel.EnvInt("CTSCRUB_MODEL_LEAVE_SEEDS", 4), "seeds of the sweeper's leave walk")
	leaveModelSeed   = flag.Uint64("model.leave.seed", 0, "run only this seed (0: 1..model.leave.seeds)")
)

// The points of a pass where a caller may leave or a new pod make flows.
const (
	atTaken  = iota // the runner took the pass, before it filled the set
	atFirst         // before the first map (TCP4)
	atSecond        // before the second map (Any4)
	stays           // never: the caller waits for the answer
	numPoints
)

var pointNames = [numPoints]string{"taken", "before-TCP4", "before-Any4", "stays"}

// leaveCaller is one caller of a trial.
type leaveCaller struct {
	ip    netip.Addr
	leave int // a point, or stays
}

// leaveTrial is one pass: its callers, and the point (after every caller of
// the IP left) at which each IP's new pod makes flows (-1: none).
type leaveTrial struct {
	callers []leaveCaller
	fresh   map[netip.Addr]int
	old     map[netip.Addr]int // flows of each kind per IP made before the pass
}

func (tr leaveTrial) String() string {
	var b strings.Builder
	for _, c := range tr.callers {
		fmt.Fprintf(&b, "caller(%s leaves %s) ", c.ip, pointNames[c.leave])
	}
	for ip, at := range tr.fresh {
		if at >= 0 {
			fmt.Fprintf(&b, "new-pod(%s at %s) ", ip, pointNames[at])
		}
	}
	return strings.TrimSpace(b.String())
}

var leavePool = []netip.Addr{
	netip.MustParseAddr("10.244.0.30"), netip.MustParseAddr("10.244.0.31"),
	netip.MustParseAddr("10.244.0.32"), netip.MustParseAddr("10.244.0.33"),
}

func leaveTrials(seed uint64, n int) []leaveTrial {
	rng := rand.New(rand.NewPCG(seed, seed^0x1ea5e))
	out := make([]leaveTrial, n)
	for i := range out {
		tr := leaveTrial{fresh: map[netip.Addr]int{}, old: map[netip.Addr]int{}}
		ips := leavePool[:1+rng.IntN(len(leavePool))]
		for _, ip := range ips {
			tr.old[ip] = 1 + rng.IntN(3)
			last := -1
			for range 1 + rng.IntN(2) {
				c := leaveCaller{ip: ip, leave: rng.IntN(numPoints)}
				tr.callers = append(tr.callers, c)
				last = max(last, c.leave)
			}
			tr.fresh[ip] = -1
			// The new pod starts only once its IP's callers all left, at a
			// later point of the pass.
			if last < atSecond && rng.IntN(3) > 0 {
				tr.fresh[ip] = last + 1 + rng.IntN(atSecond-last)
			}
		}
		out[i] = tr
	}
	return out
}

// runLeaveTrial runs tr on a fresh world and returns the first violation ("" none).
func runLeaveTrial(t *testing.T, tr leaveTrial) string {
	lw, c := newLeaveWorld(t)
	sw := c.Sweeper()
	old := map[netip.Addr][]ctmap.CTKey4{}
	for _, ip := range leavePool {
		if n := tr.old[ip]; n > 0 {
			old[ip], _ = lw.addPod(ip, n)
		}
	}
	// IPs outside the pass keep their entries.
	outside, _ := lw.addPod(netip.MustParseAddr("10.244.0.40"), 2)
	lw.addPod(leaverZ, 1)

	ctxs := make([]context.Context, len(tr.callers))
	cancels := make([]context.CancelFunc, len(tr.callers))
	for i := range tr.callers {
		ctxs[i], cancels[i] = context.WithCancel(context.Background())
		defer cancels[i]()
	}
	answers := make([]answer, len(tr.callers))
	got := make([]bool, len(tr.callers))
	left := make([]bool, len(tr.callers)) // cancelled at its point (a point the pass never reached: it stayed)
	chs := make(chan []chan answer, 1)
	var fresh []ctmap.CTKey4
	var freshNAT []ctmap.CTKey4
	takes, walks := 0, 0
	point := func(at int) {
		var mine []chan answer
		remaining := 0
		for _, cl := range tr.callers {
			if cl.leave > at {
				remaining++
			}
		}
		for i, cl := range tr.callers {
			if cl.leave != at {
				continue
			}
			if mine == nil {
				mine = <-chs
				chs <- mine
			}
			cancels[i]()
			left[i] = true
			if remaining == 0 {
				// The pass's last caller waits for the pass to stop, which
				// is after this hook: its answer is read at the end.
				continue
			}
			answers[i] = <-mine[i] // its answer: it has left
			got[i] = true
		}
		if remaining == 0 {
			// The pass stops here; a new pod after it is outside the pass.
			return
		}
		for ip, fat := range tr.fresh {
			if fat == at {
				k, n := lw.addPod(ip, 2)
				fresh = append(fresh, k...)
				freshNAT = append(freshNAT, n...)
			}
		}
	}
	hold := make(chan struct{})
	setHooks(sw, hooks{
		onTaken: func() {
			if takes++; takes == 1 {
				<-hold
				return
			}
			if takes == 2 {
				point(atTaken)
			}
		},
		onWalking: func() {
			if takes != 2 {
				return
			}
			if walks++; walks <= 2 {
				point(atTaken + walks)
			}
		},
	})
	defer setHooks(sw, nil)
	ips := make([]netip.Addr, len(tr.callers))
	for i, cl := range tr.callers {
		ips[i] = cl.ip
	}
	// The callers' channels go to the hooks before the blocker's pass is
	// released (as in sharedPass), so a hook never waits for them.
	res := func() []chan answer {
		blocker := sweepAsync(sw, context.Background(), leaverZ)
		waitFor(t, func() bool { _, r := sw.Waiting(); return r == 1 })
		var cs []chan answer
		for i, ip := range ips {
			cs = append(cs, sweepAsync(sw, ctxs[i], ip))
		}
		waitFor(t, func() bool { p, _ := sw.Waiting(); return p == len(ips) })
		chs <- cs
		close(hold)
		if a := <-blocker; a.err != nil || !a.r.Complete {
			t.Fatalf("the blocker's pass: %+v, %v", a.r, a.err)
		}
		return cs
	}()
	// The hooks read the answers of the callers they make leave; the rest
	// are read once no caller waits in a running pass (the last callers
	// to leave wait for the pass to stop).
	waitFor(t, func() bool { p, r := sw.Waiting(); return p == 0 && r == 0 })
	for i := range tr.callers {
		if !got[i] {
			answers[i] = <-res[i]
		}
	}
	setHooks(sw, nil)

	// The model's verdicts.
	if _, gone := lw.present(fresh, false); len(gone) > 0 {
		return fmt.Sprintf("%d of %d CT entries of a new pod, made after its IP's last caller left, deleted by the pass (e.g. %s)", len(gone), len(fresh), gone[0])
	}
	if _, gone := lw.present(freshNAT, true); len(gone) > 0 {
		return fmt.Sprintf("%d of %d SNAT mappings of a new pod deleted by the pass", len(gone), len(freshNAT))
	}
	if _, gone := lw.present(outside, false); len(gone) > 0 {
		return fmt.Sprintf("%d entries of an IP outside the pass deleted", len(gone))
	}
	for i, cl := range tr.callers {
		a := answers[i]
		if left[i] && got[i] && a.r.Complete {
			// It left while the runner was held: the pass cannot have ended.
			return fmt.Sprintf("caller %d (%s) left at %s and was answered complete", i, cl.ip, pointNames[cl.leave])
		}
		if left[i] && !a.r.Complete {
			continue
		}
		// A last caller's cancel races the pass's end (it may be answered
		// complete if the pass ran to the end first): then it claims
		// complete, and the claim is checked as any other.
		if left[i] {
			if in, _ := lw.present(old[cl.ip], false); len(in) > 0 {
				return fmt.Sprintf("caller %d (%s) left at %s, answered complete with %d of its old entries left", i, cl.ip, pointNames[cl.leave], len(in))
			}
			continue
		}
		if a.err != nil {
			return fmt.Sprintf("caller %d (%s) stayed and got %v", i, cl.ip, a.err)
		}
		if !a.r.Complete {
			return fmt.Sprintf("caller %d (%s) stayed and was answered incomplete", i, cl.ip)
		}
		if in, _ := lw.present(old[cl.ip], false); len(in) > 0 {
			return fmt.Sprintf("caller %d (%s) answered complete with %d of its old entries left (e.g. %s)", i, cl.ip, len(in), in[0])
		}
	}
	setEmpty(t, sw)
	return ""
}

func TestSweepLeaveModel(t *testing.T) {
	needRoot(t)
	trials, violations := 0, 0
	for _, seed := range ownermodel.Seeds(*leaveModelSeed, *leaveModelSeeds) {
		for i, tr := range leaveTrials(seed, *leaveModelTrials) {
			trials++
			// A subtest per pass: its world's maps and programs close
			// when it ends, not when the walk does.
			var v string
			t.Run(fmt.Sprintf("seed%d-pass%d", seed, i), func(t *testing.T) { v = runLeaveTrial(t, tr) })
			if v != "" {
				violations++
				t.Errorf("seed %d, trial %d: %s\n  trial: %s\n  rerun: go test ./scrubd/cilium -run TestSweepLeaveModel -model.leave.seed %d -model.leave.trials %d",
					seed, i, v, tr, seed, i+1)
				break
			}
		}
	}
	t.Logf("%d passes over %d seeds, %d violations", trials, len(ownermodel.Seeds(*leaveModelSeed, *leaveModelSeeds)), violations)
}
