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
	alive   map[api.Attachment]netip.Addr // the node's pods (their netns)

	// The bootstrap of the last restart (scrubd/daemon boot.go): the pods
	// it found that no attachment names (by their real attachment: the
	// DEL's netns names them), what the rule judges at the pass's end, and
	// the pass: the entries its walk read, those filed into the index, the
	// IPs marked while it ran.
	found  map[api.Attachment]netip.Addr
	boot   *Boot
	hidden map[api.Attachment]bool
	missed bool
	open   bool
	walked map[int]bool
	filed  map[int]bool
	marked map[netip.Addr]bool
}

func newRuleSystem() ownermodel.System {
	return &ruleSystem{r: New(), tracked: map[netip.Addr]bool{}, present: map[int]ownermodel.Entry{}, active: map[api.Attachment]netip.Addr{},
		alive: map[api.Attachment]netip.Addr{}, found: map[api.Attachment]netip.Addr{}, filed: map[int]bool{}}
}

// foundName is the name a found pod holds its IP under until its DEL.
func foundName(a api.Attachment) api.Attachment {
	return api.Attachment{ContainerID: "found:" + a.ContainerID, IfName: a.IfName}
}

// verdicts applies a ticket's Sweep verdicts: the IP's index is marked.
func (s *ruleSystem) verdicts(t *Ticket, ips ...netip.Addr) {
	for _, ip := range ips {
		if t.Verdict(ip) == Sweep {
			s.mark(ip)
		}
	}
}

func (s *ruleSystem) mark(ip netip.Addr) {
	s.tracked[ip] = false
	if s.open {
		s.marked[ip] = true
	}
}

// scrub is the backend: the index's entries of a tracked IP, or a sweep.
func (s *ruleSystem) scrub(ip netip.Addr) {
	for id, e := range s.present {
		if e.IP == ip && (!s.tracked[ip] || e.Indexed || s.filed[id]) {
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
	for b, x := range s.found {
		if x == ip {
			s.r.Stop(foundName(b)) // displaced (displaceFound)
			delete(s.found, b)
		}
	}
	s.r.Start(a, []netip.Addr{ip})
	s.active[a] = ip
	return true
}

func (s *ruleSystem) Del(a api.Attachment, ip netip.Addr) bool {
	if fip, ok := s.found[a]; ok && s.r.Rename(foundName(a), a) { // adoptFound
		delete(s.found, a)
		s.active[a] = fip
	}
	_, known := s.active[a]
	_, running := s.alive[a]
	// A DEL of an attachment scrubd never indexed is a sign of an unseen
	// owner, unless its pod was gone before it while the rule saw
	// (goneBeforeDel).
	sign := !known && (running || s.r.Blind())
	defer func() {
		s.r.Stop(a)
		delete(s.active, a)
		if sign {
			s.r.Unseen()
		}
	}()
	if !known {
		for _, x := range s.active {
			if x == ip {
				return false // another attachment holds it: left alone
			}
		}
		for _, x := range s.found {
			if x == ip {
				return false // a pod found at start holds it (holderOf)
			}
		}
	}
	ev := Del
	if !known && !sign {
		ev = DelGone
	}
	t := s.r.Begin(ev, a, []netip.Addr{ip})
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
	for _, ip := range s.found {
		keep[ip] = true
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
			s.mark(ip)
		}
	}
}

func (s *ruleSystem) SetChained(chained bool) { s.r.SetChained(chained) }

// Restart is the daemon's restore and its bootstrap's attach step
// (findAtStart): the rule starts anew with the attachments, the pods found
// that no attachment names, and, after a clean stop, the rule's state kept
// in the snapshot; the pass begins.
func (s *ruleSystem) Restart(kill bool, gone, hidden []api.Attachment, missed bool) {
	var kept *State
	if !kill {
		st := s.r.State()
		kept = &st
	}
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
	clear(s.found)
	s.hidden = map[api.Attachment]bool{}
	for _, a := range hidden {
		s.hidden[a] = true
	}
	var strangers []Found
	for a, ip := range s.alive {
		if _, in := s.active[a]; in || s.hidden[a] {
			continue
		}
		s.found[a] = ip
		s.tracked[ip] = false // ReasonOwner: it ran unseen until now
		strangers = append(strangers, Found{A: foundName(a), IPs: []netip.Addr{ip}})
	}
	s.missed = missed
	s.boot = s.r.BeginBoot(kept, strangers, missed)
	s.open, s.marked, s.walked = true, map[netip.Addr]bool{}, map[int]bool{}
	for id := range s.present {
		s.walked[id] = true // older than the pass: the walk reads them
	}
}

// PassEnd is the pass's end (runBootstrap): the walk's entries and the
// recorded ones are filed; the second find's pods no ADD attached (born
// since, outside ctscrub) and the missed ones keep free addresses out; the
// rule judges each address.
func (s *ruleSystem) PassEnd() {
	if !s.open {
		return
	}
	s.open = false
	for id, e := range s.present {
		if s.walked[id] || e.Indexed {
			s.filed[id] = true
		}
	}
	freeNow := !s.missed
	unrecorded := map[netip.Addr]bool{}
	for a, ip := range s.alive {
		_, act := s.active[a]
		_, fnd := s.found[a]
		if s.hidden[a] {
			freeNow = false
		} else if !act && !fnd {
			freeNow = false
			unrecorded[ip] = true
		}
	}
	var tracked []netip.Addr
	for _, ip := range ownermodel.IPs() {
		if !s.marked[ip] && !unrecorded[ip] && s.boot.Trust(ip, freeNow) {
			s.tracked[ip] = true
			tracked = append(tracked, ip)
		}
	}
	s.boot.Release(tracked, freeNow)
}

// Refind is the daemon's find after a sign (refind.go): every live pod it
// can follow that no attachment or earlier find names becomes a found
// holder, recorded from now on, its IP marked (it ran unseen); the rule
// sees again when none was hidden.
func (s *ruleSystem) Refind() {
	epoch := s.r.Epoch()
	missed := false
	for a, ip := range s.alive {
		_, act := s.active[a]
		_, fnd := s.found[a]
		switch {
		case s.hidden[a]:
			missed = true
		case !act && !fnd:
			s.found[a] = ip
			s.mark(ip)
			s.r.Start(foundName(a), []netip.Addr{ip})
		}
	}
	if !missed {
		s.r.Sight(epoch)
	}
}

func (s *ruleSystem) Born(a api.Attachment, ip netip.Addr) { s.alive[a] = ip }

func (s *ruleSystem) Gone(a api.Attachment) {
	delete(s.alive, a)
	delete(s.hidden, a)
}
func (s *ruleSystem) Flow(e ownermodel.Entry)         { s.present[e.ID] = e }
func (s *ruleSystem) Present(e ownermodel.Entry) bool { _, ok := s.present[e.ID]; return ok }

func TestOwnershipModel(t *testing.T) {
	seeds := ownermodel.Seeds(*modelSeed, *modelSeeds)
	for _, r := range ownermodel.Check(newRuleSystem, seeds, *modelSteps, true) {
		t.Errorf("%s\nrerun: go test ./scrubd/owner -run TestOwnershipModel -model.seed %d -model.steps %d", r, r.Seed, *modelSteps)
	}
	t.Logf("%d seeds x %d steps", len(seeds), *modelSteps)
}
