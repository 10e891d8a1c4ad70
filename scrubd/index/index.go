// Package index keeps, for every local pod IP, the set of Cilium CT keys that
// contain it, so a scrub deletes exactly those keys instead of walking the map.
//
// The kernel side (the recorder, bpf/recorder.c) sees each new flow of a pod on
// the pod's own interface and sends one record per flow through a ring buffer;
// Add is the one path every record takes into this index. Each key is indexed
// under every address of the key that lies in the pod CIDRs (a same-node
// pod-to-pod entry is found from either pod).
//
// Why user space: a packed per-IP table of key records (keyset.go) costs
// 12.6-16.5 bytes per key per address (see docs/design.md for the measured
// figure), a kernel hash keyed by (pod IP, CT key) costs over 100 with its
// htab_elem header and buckets.
//
// Locking: one small lock per shard of IPs and one per IP; scrubs of different
// IPs never wait on each other.
package index

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"net/netip"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// Reasons an IP's index cannot prove completeness.
const (
	ReasonUnknown   = "not tracked since the index started"
	ReasonFull      = "index full for this IP"
	ReasonLost      = "recorder events lost"
	ReasonService   = "flow to a load-balanced service VIP"
	ReasonCancelled = "scrub cancelled before it finished"
	ReasonRestart   = "daemon restarted without a consistent snapshot"
	ReasonAuditMiss = "the audit found a CT entry the index did not cover"
	ReasonOwner     = "may have had an owner ctscrub did not see"
	ReasonCTMaps    = "Cilium's CT maps were re-created (agent restart)"
	// ReasonForeignSource: the recorder saw a pod send from this address
	// although its interface does not own it (docs/recorder.md).
	ReasonForeignSource = "a pod sent packets with this IP as its source: entries Cilium may have created for them are not indexed"
	// ReasonServiceMaps: the recorder read service maps Cilium no longer
	// filled until it reloaded its programs over the new ones.
	ReasonServiceMaps = "Cilium's service maps changed under the recorder (agent restart)"
	// ReasonNotFed is what a scrub reports for the IPs it swept because no
	// recorder was feeding the index (not started yet, or stopped): flows
	// since then may sit unread in the ring buffer or be missing. Sync
	// fails with ErrNotFed; no slot is marked.
	ReasonNotFed = "the recorder is not running: the index may miss flows"
	// ReasonNotSynced: the recorder's reader did not apply the records
	// produced before the scrub within the scrub's bound.
	ReasonNotSynced = "the recorder's reader did not catch up in time"
)

// ErrNotFed is Sync's error while no recorder feeds the index (it has not
// started, or it stopped): a scrub then trusts no IP's set and sweeps.
var ErrNotFed = errors.New("index: " + ReasonNotFed)

// Config bounds the index.
type Config struct {
	// PodCIDRs: only addresses inside them are indexed. Empty means all.
	PodCIDRs []netip.Prefix
	// MaxKeysPerIP caps one IP's set; past it the IP is marked incomplete
	// (ReasonFull) and its next scrub sweeps. 0 means 1<<20.
	MaxKeysPerIP int
}

// Index is the IP-to-CT-key index.
type Index struct {
	cfg    Config
	seed   maphash.Seed
	shards [64]shard

	keys       atomic.Int64 // indexed (ip, key) pairs
	incomplete atomic.Int64 // IPs marked incomplete

	hooks atomic.Pointer[Hooks]
	// feedMu guards feedUp and feedDown, the recorder's presence as Sync
	// sees it: feedUp is closed once hooks are installed; feedDown is set
	// when they are removed (the recorder stopped) and cleared when they
	// are installed again.
	feedMu   sync.Mutex
	feedUp   chan struct{}
	feedDown bool

	gens atomic.Uint64 // source of IPEntry.gen values: never repeats

	// filing is the bootstrap pass's Filing while one is open (filing.go).
	filing atomic.Pointer[Filing]

	// peers mirrors the slots' keys under their other addresses while
	// EnablePeers has turned it on (peers.go); nil: off.
	peers atomic.Pointer[peerTable]
}

// Hooks let the recorder follow keys out of the index. The recorder's
// kernel cache of flows it has already recorded must forget a flow whose
// entry a scrub deletes, or the entry re-created by the flow's next packet
// would never be recorded. Both are called synchronously, after the IP's
// lock is released, before Take or Track returns.
type Hooks struct {
	// Taken receives the keys Take handed out (non-empty sets only).
	Taken func(ip netip.Addr, k4 []ctmap.CTKey4, k6 []ctmap.CTKey6)
	// Tracked is called when IPs are declared complete: every flow of
	// them must be recorded again from now on. TrackAll passes all its IPs
	// in one call (the recorder then forgets them in shared passes).
	Tracked func(ips []netip.Addr)
	// Sync returns once every record the kernel produced before the call
	// has been applied (the reader may lag behind the ring buffer).
	Sync func(ctx context.Context) error
	// Resolve learns the backends of ip's service flows (Services) and
	// indexes their OUT keys, or marks ip incomplete
	// (ReasonServiceUnresolved) where it cannot. Take and ScrubKeys call
	// it first, so a scrub and the audit see the flows' current backends.
	Resolve func(ip netip.Addr)
	// Confirm is handed the Repick flows (SvcState.Repick) Take took, once
	// Taken has made the recorder record every packet of ip again: it
	// checks that no packet that passed before re-picked a backend unseen,
	// and returns the OUT keys of picks it found made meanwhile. why != ""
	// when it cannot tell: Take then marks ip incomplete. Without Confirm,
	// Take marks such an IP.
	Confirm func(ip netip.Addr, svcs []Service) (k4 []ctmap.CTKey4, k6 []ctmap.CTKey6, why string)
}

// resolve runs the Resolve hook for ip.
func (ix *Index) resolve(ip netip.Addr) {
	if h := ix.hooks.Load(); h != nil && h.Resolve != nil {
		h.Resolve(ip)
	}
}

// SetHooks installs h (nil removes them). scrubd/recorder.Run installs its
// hooks when it starts reading and removes them when it stops; code that
// adds every key itself, synchronously (benchmarks, tests), installs hooks
// without Sync.
func (ix *Index) SetHooks(h *Hooks) {
	ix.feedMu.Lock()
	defer ix.feedMu.Unlock()
	ix.hooks.Store(h)
	if h != nil {
		ix.feedDown = false
		select {
		case <-ix.feedUp:
		default:
			close(ix.feedUp)
		}
		return
	}
	ix.feedDown = true
	select {
	case <-ix.feedUp:
		ix.feedUp = make(chan struct{})
	default:
	}
}

// Fed reports whether hooks are installed: a recorder (or a caller adding
// keys itself) feeds the index now.
func (ix *Index) Fed() bool { return ix.hooks.Load() != nil }

// Sync waits until the recorder has applied every record produced before the
// call, so that an IP's set holds every flow the kernel reported until now.
// A scrub calls it before it trusts the index, and trusts no IP when it
// fails. It fails closed: before the recorder has installed its hooks (the
// daemon serves while the recorder starts) it waits for them within ctx;
// after the recorder stopped it fails at once with ErrNotFed. Hooks
// without Sync mean their installer adds every key synchronously.
func (ix *Index) Sync(ctx context.Context) error {
	for {
		if h := ix.hooks.Load(); h != nil {
			if h.Sync == nil {
				return nil
			}
			return h.Sync(ctx)
		}
		ix.feedMu.Lock()
		up, down := ix.feedUp, ix.feedDown
		ix.feedMu.Unlock()
		if down {
			return ErrNotFed
		}
		select {
		case <-up:
		case <-ctx.Done():
			return fmt.Errorf("%w (waited for it to start: %w)", ErrNotFed, ctx.Err())
		}
	}
}

type shard struct {
	mu  sync.RWMutex
	ips map[netip.Addr]*IPEntry
}

// IPEntry is one IP's slot. Its lock is held by a scrub of that IP while it
// takes the keys, never across another IP's work.
type IPEntry struct {
	mu      sync.Mutex
	ip      netip.Addr
	a4      [4]byte  // ip.As4() when ip is IPv4
	a16     [16]byte // ip.As16()
	keys4   keySet   // IPv4 keys, records relative to a4
	keys6   keySet   // IPv6 keys, records relative to a16
	tracked bool     // swept (or created fresh) since the index started
	held    bool     // a pod on this node holds the IP (Hold, Release)
	// unrecorded: why no recorder sees the holding pod's flows ("" when
	// one does). Unlike a mark, a sweep does not clear it (Unrecorded).
	unrecorded string
	incomplete string // first reason it cannot prove completeness; "" when complete
	pruneAt    int    // size at which the set is checked for stale keys
	gen        uint64 // changes on every Take and Track (see State.Gen)
	// filed: the epoch of the bootstrap pass that vouches for the slot
	// since the pass began (0: none; any mark clears it). dead: the slot
	// was dropped or forgotten; whoever still holds it looks again.
	filed uint64
	made  uint64 // the epoch of the bootstrap pass during which the slot was made
	dead  bool

	// While a Prune of this IP runs (pruning > 0) every key added is also
	// noted in added4/added6: Prune then keeps it even if it judged the key
	// stale, since its entry may have been re-created and recorded since.
	pruning        int
	added4, added6 keySet

	// svc: the IP's flows through VIPs Cilium load-balances per packet,
	// by SERVICE key (service.go). Emptied with the keys (Take, a sweep).
	svc map[svcID]*SvcState
}

func (e *IPEntry) size() int { return e.keys4.n + e.keys6.n }

// add4 inserts k (which contains e.ip) under e's lock; false when present.
func (e *IPEntry) add4(k *ctmap.CTKey4) bool {
	var rec [RecSize4]byte
	if !e.ip.Is4() || !pack(rec[:], e.a4[:], k[:], 4) {
		return false
	}
	if e.pruning > 0 {
		e.added4.add(rec[:])
	}
	return e.keys4.add(rec[:])
}

func (e *IPEntry) add6(k *ctmap.CTKey6) bool {
	var rec [RecSize6]byte
	if !e.ip.Is6() || !pack(rec[:], e.a16[:], k[:], 16) {
		return false
	}
	if e.pruning > 0 {
		e.added6.add(rec[:])
	}
	return e.keys6.add(rec[:])
}

func (e *IPEntry) has4(k *ctmap.CTKey4) bool {
	var rec [RecSize4]byte
	if !e.ip.Is4() || e.keys4.n == 0 || !pack(rec[:], e.a4[:], k[:], 4) {
		return false
	}
	_, ok := e.keys4.find(rec[:])
	return ok
}

func (e *IPEntry) has6(k *ctmap.CTKey6) bool {
	var rec [RecSize6]byte
	if !e.ip.Is6() || e.keys6.n == 0 || !pack(rec[:], e.a16[:], k[:], 16) {
		return false
	}
	_, ok := e.keys6.find(rec[:])
	return ok
}

func (e *IPEntry) list(k4 []ctmap.CTKey4, k6 []ctmap.CTKey6) ([]ctmap.CTKey4, []ctmap.CTKey6) {
	if e.keys4.n > 0 {
		k4 = e.keys4.keys4(&e.a4, k4)
	}
	if e.keys6.n > 0 {
		k6 = e.keys6.keys6(&e.a16, k6)
	}
	return k4, k6
}

// New returns an empty index.
func New(cfg Config) *Index {
	if cfg.MaxKeysPerIP == 0 {
		cfg.MaxKeysPerIP = 1 << 20
	}
	ix := &Index{cfg: cfg, seed: maphash.MakeSeed(), feedUp: make(chan struct{})}
	for i := range ix.shards {
		ix.shards[i].ips = make(map[netip.Addr]*IPEntry)
	}
	return ix
}

// PodCIDRs is the index's pod CIDRs (Config.PodCIDRs; none: every
// address is owned).
func (ix *Index) PodCIDRs() []netip.Prefix { return slices.Clone(ix.cfg.PodCIDRs) }

// Owns reports whether ip lies in the configured pod CIDRs.
func (ix *Index) Owns(ip netip.Addr) bool {
	if len(ix.cfg.PodCIDRs) == 0 {
		return true
	}
	ip = ip.Unmap()
	for _, p := range ix.cfg.PodCIDRs {
		if p.Contains(ip) {
			return true
		}
	}
	return false
}

func (ix *Index) shard(ip netip.Addr) *shard {
	b := ip.As16()
	return &ix.shards[maphash.Bytes(ix.seed, b[:])%uint64(len(ix.shards))]
}

// entry returns ip's slot, creating it (untracked) when create is set.
func (ix *Index) entry(ip netip.Addr, create bool) *IPEntry {
	sh := ix.shard(ip)
	sh.mu.RLock()
	e := sh.ips[ip]
	sh.mu.RUnlock()
	if e != nil || !create {
		return e
	}
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if e = sh.ips[ip]; e == nil {
		e = &IPEntry{ip: ip, a16: ip.As16(), pruneAt: 1024, gen: ix.gens.Add(1)}
		if ip.Is4() {
			e.a4 = ip.As4()
		}
		if f := ix.filingNow(); f != nil {
			e.made = f.epoch
			if !f.isGone(ip) {
				e.filed = f.epoch
			}
		}
		sh.ips[ip] = e
	}
	return e
}

// Add4 indexes a CT key under each of its addresses that has a slot (the
// recorder adds a flow's related ICMP key as a key of its own). It is the
// single path by which the recorder's records and the benchmark's fills
// enter the index.
func (ix *Index) Add4(k ctmap.CTKey4) {
	ix.AddTo4(k.DAddr(), k)
	if k.SAddr() != k.DAddr() {
		ix.AddTo4(k.SAddr(), k)
	}
}

// Add6 is Add4 for IPv6 keys.
func (ix *Index) Add6(k ctmap.CTKey6) {
	ix.AddTo6(k.DAddr(), k)
	if k.SAddr() != k.DAddr() {
		ix.AddTo6(k.SAddr(), k)
	}
}

// AddTo4 is Add4 under one of the key's addresses only: the recorder's
// record of a forged source files the key under its receiver and never
// under the address the sender claimed. Nothing when ip is not in the key
// or has no slot: only IPs a pod of this node holds (Hold) and IPs a scrub
// tracked collect keys, so a peer's address gets no slot of its own.
func (ix *Index) AddTo4(ip netip.Addr, k ctmap.CTKey4) {
	if k.DAddr() != ip && k.SAddr() != ip {
		return
	}
	e := ix.slot(ip)
	if e == nil {
		return
	}
	e.mu.Lock()
	drop := false
	if e.size() >= ix.cfg.MaxKeysPerIP && !e.has4(&k) {
		drop = ix.markLocked(e, ReasonFull)
	} else if e.add4(&k) {
		ix.keys.Add(1)
		ix.mirror4(e, &k)
	}
	e.mu.Unlock()
	if drop {
		ix.dropSlot(ip, e)
	}
}

// AddTo6 is AddTo4 for IPv6 keys.
func (ix *Index) AddTo6(ip netip.Addr, k ctmap.CTKey6) {
	if k.DAddr() != ip && k.SAddr() != ip {
		return
	}
	e := ix.slot(ip)
	if e == nil {
		return
	}
	e.mu.Lock()
	drop := false
	if e.size() >= ix.cfg.MaxKeysPerIP && !e.has6(&k) {
		drop = ix.markLocked(e, ReasonFull)
	} else if e.add6(&k) {
		ix.keys.Add(1)
		ix.mirror6(e, &k)
	}
	e.mu.Unlock()
	if drop {
		ix.dropSlot(ip, e)
	}
}

// slot returns ip's slot, or nil when it has none or lies outside the pod
// CIDRs. While a bootstrap pass files (filing.go) every address in the pod
// CIDRs gets one.
func (ix *Index) slot(ip netip.Addr) *IPEntry {
	if !ix.Owns(ip) {
		return nil
	}
	return ix.entry(ip, ix.filingNow() != nil)
}

// markLocked marks e incomplete. A slot no pod of this node holds is
// dropped instead (drop reports it; the caller drops it after unlocking):
// an IP without a slot is incomplete already (ReasonUnknown), so nothing is
// lost, and a node-wide marking (Cilium's maps re-created, the lost counter
// full) does not leave the IPs of released pods and of peers marked for
// ever.
func (ix *Index) markLocked(e *IPEntry, reason string) (drop bool) {
	if e.incomplete == "" {
		e.incomplete = reason
		ix.incomplete.Add(1)
	}
	e.filed = 0
	return !e.held
}

// MarkIncomplete records that ip's index cannot prove completeness; its next
// scrub sweeps. An IP no pod of this node holds loses its slot instead
// (markLocked).
func (ix *Index) MarkIncomplete(ip netip.Addr, reason string) {
	e := ix.entry(ip, false)
	if e == nil {
		// No slot: incomplete already. A bootstrap pass must not vouch
		// for a slot it makes for ip later.
		if f := ix.filingNow(); f != nil && ix.Owns(ip) {
			f.noteGone(ip)
		}
		return
	}
	e.mu.Lock()
	drop := ix.markLocked(e, reason)
	e.mu.Unlock()
	if drop {
		ix.dropSlot(ip, e)
	}
}

// Hold records that a pod on this node holds ip (an index start, or the
// attachments restored at start): its slot is kept whatever marks it, and
// created (not tracked) when missing, so the pod's flows are indexed from
// its first packet.
func (ix *Index) Hold(ip netip.Addr) {
	if !ix.Owns(ip) {
		return
	}
	e := ix.entry(ip, true)
	e.mu.Lock()
	e.held = true
	e.mu.Unlock()
}

// Unrecorded records that no recorder sees the flows of the pod holding
// ip (the recorder could not attach to it): the IP stays incomplete for
// reason through any number of sweeps, since a sweep's Track would
// otherwise declare complete an IP whose new flows nobody records. Recorded
// or the slot's drop (Release) ends it.
func (ix *Index) Unrecorded(ip netip.Addr, reason string) {
	if !ix.Owns(ip) {
		return
	}
	e := ix.entry(ip, true)
	e.mu.Lock()
	e.held = true
	e.unrecorded = reason
	ix.markLocked(e, reason)
	e.mu.Unlock()
}

// Held reports whether a pod of this node holds ip (Hold).
func (ix *Index) Held(ip netip.Addr) bool {
	e := ix.entry(ip, false)
	if e == nil {
		return false
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.held
}

// Recorded ends Unrecorded: the recorder is attached to the pod holding ip.
func (ix *Index) Recorded(ip netip.Addr) {
	e := ix.entry(ip, false)
	if e == nil {
		return
	}
	e.mu.Lock()
	e.unrecorded = ""
	e.mu.Unlock()
}

// Release records that no pod of this node holds ip any more (its pod was
// deleted). A complete slot stays: it keeps collecting the keys of live
// pods' flows towards the IP, so the scrub at the IP's next ADD needs no
// sweep. An incomplete one is dropped (markLocked).
func (ix *Index) Release(ip netip.Addr) {
	e := ix.entry(ip, false)
	if e == nil {
		return
	}
	e.mu.Lock()
	e.held = false
	drop := e.incomplete != "" || !e.tracked
	e.mu.Unlock()
	if drop {
		ix.dropSlot(ip, e)
	}
}

// Slots is the number of IP slots (metrics: the index's size in IPs).
func (ix *Index) Slots() int {
	n := 0
	for i := range ix.shards {
		sh := &ix.shards[i]
		sh.mu.RLock()
		n += len(sh.ips)
		sh.mu.RUnlock()
	}
	return n
}

// dropSlot removes e, ip's slot, unless it was replaced or is held again.
func (ix *Index) dropSlot(ip netip.Addr, e *IPEntry) {
	sh := ix.shard(ip)
	sh.mu.Lock()
	if sh.ips[ip] != e {
		sh.mu.Unlock()
		return
	}
	e.mu.Lock()
	if e.held {
		// Held again meanwhile: the slot stays, with its mark.
		e.mu.Unlock()
		sh.mu.Unlock()
		return
	}
	delete(sh.ips, ip)
	ix.keys.Add(-int64(e.size()))
	if e.incomplete != "" {
		ix.incomplete.Add(-1)
	}
	e.dead, e.filed = true, 0
	if f := ix.filingNow(); f != nil {
		f.noteGone(ip)
	}
	// Anyone still holding e (a Take, an Add that found it) works on a
	// slot no longer in the index: the IP has no slot, so it is not
	// tracked (ReasonUnknown) whatever they do to e.
	e.keys4, e.keys6 = keySet{}, keySet{}
	e.incomplete, e.tracked, e.unrecorded = "", false, ""
	e.mu.Unlock()
	sh.mu.Unlock()
	ix.maybeCleanPeers()
}

// Track declares ip complete from now on: called after a sweep removed every
// entry of ip, or for an IP whose every flow the recorders have seen.
func (ix *Index) Track(ip netip.Addr) {
	ix.track(ip)
	if h := ix.hooks.Load(); h != nil && h.Tracked != nil {
		h.Tracked([]netip.Addr{ip})
	}
}

// TrackAll is Track for several IPs (e.g. before one sweep of all of them):
// the Tracked hook runs once for the set.
func (ix *Index) TrackAll(ips []netip.Addr) {
	for _, ip := range ips {
		ix.track(ip)
	}
	if h := ix.hooks.Load(); h != nil && h.Tracked != nil && len(ips) > 0 {
		h.Tracked(ips)
	}
}

func (ix *Index) track(ip netip.Addr) {
	e := ix.entry(ip, true)
	e.mu.Lock()
	e.tracked = true
	e.gen = ix.gens.Add(1)
	if e.incomplete != "" {
		e.incomplete = ""
		ix.incomplete.Add(-1)
	}
	e.mu.Unlock()
}

// State is what the index knows of one IP.
type State struct {
	IP         netip.Addr
	Keys       int
	Complete   bool
	Incomplete string // reason when !Complete
}

// Gen is ip's generation: it changes whenever a scrub takes the IP's keys,
// the IP is declared complete, or its slot is created (0: no slot). An audit
// that reads the same Gen before its kernel read and after knows that no
// scrub moved keys out of the index in between.
func (ix *Index) Gen(ip netip.Addr) uint64 {
	e := ix.entry(ip, false)
	if e == nil {
		return 0
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.gen
}

// State returns ip's state. An IP the index has never seen is incomplete.
func (ix *Index) State(ip netip.Addr) State {
	e := ix.entry(ip, false)
	if e == nil {
		return State{IP: ip, Incomplete: ReasonUnknown}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.stateLocked()
}

func (e *IPEntry) stateLocked() State {
	s := State{IP: e.ip, Keys: e.size()}
	switch {
	case e.unrecorded != "":
		s.Incomplete = e.unrecorded
	case e.incomplete != "":
		s.Incomplete = e.incomplete
	case !e.tracked:
		s.Incomplete = ReasonUnknown
	default:
		s.Complete = true
	}
	return s
}

// Take hands a scrub the keys of ip and removes them from ip's set. The scrub
// deletes them from the CT maps and gives back (Return) those it could not
// delete, so a cancelled scrub leaves the index consistent.
func (ix *Index) Take(ip netip.Addr) (k4 []ctmap.CTKey4, k6 []ctmap.CTKey6, st State) {
	ix.resolve(ip)
	e := ix.entry(ip, false)
	if e == nil {
		return nil, nil, State{IP: ip, Incomplete: ReasonUnknown}
	}
	e.mu.Lock()
	// A service flow with a pick not resolved to an OUT key (a read, or a
	// pending pick, left after the Resolve above or without one): its
	// state goes with the keys, so the scrub cannot know that OUT entry.
	drop := false
	if e.svcUnsettledLocked() {
		drop = ix.markLocked(e, ReasonServiceUnresolved)
	}
	st = e.stateLocked()
	var repick []Service
	if st.Complete {
		for id, s := range e.svc {
			if s.Repick {
				repick = append(repick, id.service(s))
			}
		}
	}
	k4, k6 = e.list(nil, nil)
	ix.keys.Add(-int64(len(k4) + len(k6)))
	e.keys4, e.keys6 = keySet{}, keySet{}
	e.svc = nil
	e.gen = ix.gens.Add(1)
	e.mu.Unlock()
	if drop {
		ix.dropSlot(ip, e)
	}
	ix.maybeCleanPeers()
	h := ix.hooks.Load()
	taken := h != nil && h.Taken != nil && len(k4)+len(k6) > 0
	if taken {
		h.Taken(ip, k4, k6)
	}
	if len(repick) > 0 {
		why := "a flow's backend was removed and no recorder can confirm that no packet re-picked"
		if taken && h.Confirm != nil {
			var x4 []ctmap.CTKey4
			var x6 []ctmap.CTKey6
			x4, x6, why = h.Confirm(ip, repick)
			k4, k6 = append(k4, x4...), append(k6, x6...)
		}
		if why != "" {
			ix.MarkIncomplete(ip, ReasonServiceUnresolved)
			st.Complete, st.Incomplete = false, ReasonServiceUnresolved
		}
	}
	return k4, k6, st
}

// KeysOf returns a copy of ip's keys and its state, leaving the index as it
// is (tests, diagnostics).
func (ix *Index) KeysOf(ip netip.Addr) (k4 []ctmap.CTKey4, k6 []ctmap.CTKey6, st State) {
	e := ix.entry(ip, false)
	if e == nil {
		return nil, nil, State{IP: ip, Incomplete: ReasonUnknown}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	k4, k6 = e.list(nil, nil)
	return k4, k6, e.stateLocked()
}

// Return puts back keys a scrub took but did not delete. Keys that do not
// contain ip (never taken from it) are ignored.
func (ix *Index) Return(ip netip.Addr, k4 []ctmap.CTKey4, k6 []ctmap.CTKey6) {
	if len(k4)+len(k6) == 0 {
		return
	}
	e := ix.entry(ip, false)
	if e == nil {
		return // dropped meanwhile: not tracked, its keys do not matter
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	for i := range k4 {
		if e.add4(&k4[i]) {
			ix.keys.Add(1)
			ix.mirror4(e, &k4[i])
		}
	}
	for i := range k6 {
		if e.add6(&k6[i]) {
			ix.keys.Add(1)
			ix.mirror6(e, &k6[i])
		}
	}
	e.noteServiceKeysLocked(k4, k6)
}

// Forget drops ip's slot entirely (its keys and its tracked state), e.g. when
// the IP leaves the pod CIDRs.
func (ix *Index) Forget(ip netip.Addr) {
	sh := ix.shard(ip)
	sh.mu.Lock()
	e := sh.ips[ip]
	delete(sh.ips, ip)
	sh.mu.Unlock()
	if e == nil {
		return
	}
	e.mu.Lock()
	ix.keys.Add(-int64(e.size()))
	if e.incomplete != "" {
		ix.incomplete.Add(-1)
	}
	e.dead, e.filed = true, 0
	e.mu.Unlock()
	if f := ix.filingNow(); f != nil {
		f.noteGone(ip)
	}
}

// Keys is the number of indexed (IP, key) pairs.
func (ix *Index) Keys() int64 { return ix.keys.Load() }

// IncompleteIPs is the number of IPs marked incomplete.
func (ix *Index) IncompleteIPs() int64 { return ix.incomplete.Load() }

// IPs lists every IP the index holds, sorted.
func (ix *Index) IPs() []netip.Addr {
	var out []netip.Addr
	for i := range ix.shards {
		sh := &ix.shards[i]
		sh.mu.RLock()
		for ip := range sh.ips {
			out = append(out, ip)
		}
		sh.mu.RUnlock()
	}
	slices.SortFunc(out, func(a, b netip.Addr) int { return a.Compare(b) })
	return out
}

// Prune drops from ip's set the keys for which gone reports true (entries
// Cilium's LRU or GC already removed). The recorder's flow cache must forget
// such a flow too, so a re-created entry is recorded again; callers pass that
// in gone.
//
// gone runs without ip's lock (it may make syscalls per key): Prune copies
// the keys under the lock, asks gone about each copy, and removes under the
// lock those judged gone that are still in the set and were not added again
// meanwhile (a key re-added during the prune, e.g. because its entry was
// re-created and recorded, stays). The ring buffer reader's Add for ip thus
// never waits for more than a copy or a removal.
func (ix *Index) Prune(ip netip.Addr, gone4 func(ctmap.CTKey4) bool, gone6 func(ctmap.CTKey6) bool) (dropped int) {
	e := ix.entry(ip, false)
	if e == nil {
		return 0
	}
	e.mu.Lock()
	k4, k6 := e.list(nil, nil)
	e.pruning++
	e.mu.Unlock()

	// Compact the stale ones in place.
	var d4 []ctmap.CTKey4
	if gone4 != nil {
		d4 = k4[:0]
		for _, k := range k4 {
			if gone4(k) {
				d4 = append(d4, k)
			}
		}
	}
	var d6 []ctmap.CTKey6
	if gone6 != nil {
		d6 = k6[:0]
		for _, k := range k6 {
			if gone6(k) {
				d6 = append(d6, k)
			}
		}
	}

	// Remove them in batches, giving the lock up between batches: a set's
	// delete costs microseconds per key, and the ring buffer reader's Add
	// for this IP must not wait for thousands of them (20,000 stale keys
	// held the lock for 180 ms). Keys added meanwhile are in added4/6
	// while e.pruning is set, and are kept.
	const batch = 256
	e.mu.Lock()
	defer e.mu.Unlock()
	n := 0
	yield := func() {
		if n++; n%batch == 0 {
			e.mu.Unlock()
			runtime.Gosched() // a waiting Add takes the lock now
			e.mu.Lock()
		}
	}
	for i := range d4 {
		var rec [RecSize4]byte
		if pack(rec[:], e.a4[:], d4[i][:], 4) {
			if _, again := e.added4.find0(rec[:]); !again && e.keys4.del(rec[:]) {
				dropped++
				if d4[i].Flags()&ctmap.FlagService != 0 {
					e.dropSettledSvcLocked(svcID4(&d4[i]))
				}
			}
		}
		yield()
	}
	for i := range d6 {
		var rec [RecSize6]byte
		if pack(rec[:], e.a16[:], d6[i][:], 16) {
			if _, again := e.added6.find0(rec[:]); !again && e.keys6.del(rec[:]) {
				dropped++
				if d6[i].Flags()&ctmap.FlagService != 0 {
					e.dropSettledSvcLocked(svcID6(&d6[i]))
				}
			}
		}
		yield()
	}
	if e.pruning--; e.pruning == 0 {
		e.added4, e.added6 = keySet{}, keySet{}
	}
	ix.keys.Add(-int64(dropped))
	e.pruneAt = max(1024, 2*e.size())
	return dropped
}

// NeedsPrune reports whether ip's set has doubled since it was last pruned;
// pruning then costs O(1) amortised per added key and bounds stale keys to
// half of a set.
func (ix *Index) NeedsPrune(ip netip.Addr) bool {
	e := ix.entry(ip, false)
	if e == nil {
		return false
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.size() >= e.pruneAt
}
