// Package ownermodel is the reference model of the ownership tests: a
// seeded random walk over a small node (pods come and go on a few IPs, talk,
// are created and deleted with ctscrub chained or not, GCs, scrubd restarts)
// that knows the truth (which pod holds which IP, which CT entries exist and
// which the recorder saw) without using the rule under test. A System
// performs the node's events on what is tested: the ownership rule alone
// (scrubd/owner) or the real daemon over real maps (scrubd/daemon).
//
// The invariants, checked after every step:
//
//   - a scrub that answered complete left no entry of its IP (every entry
//     existed before the answer: the walk is sequential);
//   - a GC deleted no entry whose pods (its own, and its local peer's) are
//     all alive.
//
// On a violation, Check reports the seed and the shortest step list it
// finds that still violates (delta debugging over the steps).
package ownermodel

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"strconv"
	"strings"

	"github.com/ctscrub/ctscrub/scrubd/api"
)

// Entry is one CT entry of the model: a flow of Pod (the IP's holder when
// it was made), made by the pod or by a peer towards it.
type Entry struct {
	ID      int
	IP      netip.Addr // the IP it is filed under (its pod's)
	Pod     int
	Peer    netip.Addr // the other end when it is a local pod (else a remote address)
	PeerPod int        // that pod (-1: a remote address)
	Indexed bool       // the recorder saw it (the sender's or receiver's interface is attached)
	// Free: a pod's flow towards an address no pod held (Peer, PeerPod are
	// the sender; IP the free address). No pod's live flow: a GC may take it.
	Free bool
}

// System is what the walk drives. Each method that scrubs returns whether
// the answer was complete; the model then checks Present on the IP's
// entries.
type System interface {
	// Delegate is Cilium's agent asking scrubd at an endpoint's create or
	// delete (api.DelegateEventCreate, api.DelegateEventDelete).
	Delegate(event string, ip netip.Addr) (complete bool)
	// Add is ctscrub's ADD: its scrub, then (unless fail) the index start.
	Add(a api.Attachment, ip netip.Addr, fail bool) (complete bool)
	// Del is ctscrub's DEL of a (the scrub and index stop in one request).
	Del(a api.Attachment, ip netip.Addr) (complete bool)
	// GC is a CNI GC listing valid as the network's attachments.
	GC(valid []api.Attachment)
	// SetChained makes the CNI config chain ctscrub or not.
	SetChained(chained bool)
	// Restart restarts scrubd; kill: without a clean stop. gone is the
	// attachments whose pod is gone (their netns too). The restart's
	// bootstrap finds every live pod's interface except hidden's, and
	// missed says that it could not follow one (hidden, or a device it
	// cannot tell from a pod's). Its pass over the CT maps runs until
	// PassEnd (or the next restart).
	Restart(kill bool, gone, hidden []api.Attachment, missed bool)
	// PassEnd lets the bootstrap pass end and waits for it.
	PassEnd()
	// Refind is scrubd's find after a sign of an unseen owner (or a find
	// at start that missed a pod): the recorder put on every pod interface
	// it can follow (all but the last restart's hidden one), and the rule
	// told it sees again when nothing was missed. Nothing while the CNI
	// config does not chain ctscrub.
	Refind()
	// Born says that a's pod exists now (its sandbox and network
	// namespace), before anything else of it.
	Born(a api.Attachment, ip netip.Addr)
	// Gone says that a's pod is gone: its sandbox and network namespace.
	Gone(a api.Attachment)
	// Flow makes e's CT entries (and, when e.Indexed, records them).
	Flow(e Entry)
	// Present reports whether any CT entry of e is left.
	Present(e Entry) bool
}

// Op is a kind of step.
type Op uint8

const (
	OpCreate           Op = iota // a pod gets a free IP (ADD through the chain when chained)
	OpCreateFail                 // as OpCreate, ctscrub's ADD fails after its scrub: the runtime tears the pod down
	OpTraffic                    // a pod makes a flow, or a peer makes one towards it
	OpDelete                     // a pod goes (DEL through the chain when chained; then Cilium's delete)
	OpDeleteAgentFirst           // as OpDelete, Cilium's endpoint delete before ctscrub's DEL
	OpRetryDel                   // a dead pod's DEL comes again through the chain
	OpUnchain                    // the CNI config stops chaining ctscrub
	OpRechain                    // and chains it again
	OpGC                         // CNI GC with the alive pods as the valid list
	OpRestart                    // scrubd restarts cleanly
	OpKill                       // scrubd is killed (the index is lost)
	OpCreateMissed               // a pod created outside the chain, and the conflist watch missed it
	OpDeleteMissed               // a pod's DEL bypasses ctscrub, and the watch missed it
	OpRestartMissed              // scrubd restarts cleanly and its bootstrap's find misses a pod
	OpPassEnd                    // the bootstrap pass of the last restart ends
	OpTrafficFree                // a pod sends towards an address no pod holds (Cilium makes its entry at the sender)
	OpRefind                     // scrubd's find after a sign puts the recorder on every pod it can follow
	numOps
)

var opNames = [numOps]string{"create", "create-add-fails", "traffic", "delete", "delete-agent-first", "retry-del",
	"unchain", "rechain", "gc", "restart", "kill", "create-missed", "delete-missed", "restart-find-misses", "pass-end", "traffic-to-free", "refind"}

// Step is one step: an Op and two choices, taken modulo what is there when
// the step runs (so any sub-list of steps is a valid walk).
type Step struct {
	Op   Op
	A, B int
}

func (s Step) String() string { return fmt.Sprintf("%s(%d,%d)", opNames[s.Op], s.A, s.B) }

// Weights of the ops: pods come and go and talk often; signs, GCs and
// restarts are rare, as on a node.
var Weights = [numOps]int{OpCreate: 20, OpCreateFail: 2, OpTraffic: 30, OpDelete: 15, OpDeleteAgentFirst: 4,
	OpRetryDel: 3, OpUnchain: 2, OpRechain: 3, OpGC: 3, OpRestart: 1, OpKill: 1, OpCreateMissed: 1, OpDeleteMissed: 1, OpRestartMissed: 1, OpPassEnd: 3, OpTrafficFree: 5, OpRefind: 3}

// Steps generates n steps from seed.
func Steps(seed uint64, n int) []Step {
	rng := rand.New(rand.NewPCG(seed, seed^0x5eed))
	total := 0
	for _, w := range Weights {
		total += w
	}
	out := make([]Step, n)
	for i := range out {
		x := rng.IntN(total)
		k := Op(0)
		for ; x >= Weights[k]; k++ {
			x -= Weights[k]
		}
		out[i] = Step{Op: k, A: rng.IntN(64), B: rng.IntN(64)}
	}
	return out
}

type pod struct {
	id     int
	ip     netip.Addr
	alive  bool
	bypass bool // its ADD bypassed ctscrub with no sign: so does its DEL
	att    api.Attachment
}

// World is the truth of one walk.
type World struct {
	sys     System
	ips     []netip.Addr
	pods    []*pod
	holder  map[netip.Addr]*pod // the alive pod holding an IP
	entries map[netip.Addr][]Entry
	active  map[int]bool // scrubd's active attachments, as its journal has them
	found   map[int]bool // live pods the last restart's bootstrap (or a find since) found: recorded since
	hidden  int          // the pod the last restart's find missed (-1: none); every find misses it
	chained bool
	nextID  int
	// Violation is the first broken invariant ("" while none).
	Violation string
}

// IPs are the walk's pod IPs (few, so that they are reused often).
func IPs() []netip.Addr {
	var out []netip.Addr
	for i := range 4 {
		out = append(out, netip.AddrFrom4([4]byte{10, 244, 0, byte(10 + i)}))
	}
	return out
}

// NewWorld starts a walk on sys.
func NewWorld(sys System) *World {
	return &World{sys: sys, ips: IPs(), holder: map[netip.Addr]*pod{}, entries: map[netip.Addr][]Entry{},
		active: map[int]bool{}, found: map[int]bool{}, hidden: -1, chained: true}
}

func (w *World) fail(format string, args ...any) {
	if w.Violation == "" {
		w.Violation = fmt.Sprintf(format, args...)
	}
}

// answered checks a scrub's answer for ip: complete means none of its
// entries is left. The entries gone are dropped from the truth.
func (w *World) answered(what string, ip netip.Addr, complete bool) {
	var left []Entry
	for _, e := range w.entries[ip] {
		if w.sys.Present(e) {
			left = append(left, e)
		}
	}
	w.entries[ip] = left
	if complete && len(left) > 0 {
		w.fail("%s of %s answered complete with %d entries left (pod %d's, indexed %v)", what, ip, len(left), left[0].Pod, left[0].Indexed)
	}
}

func (w *World) alive() []*pod {
	var out []*pod
	for _, ip := range w.ips {
		if p := w.holder[ip]; p != nil {
			out = append(out, p)
		}
	}
	return out
}

// dead lists the last pods that went (a DEL retry comes soon after).
func (w *World) dead() []*pod {
	var out []*pod
	for i := len(w.pods) - 1; i >= 0 && len(out) < 8 && i >= len(w.pods)-64; i-- {
		if !w.pods[i].alive {
			out = append(out, w.pods[i])
		}
	}
	return out
}

func (w *World) delegate(event string, ip netip.Addr) {
	w.answered("delegate "+event, ip, w.sys.Delegate(event, ip))
}

func (w *World) del(p *pod) {
	w.answered("DEL scrub", p.ip, w.sys.Del(p.att, p.ip))
	delete(w.active, p.id)
}

// Run runs one step.
func (w *World) Run(s Step) {
	switch s.Op {
	case OpCreate, OpCreateFail, OpCreateMissed:
		var free []netip.Addr
		for _, ip := range w.ips {
			if w.holder[ip] == nil {
				free = append(free, ip)
			}
		}
		if len(free) == 0 {
			return
		}
		ip := free[s.A%len(free)]
		p := &pod{id: len(w.pods), ip: ip, alive: true}
		p.att = api.Attachment{ContainerID: fmt.Sprintf("c%d", p.id), IfName: "eth0"}
		w.pods = append(w.pods, p)
		w.holder[ip] = p
		w.sys.Born(p.att, ip)
		w.delegate(api.DelegateEventCreate, ip) // cilium-cni's ADD, first in the chain
		if !w.chained || s.Op == OpCreateMissed {
			p.bypass = s.Op == OpCreateMissed
			return // the pod runs unseen
		}
		fail := s.Op == OpCreateFail
		w.answered("ADD scrub", ip, w.sys.Add(p.att, ip, fail))
		if fail {
			// The runtime DELs the pod whose ADD failed.
			p.alive = false
			delete(w.holder, ip)
			w.sys.Gone(p.att)
			w.del(p)
			w.delegate(api.DelegateEventDelete, ip)
			return
		}
		for id := range w.active {
			if w.pods[id].ip == ip {
				delete(w.active, id) // displaced by the index start
			}
		}
		w.active[p.id] = true
	case OpTraffic:
		al := w.alive()
		if len(al) == 0 {
			return
		}
		p, peer := al[s.A%len(al)], al[s.B%len(al)]
		e := Entry{ID: w.nextID, IP: p.ip, Pod: p.id, PeerPod: -1, Indexed: w.recorded(p)}
		w.nextID++
		if peer != p {
			// A peer's flow towards p, recorded on either interface.
			e.Peer, e.PeerPod = peer.ip, peer.id
			e.Indexed = e.Indexed || w.recorded(peer)
		}
		w.sys.Flow(e)
		w.entries[p.ip] = append(w.entries[p.ip], e)
	case OpDelete, OpDeleteAgentFirst, OpDeleteMissed:
		al := w.alive()
		if len(al) == 0 {
			return
		}
		p := al[s.A%len(al)]
		p.alive = false
		delete(w.holder, p.ip)
		w.sys.Gone(p.att)
		if s.Op == OpDeleteAgentFirst {
			w.delegate(api.DelegateEventDelete, p.ip)
		}
		if w.chained && !p.bypass && s.Op != OpDeleteMissed {
			w.del(p)
		}
		if s.Op != OpDeleteAgentFirst {
			w.delegate(api.DelegateEventDelete, p.ip)
		}
	case OpRetryDel:
		d := w.dead()
		if len(d) == 0 || !w.chained {
			return
		}
		p := d[s.A%len(d)]
		if h := w.holder[p.ip]; h != nil && w.active[h.id] {
			return // the plugin leaves an IP another attachment holds
		}
		w.del(p)
	case OpUnchain:
		w.chained = false
		w.sys.SetChained(false)
	case OpRechain:
		w.chained = true
		w.sys.SetChained(true)
	case OpGC:
		var valid []api.Attachment
		for _, p := range w.alive() {
			valid = append(valid, p.att)
		}
		if len(valid) == 0 {
			return // a GC with no valid attachment is refused
		}
		// Only what the GC itself deletes counts: an earlier step's scrub of
		// a peer's IP (a DEL retry sweeping an IP an unseen pod holds now)
		// may have taken a pod-to-pod entry already.
		before := map[int]bool{}
		for _, ip := range w.ips {
			for _, e := range w.entries[ip] {
				before[e.ID] = w.sys.Present(e)
			}
		}
		w.sys.GC(valid)
		for id := range w.active {
			if !w.pods[id].alive {
				delete(w.active, id)
			}
		}
		for _, ip := range w.ips {
			var left []Entry
			for _, e := range w.entries[ip] {
				if w.sys.Present(e) {
					left = append(left, e)
				} else if before[e.ID] && !e.Free && w.pods[e.Pod].alive && (e.PeerPod < 0 || w.pods[e.PeerPod].alive) {
					// A flow between two pods goes with either: only one
					// whose every pod is alive must stay.
					w.fail("GC deleted an entry of %s of pod %d, alive (peer %v, pod %d; indexed %v)", ip, e.Pod, e.Peer, e.PeerPod, e.Indexed)
				}
			}
			w.entries[ip] = left
		}
	case OpRestart, OpKill, OpRestartMissed:
		var gone []api.Attachment
		for id := range w.active {
			if p := w.pods[id]; !p.alive {
				gone = append(gone, p.att)
				delete(w.active, id) // restore stops it: its netns is gone
			}
		}
		// The bootstrap attaches the recorder to every live pod it finds;
		// a restored attachment is re-attached whatever the find says.
		var hidden []api.Attachment
		if s.Op == OpRestartMissed {
			var cand []*pod
			for _, p := range w.alive() {
				if !w.active[p.id] {
					cand = append(cand, p)
				}
			}
			if len(cand) > 0 {
				hidden = append(hidden, cand[s.B%len(cand)].att)
			}
		}
		clear(w.found)
		w.hidden = -1
		for _, p := range w.alive() {
			if len(hidden) == 0 || p.att != hidden[0] {
				w.found[p.id] = true
			} else {
				w.hidden = p.id
			}
		}
		w.sys.Restart(s.Op == OpKill, gone, hidden, s.Op == OpRestartMissed)
		if !w.chained {
			w.sys.SetChained(false) // the conflist watch's first reading
		}
	case OpPassEnd:
		w.sys.PassEnd()
	case OpRefind:
		if !w.chained {
			return
		}
		for _, p := range w.alive() {
			if p.id != w.hidden {
				w.found[p.id] = true
			}
		}
		w.sys.Refind()
	case OpTrafficFree:
		al := w.alive()
		var free []netip.Addr
		for _, ip := range w.ips {
			if w.holder[ip] == nil {
				free = append(free, ip)
			}
		}
		if len(al) == 0 || len(free) == 0 {
			return
		}
		var senders []*pod
		for _, p := range al {
			// A pod no sign revealed (created outside the chain with the
			// conflist watch missing it) is outside what any rule can know
			// until a find records it: the model keeps it to holders'
			// cases, which the delegate's create names.
			if !p.bypass || w.recorded(p) {
				senders = append(senders, p)
			}
		}
		if len(senders) == 0 {
			return
		}
		p, ip := senders[s.A%len(senders)], free[s.B%len(free)]
		e := Entry{ID: w.nextID, IP: ip, Pod: p.id, Peer: p.ip, PeerPod: p.id, Indexed: w.recorded(p), Free: true}
		w.nextID++
		w.sys.Flow(e)
		w.entries[ip] = append(w.entries[ip], e)
	}
}

// recorded reports whether a recorder sees p's flows: its attachment's,
// or the bootstrap's since it found p.
func (w *World) recorded(p *pod) bool { return w.active[p.id] || w.found[p.id] }

// Walk runs steps on a fresh System and returns the index of the step
// after which an invariant broke (-1: none) and what broke.
func Walk(newSys func() System, steps []Step) (int, string) {
	w := NewWorld(newSys())
	for i, s := range steps {
		w.Run(s)
		if w.Violation != "" {
			return i, w.Violation
		}
	}
	return -1, ""
}

// Shrink returns a shorter list of steps that still violates (ddmin).
func Shrink(newSys func() System, steps []Step) []Step {
	n := 2
	for len(steps) >= 2 {
		chunk := (len(steps) + n - 1) / n
		reduced := false
		for start := 0; start < len(steps); start += chunk {
			end := min(start+chunk, len(steps))
			try := append(append([]Step(nil), steps[:start]...), steps[end:]...)
			if at, _ := Walk(newSys, try); at >= 0 {
				steps = try[:at+1]
				n = max(n-1, 2)
				reduced = true
				break
			}
		}
		if !reduced {
			if n >= len(steps) {
				break
			}
			n = min(2*n, len(steps))
		}
	}
	return steps
}

// Report is a violation found by Check, ready to print.
type Report struct {
	Seed     uint64
	At       int
	Why      string
	Shortest []Step
	MinWhy   string
}

func (r Report) String() string {
	var list []string
	for _, s := range r.Shortest {
		list = append(list, s.String())
	}
	return fmt.Sprintf("seed %d: violated after step %d: %s\nshortest found (%d steps): %s\n  -> %s",
		r.Seed, r.At, r.Why, len(r.Shortest), strings.Join(list, " "), r.MinWhy)
}

// Check walks seeds x steps and returns the violations, each shrunk
// (shrink false: not shrunk, for a system too slow for it).
func Check(newSys func() System, seeds []uint64, steps int, shrink bool) []Report {
	var out []Report
	for _, seed := range seeds {
		all := Steps(seed, steps)
		at, why := Walk(newSys, all)
		if at < 0 {
			continue
		}
		r := Report{Seed: seed, At: at, Why: why, Shortest: all[:at+1], MinWhy: why}
		if shrink {
			r.Shortest = Shrink(newSys, all[:at+1])
			_, r.MinWhy = Walk(newSys, r.Shortest)
		}
		out = append(out, r)
	}
	return out
}

// EnvInt is the positive integer in the environment variable k, or def:
// how long a walk is (CTSCRUB_MODEL_STEPS and friends).
func EnvInt(k string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(k)); err == nil && v > 0 {
		return v
	}
	return def
}

// Seeds are the seeds 1..n, or only one when one is given.
func Seeds(one uint64, n int) []uint64 {
	if one != 0 {
		return []uint64{one}
	}
	out := make([]uint64, 0, n)
	for s := 1; s <= n; s++ {
		out = append(out, uint64(s))
	}
	return out
}
