// Package bootstrap is scrubd's one pass over Cilium's CT maps at start: it
// files every key holding an address of the pod CIDRs under that address in
// the index, so that from the end of the pass each address's set is whole
// (entries older than the recorder's attach are in the pass, newer ones are
// recorded) without one sweep of the table per address. The argument, and
// what it does not cover, is in docs/design.md ("The bootstrap pass").
//
// The walk reads each global CT map in the kernel (kernel.go,
// bpf/bootstrap.c): one run of a syscall program per map copies the keys
// holding a pod-CIDR address into an mmapped array, and one goroutine
// buffers each key's record under its addresses (index.Filing.Add4/Add6)
// from that array in place while the program walks the next map. Where
// the program cannot load (or its output array fills) a map is read with
// BPF_MAP_LOOKUP_BATCH instead, as Cilium 1.18+ walks them
// (internal/ciliumwalk is that walk as the benchmarks' baseline), the maps
// on up to GOMAXPROCS goroutines at once, each batch handed to the same
// filing goroutine. After the walk each address's table is built from its buffer
// without a lock and joined with its slot under the IP's lock
// (Filing.Merge). It holds no lock a scrub needs for longer than that
// join: no lock at all during the walk.
//
// Run declares nothing complete: it returns the Filing and the addresses
// it vouches for, and the daemon declares those its ownership rule allows
// with index.TrackFiled.
package bootstrap

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"runtime"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// Options tune a pass.
type Options struct {
	// Forget makes the recorder forget every cached flow
	// (recorder.Recorder.ForgetAll). It runs after the slots opened and
	// before the walk: a flow a previous scrubd recorded, whose entry went
	// and comes back behind the walk, is then recorded again. Nil only
	// where no recorder's cache predates the pass (tests of the walk).
	Forget func() error
	// Walk is how the maps are read (0: WalkKernel).
	Walk Walk
	// Batch is the entries per BPF_MAP_LOOKUP_BATCH (0: 8192; doubled
	// when a hash bucket does not fit), for maps read by the batch walk.
	Batch int
	// Walkers is how many maps WalkBatch reads at once (0: GOMAXPROCS,
	// at most the maps there are). The kernel's copy is most of that
	// walk; on a Cilium node the TCP map holds about 40 % of the entries
	// and the any map 60 %, so two walkers take the copy's wall time to
	// that of the larger map. WalkKernel runs GOMAXPROCS-1 programs at
	// once instead (kernel.go: a run holds its CPU).
	Walkers int
	// Progress, when set, follows the pass (metrics, `scrubd status`).
	Progress *Progress
	// Cover is the node's own pod ranges (at most 65,536 addresses), when
	// known: their free addresses, with no entry at all, are vouched for
	// too (index.Filing.Cover). Without it only addresses that hold a
	// slot (a key, a record, a pod) at the end are.
	Cover []netip.Prefix
	// SyncWait bounds the wait, after the walk, for the recorder's reader
	// to apply what the kernel recorded until then (0: 1 minute). A
	// reader that is not running by then fails the pass.
	SyncWait time.Duration
	// Heal names the marks made before the pass that it makes good
	// (index.BeginFilingHealing): the daemon's restart marks, lost
	// records, ... nil: a slot marked before the pass stays out of it.
	Heal func(reason string) bool
	// Walked, when set, is called once the walk is over and its keys
	// merged, before the recorder's records are awaited: entries made from
	// here on reach the index only as records (tests hold the pass there).
	Walked func()
	// Finish, when set, is called with a successful pass's result before
	// the pass is reported done (Progress, `scrubd status`): the caller
	// declares complete what the pass vouches for there, so whoever sees
	// the pass done sees its addresses tracked.
	Finish func(Result)

	// afterBatch, tests only: called on the walking goroutine after each
	// batch read (the batch's number in its map, from 1), and after each
	// map's kernel run (1).
	afterBatch func(kind ctmap.Kind, batch int)
	// outKeys, tests only: the kernel read's output array holds this many
	// keys instead of the map's max_entries.
	outKeys uint32
}

// Walk is how a pass reads the CT maps.
type Walk int

const (
	// WalkKernel reads each map with one run of bpf/bootstrap.c, and with
	// the batch walk where the program cannot load or its output fills.
	WalkKernel Walk = iota
	// WalkBatch reads every map with BPF_MAP_LOOKUP_BATCH.
	WalkBatch
)

// ReadKernel is Result.Read's value for a map read by bpf/bootstrap.c;
// a map read by the batch walk has "batch" and, on the kernel path, why.
const ReadKernel = "kernel"

// Result is what one pass did.
type Result struct {
	// Filing is the pass's hold on the index: hand it to
	// index.TrackFiled with the ownership rule to declare addresses
	// complete (or to drop the slots the pass made, trust refusing all).
	Filing *index.Filing
	// Addrs are the addresses the pass vouches for at Done (Filing.End):
	// every slot present when the pass began or made during it that no
	// mark, drop or lost record touched meanwhile. Sorted.
	Addrs []netip.Addr
	// Visited is the entries read from the maps, Pairs the (address, key)
	// pairs the pass added to the index (keys already there, from a record
	// or a snapshot, are not counted).
	Visited, Pairs int64
	// Maps is the maps walked (nil ones skipped), by name.
	Maps []string
	// Read says how each map was read, by name: ReadKernel, or "batch"
	// (with the reason the kernel read was not used, on WalkKernel).
	Read        map[string]string
	Start, Done time.Time
}

// Duration is the pass's wall time.
func (r Result) Duration() time.Duration { return r.Done.Sub(r.Start) }

// Run makes one pass over maps into ix. The recorder must already be
// attached to every pod interface of the node and its reader running (or
// about to run: Run waits for it within ctx), since records of entries
// made behind the walk are what complete the sets. On an error nothing is
// vouched for: the slots the pass made that no pod holds are dropped, and
// Result.Filing is nil.
func Run(ctx context.Context, ix *index.Index, maps *ctmap.Maps, opts Options) (res Result, err error) {
	p := opts.Progress
	if p == nil {
		p = &Progress{}
	}
	res.Start = time.Now()
	f, err := ix.BeginFilingHealing(opts.Heal)
	if err != nil {
		return res, err
	}
	p.begin(res.Start, f)
	defer func() {
		res.Done = time.Now()
		p.end(res, err)
		if err != nil {
			f.Abort()
			res.Filing, res.Addrs = nil, nil
		}
	}()
	if _, err := f.Cover(opts.Cover); err != nil {
		return res, fmt.Errorf("bootstrap: cover %v: %w", opts.Cover, err)
	}
	if opts.Forget != nil {
		if err := opts.Forget(); err != nil {
			return res, fmt.Errorf("bootstrap: forget the recorder's cached flows: %w", err)
		}
	}
	batch := opts.Batch
	if batch <= 0 {
		batch = 8192
	}
	var kinds []ctmap.Kind
	for _, k := range ctmap.Kinds {
		if maps.Map(k) != nil {
			kinds = append(kinds, k)
			res.Maps = append(res.Maps, k.Name())
		}
	}
	walkers := opts.Walkers
	if walkers <= 0 {
		walkers = runtime.GOMAXPROCS(0)
	}
	walkers = max(1, min(walkers, len(kinds)))
	w := newWalker(f, batch, p, walkers)
	w.afterBatch = opts.afterBatch
	res.Read = map[string]string{}
	if opts.Walk == WalkBatch {
		for _, k := range kinds {
			res.Read[k.Name()] = "batch"
		}
		err = w.walkAll(ctx, maps, kinds, walkers)
	} else {
		err = w.readKernel(ctx, maps, kinds, ix.PodCIDRs(), opts.outKeys, res.Read)
	}
	if err != nil {
		return res, err
	}
	res.Visited = p.visited.Load() - p.visitedAt
	// Each address's records into its set: two workers, the tables built
	// without a lock.
	f.Merge(2)
	if opts.Walked != nil {
		opts.Walked()
	}
	// Every record the kernel produced before now (an entry made behind
	// the walk) applied, and the lost counters read (a lost record marks
	// its IP, or spoils the pass).
	wait := opts.SyncWait
	if wait <= 0 {
		wait = time.Minute
	}
	sctx, cancel := context.WithTimeout(ctx, wait)
	err = ix.Sync(sctx)
	cancel()
	if err != nil {
		return res, fmt.Errorf("bootstrap: wait for the recorder's records: %w", err)
	}
	res.Addrs = f.End()
	res.Pairs = f.Added()
	res.Filing = f
	if opts.Finish != nil {
		res.Done = time.Now()
		opts.Finish(res)
	}
	return res, nil
}

// chunk is one BPF_MAP_LOOKUP_BATCH's worth of keys.
type chunk struct {
	v6   bool
	k4   []ctmap.CTKey4
	k6   []ctmap.CTKey6
	vals []ctmap.Entry // the batch lookup's values; not used
	n    int
	// A kernel read (kernel.go), instead of k4/k6: its keys are filed
	// as its program publishes them, and it is released, not returned to
	// free.
	stream *stream
}

// walker reads batches on walking goroutines (one map each) and files them
// on one goroutine of its own: index.Filing's buffers take one writer.
type walker struct {
	f    *index.Filing
	p    *Progress
	free chan *chunk
	full chan *chunk
	done sync.WaitGroup
	size int

	hookMu     sync.Mutex // afterBatch runs on one walker at a time
	afterBatch func(ctmap.Kind, int)
}

// newWalker starts the filing goroutine, with chunks enough for walkers
// reading at once: one read per walker, one filed, one between.
func newWalker(f *index.Filing, size int, p *Progress, walkers int) *walker {
	inFlight := walkers + 2
	w := &walker{f: f, p: p, size: size, free: make(chan *chunk, inFlight), full: make(chan *chunk, inFlight)}
	for range inFlight {
		w.free <- &chunk{}
	}
	w.done.Add(1)
	go func() {
		defer w.done.Done()
		for c := range w.full {
			if c.stream != nil {
				w.fileStream(c.v6, c.stream)
				continue
			}
			if c.v6 {
				w.f.Add6(c.k6[:c.n])
			} else {
				w.f.Add4(c.k4[:c.n])
			}
			w.free <- c
		}
	}()
	return w
}

// walkAll reads kinds' maps, walkers of them at once, and waits until
// every chunk read is filed. The first error stops the other walks.
func (w *walker) walkAll(ctx context.Context, maps *ctmap.Maps, kinds []ctmap.Kind, walkers int) error {
	defer w.close()
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	next := make(chan ctmap.Kind, len(kinds))
	for _, k := range kinds {
		next <- k
	}
	close(next)
	var wg sync.WaitGroup
	for range walkers {
		wg.Go(func() {
			for k := range next {
				if err := w.walk(ctx, maps.Map(k), k); err != nil {
					cancel(fmt.Errorf("bootstrap: walk %s: %w", k.Name(), err))
					return
				}
			}
		})
	}
	wg.Wait()
	if err := context.Cause(ctx); err != nil {
		return err
	}
	return nil
}

// close waits until every chunk read is filed.
func (w *walker) close() {
	if w.full != nil {
		close(w.full)
		w.done.Wait()
		w.full = nil
	}
}

func (c *chunk) fit(v6 bool, size int) {
	c.v6 = v6
	if len(c.vals) < size {
		c.vals = make([]ctmap.Entry, size)
	}
	c.vals = c.vals[:size]
	if v6 {
		if len(c.k6) < size {
			c.k6 = make([]ctmap.CTKey6, size)
		}
		c.k6 = c.k6[:size]
	} else {
		if len(c.k4) < size {
			c.k4 = make([]ctmap.CTKey4, size)
		}
		c.k4 = c.k4[:size]
	}
}

// walk reads m to its end. An entry deleted or added while the walk runs
// may or may not be read (the kernel's cursor is a bucket); the design's
// argument covers both (docs/design.md).
func (w *walker) walk(ctx context.Context, m *ebpf.Map, kind ctmap.Kind) error {
	var cursor ebpf.MapBatchCursor
	size := w.size
	for batches := 1; ; batches++ {
		if err := ctx.Err(); err != nil {
			return err
		}
		var c *chunk
		select {
		case c = <-w.free:
		case <-ctx.Done():
			return context.Cause(ctx)
		}
		c.fit(kind.IPv6(), size)
		var n int
		var err error
		if c.v6 {
			n, err = m.BatchLookup(&cursor, c.k6, c.vals, nil)
		} else {
			n, err = m.BatchLookup(&cursor, c.k4, c.vals, nil)
		}
		if errors.Is(err, unix.ENOSPC) && n == 0 { // a hash bucket larger than the buffer
			w.free <- c
			size *= 2
			continue
		}
		c.n = n
		w.p.visited.Add(int64(n))
		w.full <- c
		if w.afterBatch != nil {
			w.hookMu.Lock()
			w.afterBatch(kind, batches)
			w.hookMu.Unlock()
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil // end of the map
		}
		if err != nil {
			return err
		}
	}
}
