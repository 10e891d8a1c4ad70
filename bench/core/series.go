package main

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"runtime"
	"slices"
	"sync"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/cilium"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// indexOnly runs the index series on a node of n entries, then frees it.
func indexOnly(cfg config, n int) (backend, sock time.Duration, err error) {
	nd, c, err := setup(cfg, n)
	if err != nil {
		return 0, 0, err
	}
	defer nd.close()
	defer c.Close()
	d, s, _, _, err := indexSeries(nd, c, cfg.indexReps)
	if err != nil {
		return 0, 0, err
	}
	fmt.Printf("  %d entries: scrub through the socket median %s, p99 %s; backend only median %s, p99 %s; %d scrubs each\n", n,
		fmtDur(quantile(s, 0.5)), fmtDur(quantile(s, 0.99)), fmtDur(quantile(d, 0.5)), fmtDur(quantile(d, 0.99)), len(d))
	return quantile(d, 0.5), quantile(s, 0.5), nil
}

// indexSeries times reps index scrubs through scrubd's socket and reps
// through the backend alone, alternating, each of a fresh target, and
// checks each scrub.
func indexSeries(nd *node, c *cilium.Backend, reps int) (d, sock, cpu, waited []time.Duration, err error) {
	gcDuring, gcDuringSock := 0, 0
	// One OS thread for the whole series, so its CPU time and its wait for a
	// CPU (schedstat) can be read around each backend scrub: on a shared
	// machine the slow tail is time spent runnable but not running.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	for i := range 2 * reps {
		target, t, err := nd.take()
		if err != nil {
			return nil, nil, nil, nil, err
		}
		if st := nd.ix.State(target); !st.Complete || st.Keys != nd.k {
			return nil, nil, nil, nil, fmt.Errorf("index before scrub %d: %+v, want complete with %d keys", i, st, nd.k)
		}
		var r scrub.Result
		if i%2 == 0 {
			var took time.Duration
			gc0 := gcCycles()
			r, took, err = nd.scrubd.scrub([]netip.Addr{target}, scrub.ReasonDel)
			sock = append(sock, took)
			if gcCycles() != gc0 {
				gcDuringSock++
			}
		} else {
			gc0, wait0 := gcCycles(), runDelay()
			cpu0 := threadCPU()
			start := time.Now()
			r, err = c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{target}, Reason: scrub.ReasonDel})
			d = append(d, time.Since(start))
			cpu = append(cpu, threadCPU()-cpu0)
			waited = append(waited, runDelay()-wait0)
			if gcCycles() != gc0 {
				gcDuring++
			}
		}
		if err != nil {
			return nil, nil, nil, nil, fmt.Errorf("index scrub %d: %w", i, err)
		}
		if r.Method != scrub.MethodIndex || r.Total != nd.k {
			return nil, nil, nil, nil, fmt.Errorf("index scrub %d: %+v, want method index and %d deleted", i, r, nd.k)
		}
		if err := nd.scrubbed("index scrub", t, i == 2*reps-1); err != nil {
			return nil, nil, nil, nil, err
		}
	}
	slow := slices.Clone(sock)
	slices.Sort(slow)
	slow = slow[max(0, len(slow)-5):]
	fmt.Printf("  index scrubs: slowest through the socket %v, a Go GC cycle of scrubd's ran during %d of %d; backend only: a Go GC cycle ran during %d of %d, CPU time median %s p99 %s, waiting for a CPU p99 %s\n",
		slow, gcDuringSock, len(sock), gcDuring, len(d), fmtDur(quantile(cpu, 0.5)), fmtDur(quantile(cpu, 0.99)), fmtDur(quantile(waited, 0.99)))
	return d, sock, cpu, waited, nil
}

// series times a full-map method: the first run always, more while they fit
// in budget, at most maxReps. Each run scrubs a fresh target; the first run
// is checked for exactness (every other entry still there).
func series(name string, maxReps int, budget time.Duration, nd *node, fn func(target netip.Addr) error) ([]time.Duration, error) {
	var d []time.Duration
	var total time.Duration
	for len(d) < maxReps {
		if len(d) > 0 && total+total/time.Duration(len(d)) > budget {
			break
		}
		target, ti, err := nd.take()
		if err != nil {
			return nil, err
		}
		t := time.Now()
		nd.extra = 0
		if err := fn(target); err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		el := time.Since(t) + nd.extra
		d = append(d, el)
		total += el
		fmt.Printf("  %s: %s\n", name, fmtDur(el))
		if err := nd.scrubbed(name, ti, len(d) == 1); err != nil {
			return nil, err
		}
	}
	return d, nil
}

// deleteFloor times BPF_MAP_DELETE_BATCH of fresh targets' keys, untouched
// since the fill, two ways, alternating, floorReps targets each: each map's
// share in one call, the maps one after the other (seq, the floor the
// targets are stated against), and both maps' calls at once from two
// threads (par: a scrub deletes from its CT maps at once, so the kernel's
// cheapest way of deleting the same keys on this machine's two CPUs is
// reported too). It returns each way's median. The index still holds the
// keys: the target is marked incomplete so nothing scrubs it later by
// index.
func deleteFloor(nd *node) (seq, par time.Duration, err error) {
	var seqs, pars []time.Duration
	for i := range 2 * floorReps {
		target, t, err := nd.take()
		if err != nil {
			return 0, 0, err
		}
		nd.ix.MarkIncomplete(target, index.ReasonLost)
		byKind := map[ctmap.Kind][]ctmap.CTKey4{}
		for _, k := range nd.target4[t] {
			byKind[k.Kind()] = append(byKind[k.Kind()], k)
		}
		del := func(kind ctmap.Kind) error {
			keys := byKind[kind]
			if n, err := nd.maps.Map(kind).BatchDelete(keys, nil); err != nil || n != len(keys) {
				return fmt.Errorf("delete floor: %d of %d keys of %s deleted: %v", n, len(keys), kind.Name(), err)
			}
			return nil
		}
		var took time.Duration
		if i%2 == 0 {
			start := time.Now()
			for kind := range byKind {
				if err := del(kind); err != nil {
					return 0, 0, err
				}
			}
			took = time.Since(start)
			seqs = append(seqs, took)
		} else {
			var kinds []ctmap.Kind
			for kind := range byKind {
				kinds = append(kinds, kind)
			}
			errs := make([]error, len(kinds))
			var wg sync.WaitGroup
			start := time.Now()
			for j, kind := range kinds[1:] {
				wg.Go(func() { errs[j+1] = del(kind) })
			}
			errs[0] = del(kinds[0])
			wg.Wait()
			took = time.Since(start)
			pars = append(pars, took)
			if err := errors.Join(errs...); err != nil {
				return 0, 0, err
			}
		}
		if err := nd.scrubbed("delete floor", t, false); err != nil {
			return 0, 0, err
		}
	}
	return median(seqs), median(pars), nil
}
