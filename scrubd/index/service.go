package index

import (
	"net/netip"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// ReasonServiceUnresolved: a flow of the IP's through a VIP Cilium
// load-balances per packet went to a backend the index could not learn
// for certain (its SERVICE entry gone before it was read, its backend
// removed before its address was read, an OUT entry missing where the
// backend's says it must be): the flow's OUT entry may be anywhere.
const ReasonServiceUnresolved = "a load-balanced flow's backend could not be learnt for certain"

// Service is one flow the IP sends through a VIP, as the index knows it:
// Cilium's SERVICE key (in the IP's family) and what is learnt of the
// backends its entry named. The recorder resolves it (scrubd/recorder:
// Resolve) into the flow's OUT key, which it indexes like any key.
type Service struct {
	V6 bool
	K4 ctmap.CTKey4
	K6 ctmap.CTKey6
	SvcState
}

// SvcState is what is learnt of a service flow's backends.
type SvcState struct {
	// Pending: Cilium may have picked a backend nobody has read yet (the
	// entry was absent when a packet passed the recorder, so that packet
	// made one; a backend was found removed, so the next packet re-picks;
	// or the key came from a snapshot, with what was learnt lost).
	Pending bool
	// Repick: pending only because the entry's backend (ID) was found
	// removed, so the flow's next packet re-picks. ID's OUT key is held:
	// every pick up to that read is known. A scrub takes such a flow and
	// confirms, once the recorder records every packet again, that no
	// packet re-picked unseen (Hooks.Confirm); any other change to the
	// state clears it.
	Repick bool
	// ID is the backend whose OUT key the index holds (0: none yet).
	ID uint32
	// Read are backend IDs the recorder read from the SERVICE entry, not
	// yet resolved to an address.
	Read []uint32
	// NoEntry: settled as "Cilium made no entry" (a service without
	// backends drops the packet before any CT entry): no packet of the
	// flow up to Since made a pick (scrubd/recorder, resolveNoEntry).
	NoEntry bool
	// Since, CLOCK_MONOTONIC ns (0: unknown). Pending: no packet that
	// may have made an unread pick is older than this (the record of
	// the first packet that found no entry, or a NoEntry state's Since).
	// NoEntry: the latest packet known to have made no entry.
	Since int64

	seq uint32 // records applied to the state (a change since a list was taken)
	// overflow: Pending because more backends were read than Read keeps;
	// a later read does not answer that.
	overflow bool
}

type svcID struct {
	b  [ctmap.KeySize6]byte
	v6 bool
}

func svcID4(k *ctmap.CTKey4) (id svcID) { copy(id.b[:], k[:]); return id }
func svcID6(k *ctmap.CTKey6) svcID      { return svcID{b: *k, v6: true} }

func (id svcID) service(st *SvcState) Service {
	s := Service{V6: id.v6, SvcState: *st}
	s.Read = append([]uint32(nil), st.Read...)
	if id.v6 {
		s.K6 = ctmap.CTKey6(id.b)
	} else {
		copy(s.K4[:], id.b[:ctmap.KeySize4])
	}
	return s
}

// notePendingLocked gives a SERVICE key that entered the set without a
// record (a snapshot) a pending state: nothing of its backends is known.
func (e *IPEntry) notePendingLocked(id svcID) {
	if e.svc == nil {
		e.svc = map[svcID]*SvcState{}
	}
	if e.svc[id] == nil {
		e.svc[id] = &SvcState{Pending: true}
	}
}

// ServiceRecord4 notes a recorder's record of a service flow of ip's: its
// SERVICE key is indexed like any key (a scrub deletes it) and backend is
// the backend_id its entry held when the packet passed (0: none, so that
// packet makes the entry and picks a backend nobody has read).
func (ix *Index) ServiceRecord4(ip netip.Addr, k ctmap.CTKey4, backend uint32) {
	ix.ServiceRecordAt4(ip, k, backend, 0)
}

// ServiceRecord6 is ServiceRecord4 for IPv6.
func (ix *Index) ServiceRecord6(ip netip.Addr, k ctmap.CTKey6, backend uint32) {
	ix.ServiceRecordAt6(ip, k, backend, 0)
}

// ServiceRecordAt4 is ServiceRecord4 with the time the packet passed the
// recorder (CLOCK_MONOTONIC ns, rounded down; 0: unknown, an older
// program): a record of backend 0 that starts a run of packets finding no
// entry gives the run its Since.
func (ix *Index) ServiceRecordAt4(ip netip.Addr, k ctmap.CTKey4, backend uint32, at int64) {
	ix.AddTo4(ip, k)
	ix.serviceRecord(ip, svcID4(&k), backend, at)
}

// ServiceRecordAt6 is ServiceRecordAt4 for IPv6.
func (ix *Index) ServiceRecordAt6(ip netip.Addr, k ctmap.CTKey6, backend uint32, at int64) {
	ix.AddTo6(ip, k)
	ix.serviceRecord(ip, svcID6(&k), backend, at)
}

func (ix *Index) serviceRecord(ip netip.Addr, id svcID, backend uint32, at int64) {
	e := ix.slot(ip)
	if e == nil {
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.svc == nil {
		e.svc = map[svcID]*SvcState{}
	}
	st := e.svc[id]
	if st == nil {
		st = &SvcState{}
		e.svc[id] = st
	}
	st.Repick = false // a packet passed: the next resolution reads what it did
	st.seq++
	switch {
	case backend == 0 && st.NoEntry:
		// The flow's cache entry was made again (evicted, or its
		// addresses' generations bumped): its packets since Since are
		// unknown, and none is older.
		st.Pending, st.NoEntry = true, false
	case backend == 0 && !st.Pending:
		st.Pending, st.Since = true, at // a run of packets finding no entry starts
	case backend == 0:
		// A run goes on (Since kept), or a pick is pending for another
		// reason (Since 0: never settled as no entry).
	case backend != st.ID && len(st.Read) < 16:
		st.Read = append(st.Read, backend)
		if !st.overflow {
			// The entry names the pick the flow's earlier packets made
			// (the one that found no entry, or the one after a backend
			// was found removed): that pick is read now (issue 35 item
			// 5: it stayed pending, and its client was marked when the
			// SERVICE entry went).
			st.Pending = false
		}
	case backend != st.ID:
		st.Pending, st.overflow = true, true // more re-picks than worth keeping: read the entry
	}
	if backend != 0 {
		// An entry was there: if it is gone by the next resolution,
		// something removed it before its lifetime ran out (an LRU
		// eviction, a flush), so the run cannot be settled as no entry.
		st.NoEntry, st.Since = false, 0
	}
}

// Services lists ip's service flows (nil for most IPs: one lock).
func (ix *Index) Services(ip netip.Addr) []Service {
	e := ix.entry(ip, false)
	if e == nil {
		return nil
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.svc) == 0 {
		return nil
	}
	out := make([]Service, 0, len(e.svc))
	for id, st := range e.svc {
		out = append(out, id.service(st))
	}
	return out
}

// ServiceResolved stores what a resolution learnt of s (read from the
// list Services returned): the backend whose OUT key it indexed, whether a
// pick is still unread, and the reads it consumed. done: the flow's
// SERVICE entry is gone with every pick learnt; its state and its SERVICE
// key leave the set. A record that arrived since the list was taken is
// kept (its reads, and pending).
func (ix *Index) ServiceResolved(ip netip.Addr, s Service, id uint32, pending, done bool) {
	e := ix.entry(ip, false)
	if e == nil {
		return
	}
	key := s.id()
	e.mu.Lock()
	defer e.mu.Unlock()
	st := e.svc[key]
	if st == nil {
		return // taken meanwhile
	}
	// Reads since the list was taken stay for the next resolution.
	later := st.Read[min(len(s.Read), len(st.Read)):]
	laterPending := st.Pending && !s.Pending
	if done && len(later) == 0 && !laterPending {
		delete(e.svc, key)
		if e.del(s) {
			ix.keys.Add(-1)
		}
		return
	}
	st.ID = id
	st.Pending = pending || laterPending
	st.Repick = false
	st.Read = append([]uint32(nil), later...)
	if !st.Pending {
		st.NoEntry, st.Since = false, 0
	}
}

// ServiceNoEntry settles s (read from the list Services returned) as a
// flow Cilium made no entry for, up to the packet at covered
// (CLOCK_MONOTONIC ns): the caller proved that no packet up to it made a
// pick (scrubd/recorder, resolveNoEntry). Nothing changes when a record
// arrived since the list was taken (the next resolution decides).
func (ix *Index) ServiceNoEntry(ip netip.Addr, s Service, covered int64) {
	e := ix.entry(ip, false)
	if e == nil {
		return
	}
	key := s.id()
	e.mu.Lock()
	defer e.mu.Unlock()
	st := e.svc[key]
	if st == nil || st.Pending != s.Pending || st.NoEntry != s.NoEntry || st.Since != s.Since || len(st.Read) != len(s.Read) || st.ID != s.ID {
		return
	}
	st.Pending, st.NoEntry, st.Since, st.Repick = false, true, covered, false
}

// ServiceRepick stores that the final resolution read s's SERVICE entry
// holding backend id, which is s's learnt backend and is gone from the
// backend map: every pick so far is known (id's OUT key is held), and the
// flow's next packet re-picks. Such a flow does not make its IP
// incomplete by itself: Take hands it to Hooks.Confirm. Nothing changes
// when a record arrived since the list was taken (it stays pending).
func (ix *Index) ServiceRepick(ip netip.Addr, s Service, id uint32) {
	e := ix.entry(ip, false)
	if e == nil {
		return
	}
	key := s.id()
	e.mu.Lock()
	defer e.mu.Unlock()
	st := e.svc[key]
	if st == nil {
		return
	}
	if st.seq != s.seq {
		// A record since: what it read stays for the next resolution.
		st.Read = append([]uint32(nil), st.Read[min(len(s.Read), len(st.Read)):]...)
		st.ID, st.Pending, st.Repick = id, true, false
		return
	}
	st.ID, st.Pending, st.Repick, st.Read, st.NoEntry, st.Since = id, true, true, nil, false, 0
}

// ServiceUnsettle turns a NoEntry state back into a pending one whose run
// started after since (packets came after the settled one and could not be
// settled yet). Nothing changes when a record arrived since the list was
// taken.
func (ix *Index) ServiceUnsettle(ip netip.Addr, s Service) {
	e := ix.entry(ip, false)
	if e == nil {
		return
	}
	key := s.id()
	e.mu.Lock()
	defer e.mu.Unlock()
	if st := e.svc[key]; st != nil && st.NoEntry && st.Since == s.Since {
		st.Pending, st.NoEntry, st.Repick = true, false, false
	}
}

// del removes s's SERVICE key from e's set under e's lock.
func (e *IPEntry) del(s Service) bool {
	if s.V6 {
		var rec [RecSize6]byte
		return e.ip.Is6() && pack(rec[:], e.a16[:], s.K6[:], 16) && e.keys6.del(rec[:])
	}
	var rec [RecSize4]byte
	return e.ip.Is4() && pack(rec[:], e.a4[:], s.K4[:], 4) && e.keys4.del(rec[:])
}

// noteServiceKeysLocked gives every SERVICE key of e's set without a
// state a pending one (keys restored from a snapshot or given back by a
// scrub: what was learnt of them is gone).
func (e *IPEntry) noteServiceKeysLocked(k4 []ctmap.CTKey4, k6 []ctmap.CTKey6) {
	for i := range k4 {
		if k4[i].Flags()&ctmap.FlagService != 0 {
			e.notePendingLocked(svcID4(&k4[i]))
		}
	}
	for i := range k6 {
		if k6[i].Flags()&ctmap.FlagService != 0 {
			e.notePendingLocked(svcID6(&k6[i]))
		}
	}
}

// svcUnsettledLocked: one of e's service flows has a pick not resolved to
// an OUT key in the set (pending, or backends read and not resolved).
//
// A Repick flow is settled up to its last read; Take confirms it.
func (e *IPEntry) svcUnsettledLocked() bool {
	for _, st := range e.svc {
		if (st.Pending && !st.Repick) || len(st.Read) > 0 {
			return true
		}
	}
	return false
}

// svcReadLocked: one of e's service flows has backends read and not yet
// resolved (lost by a snapshot, which keeps only the keys).
func (e *IPEntry) svcReadLocked() bool {
	for _, st := range e.svc {
		if len(st.Read) > 0 {
			return true
		}
	}
	return false
}

// dropSettledSvcLocked forgets the state of a service flow whose SERVICE
// key a prune removed (its entry gone), when every pick of it was learnt;
// an unsettled one stays, for the next final resolution to mark.
//
// A NoEntry state stays: its SERVICE entry is absent by definition, and the
// flow's later packets send no record while the entry stays absent (the
// state is what tells the next resolution to look at them).
func (e *IPEntry) dropSettledSvcLocked(id svcID) {
	if st := e.svc[id]; st != nil && !st.Pending && !st.NoEntry && len(st.Read) == 0 {
		delete(e.svc, id)
	}
}

// String is the flow's SERVICE key, for logs.
func (s Service) String() string {
	if s.V6 {
		return s.K6.String()
	}
	return s.K4.String()
}

// id is the flow's key in an IP's service states.
func (s *Service) id() svcID {
	if s.V6 {
		return svcID6(&s.K6)
	}
	return svcID4(&s.K4)
}
