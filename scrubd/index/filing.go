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
// Add4 and Add6 take a batch of keys (one goroutine files at a time) and
// take no lock of the index: they append each key's record to its
// address's buffer. Merge builds each address's table from its buffer
// without a lock, sized for it (a table built in one go stays in the CPU's
// caches while it is built: a key inserted in a table of the index as it
// arrives cost three to four times as much, one cache miss or more per
// key), and puts it in the address's slot under the IP's lock, inserting
// the smaller of the two sets into the larger. The buffers cost 11 bytes
// per IPv4 key (23 per IPv6 key) and 16 KB per address until Merge.
type Filing struct {
	ix    *Index
	epoch uint64

	mu      sync.Mutex
	gone    map[netip.Addr]struct{} // slots dropped or forgotten during the pass
	spoiled bool                    // SpoilFiling: no address is vouched for
	ended   bool
	// heal (BeginFilingHealing): the marks made before the pass that it
	// makes good; nil: a slot marked before the pass is not vouched for.
	heal func(reason string) bool

	// Records filed and not merged yet, per address.
	buf4 map[[4]byte]*recBuf
	buf6 map[[16]byte]*recBuf

	v4  []prefix4 // the pod CIDRs' IPv4 prefixes, for a cheap Owns
	all bool      // no pod CIDRs: every address is owned

	pairs  atomic.Int64 // (address, key) pairs the pass filed
	added  atomic.Int64 // of them, added to the index (Merge): not there yet
	marked atomic.Int64 // keys not added: the IP's set was full
}

type prefix4 struct{ base, mask uint32 }

// ErrFilingOpen is BeginFiling's error while another pass holds the index.
var ErrFilingOpen = errors.New("index: a bootstrap pass is already filing")

// BeginFiling opens a bootstrap pass's Filing (see Filing). Only one may be
// open at a time.
func (ix *Index) BeginFiling() (*Filing, error) { return ix.BeginFilingHealing(nil) }

// BeginFilingHealing is BeginFiling for a pass that makes good the marks
// heal accepts, made before it began: a slot so marked is vouched for
// like an unmarked one, and TrackFiled clears its mark. The walk reads
// every entry older than the pass, so a mark that says only that keys of
// the IP may be missing from its set (a restart without a snapshot, lost
// records, a cancelled sweep, an owner the recorder did not see) is made
// good by it; a mark that says the set stays short after the pass (the
// set full, a Cilium feature whose entries are elsewhere, a forged source)
// is not. A mark made during the pass still withdraws the slot.
func (ix *Index) BeginFilingHealing(heal func(reason string) bool) (*Filing, error) {
	f := &Filing{ix: ix, epoch: ix.gens.Add(1), gone: map[netip.Addr]struct{}{}, heal: heal,
		buf4: map[[4]byte]*recBuf{}, buf6: map[[16]byte]*recBuf{}, all: len(ix.cfg.PodCIDRs) == 0}
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
			if !e.dead && (heal == nil || e.incomplete == "" || heal(e.incomplete)) {
				e.filed = f.epoch
			}
			e.mu.Unlock()
		}
		sh.mu.RUnlock()
	}
	return f, nil
}

// MaxCover bounds the addresses Cover makes slots for (a /16 of IPv4).
const MaxCover = 1 << 16

// ErrCoverTooLarge is Cover's error for prefixes past MaxCover addresses.
var ErrCoverTooLarge = errors.New("index: the node's ranges to cover hold more than 65,536 addresses")

// Cover makes a slot, now, for every address of prefixes in the pod CIDRs
// (the node's own pod ranges: the addresses its IPAM gives its next
// pods). Call it right after BeginFiling. Such a slot carries the pass's
// epoch like any slot present when the pass began, so an address that
// has no entry at all, a free one, is listed by End with an empty set:
// its slot collects every record from the pass's start, and its next
// ADD may go by the index if the rule trusts it. Without Cover a free
// address has no slot at End and stays unknown (its first scrub sweeps).
// Returns the slots made.
func (f *Filing) Cover(prefixes []netip.Prefix) (int, error) {
	total := 0
	for _, p := range prefixes {
		p = p.Masked()
		bits := p.Addr().BitLen() - p.Bits()
		if bits > 16 || total+1<<bits > MaxCover {
			return 0, ErrCoverTooLarge
		}
		total += 1 << bits
	}
	made := 0
	for _, p := range prefixes {
		p = p.Masked()
		for a := p.Addr(); p.Contains(a); a = a.Next() {
			if f.ix.Owns(a) {
				f.ix.entry(a, true)
				made++
			}
		}
	}
	return made, nil
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

// recBuf is one address's records filed and not merged yet: blocks of
// blockRecs records (no copy as it grows), and its SERVICE keys.
type recBuf struct {
	blocks [][]byte
	n      int
	svc4   []ctmap.CTKey4
	svc6   []ctmap.CTKey6
}

const blockBytes = 16 << 10

func (b *recBuf) add(rec []byte) {
	if len(b.blocks) == 0 || len(b.blocks[len(b.blocks)-1])+len(rec) > cap(b.blocks[len(b.blocks)-1]) {
		b.blocks = append(b.blocks, make([]byte, 0, blockBytes/len(rec)*len(rec)))
	}
	last := &b.blocks[len(b.blocks)-1]
	*last = append(*last, rec...)
	b.n++
}

func (f *Filing) buffer4(a [4]byte, k *ctmap.CTKey4, svc bool) {
	b := f.buf4[a]
	if b == nil {
		b = &recBuf{}
		f.buf4[a] = b
	}
	var rec [RecSize4]byte
	pack(rec[:], a[:], k[:], 4)
	b.add(rec[:])
	if svc {
		b.svc4 = append(b.svc4, *k)
	}
}

func (f *Filing) buffer6(a [16]byte, k *ctmap.CTKey6, svc bool) {
	b := f.buf6[a]
	if b == nil {
		b = &recBuf{}
		f.buf6[a] = b
	}
	var rec [RecSize6]byte
	pack(rec[:], a[:], k[:], 16)
	b.add(rec[:])
	if svc {
		b.svc6 = append(b.svc6, *k)
	}
}

// Add4 files keys read from a CT map, as the recorder's records file them
// (recorder.Apply): a key under each of its addresses in the pod CIDRs
// (both, for a same-node flow), a SERVICE key only under its saddr (the
// pod; its daddr is the VIP) with a pending state, so a scrub resolves its
// backend as it does for a snapshot's SERVICE keys. RELATED, IN and OUT
// keys are keys of their own in the maps and are filed as found; the
// forms a scrub adds to them (Covered) follow from the keys as they do for
// recorded ones. The keys reach the index at Merge. It returns the
// (address, key) pairs filed.
func (f *Filing) Add4(keys []ctmap.CTKey4) int {
	filed := 0
	for i := range keys {
		k := &keys[i]
		d, s := [4]byte(k[0:4]), [4]byte(k[4:8])
		if k[13]&ctmap.FlagService != 0 {
			if f.owns4(s) {
				f.buffer4(s, k, k[13]&ctmap.FlagRelated == 0)
				filed++
			}
			continue
		}
		if f.owns4(d) {
			f.buffer4(d, k, false)
			filed++
		}
		if s != d && f.owns4(s) {
			f.buffer4(s, k, false)
			filed++
		}
	}
	f.pairs.Add(int64(filed))
	return filed
}

// Add6 is Add4 for IPv6 keys.
func (f *Filing) Add6(keys []ctmap.CTKey6) int {
	filed := 0
	for i := range keys {
		k := &keys[i]
		d, s := k.DAddr(), k.SAddr()
		if k[37]&ctmap.FlagService != 0 {
			if f.ix.Owns(s) {
				f.buffer6(s.As16(), k, k[37]&ctmap.FlagRelated == 0)
				filed++
			}
			continue
		}
		if f.ix.Owns(d) {
			f.buffer6(d.As16(), k, false)
			filed++
		}
		if s != d && f.ix.Owns(s) {
			f.buffer6(s.As16(), k, false)
			filed++
		}
	}
	f.pairs.Add(int64(filed))
	return filed
}

// Merge puts every buffered record into its address's slot (made, while
// the filing is open, when missing), on workers goroutines (at least 1),
// and empties the buffers. Call it once the walk is over, before End.
func (f *Filing) Merge(workers int) {
	type job struct {
		ip  netip.Addr
		buf *recBuf
	}
	jobs := make(chan job, 64)
	var wg sync.WaitGroup
	for range max(workers, 1) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range jobs {
				f.merge(j.ip, j.buf)
			}
		}()
	}
	for a, b := range f.buf4 {
		jobs <- job{netip.AddrFrom4(a), b}
		delete(f.buf4, a)
	}
	for a, b := range f.buf6 {
		jobs <- job{netip.AddrFrom16(a), b}
		delete(f.buf6, a)
	}
	close(jobs)
	wg.Wait()
}

// merge builds ip's records into a table of their own, without a lock,
// then joins it with ip's set under the IP's lock.
func (f *Filing) merge(ip netip.Addr, b *recBuf) {
	rs := RecSize4
	if ip.Is6() {
		rs = RecSize6
	}
	var nb keySet
	// About 4/5 full: between the 2/3 and 7/8 the set keeps to, so a
	// set read from the kernel costs what one grown by records does.
	nb.resize(rs, b.n*5/4+1)
	for i, blk := range b.blocks {
		for off := 0; off < len(blk); off += rs {
			nb.add(blk[off : off+rs])
		}
		b.blocks[i] = nil // the buffer's memory goes as the table grows
	}
	for {
		e := f.ix.entry(ip, true)
		e.mu.Lock()
		if e.dead {
			e.mu.Unlock()
			continue // dropped meanwhile: look again (a new slot is not stamped)
		}
		added, drop := 0, false
		set := &e.keys4
		if rs == RecSize6 {
			set = &e.keys6
		}
		switch {
		case e.size()-set.n+max(set.n, nb.n) > f.ix.cfg.MaxKeysPerIP:
			// Past the cap the IP sweeps: its keys do not matter.
			drop = f.ix.markLocked(e, ReasonFull)
			f.marked.Add(int64(nb.n))
		case e.pruning > 0:
			// A prune notes what is added meanwhile (added4/6).
			nb.each(rs, func(rec []byte) {
				if rs == RecSize4 {
					var k ctmap.CTKey4
					unpack(k[:], e.a4[:], rec, 4)
					if e.add4(&k) {
						added++
					}
				} else {
					var k ctmap.CTKey6
					unpack(k[:], e.a16[:], rec, 16)
					if e.add6(&k) {
						added++
					}
				}
			})
		case set.n <= nb.n:
			// The usual case: the slot holds what the recorder filed
			// during the pass, if anything.
			before := set.n
			set.each(rs, func(rec []byte) { nb.add(rec) })
			added = nb.n - before
			*set = nb
		default:
			nb.each(rs, func(rec []byte) {
				if set.add(rec) {
					added++
				}
			})
		}
		if !drop {
			for i := range b.svc4 {
				e.notePendingLocked(svcID4(&b.svc4[i]))
			}
			for i := range b.svc6 {
				e.notePendingLocked(svcID6(&b.svc6[i]))
			}
			e.pruneAt = max(e.pruneAt, 2*e.size())
			f.ix.mirrorAllLocked(e)
		}
		e.mu.Unlock()
		f.ix.keys.Add(int64(added))
		f.added.Add(int64(added))
		if drop {
			f.ix.dropSlot(ip, e)
		}
		return
	}
}

// Pairs is the (address, key) pairs this pass filed so far (progress).
func (f *Filing) Pairs() int64 { return f.pairs.Load() }

// Added is the pairs Merge added to the index (pairs already there, from a
// record or a snapshot, are not counted).
func (f *Filing) Added() int64 { return f.added.Load() }

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
	if len(f.buf4)+len(f.buf6) > 0 {
		f.Merge(1)
	}
	f.mu.Lock()
	f.ended = true
	spoiled := f.spoiled
	f.mu.Unlock()
	ix.filing.CompareAndSwap(f, nil)
	var out []netip.Addr
	for i := range ix.shards {
		sh := &ix.shards[i]
		sh.mu.RLock()
		for ip, e := range sh.ips {
			e.mu.Lock()
			if e.filed == f.epoch {
				e.pruneAt = max(e.pruneAt, 2*e.size())
				// A spoiled pass keeps the epochs: TrackFiled then
				// drops the slots it made that nobody holds.
				if !spoiled && (e.incomplete == "" || f.heal != nil) && e.unrecorded == "" {
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

// Abort ends a pass that failed: its buffered records are dropped, it
// vouches for nothing, and the slots it made that no pod holds go.
func (f *Filing) Abort() {
	f.mu.Lock()
	f.spoiled = true
	f.mu.Unlock()
	clear(f.buf4)
	clear(f.buf6)
	f.End()
	f.ix.TrackFiled(f, nil)
}

// TrackFiled is the end of a bootstrap pass as the daemon decides it: each
// address whose slot still carries f's epoch (End listed it, and nothing
// marked, dropped or forgot it since) is declared complete when trust
// says so, as Track does (the Tracked hook runs once for all of them). A
// slot the pass stamped that trust refuses, no pod holds and no scrub
// tracked is dropped, and so is one it made that it does not vouch for (a
// slot made again after a drop, or during a spoiled pass): either would
// only collect keys nobody vouches for. trust
// runs without the index's locks (it may call the index). Every slot loses
// the epoch; a second call, or one before End, does nothing.
func (ix *Index) TrackFiled(f *Filing, trust func(netip.Addr) bool) (tracked []netip.Addr, dropped int) {
	f.mu.Lock()
	ended, spoiled := f.ended, f.spoiled
	f.mu.Unlock()
	if !ended {
		return nil, 0
	}
	if spoiled {
		trust = func(netip.Addr) bool { return false }
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
			if e.filed == f.epoch || e.made == f.epoch {
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
		vouched, made := e.filed == f.epoch, e.made == f.epoch
		if (vouched || made) && !e.dead {
			e.filed, e.made = 0, 0
			switch {
			case vouched && ok && (e.incomplete == "" || f.heal != nil) && e.unrecorded == "":
				// A mark left on a vouched slot was made before the pass
				// and healed by it (BeginFilingHealing): marks since
				// took the epoch away.
				if e.incomplete != "" {
					e.incomplete = ""
					ix.incomplete.Add(-1)
				}
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
