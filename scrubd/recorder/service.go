package recorder

import (
	"context"
	"errors"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// resolveDelay: how long after a service flow's record the early
// resolution waits, so Cilium (which handles the packet after the
// recorder) has created the flow's SERVICE and OUT entries.
const resolveDelay = 100 * time.Millisecond

// resolveQueueLen bounds the early resolution's queue (IPs, not records:
// an IP queued is not queued again).
const resolveQueueLen = 4096

// resolveQueue hands the early resolution the IPs of new service records,
// each due resolveDelay after its record. In order of records, so the
// worker waits only for the head's remaining delay: a burst of IPs is
// resolved one after the other at Resolve's own pace, not 100 ms apiece.
// Bounded: an IP offered to a full queue is dropped (counted); its next
// record offers it again. Dropping is sound because every scrub and audit
// resolves first (index.Hooks.Resolve, final) and marks there what can no
// longer be learnt: the early pass only narrows the windows in which a
// backend can vanish before its address is read.
type resolveQueue struct {
	mu      sync.Mutex
	queued  map[netip.Addr]bool
	ch      chan queuedIP
	dropped atomic.Uint64
}

type queuedIP struct {
	ip  netip.Addr
	due time.Time
}

func newResolveQueue(n int) *resolveQueue {
	return &resolveQueue{queued: make(map[netip.Addr]bool), ch: make(chan queuedIP, n)}
}

// offer queues ip, due resolveDelay after at (its record's arrival).
func (q *resolveQueue) offer(ip netip.Addr, at time.Time) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.queued[ip] {
		return
	}
	select {
	case q.ch <- queuedIP{ip: ip, due: at.Add(resolveDelay)}:
		q.queued[ip] = true
	default:
		q.dropped.Add(1)
	}
}

// taken: the worker resolves ip now; a record from here on queues it again.
func (q *resolveQueue) taken(ip netip.Addr) {
	q.mu.Lock()
	delete(q.queued, ip)
	q.mu.Unlock()
}

// resolveEarly runs the early resolution until ctx ends.
func (r *Recorder) resolveEarly(ctx context.Context, ix *index.Index, q *resolveQueue) {
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		var it queuedIP
		select {
		case <-ctx.Done():
			return
		case it = <-q.ch:
		}
		if d := time.Until(it.due); d > 0 {
			t.Reset(d)
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
		q.taken(it.ip)
		if retry := r.resolve(ix, it.ip, false); retry > 0 {
			// A flow's latest packet was too recent to settle it as
			// "no entry": again once Cilium has surely handled it.
			q.offer(it.ip, time.Now().Add(retry-resolveDelay))
		}
	}
}

// EarlyResolveDropped counts IPs the early resolution's full queue did not
// take (resolved at their scrub instead).
func (r *Recorder) EarlyResolveDropped() uint64 {
	if q := r.svcq.Load(); q != nil {
		return q.dropped.Load()
	}
	return 0
}

// Resolve learns the backends of ip's flows through VIPs Cilium
// load-balances per packet (index.Services) and indexes each flow's OUT
// key and its RELATED key, under every address of them that has a slot (a
// local backend pod's too). A backend that cannot be learnt for certain
// marks ip incomplete (index.ReasonServiceUnresolved), never guessed.
//
// final: a scrub or the audit is about to rely on the index. Then a pick
// still unread whose SERVICE entry is gone, and a newly learnt backend
// whose OUT entry is absent, mark the IP; early (final false, soon after
// the record) they only stay pending, since Cilium may not have created
// the entries yet. The windows are in docs/recorder.md ("Service VIPs").
func (r *Recorder) Resolve(ix *index.Index, ip netip.Addr, final bool) {
	r.resolve(ix, ip, final)
}

// resolve is Resolve; retry > 0 asks the early pass to come back then (a
// flow that may be settled as "no entry" once its latest packet is older).
func (r *Recorder) resolve(ix *index.Index, ip netip.Addr, final bool) (retry time.Duration) {
	svcs := ix.Services(ip)
	if !final {
		// The early pass only settles what records left unsettled: a
		// settled flow changes backend only by a re-pick, which the
		// recorder reads at the flow's next packet (a read, unsettling it)
		// or which the final pass finds in the entry. Without this, each
		// record of a pod with thousands of live DNS flows would re-read
		// all of their entries.
		svcs = slices.DeleteFunc(svcs, func(s index.Service) bool { return !s.Pending && len(s.Read) == 0 })
	}
	if len(svcs) == 0 || !ix.State(ip).Complete {
		return 0 // an incomplete IP sweeps: nothing to learn for it
	}
	r.ctMu.RLock()
	defer r.ctMu.RUnlock()
	ct := r.opts.CT
	fail := func(why string, err error, fl ...any) {
		if final {
			r.opts.Log.Warn("recorder: service flow's backend unresolved; the IP is marked incomplete", append([]any{"ip", ip, "why", why, "err", err}, fl...)...)
			r.unresolved.Add(1)
			ix.MarkIncomplete(ip, index.ReasonServiceUnresolved)
		}
	}
	if ct == nil {
		fail("no CT maps to read SERVICE entries from", nil)
		return 0
	}
	be, err := ctmap.OpenBackends(r.opts.CTRoot)
	if err != nil {
		fail("open backend maps", err)
		return 0
	}
	defer be.Close()
	for _, s := range svcs {
		why, again, err := r.resolveOne(ix, ip, ct, be, s, final)
		if again > 0 && (retry == 0 || again < retry) {
			retry = again
		}
		if why != "" {
			// The flow and the state it was in: which case of
			// resolveOne's it was, for whoever reads the log.
			fl := []any{"flow", s.String(), "backend_id", s.ID, "reads", s.Read, "pending", s.Pending, "no_entry", s.NoEntry, "since_ns", s.Since}
			if !final {
				// A fact whatever the timing (a backend removed before
				// its address was read): mark now.
				final = true
				fail(why, err, fl...)
				final = false
			} else {
				fail(why, err, fl...)
			}
			return 0
		}
	}
	return retry
}

// resolveOne resolves one flow; why is non-empty when ip must be marked.
func (r *Recorder) resolveOne(ix *index.Index, ip netip.Addr, ct *ctmap.Maps, be *ctmap.Backends, s index.Service, final bool) (why string, retry time.Duration, err error) {
	// A flow settled as "no entry" whose entry is there now: a later
	// packet made it, and its pick is new.
	id, pending := s.ID, s.Pending || s.NoEntry
	learn := func(b uint32) (ok bool, err error) {
		bk, found, err := be.Lookup(s.V6, b)
		if err != nil || !found {
			return false, err
		}
		addOut(ix, s, b, bk)
		return true, nil
	}
	// Backends the recorder read from the entry on later packets.
	for _, b := range s.Read {
		ok, err := learn(b)
		if err != nil {
			return "read backend map", 0, err
		}
		if !ok {
			if b != id {
				return "a backend the flow used was removed before its address was read", 0, nil
			}
			pending = true // Cilium re-picks at the flow's next packet
			continue
		}
		id = b
	}
	// The entry now: the backend of the flow's last packet.
	e, err := serviceEntry(ct, &s)
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		if pending {
			// A service without backends: Cilium dropped the packets
			// before making any entry (noentry.go).
			ok, again, whyNot := r.noEntry(ix, ip, ct, s)
			if ok {
				return "", 0, nil
			}
			if final && again > 0 && again <= 2*settleDelay {
				// The scrub waits for Cilium to handle the latest
				// packet rather than sweep the table for it.
				time.Sleep(again)
				if ok, _, whyNot = r.noEntry(ix, ip, ct, s); ok {
					return "", 0, nil
				}
			}
			if final {
				why := "the SERVICE entry is gone and its last backend was never read"
				if whyNot != "" {
					why += " (not settled as a flow Cilium made no entry for: " + whyNot + ")"
				}
				return why, 0, nil
			}
			if s.NoEntry {
				ix.ServiceUnsettle(ip, s)
			} else {
				ix.ServiceResolved(ip, s, id, true, false)
			}
			return "", again, nil
		}
		ix.ServiceResolved(ip, s, id, false, true) // every pick learnt; the entry is gone
		return "", 0, nil
	}
	if err != nil {
		return "read SERVICE entry", 0, err
	}
	if s.NoEntry {
		// Its SERVICE key may have been pruned while the entry was absent.
		if s.V6 {
			ix.AddTo6(ip, s.K6)
		} else {
			ix.AddTo4(ip, s.K4)
		}
	}
	b := uint32(e.Decode().BackendID)
	bk, found, err := be.Lookup(s.V6, b)
	if err != nil {
		return "read backend map", 0, err
	}
	if !found {
		if b != id {
			return "the SERVICE entry's backend was removed before its address was read", 0, nil
		}
		// Every pick so far is known; the next packet re-picks (a scrub
		// confirms none did unseen: confirmRepicks).
		ix.ServiceRepick(ip, s, id)
		return "", 0, nil
	}
	out := outKey(s, bk)
	if b != id || pending {
		// A newly learnt backend: its OUT entry must be there (Cilium
		// creates it right after the SERVICE entry), unless the backend is
		// the client itself (a hairpin: the OUT entry names the service
		// loopback address, IPv4 at every version and IPv6 from 1.19,
		// and the pod's own recorder saw the packet arrive from it; the
		// IPv6 exception was missing and 1.19+'s IPv6 hairpin clients
		// were marked, issue 35 item 5). Absent: the ID may name another
		// backend than the one the flow went to (removed, ID reused), or
		// Cilium dropped the packet after the SERVICE entry.
		if !present(ct, s, out) && bk.Addr != ip {
			if final {
				return "no OUT entry towards the SERVICE entry's backend", 0, nil
			}
			addOut(ix, s, b, bk)
			ix.ServiceResolved(ip, s, b, true, false)
			return "", 0, nil
		}
	}
	addOut(ix, s, b, bk)
	ix.ServiceResolved(ip, s, b, false, false)
	return "", 0, nil
}

// confirmRepicks is index.Hooks.Confirm: Take handed a scrub the keys of
// ip's flows whose backend the final resolution found removed (the pick it
// read is indexed, the next packet re-picks) and the recorder now records
// every packet of ip again (Taken). A packet that passed the recorder
// before that without a record (its flow was cached) may still re-pick
// once Cilium handles it:
// after settleDelay every such packet has been handled, so the entry then
// holds the last pick any of them made. The same backend: nothing was
// re-picked unseen. Another backend: its OUT and RELATED keys are
// returned for the scrub to delete, when its address is still known and
// its OUT entry is there. Anything else (the entry gone, the new backend
// removed too) cannot be told: why says so and ip sweeps.
func (r *Recorder) confirmRepicks(ip netip.Addr, svcs []index.Service) (k4 []ctmap.CTKey4, k6 []ctmap.CTKey6, why string) {
	time.Sleep(settleDelay)
	fail := func(s *index.Service, why string, err error) ([]ctmap.CTKey4, []ctmap.CTKey6, string) {
		r.opts.Log.Warn("recorder: service flow's backend unresolved; the IP is marked incomplete", "ip", ip, "why", why, "err", err,
			"flow", s.String(), "backend_id", s.ID, "repick", true)
		r.unresolved.Add(1)
		return nil, nil, why
	}
	r.ctMu.RLock()
	defer r.ctMu.RUnlock()
	ct := r.opts.CT
	if ct == nil {
		return fail(&svcs[0], "no CT maps to read SERVICE entries from", nil)
	}
	be, err := ctmap.OpenBackends(r.opts.CTRoot)
	if err != nil {
		return fail(&svcs[0], "open backend maps", err)
	}
	defer be.Close()
	for i := range svcs {
		s := &svcs[i]
		e, err := serviceEntry(ct, s)
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return fail(s, "the SERVICE entry of a flow whose backend was removed went before the scrub could see whether a packet re-picked", nil)
		}
		if err != nil {
			return fail(s, "read SERVICE entry", err)
		}
		b := uint32(e.Decode().BackendID)
		if b == s.ID {
			r.repicksConfirmed.Add(1)
			continue
		}
		bk, found, err := be.Lookup(s.V6, b)
		if err != nil {
			return fail(s, "read backend map", err)
		}
		if !found {
			return fail(s, "a packet re-picked a backend that was removed before its address was read", nil)
		}
		o := outKey(*s, bk)
		if !present(ct, *s, o) && !(bk.Addr == ip && !s.V6) {
			return fail(s, "no OUT entry towards the backend a packet re-picked", nil)
		}
		if s.V6 {
			k6 = append(k6, o.k6, o.k6.Related())
		} else {
			k4 = append(k4, o.k4, o.k4.Related())
		}
		r.repicksConfirmed.Add(1)
	}
	return k4, k6, ""
}

// RepicksConfirmed counts the flows confirmRepicks settled (no pick
// missed, or the one made meanwhile added to the scrub).
func (r *Recorder) RepicksConfirmed() uint64 { return r.repicksConfirmed.Load() }

// serviceEntry reads s's SERVICE entry.
func serviceEntry(ct *ctmap.Maps, s *index.Service) (e ctmap.Entry, err error) {
	if s.V6 {
		err = ct.Map(s.K6.Kind()).Lookup(s.K6, &e)
	} else {
		err = ct.Map(s.K4.Kind()).Lookup(s.K4, &e)
	}
	return e, err
}

type outKeys struct {
	k4 ctmap.CTKey4
	k6 ctmap.CTKey6
}

// outKey is the flow's OUT key towards bk: the pod as initiator (daddr, its
// port in sport), the backend as responder.
func outKey(s index.Service, bk ctmap.Backend) outKeys {
	if s.V6 {
		return outKeys{k6: ctmap.NewKey6(s.K6.SAddr(), bk.Addr, bk.Port, s.K6.DPort(), s.K6.NextHdr(), ctmap.FlagOut)}
	}
	return outKeys{k4: ctmap.NewKey4(s.K4.SAddr(), bk.Addr, bk.Port, s.K4.DPort(), s.K4.NextHdr(), ctmap.FlagOut)}
}

func present(ct *ctmap.Maps, s index.Service, o outKeys) bool {
	var e ctmap.Entry
	if s.V6 {
		return ct.Map(o.k6.Kind()).Lookup(o.k6, &e) == nil
	}
	return ct.Map(o.k4.Kind()).Lookup(o.k4, &e) == nil
}

// addOut indexes the OUT key and its RELATED key as Apply indexes a flow's
// (under each address with a slot: a local backend pod's too).
//
// The SERVICE key goes in the index's peer table under the backend's
// address, with b, the backend ID its entry named: a remote-backend scrub
// of that address deletes it while it still names b (docs/remote.md).
func addOut(ix *index.Index, s index.Service, b uint32, bk ctmap.Backend) {
	o := outKey(s, bk)
	client := s.K4.SAddr()
	if s.V6 {
		client = s.K6.SAddr()
	}
	ix.ServiceBackend(client, s, b, bk.Addr)
	if s.V6 {
		ix.Add6(o.k6)
		ix.Add6(o.k6.Related())
		return
	}
	ix.Add4(o.k4)
	ix.Add4(o.k4.Related())
}

// ServiceUnresolved counts the IPs Resolve marked incomplete
// (index.ReasonServiceUnresolved).
func (r *Recorder) ServiceUnresolved() uint64 { return r.unresolved.Load() }
