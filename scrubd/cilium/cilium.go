// Package cilium is ctscrub's backend for Cilium's four global CT maps: a scrub
// deletes an IP's entries through the index (O(k): exactly its keys and the
// forms Cilium may re-create them in, by the in-kernel delete program, or
// BPF_MAP_DELETE_BATCH where the kernel refuses it) when the index can prove
// completeness, else through the
// sweep (bpf/sweep.c, one in-kernel pass over each map for a set of IPs,
// shared by concurrent callers).
package cilium

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/scrub"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// Options tunes the Cilium backend.
type Options struct {
	// DeleteChunk is the number of keys per BPF_MAP_DELETE_BATCH call of the
	// index path; ctx is checked between chunks. 0 means 1024 (about 0.2 ms
	// of deletes, so a cancelled scrub stops within a fraction of a ms).
	DeleteChunk int
	// SyncTimeout bounds the wait for the recorder's reader to apply the
	// records already in its ring buffer before a scrub trusts the index
	// (index.Sync). Past it the scrub sweeps. 0 means 2 s.
	SyncTimeout time.Duration
}

// Backend scrubs Cilium's global CT maps: through the index for IPs whose
// index is complete, through the shared sweep for the others.
type Backend struct {
	// mu guards maps and the programs loaded on them (sweeper, del, and
	// their errors): every scrub and count holds it for reading, Reopen for
	// writing while it moves the backend to re-created maps.
	mu      sync.RWMutex
	maps    *ctmap.Maps
	ix      *index.Index
	opts    Options
	sweeper *Sweeper

	// Scrubs of one IP run one at a time: a scrub takes the IP's keys from
	// the index and gives back what it did not delete, and a second scrub in
	// between would see an empty set and wrongly report the IP clean.
	lockMu sync.Mutex
	locks  map[netip.Addr]*ipLock

	features *Features // Cilium features that put entries out of the index's reach

	countErr error    // why Count walks instead of reading the kernel's counter
	del      *deleter // nil: the kernel refused the delete program, batch deletes instead
	delErr   error    // why del is nil
}

type ipLock struct {
	ch   chan struct{} // holds one token while the IP is free
	refs int
}

// New loads the sweep program once per CT map of maps (the maps stay
// the caller's: Close does not close them). ix is the index the recorder
// fills.
func New(maps *ctmap.Maps, ix *index.Index, opts Options) (*Backend, error) {
	if maps == nil || ix == nil {
		return nil, errors.New("scrub: New needs the CT maps and the index")
	}
	if maps.Map(ctmap.TCP4) == nil && maps.Map(ctmap.TCP6) == nil {
		return nil, errors.New("scrub: no CT map present")
	}
	if opts.DeleteChunk <= 0 {
		opts.DeleteChunk = 1024
	}
	if opts.SyncTimeout <= 0 {
		opts.SyncTimeout = 2 * time.Second
	}
	progs, ips4, ips6, countErr, err := loadProgs(maps)
	if err != nil {
		return nil, err
	}
	del, delErr := loadDeleter(maps)
	return &Backend{
		del:      del,
		delErr:   delErr,
		maps:     maps,
		ix:       ix,
		opts:     opts,
		sweeper:  &Sweeper{progs: progs, ips4: ips4, ips6: ips6},
		locks:    map[netip.Addr]*ipLock{},
		countErr: countErr,
		features: NewFeatures(maps.Root),
	}, nil
}

// Name labels the backend's metrics and results.
func (c *Backend) Name() string { return "cilium" }

// Features returns the backend's detection of Cilium features that keep
// entries out of the index's reach (and its counts, for the metrics).
func (c *Backend) Features() *Features { return c.features }

// UncoveredFeatures lists the Cilium features whose entries the index does
// not cover and whether each is on (scrubd status, ctscrub_uncovered_feature).
func (c *Backend) UncoveredFeatures() []Uncovered { return c.features.UncoveredFeatures() }

// UncoveredReason is why a feature the index does not cover keeps ip from
// being vouched for ("" when none): a feature on for ip now, or the mark a
// feature left on ip's index since its last complete sweep.
func (c *Backend) UncoveredReason(ip netip.Addr) string {
	if !c.ix.Owns(ip) {
		return ""
	}
	r := c.features.Reason(ip)
	if r == "" {
		r = c.ix.State(ip).Incomplete
	}
	switch r {
	case ReasonLocalCT, ReasonPerClusterCT:
		// Entries outside the global maps: the scrub still deletes the
		// global ones and OutsideGlobalMaps answers (docs/delegate-api.md).
		return ""
	}
	if IsFeatureReason(r) {
		return r
	}
	return ""
}

// Sweeper returns the backend's shared sweep (a new one after Reopen).
func (c *Backend) Sweeper() *Sweeper {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.sweeper
}

// Maps returns the CT maps the backend scrubs (other ones after Reopen).
func (c *Backend) Maps() *ctmap.Maps {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.maps
}

// Close unloads the sweep programs. The CT maps are left open.
func (c *Backend) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.sweeper.close()
	if c.del != nil {
		c.del.close()
	}
	return c.features.Close()
}

// Reopen moves the backend to maps (Cilium re-created its CT maps): it loads
// the sweep and delete programs on them, waits for the scrubs in flight on
// the old maps to end, switches, runs during (nil allowed) before any scrub
// sees the new maps, and unloads the old programs. It returns the old maps,
// which stay the caller's to close. On error nothing changed.
func (c *Backend) Reopen(maps *ctmap.Maps, during func()) (old *ctmap.Maps, err error) {
	if maps == nil || (maps.Map(ctmap.TCP4) == nil && maps.Map(ctmap.TCP6) == nil) {
		return nil, errors.New("scrub: Reopen needs CT maps")
	}
	progs, ips4, ips6, countErr, err := loadProgs(maps)
	if err != nil {
		return nil, err
	}
	del, delErr := loadDeleter(maps)
	c.mu.Lock()
	old, oldSweeper, oldDel := c.maps, c.sweeper, c.del
	c.maps = maps
	c.sweeper = &Sweeper{progs: progs, ips4: ips4, ips6: ips6}
	c.del, c.delErr, c.countErr = del, delErr, countErr
	if during != nil {
		during()
	}
	c.mu.Unlock()
	oldSweeper.close()
	if oldDel != nil {
		oldDel.close()
	}
	return old, nil
}

// Scrub deletes every CT entry of req.IPs. See the package comment for the
// two methods. On ctx's end it stops, gives the index back the keys it did
// not try, marks swept IPs incomplete and returns Cancelled with the counts
// so far.
func (c *Backend) Scrub(ctx context.Context, req scrub.Request) (scrub.Result, error) {
	start := time.Now()
	// Held to the end: Reopen waits for scrubs on the old maps.
	c.mu.RLock()
	defer c.mu.RUnlock()
	s := &scrubRun{c: c, ctx: ctx, req: req, steps: api.StepsFrom(ctx), res: scrub.Result{
		Backend: c.Name(),
		Method:  scrub.MethodIndex,
		Outcome: scrub.Complete,
		Deleted: map[string]int{},
		PerIP:   map[string]scrub.Method{},
	}}
	for _, k := range ctmap.Kinds {
		if c.maps.Map(k) != nil {
			s.res.Deleted[k.Name()] = 0
		}
	}
	ips, err := c.checkIPs(req.IPs)
	if err != nil {
		return s.finish(start, err)
	}
	unlock, err := c.lockIPs(ctx, ips)
	s.steps.Mark("lock")
	if err != nil {
		return s.finish(start, err)
	}
	defer unlock()
	return s.finish(start, s.run(ips))
}

// checkIPs validates a request's IPs against the maps present.
func (c *Backend) checkIPs(ips []netip.Addr) ([]netip.Addr, error) {
	ips, err := scrub.CheckIPs(ips)
	if err != nil {
		return nil, err
	}
	for _, ip := range ips {
		if ip.Is6() && !c.maps.HasIPv6() {
			return nil, fmt.Errorf("%w: %s is IPv6 but the IPv6 CT maps (%s, %s) are not present under %s (IPv6 disabled in Cilium?); nothing deleted",
				scrub.ErrBadRequest, ip, ctmap.TCP6.Name(), ctmap.Any6.Name(), c.maps.Root)
		}
	}
	return ips, nil
}

// A scrubRun is one Scrub while it holds its IPs' scrub locks: the index path
// IP by IP, then one sweep for the IPs the index cannot prove complete.
type scrubRun struct {
	c     *Backend
	ctx   context.Context
	req   scrub.Request
	steps *api.Steps // nil when no caller times the scrub
	res   scrub.Result

	featured map[netip.Addr]string // IPs a Cilium feature sends to the sweep, and why
	sweepIPs []netip.Addr
	taken    []heldKeys // keys taken from the index for IPs that sweep
}

// heldKeys are an IP's keys a scrub took from the index: given back, with
// the IP marked incomplete, when its sweep does not complete.
type heldKeys struct {
	ip netip.Addr
	k4 []ctmap.CTKey4
	k6 []ctmap.CTKey6
}

func (s *scrubRun) run(ips []netip.Addr) error {
	// The IPs' newest records may still sit in the recorder's ring buffer
	// (its reader lags under load or after a burst of new flows): the index
	// is trusted only once everything produced until now is applied, or
	// the scrub deleted a set that misses those flows and called it complete.
	var unsynced string // why no IP's index is trusted; "" when synced
	if err := s.c.syncIndex(s.ctx); errors.Is(err, index.ErrNotFed) {
		unsynced = index.ReasonNotFed
	} else if err != nil {
		unsynced = index.ReasonNotSynced
	}
	s.steps.Mark("sync")
	s.markFeatures(ips)
	s.steps.Mark("features")
	for _, ip := range ips {
		if err := s.ctx.Err(); err != nil {
			return err
		}
		if s.req.Still != nil && !s.req.Still(ip) {
			continue
		}
		// The index only holds keys of IPs in the pod CIDRs: any other IP
		// always takes the sweep, whatever its slot says.
		if why := s.untrusted(ip, unsynced); why != "" {
			s.toSweep(ip, why)
			continue
		}
		var err error
		if s.req.DryRun {
			err = s.countByIndex(ip)
		} else {
			err = s.deleteByIndex(ip)
		}
		if err != nil {
			return err
		}
	}
	if len(s.sweepIPs) == 0 {
		return nil
	}
	return s.sweep()
}

// markFeatures finds the IPs whose entries a Cilium feature puts where the
// recorder or the global maps do not reach (L7 proxy, per-endpoint or
// per-cluster CT maps): they sweep, and a real scrub marks them incomplete,
// before the sweep and again after it (they stay so while the feature is
// on). A dry run changes nothing.
func (s *scrubRun) markFeatures(ips []netip.Addr) {
	for _, ip := range ips {
		if !s.c.ix.Owns(ip) {
			continue
		}
		r := s.c.features.Reason(ip)
		if r == "" {
			continue
		}
		if s.featured == nil {
			s.featured = map[netip.Addr]string{}
		}
		s.featured[ip] = r
		if !s.req.DryRun {
			s.c.ix.MarkIncomplete(ip, r)
			s.c.features.counted(r)
		}
	}
}

// untrusted says why ip's index cannot be trusted for this scrub ("" when
// it can): the recorder not synced (unsynced), a Cilium feature, an IP
// outside the pod CIDRs, or the IP's own state.
func (s *scrubRun) untrusted(ip netip.Addr, unsynced string) string {
	switch {
	case unsynced != "":
		return unsynced
	case s.featured[ip] != "":
		return s.featured[ip]
	case !s.c.ix.Owns(ip):
		return "outside the pod CIDRs: never indexed"
	}
	return s.c.ix.State(ip).Incomplete
}

// toSweep leaves ip to the sweep, or alone when the request is IndexOnly;
// why goes in the result.
func (s *scrubRun) toSweep(ip netip.Addr, why string) {
	if s.req.IndexOnly {
		return
	}
	s.sweepIPs = append(s.sweepIPs, ip)
	if s.res.SweptWhy == nil {
		s.res.SweptWhy = map[string]string{}
	}
	s.res.SweptWhy[ip.String()] = why
}

// countByIndex counts the entries of ip's keys that exist (a dry run): it
// reads the index and the maps and changes nothing (Take would make the
// recorder forget the IP's cached flows).
func (s *scrubRun) countByIndex(ip netip.Addr) error {
	k4, k6, st := s.c.ix.ScrubKeys(ip)
	if !st.Complete {
		s.toSweep(ip, st.Incomplete)
		return nil
	}
	s.res.PerIP[ip.String()] = scrub.MethodIndex
	return s.c.countKeys(s.ctx, k4, k6, s.res.Deleted)
}

// deleteByIndex takes ip's keys from the index and deletes them, and gives
// back the ones it did not try.
func (s *scrubRun) deleteByIndex(ip netip.Addr) error {
	k4, k6, st := s.c.ix.Take(ip)
	if !st.Complete {
		// Marked incomplete after State: the sweep handles it, and the
		// keys taken now are covered by it.
		if s.req.IndexOnly {
			s.c.ix.Return(ip, k4, k6)
			return nil
		}
		s.toSweep(ip, st.Incomplete)
		s.taken = append(s.taken, heldKeys{ip, k4, k6})
		return nil
	}
	s.res.PerIP[ip.String()] = scrub.MethodIndex
	// Every key the index holds, plus the forms Cilium may re-create them
	// in (index.Covered): the one definition the audit checks.
	buf := coverBufs.Get().(*coverBuf)
	var x4 []ctmap.CTKey4
	var x6 []ctmap.CTKey6
	var left4 []ctmap.CTKey4
	var left6 []ctmap.CTKey6
	var err error
	if h := s.earlyHelper(len(k4) + len(k6)); h != nil {
		// The index's keys go to the deletes' helper at once, and the
		// caller makes their forms meanwhile (about 0.1 ms for 1,000
		// keys, cold caches), then joins it: the helper's thread, woken
		// on an idle CPU, takes tens of µs to run, and has the keys
		// when it does. The forms are the keys Covered adds: each key
		// is tried once.
		j := s.c.newDeleteJob(s.ctx)
		j.add(k4, k6)
		j.share(h)
		var f4, f6 int
		x4, f4, x6, f6 = index.AppendCoveredKeysFirst(buf.k4[:0], buf.k6[:0], k4, k6)
		s.steps.Mark("take")
		j.add(x4[f4:], x6[f6:])
		left4, left6, err = j.finish(s.res.Deleted)
	} else {
		// Too few keys to share: one list, one program run per map.
		x4, x6 = index.AppendCovered(buf.k4[:0], buf.k6[:0], k4, k6)
		s.steps.Mark("take")
		left4, left6, err = s.c.deleteKeys(s.ctx, x4, x6, s.res.Deleted, nil)
	}
	s.steps.Mark("delete")
	s.c.ix.Return(ip, left4, left6)
	if cap(x4)+cap(x6) <= maxPooledKeys {
		buf.k4, buf.k6 = x4, x6
		coverBufs.Put(buf)
	}
	return err
}

// earlyHelper starts the deletes' helper for a scrub of n index keys
// whose covered list is long enough to share (about three forms a key),
// where the process may run two goroutines at once; else nil.
func (s *scrubRun) earlyHelper(n int) *deleteHelper {
	if n < parallelMin/3 {
		return nil
	}
	return startDeleteHelper()
}

// sweep runs the shared sweep for the IPs the index path left. Each IP's keys
// are taken and the IP declared tracked before the pass starts: a flow
// recorded while the pass runs stays indexed (its entry may be created after
// the pass went by), and records lost meanwhile mark the IP incomplete again
// rather than being wiped by a Track at the end.
func (s *scrubRun) sweep() error {
	s.res.Method = scrub.MethodSweep
	var track []netip.Addr
	for _, ip := range s.sweepIPs {
		s.res.PerIP[ip.String()] = scrub.MethodSweep
		if s.req.DryRun || !s.c.ix.Owns(ip) {
			continue
		}
		if !slices.ContainsFunc(s.taken, func(h heldKeys) bool { return h.ip == ip }) {
			k4, k6, _ := s.c.ix.Take(ip)
			s.taken = append(s.taken, heldKeys{ip, k4, k6})
		}
		track = append(track, ip)
	}
	// One TrackAll: the recorder forgets the flows of all these IPs in
	// shared passes over its seen caches rather than one pass per IP.
	s.c.ix.TrackAll(track)
	for _, ip := range track {
		if r := s.featured[ip]; r != "" {
			s.c.ix.MarkIncomplete(ip, r)
		}
	}
	s.steps.Mark("take")
	sr, err := s.c.sweeper.Sweep(s.ctx, s.sweepIPs, s.req.DryRun)
	s.steps.Mark("sweep")
	for k, n := range sr.Deleted {
		if n > 0 {
			s.res.Deleted[ctmap.Kind(k).Name()] += n
		}
	}
	for v6, n := range sr.NATDeleted {
		if n > 0 {
			s.res.Deleted[ctmap.NATName(v6 == 1)] += n
		}
	}
	if err == nil && !sr.Complete {
		err = errors.New("sweep ended before every map was swept")
	}
	if err != nil && !s.req.DryRun {
		// Entries from before the pass may be left: the next scrub sweeps.
		why := ReasonSweepFailed
		if cancelled(err) {
			why = index.ReasonCancelled
		}
		for _, h := range s.taken {
			s.c.ix.Return(h.ip, h.k4, h.k6)
			s.c.ix.MarkIncomplete(h.ip, why)
		}
	}
	return err
}

// ReasonSweepFailed marks the IPs of a sweep that failed (not cancelled).
const ReasonSweepFailed = "sweep failed before it finished"

func cancelled(err error) bool {
	return errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)
}

// finish totals the counts and sets the outcome from err.
func (s *scrubRun) finish(start time.Time, err error) (scrub.Result, error) {
	res := s.res
	res.Duration = time.Since(start)
	for _, name := range []string{ctmap.NATName4, ctmap.NATName6} {
		if n, ok := res.Deleted[name]; ok {
			delete(res.Deleted, name)
			if res.NATDeleted == nil {
				res.NATDeleted = map[string]int{}
			}
			res.NATDeleted[name] += n
		}
	}
	for _, n := range res.Deleted {
		res.Total += n
	}
	switch {
	case err == nil:
	case cancelled(err):
		res.Outcome = scrub.Cancelled
		res.Error = err.Error()
	default:
		res.Outcome = scrub.Failed
		res.Error = err.Error()
	}
	return res, err
}

// syncIndex waits, at most SyncTimeout, until the recorder has applied every
// record produced before the call.
func (c *Backend) syncIndex(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, c.opts.SyncTimeout)
	defer cancel()
	return c.ix.Sync(ctx)
}

// deleteKeys deletes keys from their maps (the delete program, or
// BPF_MAP_DELETE_BATCH when the kernel refused it: DeleteError), adding
// to deleted per map name. It returns the keys it did not attempt (ctx ended
// or an error). A key that is already gone (Cilium's GC, LRU eviction) is
// skipped: the kernel stops the batch at it with ENOENT and reports how many
// it deleted before it.
//
// It reorders k4 and k6 (each map's keys together), and the left lists are
// copies: the caller may reuse both slices. h, when not nil, is the helper
// the caller started (startDeleteHelper); deleteKeys hands it the job
// whether or not it uses it.
func (c *Backend) deleteKeys(ctx context.Context, k4 []ctmap.CTKey4, k6 []ctmap.CTKey6, deleted map[string]int, h *deleteHelper) (left4 []ctmap.CTKey4, left6 []ctmap.CTKey6, err error) {
	j := c.newDeleteJob(ctx)
	j.add(k4, k6)
	if h != nil {
		j.share(h)
	}
	return j.finish(deleted)
}

// A deleteJob is one scrub's deletes, given in one or more lists (add):
// the keys in units of at most deleteUnit keys of one CT map each. The
// calling goroutine takes units from the front; a scrub of parallelMin keys
// or more also has a helper that takes them from the back, on the other
// CPU when the machine gives it one. Each map has its own LRU lists and
// bucket locks, so the two meet on one map's locks only where their ends
// of the list meet. The caller never waits for the helper to start: on a
// busy machine the helper's thread ran up to hundreds of µs after it was
// woken (make bench at 1 M, load 27 on 2 cores: median 0.24 ms, as long as
// the TCP map's share of a 1,000-key scrub), and with one job per map the
// caller sat idle for it. It waits only for units the helper has taken.
//
// A helper handed the job before its last list (share) deletes the units
// there are while the caller makes the next list: the index scrub hands it
// the index's own keys and computes their covered forms meanwhile.
type deleteJob struct {
	c   *Backend
	ctx context.Context
	q   *deleteQueue

	mu    sync.Mutex // left4, left6
	left4 []ctmap.CTKey4
	left6 []ctmap.CTKey6
	keys  int
	early *deleteHelper // handed the queue by share
}

func (c *Backend) newDeleteJob(ctx context.Context) *deleteJob {
	return &deleteJob{c: c, ctx: ctx, q: &deleteQueue{}}
}

// add queues keys for deletion; it reorders k4 and k6 (each map's keys
// together) and reads them until finish returns.
func (j *deleteJob) add(k4 []ctmap.CTKey4, k6 []ctmap.CTKey6) {
	tcp4, any4 := splitTCP(k4, ctmap.TCP4)
	tcp6, any6 := splitTCP(k6, ctmap.TCP6)
	j.q.add(newDeletePart(j.ctx, j.c, ctmap.TCP4, tcp4, &j.mu, &j.left4))
	j.q.add(newDeletePart(j.ctx, j.c, ctmap.Any4, any4, &j.mu, &j.left4))
	j.q.add(newDeletePart(j.ctx, j.c, ctmap.TCP6, tcp6, &j.mu, &j.left6))
	j.q.add(newDeletePart(j.ctx, j.c, ctmap.Any6, any6, &j.mu, &j.left6))
	j.keys += len(k4) + len(k6)
}

// share hands the job to h (an early helper) before its last list is
// added: h deletes what is queued and waits for the rest. It reports
// whether h took it.
func (j *deleteJob) share(h *deleteHelper) bool {
	if h.hand(j.q) {
		j.early = h
		return true
	}
	return false
}

// finish deletes the job's keys with the caller's goroutine and a helper
// (the one share handed the job, or one it starts when that one gave up
// or there is none), adds the counts to deleted and returns the keys not
// attempted. A job too small to share starts none.
func (j *deleteJob) finish(deleted map[string]int) (left4 []ctmap.CTKey4, left6 []ctmap.CTKey6, err error) {
	q := j.q
	q.mu.Lock()
	q.sealed = true
	units := len(q.pending)
	helperGone := q.helperLeft
	q.mu.Unlock()
	helpers := make([]*deleteHelper, 0, 2)
	if j.early != nil {
		helpers = append(helpers, j.early)
	}
	if units >= 2 && j.keys >= parallelMin && (j.early == nil || helperGone) {
		nh := &deleteHelper{counts: map[string]int{}}
		helpers = append(helpers, nh)
		go q.work(false, nh.counts)
	}
	q.work(true, deleted)
	q.helper.Wait()
	// A helper writes its counts only in the units it took, all finished
	// now (q.helper); one still on its way out takes none.
	for _, h := range helpers {
		for name, n := range h.counts {
			deleted[name] += n
		}
	}
	return j.left4, j.left6, errors.Join(q.errs...)
}

// A deleteHelper is deleteKeys' helper started before its keys are known
// (startDeleteHelper): it spins on its CPU until deleteKeys hands it the
// work, at most helperSpin, then gives up.
type deleteHelper struct {
	state  atomic.Int32 // helperWaiting, then helperHanded or helperGaveUp
	q      atomic.Pointer[deleteQueue]
	counts map[string]int // written by the helper for the units it took
}

const (
	helperWaiting = iota
	helperHanded
	helperGaveUp
)

// helperSpin bounds the helper's wait for its work: about what the forms
// of a few thousand keys take.
const helperSpin = 500 * time.Microsecond

// startDeleteHelper starts a helper where the process may run two
// goroutines at once, else returns nil.
func startDeleteHelper() *deleteHelper {
	if runtime.GOMAXPROCS(0) < 2 {
		return nil
	}
	h := &deleteHelper{counts: map[string]int{}}
	go h.run()
	return h
}

func (h *deleteHelper) run() {
	// Spinning, not blocking: a goroutine woken from a channel wait is
	// another wake-up of a thread, the latency this helper started early
	// to hide. Each turn yields the CPU (sched_yield), so on a machine
	// that put this thread beside the caller's the caller runs first.
	deadline := time.Now().Add(helperSpin)
	for h.state.Load() == helperWaiting {
		if time.Now().After(deadline) {
			if h.state.CompareAndSwap(helperWaiting, helperGaveUp) {
				return
			}
			break
		}
		yield()
	}
	h.q.Load().work(false, h.counts)
}

func yield() {
	runtime.Gosched()
	unix.RawSyscall(unix.SYS_SCHED_YIELD, 0, 0, 0)
}

// hand gives the helper q; false when the helper gave up waiting (or h is
// nil), and the caller starts another.
func (h *deleteHelper) hand(q *deleteQueue) bool {
	if h == nil {
		return false
	}
	h.q.Store(q)
	return h.state.CompareAndSwap(helperWaiting, helperHanded)
}

// deleteUnit is the most keys of one unit of deleteKeys' work: small enough
// that the caller and the helper share a scrub's keys evenly, large enough
// that a program run's fixed cost (a syscall, the test run's setup, about
// 5 µs) is small beside its keys'.
const deleteUnit = 256

// maxRunUnits is the most units the caller deletes in one program run
// (delChunk keys).
const maxRunUnits = delChunk / deleteUnit

// deleteQueue is a deleteJob's work: each list's maps' keys (parts) cut in
// units, taken from both ends.
type deleteQueue struct {
	mu         sync.Mutex
	parts      []deletePart
	pending    []deleteRange  // units not taken yet, in part order
	sealed     bool           // no more parts will be added
	helperLeft bool           // the helper waited for more units in vain and returned
	errs       []error        // of the runs so far
	helper     sync.WaitGroup // units the helper has taken and not finished
}

// deleteRange is keys [lo, hi) of parts[part].
type deleteRange struct{ part, lo, hi int }

// add appends p and its units: as few as hold its keys at deleteUnit each,
// of equal size (no run for a short tail).
func (q *deleteQueue) add(p deletePart) {
	if p.n == 0 {
		return
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	q.parts = append(q.parts, p)
	units := (p.n + deleteUnit - 1) / deleteUnit
	for i := range units {
		q.pending = append(q.pending, deleteRange{len(q.parts) - 1, i * p.n / units, (i + 1) * p.n / units})
	}
}

// work deletes units until none is left, from the front (the caller) or
// from the back (the helper), adding counts to deleted. The helper takes
// one unit at a time; the caller up to half of the units left (at most
// maxRunUnits, all of one map) in one program run: while the helper has
// no CPU, as at a load of 10 and more on 2 cores, 13 runs of a 3,000-key
// scrub became 6, each run's fixed cost saved (about 45 µs a scrub at 1 M,
// chunks of 256 against 1,024 keys), and the units left are still enough
// for a helper that starts. A failed run does not stop the others: each
// map's keys are deleted or left on their own (when ctx ends every later
// run returns at once with its keys left). The helper, finding no unit
// before the queue is sealed, spins for more up to helperSpin.
func (q *deleteQueue) work(front bool, deleted map[string]int) {
	var idleSince time.Time
	for {
		q.mu.Lock()
		if len(q.pending) == 0 {
			if front || q.sealed {
				q.mu.Unlock()
				return
			}
			if idleSince.IsZero() {
				idleSince = time.Now()
			} else if time.Since(idleSince) > helperSpin {
				q.helperLeft = true
				q.mu.Unlock()
				return
			}
			q.mu.Unlock()
			yield()
			continue
		}
		idleSince = time.Time{}
		var r deleteRange
		if front {
			r = q.pending[0]
			n := min(max(1, len(q.pending)/2), maxRunUnits)
			i := 1
			for ; n > 1 && i < len(q.pending) && q.pending[i].part == r.part; n-- {
				r.hi = q.pending[i].hi
				i++
			}
			q.pending = q.pending[i:]
		} else {
			r = q.pending[len(q.pending)-1]
			q.pending = q.pending[:len(q.pending)-1]
			// Counted before the lock is released: the caller's Wait
			// comes after it has found no unit left, so after this Add.
			q.helper.Add(1)
		}
		p := q.parts[r.part]
		q.mu.Unlock()
		err := p.run(r.lo, r.hi, deleted)
		if err != nil {
			q.mu.Lock()
			q.errs = append(q.errs, err)
			q.mu.Unlock()
		}
		if !front {
			q.helper.Done()
		}
	}
}

// coverBuf is a scrub's buffers for index.AppendCovered's keys.
type coverBuf struct {
	k4 []ctmap.CTKey4
	k6 []ctmap.CTKey6
}

var coverBufs = sync.Pool{New: func() any { return new(coverBuf) }}

// maxPooledKeys bounds the buffers kept for the next scrub (about 0.9 MB):
// a pod of a million flows does not keep its scrub's memory after it.
const maxPooledKeys = 1 << 16

// splitTCP moves the keys of the TCP map (kind tcp) to the front of keys, in
// place, and returns them and the rest (the "any" map's).
func splitTCP[K interface{ Kind() ctmap.Kind }](keys []K, tcp ctmap.Kind) (tcpKeys, rest []K) {
	n := 0
	for i := range keys {
		if keys[i].Kind() == tcp {
			keys[n], keys[i] = keys[i], keys[n]
			n++
		}
	}
	return keys[:n], keys[n:]
}

// deletePart is one CT map's share of a scrub's deletes (deleteKeys).
type deletePart struct {
	n   int                                            // keys
	run func(lo, hi int, deleted map[string]int) error // deletes keys [lo, hi); adds those it did not attempt to the left list
}

// newDeletePart returns the part deleting keys (all of kind k) from c's
// maps; mu guards *left, which the other runs of the scrub may add to at
// once.
func newDeletePart[K ctmap.CTKey4 | ctmap.CTKey6](ctx context.Context, c *Backend, k ctmap.Kind, keys []K, mu *sync.Mutex, left *[]K) deletePart {
	return deletePart{
		n: len(keys),
		run: func(lo, hi int, deleted map[string]int) error {
			var l []K
			err := deleteFrom(ctx, c.maps.Map(k), c.del, k, keys[lo:hi], c.opts.DeleteChunk, deleted, &l)
			if len(l) > 0 {
				mu.Lock()
				*left = append(*left, l...)
				mu.Unlock()
			}
			return err
		},
	}
}

// parallelMin is the fewest keys for which deleteKeys starts a helper;
// below it the caller deletes them alone.
const parallelMin = 256

// deleteFrom deletes keys (all of kind k) from m, adds the count to
// deleted[k.Name()] and appends the keys it did not attempt to *left.
func deleteFrom[K ctmap.CTKey4 | ctmap.CTKey6](ctx context.Context, m *ebpf.Map, d *deleter, k ctmap.Kind, keys []K, chunk int, deleted map[string]int, left *[]K) error {
	if len(keys) == 0 {
		return nil
	}
	if m == nil {
		// Cannot happen for a validated request: keys of a family are only
		// indexed for IPs of that family, which were checked against the maps.
		*left = append(*left, keys...)
		return fmt.Errorf("delete %d keys from %s: map not present", len(keys), k.Name())
	}
	var n batchCount
	var err error
	if d != nil && d.progs[k] != nil {
		n, err = deleteProg(ctx, d, k, keys, chunk)
	} else {
		n, err = deleteBatch(ctx, m, keys, chunk)
	}
	deleted[k.Name()] += n.deleted
	if n.natDeleted > 0 {
		// Under the SNAT map's name; finish moves it to Result.NATDeleted.
		deleted[ctmap.NATName(k.IPv6())] += n.natDeleted
	}
	if err != nil {
		*left = append(*left, keys[n.attempted:]...)
		if ctx.Err() != nil {
			return err
		}
		return fmt.Errorf("delete keys from %s: %w", k.Name(), err)
	}
	return nil
}

type batchCount struct {
	deleted    int // entries deleted
	stale      int // keys whose entry was already gone
	attempted  int // keys tried (deleted or stale)
	natDeleted int // SNAT mappings deleted with the entries (delete program only)
}

// deleteBatch deletes keys from m in chunks, skipping keys already gone.
func deleteBatch[K any](ctx context.Context, m *ebpf.Map, keys []K, chunk int) (batchCount, error) {
	var c batchCount
	for c.attempted < len(keys) {
		if err := ctx.Err(); err != nil {
			return c, err
		}
		end := min(c.attempted+chunk, len(keys))
		n, err := m.BatchDelete(keys[c.attempted:end], nil)
		c.deleted += n
		c.attempted += n
		if err != nil {
			if errors.Is(err, ebpf.ErrKeyNotExist) && c.attempted < len(keys) {
				c.stale++
				c.attempted++
				continue
			}
			return c, err
		}
	}
	return c, nil
}

// countKeys adds to counts, per map name, the keys that exist (dry run).
func (c *Backend) countKeys(ctx context.Context, k4 []ctmap.CTKey4, k6 []ctmap.CTKey6, counts map[string]int) error {
	var val ctmap.Entry
	for i, k := range k4 {
		if i%1024 == 0 && ctx.Err() != nil {
			return ctx.Err()
		}
		m := c.maps.Map(k.Kind())
		if m != nil && m.Lookup(k, &val) == nil {
			counts[k.Kind().Name()]++
		}
	}
	for i, k := range k6 {
		if i%1024 == 0 && ctx.Err() != nil {
			return ctx.Err()
		}
		m := c.maps.Map(k.Kind())
		if m != nil && m.Lookup(k, &val) == nil {
			counts[k.Kind().Name()]++
		}
	}
	return nil
}

// lockIPs serialises scrubs per IP, in address order so two multi-IP scrubs
// cannot deadlock.
func (c *Backend) lockIPs(ctx context.Context, ips []netip.Addr) (unlock func(), err error) {
	sorted := slices.Clone(ips)
	slices.SortFunc(sorted, func(a, b netip.Addr) int { return a.Compare(b) })
	var held []netip.Addr
	release := func() {
		c.lockMu.Lock()
		defer c.lockMu.Unlock()
		for _, ip := range held {
			l := c.locks[ip]
			l.ch <- struct{}{}
			if l.refs--; l.refs == 0 {
				delete(c.locks, ip)
			}
		}
	}
	for _, ip := range sorted {
		c.lockMu.Lock()
		l := c.locks[ip]
		if l == nil {
			l = &ipLock{ch: make(chan struct{}, 1)}
			l.ch <- struct{}{}
			c.locks[ip] = l
		}
		l.refs++
		c.lockMu.Unlock()
		select {
		case <-l.ch:
			held = append(held, ip)
		case <-ctx.Done():
			c.lockMu.Lock()
			if l.refs--; l.refs == 0 {
				delete(c.locks, ip)
			}
			c.lockMu.Unlock()
			release()
			return nil, fmt.Errorf("wait for another scrub of %s: %w", ip, ctx.Err())
		}
	}
	return release, nil
}

// Count returns the number of entries in map k, for ctscrub_ct_entries.
// With Linux 6.6+ it sums the kernel's per-CPU element counter of the map
// (kfunc bpf_map_sum_elem_count): O(CPUs), microseconds. Older kernels fall
// back to a counting walk of the map in the kernel (O(entries), about 0.3 s
// per million), skipped while a sweep runs.
func (c *Backend) Count(k ctmap.Kind) (int64, error) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if k < 0 || k >= ctmap.NumKinds || c.sweeper.progs[k] == nil {
		return 0, fmt.Errorf("count %s: map not present", k.Name())
	}
	p := c.sweeper.progs[k]
	if p.count == nil {
		return c.sweeper.countWalk(k)
	}
	var a countArgs
	if _, err := p.count.Run(&ebpf.RunOptions{Context: &a, ContextOut: &a}); err != nil {
		return 0, fmt.Errorf("count %s: %w", k.Name(), err)
	}
	return a.Count, nil
}

// CountError says why Count falls back to a walk (nil when it does not), for
// the daemon's startup log.
func (c *Backend) CountError() error {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.countErr
}

// DeleteError says why index scrubs delete with BPF_MAP_DELETE_BATCH, one
// syscall per absent key, instead of the delete program (nil when they do
// not), for the daemon's startup log.
func (c *Backend) DeleteError() error {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.delErr
}

// CountIsCheap reports whether Count uses the kernel's element counter
// rather than a walk.
func (c *Backend) CountIsCheap() bool {
	c.mu.RLock()
	defer c.mu.RUnlock()
	for _, p := range c.sweeper.progs {
		if p != nil && p.count == nil {
			return false
		}
	}
	return true
}

// NATGap says why the SNAT mappings of the deleted entries of a family's IPs
// may be left behind ("" when they are not: no SNAT map is pinned, or every
// program that deletes the family's entries deletes their mappings too). The
// delegate API answers an IP complete only when it is "".
func (c *Backend) NATGap(ipv6 bool) string {
	c.mu.RLock()
	defer c.mu.RUnlock()
	if err := c.maps.NATError(ipv6); err != nil {
		return err.Error()
	}
	if c.maps.NAT(ipv6) != nil && c.del == nil {
		return fmt.Sprintf("SNAT map %s present but the kernel refused the delete program (%v): index deletes use BPF_MAP_DELETE_BATCH, which leaves SNAT mappings", ctmap.NATName(ipv6), c.delErr)
	}
	return ""
}

// OutsideGlobalMaps says why entries of the node's IPs may be in CT maps
// other than the four global ones this backend scrubs (per-endpoint or
// per-cluster CT maps), "" when none are pinned. Cilium's own endpoint scrub
// may reach those maps; the delegate API does not answer complete for an IP
// while they exist.
func (c *Backend) OutsideGlobalMaps() string { return c.features.NodeReason() }
