package index

import (
	"errors"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// Filing is one bootstrap pass's hold on the index (scrubd/bootstrap): the
// pass walks Cilium's CT maps once and files every key it finds under each
// of the key's addresses in the pod CIDRs, while the recorder, attached to
// every pod before the pass began, keeps adding what it records.
//
// While a Filing is open:
//   - every address in the pod CIDRs gets a slot the moment a key of it is
//     filed or recorded (outside a pass only IPs a pod holds, or a scrub
//     tracked, collect keys), so an entry made during the pass is in the
//     index whether the walk reads it or the recorder records it;
//   - each slot that existed when the pass began, or was made while it
//     ran, carries the pass's epoch. Anything that may cost the slot a key
//     takes the epoch away: a mark (MarkIncomplete, records lost, the set
//     full, ...), the slot's drop or Forget (the address is then noted, so
//     a slot made again for it during the pass carries no epoch), and
//     SpoilFiling (every address at once: the recorder's per-IP lost
//     counter overflowed).
//
// At the end of the pass (after the recorder's reader caught up) End closes
// the slots again and lists the addresses whose slot kept the epoch: their
// sets hold every key of them the kernel had, except entries of paths no
// recorder sees (docs/design.md, "The bootstrap pass"). The index trusts
// none of them by itself: the daemon calls TrackFiled with its ownership
// rule, which declares complete those the rule allows.
//
// Add4 and Add6 take a batch of keys; one goroutine files at a time. The
// locks they take are the shards' (briefly, for a slot not seen before in
// this Filing) and each IP's, per key: a scrub of any IP waits at most for
// one key's insert.
type Filing struct {
	ix    *Index
	epoch uint64

	mu      sync.Mutex
	gone    map[netip.Addr]struct{} // slots dropped or forgotten during the pass
	spoiled bool                    // SpoilFiling: no address is vouched for
	ended   bool

	// The filer's own view of slots: the shard map is looked up once per
	// address per pass. A slot dropped meanwhile is seen dead under its
	// lock and looked up again.
	slots map[netip.Addr]*IPEntry

	v4  []prefix4 // the pod CIDRs' IPv4 prefixes, for a cheap Owns
	all bool      // no pod CIDRs: every address is owned

	pairs  atomic.Int64 // (address, key) pairs the pass added
	marked atomic.Int64 // keys not added: the IP's set was full
}

type prefix4 struct{ base, mask uint32 }

// ErrFilingOpen is BeginFiling's error while another pass holds the index.
var ErrFilingOpen = errors.New("index: a bootstrap pass is already filing")

// BeginFiling opens a bootstrap pass's Filing (see Filing). Only one may be
// open at a time.
func (ix *Index) BeginFiling() (*Filing, error) {
	f := &Filing{ix: ix, epoch: ix.gens.Add(1), gone: map[netip.Addr]struct{}{},
		slots: map[netip.Addr]*IPEntry{}, all: len(ix.cfg.PodCIDRs) == 0}
	for _, p := range ix.cfg.PodCIDRs {
		if p.Addr().Is4() {
			b := p.Masked().Addr().As4()
			base := uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])
			mask := ^uint32(0)
			if p.Bits() < 32 {
				mask = ^(^uint32(0) >> p.Bits())
			}
			f.v4 = append(f.v4, prefix4{base, mask})
		}
	}
	if !ix.filing.CompareAndSwap(nil, f) {
		return nil, ErrFilingOpen
	}
	// Open first, then stamp the slots that exist: a slot made between the
	// two is stamped at its creation (entry), one dropped is noted (gone).
	for i := range ix.shards {
		sh := &ix.shards[i]
		sh.mu.RLock()
		for _, e := range sh.ips {
			e.mu.Lock()
			if !e.dead {
				e.filed = f.epoch
			}
			e.mu.Unlock()
		}
		sh.mu.RUnlock()
	}
	return f, nil
}

// filingNow is the open Filing, or nil.
func (ix *Index) filingNow() *Filing { return ix.filing.Load() }

// noteGone records that ip's slot went (or was marked without one) during
// the pass: a slot made for it again carries no epoch.
func (f *Filing) noteGone(ip netip.Addr) {
	f.mu.Lock()
	f.gone[ip] = struct{}{}
	f.mu.Unlock()
}

func (f *Filing) isGone(ip netip.Addr) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	_, g := f.gone[ip]
	return g || f.spoiled
}

// SpoilFiling withdraws an open pass's claim for every address (the
// recorder lost records it cannot attribute to an IP): End then lists none.
func (ix *Index) SpoilFiling() {
	if f := ix.filingNow(); f != nil {
		f.mu.Lock()
		f.spoiled = true
		f.mu.Unlock()
	}
}

func (f *Filing) owns4(a [4]byte) bool {
	if f.all {
		return true
	}
	v := uint32(a[0])<<24 | uint32(a[1])<<16 | uint32(a[2])<<8 | uint32(a[3])
	for _, p := range f.v4 {
		if v&p.mask == p.base {
			return true
		}
	}
	return false
}

// slotFor returns ip's live slot, making it (open slots) when missing.
func (f *Filing) slotFor(ip netip.Addr) *IPEntry {
	if e := f.slots[ip]; e != nil {
		return e
	}
	e := f.ix.entry(ip, true)
	f.slots[ip] = e
	return e
}

// file4 adds k under ip (which k holds); svc: give a SERVICE key without a
// state a pending one, as a snapshot's keys get (notePendingLocked).
func (f *Filing) file4(ip netip.Addr, k *ctmap.CTKey4, svc bool) (added int) {
	for {
		e := f.slotFor(ip)
		e.mu.Lock()
		if e.dead {
			e.mu.Unlock()
			delete(f.slots, ip)
			continue
		}
		drop := false
		switch {
		case e.size() >= f.ix.cfg.MaxKeysPerIP && !e.has4(k):
			drop = f.ix.markLocked(e, ReasonFull)
			f.marked.Add(1)
		case e.add4(k):
			added = 1
		}
		if svc {
			e.notePendingLocked(svcID4(k))
		}
		e.mu.Unlock()
		if drop {
			f.ix.dropSlot(ip, e)
		}
		return added
	}
}

func (f *Filing) file6(ip netip.Addr, k *ctmap.CTKey6, svc bool) (added int) {
	for {
		e := f.slotFor(ip)
		e.mu.Lock()
		if e.dead {
			e.mu.Unlock()
			delete(f.slots, ip)
			continue
		}
		drop := false
		switch {
		case e.size() >= f.ix.cfg.MaxKeysPerIP && !e.has6(k):
			drop = f.ix.markLocked(e, ReasonFull)
			f.marked.Add(1)
		case e.add6(k):
			added = 1
		}
		if svc {
			e.notePendingLocked(svcID6(k))
		}
		e.mu.Unlock()
		if drop {
			f.ix.dropSlot(ip, e)
		}
		return added
	}
}

// Add4 files keys read from a CT map, as the recorder's records file them
// (recorder.Apply): a key under each of its addresses in the pod CIDRs
// (both, for a same-node flow), a SERVICE key only under its saddr (the
// pod; its daddr is the VIP) with a pending state, so a scrub resolves its
// backend as it does for a snapshot's SERVICE keys. RELATED, IN and OUT
// keys are keys of their own in the maps and are filed as found; the
// forms a scrub adds to them (Covered) follow from the keys as they do for
// recorded ones. It returns the (address, key) pairs added.
func (f *Filing) Add4(keys []ctmap.CTKey4) int {
	added := 0
	for i := range keys {
		k := &keys[i]
		d, s := [4]byte(k[0:4]), [4]byte(k[4:8])
		if k[13]&ctmap.FlagService != 0 {
			if f.owns4(s) {
				added += f.file4(netip.AddrFrom4(s), k, k[13]&ctmap.FlagRelated == 0)
			}
			continue
		}
		if f.owns4(d) {
			added += f.file4(netip.AddrFrom4(d), k, false)
		}
		if s != d && f.owns4(s) {
			added += f.file4(netip.AddrFrom4(s), k, false)
		}
	}
	f.ix.keys.Add(int64(added))
	f.pairs.Add(int64(added))
	return added
}

// Add6 is Add4 for IPv6 keys.
func (f *Filing) Add6(keys []ctmap.CTKey6) int {
	added := 0
	for i := range keys {
		k := &keys[i]
		d, s := k.DAddr(), k.SAddr()
		if k[37]&ctmap.FlagService != 0 {
			if f.ix.Owns(s) {
				added += f.file6(s, k, k[37]&ctmap.FlagRelated == 0)
			}
			continue
		}
		if f.ix.Owns(d) {
			added += f.file6(d, k, false)
		}
		if s != d && f.ix.Owns(s) {
			added += f.file6(s, k, false)
		}
	}
	f.ix.keys.Add(int64(added))
	f.pairs.Add(int64(added))
	return added
}

// Pairs is the (address, key) pairs this pass added so far (progress).
func (f *Filing) Pairs() int64 { return f.pairs.Load() }

// FullKeys is the keys the pass could not add because their IP's set was
// full (the IP is marked ReasonFull).
func (f *Filing) FullKeys() int64 { return f.marked.Load() }

// End closes the slots again (a peer address gets no new slot from now on)
// and returns, sorted, the addresses whose slot kept the pass's epoch:
// present since the pass began or made during it, never marked, dropped or
// spoiled meanwhile. Call it once the recorder's reader has applied every
// record produced before the walk ended (Index.Sync): an entry made during
// the pass, behind the walk, is then in the set. Their sets' prune points
// move past the keys filed, so the first record does not prune a set just
// read from the kernel.
func (f *Filing) End() []netip.Addr {
	ix := f.ix
	f.mu.Lock()
	f.ended = true
	spoiled := f.spoiled
	f.mu.Unlock()
	ix.filing.CompareAndSwap(f, nil)
	f.slots = nil
	var out []netip.Addr
	for i := range ix.shards {
		sh := &ix.shards[i]
		sh.mu.RLock()
		for ip, e := range sh.ips {
			e.mu.Lock()
			if e.filed == f.epoch {
				e.pruneAt = max(e.pruneAt, 2*e.size())
				if spoiled {
					e.filed = 0
				} else if e.incomplete == "" && e.unrecorded == "" {
					out = append(out, ip)
				}
			}
			e.mu.Unlock()
		}
		sh.mu.RUnlock()
	}
	sortAddrs(out)
	return out
}

// TrackFiled is the end of a bootstrap pass as the daemon decides it: each
// address whose slot still carries f's epoch (End listed it, and nothing
// marked, dropped or forgot it since) is declared complete when trust
// says so, as Track does (the Tracked hook runs once for all of them). A
// slot the pass stamped that trust refuses, no pod holds and no scrub
// tracked is dropped: it would only collect keys nobody vouches for. trust
// runs without the index's locks (it may call the index). Every slot loses
// the epoch; a second call, or one before End, does nothing.
func (ix *Index) TrackFiled(f *Filing, trust func(netip.Addr) bool) (tracked []netip.Addr, dropped int) {
	f.mu.Lock()
	ended := f.ended
	f.mu.Unlock()
	if !ended {
		return nil, 0
	}
	type cand struct {
		ip netip.Addr
		e  *IPEntry
	}
	var cands []cand
	for i := range ix.shards {
		sh := &ix.shards[i]
		sh.mu.RLock()
		for ip, e := range sh.ips {
			e.mu.Lock()
			if e.filed == f.epoch {
				cands = append(cands, cand{ip, e})
			}
			e.mu.Unlock()
		}
		sh.mu.RUnlock()
	}
	for _, c := range cands {
		ok := trust(c.ip)
		e := c.e
		e.mu.Lock()
		drop := false
		if e.filed == f.epoch && !e.dead {
			e.filed = 0
			switch {
			case ok && e.incomplete == "" && e.unrecorded == "":
				e.tracked = true
				e.gen = ix.gens.Add(1)
				tracked = append(tracked, c.ip)
			case !e.held && !e.tracked:
				drop = true
			}
		}
		e.mu.Unlock()
		if drop {
			ix.dropSlot(c.ip, e)
			dropped++
		}
	}
	sortAddrs(tracked)
	if h := ix.hooks.Load(); h != nil && h.Tracked != nil && len(tracked) > 0 {
		h.Tracked(tracked)
	}
	return tracked, dropped
}

func sortAddrs(a []netip.Addr) {
	slices.SortFunc(a, func(x, y netip.Addr) int { return x.Compare(y) })
}

// slotOverhead is what one IP's slot costs besides its tables: the IPEntry
// and its shard map entry (key, pointer, the map's own bookkeeping).
const slotOverhead = int64(unsafe.Sizeof(IPEntry{})) + 48

// Bytes is the index's own account of its memory: every slot's key tables
// (their full allocated length) and a fixed cost per slot. Service states
// (a few per client of a load-balanced VIP) are not counted. The Go heap
// adds the allocator's rounding to it (docs/design.md has both measured).
func (ix *Index) Bytes() int64 {
	var n int64
	for i := range ix.shards {
		sh := &ix.shards[i]
		sh.mu.RLock()
		for _, e := range sh.ips {
			e.mu.Lock()
			n += int64(cap(e.keys4.slots)+cap(e.keys6.slots)) + slotOverhead
			e.mu.Unlock()
		}
		sh.mu.RUnlock()
	}
	return n
}
