package index

import (
	"hash/maphash"
	"net/netip"
	"sync"
	"sync/atomic"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// The peer table finds the keys local pods hold towards an address that is
// not theirs (a Service backend on another node) in O(k), k = those keys:
// the remote-backend scrub (docs/remote.md) deletes them when the address
// leaves the cluster. A peer gets no slot of its own (the index stays as
// large as this node's pods and their flows): the table mirrors keys the
// slots hold, as records relative to the peer (keyset.go), and nothing else.
//
// The bound: a record is made only when a slot gains a key (one record per
// (slot, key) pair: under the key's other address), plus one per service
// flow whose backend the recorder resolved (under the backend's address,
// with its backend ID). Records whose key no slot holds any more (taken by
// a scrub, pruned, the slot dropped) are dropped by a cleanup that runs
// whenever the table passes twice the keys the slots hold plus 4,096
// records. So the table holds at most 2 x (the slots' keys) + 4,096
// records, about 14.6 bytes each for IPv4 (27.5 for IPv6) as a slot's key
// costs, and nothing at all until EnablePeers.

// peerSlack is the records the table may hold beyond twice the slots' keys.
const peerSlack = 4096

type peerTable struct {
	shards   [64]peerShard
	n        atomic.Int64 // records
	cleaning atomic.Bool
	cleans   atomic.Uint64
}

type peerShard struct {
	mu sync.Mutex
	m  map[netip.Addr]*peerSet
}

// peerSet is one peer's records: keys as records relative to the peer, and
// the SERVICE keys of flows whose backend is the peer, with the backend ID
// their entry named.
type peerSet struct {
	keys4, keys6 keySet
	svc          map[svcID]uint32
}

// EnablePeers turns the peer table on. Call it before any key is added
// (the daemon does at start, when the remote-backend watch is on); keys
// added before are not mirrored.
func (ix *Index) EnablePeers() {
	if ix.peers.Load() != nil {
		return
	}
	t := &peerTable{}
	for i := range t.shards {
		t.shards[i].m = map[netip.Addr]*peerSet{}
	}
	ix.peers.Store(t)
}

func (ix *Index) peerShard(a netip.Addr) *peerShard {
	b := a.As16()
	return &ix.peers.Load().shards[maphash.Bytes(ix.seed, b[:])%64]
}

// mirror4 files k, a key e (locked) just gained, under its other address.
func (ix *Index) mirror4(e *IPEntry, k *ctmap.CTKey4) {
	t := ix.peers.Load()
	if t == nil || k.Flags()&ctmap.FlagService != 0 {
		return
	}
	p := k.DAddr()
	if p == e.ip {
		p = k.SAddr()
	}
	if p == e.ip {
		return
	}
	var rec [RecSize4]byte
	a := p.As4()
	if !pack(rec[:], a[:], k[:], 4) {
		return
	}
	ix.filePeer(t, p, rec[:])
}

// mirror6 is mirror4 for IPv6 keys.
func (ix *Index) mirror6(e *IPEntry, k *ctmap.CTKey6) {
	t := ix.peers.Load()
	if t == nil || k.Flags()&ctmap.FlagService != 0 {
		return
	}
	p := k.DAddr()
	if p == e.ip {
		p = k.SAddr()
	}
	if p == e.ip {
		return
	}
	var rec [RecSize6]byte
	a := p.As16()
	if !pack(rec[:], a[:], k[:], 16) {
		return
	}
	ix.filePeer(t, p, rec[:])
}

// filePeer adds rec, a record relative to peer p, to p's set of its family.
func (ix *Index) filePeer(t *peerTable, p netip.Addr, rec []byte) {
	sh := ix.peerShard(p)
	sh.mu.Lock()
	ps := sh.m[p]
	if ps == nil {
		ps = &peerSet{}
		sh.m[p] = ps
	}
	set := &ps.keys4
	if p.Is6() {
		set = &ps.keys6
	}
	if set.add(rec) {
		t.n.Add(1)
	}
	sh.mu.Unlock()
	ix.maybeCleanPeers()
}

// mirrorAllLocked mirrors every key of e (locked): after a set was built
// or restored in one go (the bootstrap pass's merge, a snapshot).
func (ix *Index) mirrorAllLocked(e *IPEntry) {
	if ix.peers.Load() == nil {
		return
	}
	k4, k6 := e.list(nil, nil)
	for i := range k4 {
		ix.mirror4(e, &k4[i])
	}
	for i := range k6 {
		ix.mirror6(e, &k6[i])
	}
}

// ServiceBackend notes that client's service flow s (its SERVICE key) went
// to backend id at address backend: a remote-backend scrub of backend
// deletes the SERVICE entry while it still names id. The recorder calls it
// when it resolves a pick.
func (ix *Index) ServiceBackend(client netip.Addr, s Service, id uint32, backend netip.Addr) {
	t := ix.peers.Load()
	if t == nil || backend == client || !backend.IsValid() {
		return
	}
	sh := ix.peerShard(backend)
	sh.mu.Lock()
	ps := sh.m[backend]
	if ps == nil {
		ps = &peerSet{}
		sh.m[backend] = ps
	}
	if ps.svc == nil {
		ps.svc = map[svcID]uint32{}
	}
	if _, ok := ps.svc[s.id()]; !ok {
		t.n.Add(1)
	}
	ps.svc[s.id()] = id
	sh.mu.Unlock()
	ix.maybeCleanPeers()
}

// PeerService is a SERVICE key of a local client's flow to a peer, and the
// backend ID its entry named when the peer was learnt as its backend.
type PeerService struct {
	V6 bool
	K4 ctmap.CTKey4
	K6 ctmap.CTKey6
	ID uint32
}

// PeerKeys lists the keys local pods' slots hold towards peer, and their
// service flows whose learnt backend is peer, in O(k). It takes nothing
// out of the index: the keys stay in their slots (a scrub of a client
// finds a deleted one gone, a prune drops it), so no client's set loses a
// key whose entry a packet may make again. ok is false while the table is
// off.
func (ix *Index) PeerKeys(peer netip.Addr) (k4 []ctmap.CTKey4, k6 []ctmap.CTKey6, svcs []PeerService, ok bool) {
	if ix.peers.Load() == nil {
		return nil, nil, nil, false
	}
	peer = peer.Unmap()
	sh := ix.peerShard(peer)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	ps := sh.m[peer]
	if ps == nil {
		return nil, nil, nil, true
	}
	if peer.Is4() {
		a := peer.As4()
		k4 = ps.keys4.keys4(&a, nil)
	} else {
		a := peer.As16()
		k6 = ps.keys6.keys6(&a, nil)
	}
	for id, b := range ps.svc {
		s := id.service(&SvcState{})
		svcs = append(svcs, PeerService{V6: s.V6, K4: s.K4, K6: s.K6, ID: b})
	}
	return k4, k6, svcs, true
}

// PeerRecords is the peer table's size in records (metrics; 0 when off).
func (ix *Index) PeerRecords() int64 {
	if t := ix.peers.Load(); t != nil {
		return t.n.Load()
	}
	return 0
}

// maybeCleanPeers starts a cleanup when the table passes its bound.
func (ix *Index) maybeCleanPeers() {
	t := ix.peers.Load()
	if t == nil || t.n.Load() <= 2*ix.keys.Load()+peerSlack || !t.cleaning.CompareAndSwap(false, true) {
		return
	}
	go func() {
		defer t.cleaning.Store(false)
		ix.CleanPeers()
	}()
}

// CleanPeers drops the records whose key no slot holds any more; it
// returns how many. Each check and drop happens under the slot's lock,
// then the peer's (the order every add takes them in), so a key added
// again meanwhile keeps its record.
func (ix *Index) CleanPeers() (dropped int) {
	t := ix.peers.Load()
	if t == nil {
		return 0
	}
	t.cleans.Add(1)
	for i := range t.shards {
		sh := &t.shards[i]
		sh.mu.Lock()
		peers := make([]netip.Addr, 0, len(sh.m))
		for p := range sh.m {
			peers = append(peers, p)
		}
		sh.mu.Unlock()
		for _, p := range peers {
			k4, k6, svcs, _ := ix.PeerKeys(p)
			for i := range k4 {
				dropped += ix.dropPeerKey(sh, p, k4[i][:], k4[i].DAddr(), k4[i].SAddr(), 4)
			}
			for i := range k6 {
				dropped += ix.dropPeerKey(sh, p, k6[i][:], k6[i].DAddr(), k6[i].SAddr(), 16)
			}
			for _, s := range svcs {
				dropped += ix.dropPeerService(sh, p, s)
			}
			sh.mu.Lock()
			if ps := sh.m[p]; ps != nil && ps.keys4.n+ps.keys6.n+len(ps.svc) == 0 {
				delete(sh.m, p)
			}
			sh.mu.Unlock()
		}
	}
	return dropped
}

// dropPeerKey drops peer p's record of key unless the slot of its other
// address holds key.
func (ix *Index) dropPeerKey(sh *peerShard, p netip.Addr, key []byte, d, s netip.Addr, alen int) int {
	local := d
	if local == p {
		local = s
	}
	e := ix.entry(local, false)
	if e != nil {
		e.mu.Lock()
		defer e.mu.Unlock()
		if alen == 4 {
			k := ctmap.CTKey4(key)
			if e.has4(&k) {
				return 0
			}
		} else {
			k := ctmap.CTKey6(key)
			if e.has6(&k) {
				return 0
			}
		}
	}
	var rec [maxRec]byte
	pa := p.As16()
	ab := pa[:]
	if alen == 4 {
		a4 := p.As4()
		ab = a4[:]
	}
	if !pack(rec[:alen+7], ab, key, alen) {
		return 0
	}
	sh.mu.Lock()
	defer sh.mu.Unlock()
	ps := sh.m[p]
	if ps == nil {
		return 0
	}
	set := &ps.keys4
	if alen == 16 {
		set = &ps.keys6
	}
	if set.del(rec[:alen+7]) {
		ix.peers.Load().n.Add(-1)
		return 1
	}
	return 0
}

// dropPeerService drops p's note of s unless s's client still has the
// flow's SERVICE key.
func (ix *Index) dropPeerService(sh *peerShard, p netip.Addr, s PeerService) int {
	client, id := s.K4.SAddr(), svcID4(&s.K4)
	if s.V6 {
		client, id = s.K6.SAddr(), svcID6(&s.K6)
	}
	if e := ix.entry(client, false); e != nil {
		e.mu.Lock()
		defer e.mu.Unlock()
		if _, ok := e.svc[id]; ok {
			return 0
		}
	}
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if ps := sh.m[p]; ps != nil {
		if _, ok := ps.svc[id]; ok {
			delete(ps.svc, id)
			ix.peers.Load().n.Add(-1)
			return 1
		}
	}
	return 0
}
