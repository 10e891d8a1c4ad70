// Package owner is the ownership rule: it decides, for every scrub, whether
// scrubd's index may vouch for an IP (the scrub deletes the indexed keys and
// may answer complete) or must not (the IP is marked incomplete first and
// its scrub sweeps the CT maps), and which IPs a finished scrub releases to
// their next owner.
//
// The index holds the keys the recorder saw, and the recorder sees only the
// pods ctscrub attached to. So the index is whole for an IP only while every
// pod that held the IP since its last complete scrub was one scrubd indexed.
// The rule keeps what it needs to know that, and nothing else:
//
//   - released IPs: the last owner was an attachment scrubd indexed and its
//     DEL scrub completed;
//   - created IPs: the delegate's endpoint-create scrub completed for an IP
//     and no index start (ctscrub's ADD) has followed yet;
//   - holders: the active attachments and the epoch each was indexed in.
//
// A sign of an unseen owner (the CNI config not chaining ctscrub, a DEL of an
// attachment scrubd never indexed) cannot name the IP the unseen pod had, so
// it starts a new epoch: every release, create and holder of an earlier epoch
// stops counting. A pod no recorder sees may still be running after the sign
// (it started while the config did not chain ctscrub), and it may send
// towards an address no pod holds, or whose pod died with its DEL still to
// come: an entry no recorder saw. So a sign also makes the rule blind:
// nothing is trusted, and no release or create counts, until a find has put
// the recorder on every pod of the node (Sight). docs/design.md, "The completeness contract", states the
// rule as the model-based test (model_test.go) checks it.
//
// Rule has no I/O and no clock: events in, verdicts out. It is safe for
// concurrent use.
package owner

import (
	"net/netip"
	"sync"

	"github.com/ctscrub/ctscrub/scrubd/api"
)

// Verdict is the rule's answer for one IP of a scrub.
type Verdict uint8

const (
	// Sweep: the index may miss entries of the IP; mark it incomplete
	// (index.ReasonOwner) so that its scrub sweeps.
	Sweep Verdict = iota
	// Trust: the index holds every entry of the IP.
	Trust
)

func (v Verdict) String() string {
	if v == Trust {
		return "trust"
	}
	return "sweep"
}

// Event is what a scrub is for.
type Event uint8

const (
	// Add is ctscrub's ADD scrub, before its index start.
	Add Event = iota
	// Del is ctscrub's DEL scrub of an attachment (Begin's a).
	Del
	// GC is a CNI GC's scrub of a dropped active attachment (Begin's a).
	GC
	// Create is the delegate's endpoint-create (Cilium's agent, before
	// ctscrub's ADD in the chain).
	Create
	// Delete is the delegate's endpoint-delete.
	Delete
	// Unknown is a delegate event this scrubd does not know: judged by the
	// strictest rule, with no effect on the state.
	Unknown
	// Operator is a scrub with no attachment (scrubctl, the audit): the
	// index is trusted as it stands, nothing is released.
	Operator
	// DelGone is ctscrub's DEL scrub of an attachment scrubd never indexed
	// whose pod's network namespace was gone before it, while the rule
	// sees (the kubelet's DELs of the sandboxes of before a node reboot):
	// no sign of an unseen owner. The pod runs no more and what it made is
	// older than any release that counts, so a released IP stays released
	// and its index is trusted; any other IP sweeps, and keeps its state
	// (no new owner: a bootstrap pass running still vouches for it).
	DelGone
	// AddFound is ctscrub's ADD scrub for the interface of a pod found at
	// start (Begin's a is the found pod's name): a runtime's ADD that was
	// still in the chain while scrubd was down. The found pod is the ADD's
	// own pod, recorded since the find, its older entries read by the pass:
	// while it holds the IP in this epoch, the index is trusted. Otherwise
	// as an Add.
	AddFound
)

var eventNames = [...]string{"add", "del", "gc", "create", "delete", "unknown", "operator", "del-gone", "add-found"}

func (e Event) String() string {
	if int(e) < len(eventNames) {
		return eventNames[e]
	}
	return "event?"
}

type holder struct {
	ips   []netip.Addr
	epoch uint64
}

type ipState struct {
	gen      uint64 // new (Rule.seq) at every event that gives the IP an owner
	released bool
	relEpoch uint64
	created  bool
	crEpoch  uint64
	// crSeen: the create completed while the rule saw (not blind); only
	// such a create lets the next ADD trust the index. A create made while
	// blind still names its IP's pod unseen if no index start follows.
	crSeen bool
}

// Rule is the ownership state of one node's pod IPs. An IP's state is kept
// once made (a few words): a scrub's ticket compares generations, and a
// state dropped and made again would look unchanged. The IPs are the node's
// pod IPs that scrubd was asked about, bounded by its pod CIDRs' use.
type Rule struct {
	mu        sync.Mutex
	seq       uint64 // the last generation given out (ipState.gen)
	epoch     uint64
	unchained bool // the CNI config does not chain ctscrub now
	// blind: a pod no recorder sees may be running (a sign, or a find at
	// start that could not follow every pod); releases and creates neither
	// count nor are recorded until Sight.
	blind   bool
	ips     map[netip.Addr]*ipState
	holders map[api.Attachment]holder
}

// New returns the rule of a daemon that just started: nothing released,
// nothing held.
func New() *Rule {
	return &Rule{ips: map[netip.Addr]*ipState{}, holders: map[api.Attachment]holder{}}
}

func (r *Rule) ip(ip netip.Addr) *ipState {
	s := r.ips[ip]
	if s == nil {
		// Generation 0: being asked about is no new owner (a bootstrap
		// pass's Trust compares generations with its start's); every
		// owner event takes a new one (takeLocked).
		s = &ipState{}
		r.ips[ip] = s
	}
	return s
}

func (r *Rule) releasedLocked(ip netip.Addr) bool {
	s := r.ips[ip]
	return s != nil && s.released && s.relEpoch == r.epoch && !r.unchained && !r.blind
}

func (r *Rule) createdLocked(ip netip.Addr) bool {
	s := r.ips[ip]
	return s != nil && s.created && s.crSeen && s.crEpoch == r.epoch && !r.unchained && !r.blind
}

// heldNowLocked reports whether an active attachment indexed in this epoch
// holds ip.
func (r *Rule) heldNowLocked(ip netip.Addr) bool {
	if r.unchained {
		return false
	}
	for _, h := range r.holders {
		if h.epoch != r.epoch {
			continue
		}
		for _, x := range h.ips {
			if x == ip {
				return true
			}
		}
	}
	return false
}

// takeLocked gives ip a new owner: its release and create end, and running
// tickets see the change (Ticket.Still).
func (r *Rule) takeLocked(ip netip.Addr) {
	s := r.ip(ip)
	r.seq++
	s.gen = r.seq
	s.released, s.created = false, false
}

// A Ticket is one scrub's view of the rule, from Begin to End.
type Ticket struct {
	r        *Rule
	ev       Event
	a        api.Attachment
	epoch    uint64
	gens     map[netip.Addr]uint64
	verdicts map[netip.Addr]Verdict
	// release: End may release the IPs (a DEL or GC of an attachment
	// indexed in this epoch); create: End records a completed create.
	release, create bool
}

// Verdict is the rule's answer for ip at Begin.
func (t *Ticket) Verdict(ip netip.Addr) Verdict { return t.verdicts[ip] }

// Still reports whether no event gave ip a new owner since Begin: a scrub
// that may leave an IP alone (a GC's, a late DEL's) asks it before it
// deletes.
func (t *Ticket) Still(ip netip.Addr) bool {
	t.r.mu.Lock()
	defer t.r.mu.Unlock()
	s := t.r.ips[ip]
	return s != nil && s.gen == t.gens[ip]
}

// Begin applies the rule to a scrub of ips for ev (a is the attachment of a
// Del or GC) and returns its ticket, whose Verdict says per IP whether the
// index may be trusted. A GC's ticket also says, per IP, whether to scrub at
// all (Verdict Trust) or leave the IP to its next owner's sweep (Sweep: the
// dropped attachment is of an earlier epoch, and a pod scrubd never saw may
// hold the IP now; its live entries must stay).
func (r *Rule) Begin(ev Event, a api.Attachment, ips []netip.Addr) *Ticket {
	r.mu.Lock()
	defer r.mu.Unlock()
	t := &Ticket{r: r, ev: ev, a: a, epoch: r.epoch, gens: make(map[netip.Addr]uint64, len(ips)), verdicts: make(map[netip.Addr]Verdict, len(ips))}
	h, known := r.holders[a]
	current := known && h.epoch == r.epoch && !r.unchained
	switch ev {
	case Del:
		t.release = current
	case GC:
		// A dropped active attachment's DEL was never seen: whoever holds
		// its IPs now, no release (issue 34, item 1).
		t.release = false
	case Create:
		t.create = true
	}
	for _, ip := range ips {
		v := Sweep
		// A delegate create that no index start followed: a pod scrubd
		// never saw holds (or held) the IP; only ctscrub's own ADD, right
		// after the create in the chain, may take it from there.
		unseen := r.ips[ip] != nil && r.ips[ip].created && ev != Add
		switch ev {
		case Add:
			if r.releasedLocked(ip) || r.createdLocked(ip) {
				v = Trust
			}
			r.takeLocked(ip)
		case AddFound:
			if r.releasedLocked(ip) || r.createdLocked(ip) || (known && h.epoch == r.epoch && !r.unchained && holds(h, ip)) {
				v = Trust
			}
			r.takeLocked(ip)
		case Del:
			switch {
			case current && holds(h, ip) && !unseen:
				// The pod's own DEL, indexed in this epoch: its recorded
				// keys are every entry of the IP.
				v = Trust
			case known && holds(h, ip):
				// Indexed before a sign of an unseen owner: if this DEL is a
				// retry of one that bypassed ctscrub, a pod scrubd never saw
				// may have held the IP since. The scrub sweeps; nothing is
				// released (t.release false).
			default:
				// Not indexed: a pod scrubd never saw had this IP.
				r.takeLocked(ip)
			}
		case GC:
			if current && holds(h, ip) && !unseen {
				v = Trust
			}
		case Create:
			if r.releasedLocked(ip) {
				v = Trust
			}
			r.takeLocked(ip)
		case Delete:
			switch {
			case unseen:
				// A create no index start followed: the pod ran outside
				// ctscrub (issue 34, item 3).
				r.takeLocked(ip)
			case r.releasedLocked(ip) || r.heldNowLocked(ip):
				v = Trust
			}
		case Unknown:
			if r.releasedLocked(ip) {
				v = Trust
			}
		case Operator:
			v = Trust
		case DelGone:
			// No new owner: nothing taken (a pass running now still vouches
			// for the address at its end).
			if r.releasedLocked(ip) {
				v = Trust
			}
		}
		if r.blind && ev != Operator {
			// A pod no recorder sees may send towards this address too,
			// and a holder's interface records what reaches the address
			// only while its pod lives: one that died with its DEL still
			// to come records nothing.
			v = Sweep
		}
		t.verdicts[ip] = v
		t.gens[ip] = r.ip(ip).gen
	}
	return t
}

func holds(h holder, ip netip.Addr) bool {
	for _, x := range h.ips {
		if x == ip {
			return true
		}
	}
	return false
}

// End closes a scrub: completed reports that it completed on every backend
// for every IP. It returns the IPs it released and those the caller must
// mark incomplete now (a GC's IPs it did not let the GC scrub).
func (t *Ticket) End(completed bool) (released, distrust []netip.Addr) {
	return t.EndEach(func(netip.Addr) bool { return completed })
}

// EndEach is End with completion told per IP.
func (t *Ticket) EndEach(completed func(netip.Addr) bool) (released, distrust []netip.Addr) {
	r := t.r
	r.mu.Lock()
	defer r.mu.Unlock()
	for ip, v := range t.verdicts {
		s := r.ip(ip)
		still := s.gen == t.gens[ip] && r.epoch == t.epoch && !r.unchained
		switch t.ev {
		case Del:
			if completed(ip) && t.release && still && !r.blind && v == Trust {
				s.released, s.relEpoch = true, r.epoch
				released = append(released, ip)
			}
		case GC:
			if v == Sweep {
				distrust = append(distrust, ip)
			}
		case Create:
			if completed(ip) && still {
				s.created, s.crEpoch, s.crSeen = true, r.epoch, !r.blind
			}
		}
	}
	return released, distrust
}

// Start records an index start: a attaches ips, recorded from now on. Their
// releases and creates end.
func (r *Rule) Start(a api.Attachment, ips []netip.Addr) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, ip := range ips {
		r.takeLocked(ip)
	}
	r.holders[a] = holder{ips: append([]netip.Addr(nil), ips...), epoch: r.epoch}
}

// Stop records that a is no longer active (its DEL, or a GC dropped it).
func (r *Rule) Stop(a api.Attachment) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.holders, a)
}

// Unseen records a sign of an unseen owner: a new epoch, in which no earlier
// release, create or holder counts, and the rule blind until Sight. It
// returns how many releases ended.
func (r *Rule) Unseen() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for ip := range r.ips {
		if r.releasedLocked(ip) {
			n++
		}
	}
	r.epoch++
	r.blind = true
	return n
}

// Blind reports whether a pod no recorder sees may be running: releases
// and creates count again only after Sight.
func (r *Rule) Blind() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.blind
}

// Sight ends the blindness of a sign: a find that began in epoch (Epoch,
// read before it looked) followed every pod interface of the node and put
// the recorder on each, so every running pod is recorded from then on, its
// addresses held by an attachment or a found pod (Start). An entry such a
// pod made before towards an address no pod held is older than any release
// that counts from now: an address is released only by a scrub that began
// after it, trusting nothing (no release counted while blind), and so
// swept. It reports whether the rule sees again: not when a sign came
// since the find began, or while the config does not chain ctscrub.
func (r *Rule) Sight(epoch uint64) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.epoch != epoch || r.unchained {
		return false
	}
	r.blind = false
	return true
}

// SetChained records the conflist watch's reading. While the CNI config
// does not chain ctscrub nothing is trusted; the change either way starts a
// new epoch (pods may have started unseen in between). It reports whether
// the reading changed.
func (r *Rule) SetChained(chained bool) bool {
	r.mu.Lock()
	changed := r.unchained == chained
	r.unchained = !chained
	r.mu.Unlock()
	if changed || !chained {
		r.Unseen()
	}
	return changed
}

// Released reports whether ip is released now, and a mark that Still
// compares later (a late DEL scrubs only an IP still in the same release).
func (r *Rule) Released(ip netip.Addr) (Mark, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.releasedLocked(ip) {
		return Mark{}, false
	}
	return Mark{gen: r.ips[ip].gen, epoch: r.epoch}, true
}

// Mark is the moment of a release.
type Mark struct{ gen, epoch uint64 }

// Still reports whether ip is still in the release m was taken in.
func (r *Rule) Still(ip netip.Addr, m Mark) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.releasedLocked(ip) && r.ips[ip].gen == m.gen && r.epoch == m.epoch
}

// Holds reports whether an attachment indexed in this epoch holds ip.
func (r *Rule) Holds(ip netip.Addr) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.heldNowLocked(ip)
}

// Epoch is the number of signs of an unseen owner since the daemon started.
func (r *Rule) Epoch() uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.epoch
}

// Has reports whether ip is one of the ticket's IPs, and its verdict.
func (t *Ticket) Has(ip netip.Addr) (Verdict, bool) {
	v, ok := t.verdicts[ip]
	return v, ok
}

// Rename moves from's holding to to, with the epoch it was indexed in: a
// pod the attach step at start found (a holder under a name of scrubd's
// own, Boot) whose CNI DEL now names it. It reports whether from held.
func (r *Rule) Rename(from, to api.Attachment) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	h, ok := r.holders[from]
	if !ok {
		return false
	}
	delete(r.holders, from)
	r.holders[to] = h
	return true
}

// State is what of the rule survives a clean stop (the index snapshot):
// the IPs released and created in the current epoch. Holders are not in
// it: after a restart they come from the attachments and the attach step.
type State struct {
	Released, Created []netip.Addr
}

// State returns the releases and creates that count now (none while the
// CNI config does not chain ctscrub).
func (r *Rule) State() State {
	r.mu.Lock()
	defer r.mu.Unlock()
	var st State
	for ip := range r.ips {
		if r.releasedLocked(ip) {
			st.Released = append(st.Released, ip)
		}
		if r.createdLocked(ip) {
			st.Created = append(st.Created, ip)
		}
	}
	return st
}

// Found is a pod interface the attach step at start found that no
// restored attachment names: it holds IPs, and the recorder was attached
// to it then. A is the name scrubd gives it until its DEL names it
// (Rename).
type Found struct {
	A   api.Attachment
	IPs []netip.Addr
}

// Boot is the rule's part of one start: the holders the attach step
// found, what a clean stop kept, and, at the end of the bootstrap pass
// over the CT maps, which addresses the pass may be trusted for.
type Boot struct {
	r      *Rule
	epoch  uint64
	seq    uint64             // events after it give an IP a generation above it
	held   map[netip.Addr]int // holders of this epoch per IP at the start
	holder map[netip.Addr]api.Attachment
	// free: the attach step found every pod interface of the node, so an
	// address no pod held at the start has no pod the recorder misses.
	free bool
	// Restored reports whether kept's releases and creates were taken.
	Restored bool
}

// BeginBoot records what the attach step at start found, after the
// restored attachments were started (Start): found (pods no attachment
// names) become holders of this epoch; missed reports pod interfaces it
// could not open (a pod whose IPs nobody knows). kept (nil after an
// unclean stop) is the State a clean stop wrote: its releases and creates
// are taken only when the find shows that no pod ran unseen while scrubd
// was down: no found pod outside the attachments, none missed, and no
// kept IP held now; otherwise none is taken, as after an unclean stop.
func (r *Rule) BeginBoot(kept *State, found []Found, missed bool) *Boot {
	for _, f := range found {
		r.Start(f.A, f.IPs)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	b := &Boot{r: r, free: !missed, held: map[netip.Addr]int{}, holder: map[netip.Addr]api.Attachment{}}
	// The find at start followed every pod (or not): a pod it missed runs
	// unrecorded. A blindness from before the restart ends here only if
	// nothing was missed (the find is a Sight of its own).
	r.blind = missed
	for a, h := range r.holders {
		for _, ip := range h.ips {
			b.held[ip]++
			b.holder[ip] = a
		}
	}
	if kept != nil {
		ok := len(found) == 0 && !missed
		for _, ip := range append(append([]netip.Addr(nil), kept.Released...), kept.Created...) {
			if b.held[ip] > 0 {
				ok = false
			}
		}
		if ok && !r.unchained {
			for _, ip := range kept.Released {
				s := r.ip(ip)
				s.released, s.relEpoch = true, r.epoch
			}
			for _, ip := range kept.Created {
				s := r.ip(ip)
				s.created, s.crEpoch, s.crSeen = true, r.epoch, true
			}
			b.Restored = true
		}
		// Else they are not taken: a restart starts with none, as after an
		// unclean stop.
	}
	b.epoch, b.seq = r.epoch, r.seq
	return b
}

// Trust is the rule's answer, at the end of the bootstrap pass, for an
// address the pass vouches for (its set holds every entry of it the maps
// had, and every one the recorder saw since the attach). It is trusted
// when no sign of an unseen owner and no event that gives it an owner
// (an ADD, a delegate create, an index start, an unknown DEL) came since
// BeginBoot, and either
//   - one holder held it at the start and holds it now (the recorder saw
//     it since: a restored attachment, or a pod the attach step found), or
//   - nobody held it and free: every pod of the node was found at the
//     start, and (freeNow) again at the end of the pass (no pod the
//     recorder misses may have sent towards it).
//
// An address two holders claimed, or whose holder left (its DEL, a GC), is
// not trusted: its next scrub sweeps.
func (b *Boot) Trust(ip netip.Addr, freeNow bool) bool {
	r := b.r
	r.mu.Lock()
	defer r.mu.Unlock()
	return b.trustLocked(ip, freeNow)
}

func (b *Boot) trustLocked(ip netip.Addr, freeNow bool) bool {
	r := b.r
	if r.epoch != b.epoch || r.unchained || r.blind {
		return false
	}
	if s := r.ips[ip]; s != nil && s.gen > b.seq {
		return false
	}
	switch b.held[ip] {
	case 0:
		if !b.free || !freeNow {
			return false
		}
		for _, h := range r.holders {
			if holds(h, ip) {
				return false
			}
		}
		return true
	case 1:
		h, ok := r.holders[b.holder[ip]]
		return ok && h.epoch == r.epoch && holds(h, ip)
	}
	return false
}

// Release releases the addresses of ips that nobody held, once the index
// has declared them complete (index.TrackFiled): their next ADD or
// delegate create may trust the index, as after a DEL. Each is judged
// again as Trust judges it. It returns those released.
func (b *Boot) Release(ips []netip.Addr, freeNow bool) (released []netip.Addr) {
	r := b.r
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, ip := range ips {
		if b.held[ip] != 0 || !b.trustLocked(ip, freeNow) {
			continue
		}
		s := r.ip(ip)
		s.released, s.relEpoch = true, r.epoch
		released = append(released, ip)
	}
	return released
}
