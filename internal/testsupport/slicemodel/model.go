// Package slicemodel is the reference model of the remote-backend watch's
// tests (scrubd/endpoints): a seeded random walk over a few Services whose
// EndpointSlices gain, drain, stop, lose and move endpoints, are deleted
// and re-created, with addresses reused, and watches that drop and relist.
// It knows which slices name which address, as delivered to the watch,
// without using the rule under test, and drives a System with the events an
// informer delivers (add, update, delete, and a relist's deletes as
// cache.DeletedFinalStateUnknown).
//
// The invariants, checked on every address the System hands out:
//
//   - serving: no endpoint with serving: true names it in any delivered
//     slice;
//   - same Service: no other slice of the Service it left names it, nor
//     is it half-way through a move between two of them (written out of
//     one, not yet into the other);
//   - any slice: no slice at all names it (the rule scrubd keeps);
//   - early: it has been named by no slice for the hold;
//
// and after every step, missed: an address named by no slice for the hold
// since it was last named has been handed out.
package slicemodel

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
)

// System is what the walk drives: an informer's handlers and a clock.
type System interface {
	OnAdd(obj any, initial bool)
	OnUpdate(old, obj any)
	OnDelete(obj any)
	// Due hands out the addresses the System acts on at now.
	Due(now time.Time) []netip.Addr
}

// Hold is the hold the walk expects of the System.
const Hold = time.Second

// Figures are a walk's counts.
type Figures struct {
	Steps, Events, HandedOut int
	Violations               map[string]int
	First                    string // the first violation, with the steps before it
}

type endpoint struct {
	addr                 netip.Addr
	serving, terminating bool
}

type sliceT struct {
	service string
	eps     []endpoint
}

type walk struct {
	rng   *rand.Rand
	sys   System
	now   time.Time
	truth map[string]*sliceT // what the API holds
	seen  map[string]*sliceT // what the watch was delivered
	down  bool               // the watch is disconnected: changes reach it at the relist
	// absentSince: when the delivered slices stopped naming an address
	// (absent from the map: named now, or never named).
	absentSince map[netip.Addr]time.Time
	handed      map[netip.Addr]bool   // handed out since it was last named
	left        map[netip.Addr]string // the Service of the slice it last left
	moves       []move                // second halves of moves between slices
	log         []string
	f           Figures
	rv          int
}

type move struct {
	at   time.Time
	key  string
	addr netip.Addr
}

var (
	services = []string{"web", "api", "db"}
	sliceSuf = []string{"a", "b"}
	addrs    = func() []netip.Addr {
		var out []netip.Addr
		for i := 1; i <= 6; i++ {
			out = append(out, netip.AddrFrom4([4]byte{10, 1, 0, byte(i)}))
		}
		return out
	}()
)

// Walk runs steps steps from seed over sys.
func Walk(seed uint64, steps int, sys System) Figures {
	w := &walk{
		rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)), sys: sys,
		now: time.Unix(1_000_000, 0), truth: map[string]*sliceT{}, seen: map[string]*sliceT{},
		absentSince: map[netip.Addr]time.Time{}, handed: map[netip.Addr]bool{}, left: map[netip.Addr]string{},
		f: Figures{Violations: map[string]int{}},
	}
	for w.f.Steps = 0; w.f.Steps < steps; w.f.Steps++ {
		w.step()
		w.due()
	}
	return w.f
}

func key(svc, suf string) string { return "ns/" + svc + "-" + suf }

func (w *walk) note(format string, a ...any) {
	w.log = append(w.log, fmt.Sprintf("%5d %s ", w.f.Steps, w.now.Format("15:04:05.000"))+fmt.Sprintf(format, a...))
	if len(w.log) > 40 {
		w.log = w.log[1:]
	}
}

func (w *walk) step() {
	svc := services[w.rng.IntN(len(services))]
	k := key(svc, sliceSuf[w.rng.IntN(len(sliceSuf))])
	a := addrs[w.rng.IntN(len(addrs))]
	s := w.truth[k]
	switch r := w.rng.IntN(100); {
	case r < 22: // an endpoint joins (a pod becomes a backend, or an address is reused)
		if s == nil {
			s = &sliceT{service: svc}
		}
		if s.index(a) < 0 {
			s.eps = append(s.eps, endpoint{addr: a, serving: true})
			w.write(k, s, "add %s to %s", a, k)
		}
	case r < 32: // it drains: terminating, still serving
		if i := s.index(a); i >= 0 {
			s.eps[i].terminating = true
			w.write(k, s, "drain %s in %s", a, k)
		}
	case r < 40: // it stops serving
		if i := s.index(a); i >= 0 {
			s.eps[i].serving = false
			w.write(k, s, "stop %s in %s", a, k)
		}
	case r < 55: // it leaves (its pod deleted)
		if i := s.index(a); i >= 0 {
			s.eps = slices.Delete(s.eps, i, i+1)
			w.write(k, s, "remove %s from %s", a, k)
		}
	case r < 63: // the controller moves it to the Service's other slice, in two writes
		if i := s.index(a); i >= 0 {
			other := key(svc, sliceSuf[(slices.Index(sliceSuf, k[len(k)-1:])+1)%len(sliceSuf)])
			s.eps = slices.Delete(s.eps, i, i+1)
			w.write(k, s, "move %s out of %s", a, k)
			gap := time.Duration(w.rng.Int64N(int64(Hold * 9 / 10)))
			w.moves = append(w.moves, move{at: w.now.Add(gap), key: other, addr: a})
		}
	case r < 67: // the slice is deleted
		if s != nil {
			w.write(k, nil, "delete slice %s", k)
		}
	case r < 69: // the Service is deleted (its slices go)
		for _, suf := range sliceSuf {
			if w.truth[key(svc, suf)] != nil {
				w.write(key(svc, suf), nil, "delete slice %s (service %s deleted)", key(svc, suf), svc)
			}
		}
	case r < 72: // the watch drops; changes pile up until it relists
		if !w.down {
			w.down = true
			w.note("watch down")
		}
	case r < 76:
		if w.down {
			w.relist()
		}
	default: // time passes
		d := time.Duration(w.rng.Int64N(int64(2 * Hold)))
		w.advance(d)
	}
}

// advance moves the clock, completing the moves that fall due on the way.
func (w *walk) advance(d time.Duration) {
	end := w.now.Add(d)
	for {
		slices.SortFunc(w.moves, func(x, y move) int { return x.at.Compare(y.at) })
		if len(w.moves) == 0 || w.moves[0].at.After(end) {
			break
		}
		m := w.moves[0]
		w.moves = w.moves[1:]
		if m.at.After(w.now) {
			w.now = m.at
			w.due()
		}
		s := w.truth[m.key]
		if s == nil {
			s = &sliceT{service: m.key[3 : len(m.key)-2]}
		}
		if s.index(m.addr) < 0 {
			s.eps = append(s.eps, endpoint{addr: m.addr, serving: true})
			w.write(m.key, s, "move %s into %s", m.addr, m.key)
		}
	}
	w.now = end
}

func (s *sliceT) index(a netip.Addr) int {
	if s == nil {
		return -1
	}
	return slices.IndexFunc(s.eps, func(e endpoint) bool { return e.addr == a })
}

func (s *sliceT) clone() *sliceT {
	if s == nil {
		return nil
	}
	return &sliceT{service: s.service, eps: slices.Clone(s.eps)}
}

// write changes the API's slice k to s (nil: deleted) and delivers it
// unless the watch is down.
func (w *walk) write(k string, s *sliceT, format string, a ...any) {
	if s == nil || (len(s.eps) == 0 && w.rng.IntN(4) == 0) {
		// An empty slice is sometimes deleted rather than kept empty.
		if w.truth[k] != nil || s != nil {
			delete(w.truth, k)
			s = nil
		}
	} else {
		w.truth[k] = s.clone()
	}
	w.note(format, a...)
	if !w.down {
		w.deliver(k, s, false)
	}
}

// deliver hands the watch slice k's new state.
func (w *walk) deliver(k string, s *sliceT, relist bool) {
	old := w.seen[k]
	w.f.Events++
	if old != nil {
		for _, e := range old.eps {
			if s.index(e.addr) < 0 {
				w.left[e.addr] = old.service
			}
		}
	}
	switch {
	case s == nil && old == nil:
		return
	case s == nil:
		var obj any = w.object(k, old)
		if relist {
			obj = cache.DeletedFinalStateUnknown{Key: k, Obj: obj}
		}
		delete(w.seen, k)
		w.sys.OnDelete(obj)
	case old == nil:
		w.seen[k] = s.clone()
		w.sys.OnAdd(w.object(k, s), false)
	default:
		w.seen[k] = s.clone()
		w.sys.OnUpdate(w.object(k, old), w.object(k, s))
	}
	w.refresh()
}

// relist is the informer's re-list after a dropped watch: every slice's
// current state at once, gone ones as DeletedFinalStateUnknown.
func (w *walk) relist() {
	w.down = false
	w.note("relist")
	keys := map[string]bool{}
	for k := range w.truth {
		keys[k] = true
	}
	for k := range w.seen {
		keys[k] = true
	}
	sorted := make([]string, 0, len(keys))
	for k := range keys {
		sorted = append(sorted, k)
	}
	slices.Sort(sorted)
	for _, k := range sorted {
		w.deliver(k, w.truth[k].clone(), true)
	}
}

func (w *walk) object(k string, s *sliceT) *discoveryv1.EndpointSlice {
	w.rv++
	ns, name, _ := strings.Cut(k, "/")
	o := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, ResourceVersion: strconv.Itoa(w.rv),
			Labels: map[string]string{discoveryv1.LabelServiceName: s.service}},
		AddressType: discoveryv1.AddressTypeIPv4,
	}
	for _, e := range s.eps {
		ready := e.serving && !e.terminating
		sv, t := e.serving, e.terminating
		o.Endpoints = append(o.Endpoints, discoveryv1.Endpoint{Addresses: []string{e.addr.String()},
			Conditions: discoveryv1.EndpointConditions{Ready: &ready, Serving: &sv, Terminating: &t}})
	}
	return o
}

// refresh updates absentSince from the delivered slices.
func (w *walk) refresh() {
	for _, a := range addrs {
		named := false
		for _, s := range w.seen {
			named = named || s.index(a) >= 0
		}
		_, waiting := w.absentSince[a]
		switch {
		case named:
			delete(w.absentSince, a)
			w.handed[a] = false
		case !waiting && w.everNamed(a):
			w.absentSince[a] = w.now
		}
	}
}

func (w *walk) everNamed(a netip.Addr) bool {
	_, known := w.handed[a]
	return known
}

// due asks the System and checks what it hands out.
func (w *walk) due() {
	for _, a := range w.sys.Due(w.now) {
		w.f.HandedOut++
		w.note("handed out %s", a)
		for k, s := range w.seen {
			i := s.index(a)
			if i < 0 {
				continue
			}
			if s.eps[i].serving {
				w.violate("serving", "%s is serving in %s", a, k)
			}
			if s.service == w.left[a] {
				w.violate("same Service", "%s is in %s, a slice of the Service it left", a, k)
			}
			w.violate("any slice", "%s is in %s", a, k)
		}
		for _, m := range w.moves {
			// Mid-move: the controller has it in the Service's other
			// slice, in a write the watch has not seen yet.
			if m.addr == a {
				w.violate("same Service", "%s is moving into %s (due in %v)", a, m.key, m.at.Sub(w.now))
			}
		}
		since, ok := w.absentSince[a]
		if !ok {
			continue // named by a slice: reported above
		}
		if w.now.Sub(since) < Hold {
			w.violate("early", "%s handed out %v after it left its last slice", a, w.now.Sub(since))
		}
		if w.handed[a] {
			w.violate("twice", "%s handed out twice since it was last named", a)
		}
		w.handed[a] = true
	}
	for a, since := range w.absentSince {
		if !w.handed[a] && w.now.Sub(since) >= Hold+time.Millisecond {
			w.violate("missed", "%s named by no slice since %v and not handed out", a, w.now.Sub(since))
			w.handed[a] = true
		}
	}
}

func (w *walk) violate(kind, format string, a ...any) {
	w.f.Violations[kind]++
	if w.f.First == "" {
		w.f.First = fmt.Sprintf("%s: %s\n%s", kind, fmt.Sprintf(format, a...), strings.Join(w.log, "\n"))
	}
}

// EnvInt reads an integer from the environment, or def.
func EnvInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}
