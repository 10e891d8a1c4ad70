package owner

import (
	"flag"
	"testing"

	"github.com/ctscrub/ctscrub/internal/testsupport/ownermodel"
	"github.com/ctscrub/ctscrub/scrubd/api"

	"net/netip"
)

// The model-based test of the ownership rule: the reference model's random
// walk (internal/testsupport/ownermodel) over the Rule alone, driven as the
// daemon drives it (scrubd/daemon: ownership.go, gc.go, delegate.go,
// restore), with the index reduced to what the rule's verdicts act on: an
// IP is tracked (its index vouches) or not, and a scrub deletes the indexed
// entries of a tracked IP, every entry of another. The same walk runs over
// the real daemon in scrubd/daemon (TestOwnershipModelDaemon).
//
// -model.steps and -model.seeds (or CTSCRUB_MODEL_STEPS, CTSCRUB_MODEL_SEEDS)
// set its length: make test runs 20 x 20,000 steps, make model 20 x 50,000.

var (
	modelSteps = flag.Int("model.steps", ownermodel.EnvInt("CTSCRUB_MODEL_STEPS", 20000), "steps per seed of the ownership model walk")
	modelSeeds = flag.Int("model.seeds", ownermodel.EnvInt("CTSCRUB_MODEL_SEEDS", 20), "seeds of the ownership model walk")
	modelSeed  = flag.Uint64("model.seed", 0, "run only this seed (0: seeds 1..model.seeds)")
)

// ruleSystem is a node whose scrubd is the Rule plus a simulated index.
type ruleSystem struct {
	r       *Rule
	tracked map[netip.Addr]bool
	present map[int]ownermodel.Entry
	active  map[api.Attachment]netip.Addr // scrubd's journal
}

func newRuleSystem() ownermodel.System {
	return &ruleSystem{r: New(), tracked: map[netip.Addr]bool{}, present: map[int]ownermodel.Entry{}, active: map[api.Attachment]netip.Addr{}}
}

// verdicts applies a ticket's Sweep verdicts: the IP's index is marked.
func (s *ruleSystem) verdicts(t *Ticket, ips ...netip.Addr) {
	for _, ip := range ips {
		if t.Verdict(ip) == Sweep {
			s.tracked[ip] = false
		}
	}
}

// scrub is the backend: the index's entries of a tracked IP, or a sweep.
func (s *ruleSystem) scrub(ip netip.Addr) {
	for id, e := range s.present {
		if e.IP == ip && (!s.tracked[ip] || e.Indexed) {
			delete(s.present, id)
		}
	}
	s.tracked[ip] = true
}

func (s *ruleSystem) Delegate(event string, ip netip.Addr) bool {
	ev := Unknown
	switch event {
	case api.DelegateEventCreate:
		ev = Create
	case api.DelegateEventDelete:
		ev = Delete
	}
	t := s.r.Begin(ev, api.Attachment{}, []netip.Addr{ip})
	s.verdicts(t, ip)
	s.scrub(ip)
	t.End(true)
	return true
}

func (s *ruleSystem) Add(a api.Attachment, ip netip.Addr, fail bool) bool {
	t := s.r.Begin(Add, a, []netip.Addr{ip})
	s.verdicts(t, ip)
	s.scrub(ip)
	t.End(true)
	if fail {
		return true
	}
	for b, x := range s.active {
		if x == ip {
			s.r.Stop(b) // displaced (startPod)
			delete(s.active, b)
		}
	}
	s.r.Start(a, []netip.Addr{ip})
	s.active[a] = ip
	return true
}

func (s *ruleSystem) Del(a api.Attachment, ip netip.Addr) bool {
	_, known := s.active[a]
	defer func() {
		s.r.Stop(a)
		delete(s.active, a)
		if !known {
			s.r.Unseen() // a DEL of an attachment scrubd never indexed
		}
	}()
	if !known {
		for _, x := range s.active {
			if x == ip {
				return false // another attachment holds it: left alone
			}
		}
	}
	t := s.r.Begin(Del, a, []netip.Addr{ip})
	s.verdicts(t, ip)
	s.scrub(ip)
	t.End(true)
	return true
}

func (s *ruleSystem) GC(valid []api.Attachment) {
	ok := map[api.Attachment]bool{}
	keep := map[netip.Addr]bool{}
	for _, a := range valid {
		ok[a] = true
		if ip, in := s.active[a]; in {
			keep[ip] = true
		}
	}
	var tickets []*Ticket
	for a, ip := range s.active {
		if ok[a] {
			continue
		}
		var ips []netip.Addr
		if !keep[ip] {
			ips = append(ips, ip)
		}
		t := s.r.Begin(GC, a, ips)
		tickets = append(tickets, t)
		s.r.Stop(a)
		delete(s.active, a)
		for _, x := range ips {
			if t.Verdict(x) == Trust {
				s.scrub(x)
			}
		}
	}
	for _, t := range tickets {
		_, distrust := t.End(true)
		for _, ip := range distrust {
			s.tracked[ip] = false
		}
	}
}

func (s *ruleSystem) SetChained(chained bool) { s.r.SetChained(chained) }

func (s *ruleSystem) Restart(kill bool, gone []api.Attachment) {
	s.r = New()
	for _, a := range gone {
		delete(s.active, a)
	}
	for a, ip := range s.active {
		s.r.Start(a, []netip.Addr{ip})
	}
	if kill {
		clear(s.tracked)
	}
}

func (s *ruleSystem) Gone(api.Attachment)             {}
func (s *ruleSystem) Flow(e ownermodel.Entry)         { s.present[e.ID] = e }
func (s *ruleSystem) Present(e ownermodel.Entry) bool { _, ok := s.present[e.ID]; return ok }

func TestOwnershipModel(t *testing.T) {
	seeds := ownermodel.Seeds(*modelSeed, *modelSeeds)
	for _, r := range ownermodel.Check(newRuleSystem, seeds, *modelSteps, true) {
		t.Errorf("%s\nrerun: go test ./scrubd/owner -run TestOwnershipModel -model.seed %d -model.steps %d", r, r.Seed, *modelSteps)
	}
	t.Logf("%d seeds x %d steps", len(seeds), *modelSteps)
}
