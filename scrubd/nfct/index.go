package nfct

import (
	"net/netip"
	"sync"
)

// flowKey is an entry's identity in the kernel's table: its original tuple in
// its zone. Two entries with the same tuple in different zones are different
// flows. Addresses are stored as 16-byte arrays so the maps hold no pointers.
type flowKey struct {
	src, dst     [16]byte
	sport, dport uint16
	zone         uint16
	proto        uint8
	v6, ports    bool
}

func keyOf(e *Entry) flowKey {
	return flowKey{
		src: e.Orig.Src.As16(), dst: e.Orig.Dst.As16(),
		sport: e.Orig.SPort, dport: e.Orig.DPort,
		zone: e.Zone, proto: e.Orig.Proto,
		v6: e.Orig.Src.Is6(), ports: e.Orig.Ports,
	}
}

func (k flowKey) tuple() Tuple {
	t := Tuple{Proto: k.proto, Ports: k.ports, SPort: k.sport, DPort: k.dport}
	if k.v6 {
		t.Src, t.Dst = netip.AddrFrom16(k.src), netip.AddrFrom16(k.dst)
	} else {
		t.Src, t.Dst = netip.AddrFrom16(k.src).Unmap(), netip.AddrFrom16(k.dst).Unmap()
	}
	return t
}

// flow is one indexed entry: its key and the kernel's ID for it.
type flow struct {
	key flowKey
	id  uint32
}

// ipFlows is one pod IP's slot.
type ipFlows struct {
	flows map[flowKey]uint32 // -> CTA_ID
	// cleanGen is the loss generation at the start of the last fallback that
	// removed every entry of the IP; cleaned says there was one.
	cleanGen uint64
	cleaned  bool
}

// index maps every local pod IP to the entries whose original or reply tuple
// holds it. Events arrive on one goroutine and scrubs take an IP's flows under
// the same lock for microseconds, so one mutex is enough.
//
// Completeness is tracked with loss generations instead of per-IP flags: a
// lost event may concern any IP, including one the index has never seen, so a
// loss bumps lossGen and every IP is incomplete until a dump (seed) or a
// fallback for that IP started after the loss has finished.
type index struct {
	cidrs []netip.Prefix
	zones map[uint16]bool // nil: every zone

	mu      sync.Mutex
	ips     map[netip.Addr]*ipFlows
	keys    int    // (ip, flow) pairs
	lossGen uint64 // bumped on every detected loss of events
	seedGen uint64 // lossGen when the last complete seed dump started
	seeded  bool

	// peers, while on (enablePeers), files each entry of a local pod also
	// under its addresses outside the pod CIDRs (a Service backend on
	// another node when the CIDRs are this node's): a remote-backend scrub
	// finds them in O(k). Addresses inside the CIDRs are in ips already.
	// Bounded by the local pods' entries: a record goes with its entry's
	// DESTROY event or its delete.
	peers     map[netip.Addr]map[flowKey]uint32
	peerFlows int
}

// enablePeers turns the peer records on (before the seed dump).
func (ix *index) enablePeers() {
	ix.mu.Lock()
	if ix.peers == nil {
		ix.peers = map[netip.Addr]map[flowKey]uint32{}
	}
	ix.mu.Unlock()
}

// peerAddrs returns e's addresses outside the pod CIDRs, each once.
func (ix *index) peerAddrs(e *Entry, out *[4]netip.Addr) int {
	n := 0
	for _, ip := range [4]netip.Addr{e.Orig.Src, e.Orig.Dst, e.Reply.Src, e.Reply.Dst} {
		ip = ip.Unmap()
		if !ip.IsValid() || ix.owns(ip) {
			continue
		}
		dup := false
		for i := 0; i < n; i++ {
			dup = dup || out[i] == ip
		}
		if !dup {
			out[n] = ip
			n++
		}
	}
	return n
}

// peerFlowsOf lists the entries filed under addr: in its slot when it lies
// in the pod CIDRs, else in the peer records.
func (ix *index) peerFlowsOf(addr netip.Addr) []flow {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	var fs []flow
	if s := ix.ips[addr]; s != nil {
		for k, id := range s.flows {
			fs = append(fs, flow{k, id})
		}
	}
	for k, id := range ix.peers[addr] {
		fs = append(fs, flow{k, id})
	}
	return fs
}

// forgetPeerLocked drops a peer record of flow k, unless it is a newer flow.
func (ix *index) forgetPeerLocked(addr netip.Addr, k flowKey, id uint32) {
	m := ix.peers[addr]
	if cur, ok := m[k]; ok && cur == id {
		delete(m, k)
		ix.peerFlows--
		if len(m) == 0 {
			delete(ix.peers, addr)
		}
	}
}

func newIndex(cidrs []netip.Prefix, zones []uint16) *index {
	ix := &index{cidrs: cidrs, ips: make(map[netip.Addr]*ipFlows)}
	if len(zones) > 0 {
		ix.zones = make(map[uint16]bool)
		for _, z := range zones {
			ix.zones[z] = true
		}
	}
	return ix
}

func (ix *index) owns(ip netip.Addr) bool {
	if !ip.IsValid() {
		return false
	}
	if len(ix.cidrs) == 0 {
		return true
	}
	for _, p := range ix.cidrs {
		if p.Contains(ip) {
			return true
		}
	}
	return false
}

func (ix *index) zoneTracked(z uint16) bool { return ix.zones == nil || ix.zones[z] }

// localIPs returns the entry's addresses that are local pod IPs, each once.
// All four are looked at: with DNAT the pod IP of a server appears only as the
// reply source, with SNAT a client's only as the original source.
func (ix *index) localIPs(e *Entry, out *[4]netip.Addr) int {
	n := 0
	for _, ip := range [4]netip.Addr{e.Orig.Src, e.Orig.Dst, e.Reply.Src, e.Reply.Dst} {
		ip = ip.Unmap()
		if !ix.owns(ip) {
			continue
		}
		dup := false
		for i := 0; i < n; i++ {
			if out[i] == ip {
				dup = true
			}
		}
		if !dup {
			out[n] = ip
			n++
		}
	}
	return n
}

// add indexes an entry (NEW event or dump).
func (ix *index) add(e *Entry) {
	if !ix.zoneTracked(e.Zone) {
		return
	}
	var ips [4]netip.Addr
	n := ix.localIPs(e, &ips)
	if n == 0 {
		return
	}
	k := keyOf(e)
	ix.mu.Lock()
	for _, ip := range ips[:n] {
		s := ix.ips[ip]
		if s == nil {
			s = &ipFlows{flows: make(map[flowKey]uint32)}
			ix.ips[ip] = s
		}
		if _, ok := s.flows[k]; !ok {
			ix.keys++
		}
		s.flows[k] = e.ID
	}
	if ix.peers != nil {
		var ps [4]netip.Addr
		for _, p := range ps[:ix.peerAddrs(e, &ps)] {
			m := ix.peers[p]
			if m == nil {
				m = map[flowKey]uint32{}
				ix.peers[p] = m
			}
			if _, ok := m[k]; !ok {
				ix.peerFlows++
			}
			m[k] = e.ID
		}
	}
	ix.mu.Unlock()
}

// remove drops a destroyed entry, unless the slot already holds a newer flow
// with the same tuple (another ID).
func (ix *index) remove(e *Entry) {
	var ips [4]netip.Addr
	n := ix.localIPs(e, &ips)
	if n == 0 {
		return
	}
	k := keyOf(e)
	ix.mu.Lock()
	for _, ip := range ips[:n] {
		ix.forgetLocked(ip, k, e.ID)
	}
	if ix.peers != nil {
		var ps [4]netip.Addr
		for _, p := range ps[:ix.peerAddrs(e, &ps)] {
			ix.forgetPeerLocked(p, k, e.ID)
		}
	}
	ix.mu.Unlock()
}

func (ix *index) forgetLocked(ip netip.Addr, k flowKey, id uint32) {
	s := ix.ips[ip]
	if s == nil {
		return
	}
	if cur, ok := s.flows[k]; ok && cur == id {
		delete(s.flows, k)
		ix.keys--
	}
	if len(s.flows) == 0 && !s.cleaned {
		delete(ix.ips, ip)
	}
}

// forget drops flows of ip the scrub saw deleted or already gone.
func (ix *index) forget(ip netip.Addr, fs []flow) {
	ix.mu.Lock()
	for _, f := range fs {
		ix.forgetLocked(ip, f.key, f.id)
	}
	ix.mu.Unlock()
}

// markLost records that events were lost: every IP becomes incomplete.
func (ix *index) markLost() {
	ix.mu.Lock()
	ix.lossGen++
	ix.mu.Unlock()
}

// gen is the current loss generation; a seed or fallback that starts now
// proves completeness up to it.
func (ix *index) gen() uint64 {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	return ix.lossGen
}

func (ix *index) markSeeded(gen uint64) {
	ix.mu.Lock()
	ix.seeded, ix.seedGen = true, gen
	ix.mu.Unlock()
}

// markClean records that a fallback started at gen removed every entry of ip.
func (ix *index) markClean(ip netip.Addr, gen uint64) {
	ix.mu.Lock()
	s := ix.ips[ip]
	if s == nil {
		s = &ipFlows{flows: make(map[flowKey]uint32)}
		ix.ips[ip] = s
	}
	s.cleanGen, s.cleaned = gen, true
	ix.mu.Unlock()
}

func (ix *index) completeLocked(ip netip.Addr) bool {
	if !ix.owns(ip) {
		return false // never indexed: only a walk can find its entries
	}
	if ix.seeded && ix.seedGen == ix.lossGen {
		return true
	}
	s := ix.ips[ip]
	return s != nil && s.cleaned && s.cleanGen == ix.lossGen
}

// take returns ip's flows and whether the index proves they are all of them.
func (ix *index) take(ip netip.Addr) ([]flow, bool) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	complete := ix.completeLocked(ip)
	s := ix.ips[ip]
	if s == nil {
		return nil, complete
	}
	fs := make([]flow, 0, len(s.flows))
	for k, id := range s.flows {
		fs = append(fs, flow{k, id})
	}
	return fs, complete
}

// stats returns the indexed (ip, flow) pairs, the IPs held, and how many of
// them are incomplete. After a loss every IP is incomplete, also those the
// index holds no slot for; incompleteAll says so.
func (ix *index) stats() (keys, ips, incomplete int, incompleteAll bool) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	for ip := range ix.ips {
		if !ix.completeLocked(ip) {
			incomplete++
		}
	}
	incompleteAll = !(ix.seeded && ix.seedGen == ix.lossGen)
	return ix.keys, len(ix.ips), incomplete, incompleteAll
}
