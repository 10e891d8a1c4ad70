package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ctscrub/ctscrub/scrubd/cilium"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/expiry"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// CTMapsCheckEvery is how often scrubd compares the CT maps pinned under
// --ct-root with the ones it holds, besides the check before every scrub.
const CTMapsCheckEvery = time.Second

// ReasonLabelCTMaps labels ctscrub_index_marked_incomplete_total for IPs
// marked incomplete because Cilium re-created its CT maps.
const ReasonLabelCTMaps = "ct_maps_replaced"

// ctWatch notices Cilium's CT maps re-created under the daemon (an agent
// restart that changed their size or layout, or removed them) and moves
// everything that holds them to the new maps: the Cilium backend (sweep and
// delete programs), the expiry pass, the recorder's prune. Every IP of the
// index is marked incomplete (index.ReasonCTMaps): the index's keys came
// from flows whose entries lived in the old maps, and entries Cilium makes in
// the new maps for flows the recorder had already seen are not recorded again,
// so only a sweep of the new maps proves an IP clean.
type ctWatch struct {
	mu   sync.Mutex // one check (and re-open) at a time
	b    *cilium.Backend
	exp  *expiry.Runner                  // nil: no expiry pass
	rec  interface{ SetCT(*ctmap.Maps) } // nil: no recorder
	ix   *index.Index
	log  *slog.Logger
	errs string // last error logged, so a lasting one is logged once
	// expStale: the expiry pass could not move to the maps the backend
	// holds; run retries.
	expStale bool

	reopened prometheus.Counter
	marked   prometheus.Counter
	failed   prometheus.Counter
}

func newCTWatch(b *cilium.Backend, exp *expiry.Runner, rec interface{ SetCT(*ctmap.Maps) }, ix *index.Index, log *slog.Logger, reg prometheus.Registerer) (*ctWatch, error) {
	w := &ctWatch{b: b, exp: exp, rec: rec, ix: ix, log: log,
		reopened: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ctscrub_ct_maps_reopened_total",
			Help: "Times scrubd found Cilium's CT maps re-created under --ct-root and moved to the new ones.",
		}),
		failed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ctscrub_ct_maps_reopen_errors_total",
			Help: "Failed checks or re-opens of Cilium's CT maps (retried every second and before every scrub).",
		}),
	}
	marked := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ctscrub_index_marked_incomplete_total",
		Help: "IPs marked incomplete at once by a node-wide event, per reason (ct_maps_replaced: Cilium's CT maps were re-created); their next scrub sweeps.",
	}, []string{"backend", "reason"})
	w.marked = marked.WithLabelValues("cilium", ReasonLabelCTMaps)
	if reg != nil {
		for _, c := range []prometheus.Collector{w.reopened, w.failed, marked} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("ct maps watch metrics: %w", err)
			}
		}
	}
	return w, nil
}

// run checks every CTMapsCheckEvery until ctx ends, and runs the
// continuous coverage check (cilium.Features.MarkUncovered) at start, on
// every tick and right after the maps moved.
func (w *ctWatch) run(ctx context.Context) error {
	t := time.NewTicker(CTMapsCheckEvery)
	defer t.Stop()
	w.coverage()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		w.check()
		w.retryExpiry()
		w.coverage()
	}
}

// coverage marks the IPs a Cilium feature the index does not cover can
// reach (docs/recorder.md "Features the recorder does not cover").
func (w *ctWatch) coverage() {
	if n := w.b.Features().MarkUncovered(w.ix); n > 0 {
		w.log.Info("Cilium features the index does not cover: IPs marked incomplete", "marked", n)
	}
}

// retryExpiry retries moving a stopped expiry pass to the maps the backend
// holds. Here, not in check: a scrub's check would wait for a pass.
func (w *ctWatch) retryExpiry() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.expStale {
		w.moveExpiry(w.b.Maps())
	}
}

// check re-opens the CT maps when the pins point at other maps than the ones
// held. It reports whether it moved to new maps.
func (w *ctWatch) check() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	moved, err := w.reopen()
	if moved {
		defer w.coverage() // after the CT-maps marks, which the IPs keep
	}
	if err != nil {
		w.failed.Inc()
		if err.Error() != w.errs {
			w.log.Error("Cilium's CT maps: check or re-open failed; scrubs use the maps held, retrying", "err", err)
		}
		w.errs = err.Error()
	} else {
		w.errs = ""
	}
	return moved
}

func (w *ctWatch) reopen() (bool, error) {
	cur := w.b.Maps()
	replaced, err := cur.Replaced()
	if !replaced {
		return false, err
	}
	// Between Cilium's unpin and its re-create of the last map Open fails
	// (a map missing): the next check retries.
	nm, err := ctmap.Open(cur.Root)
	if err != nil {
		return false, fmt.Errorf("re-created CT maps under %s: %w", cur.Root, err)
	}
	var ids []uint32
	for _, k := range ctmap.Kinds {
		ids = append(ids, uint32(nm.ID(k)))
	}
	n := 0
	old, err := w.b.Reopen(nm, func() {
		// Under the backend's write lock: no scrub runs, and the first one
		// on the new maps sees every IP incomplete.
		for _, ip := range w.ix.IPs() {
			w.ix.MarkIncomplete(ip, index.ReasonCTMaps)
			n++
		}
	})
	if err != nil {
		nm.Close()
		return false, fmt.Errorf("re-created CT maps under %s: load the sweep programs: %w", cur.Root, err)
	}
	w.marked.Add(float64(n)) // first: a reader that sees the re-open counted sees the marks
	w.reopened.Inc()
	if w.rec != nil {
		w.rec.SetCT(nm)
	}
	w.moveExpiry(nm)
	old.Close() // nothing holds them now, the expiry pass neither (its Reopen)
	// Loading the programs parses their ELF objects: about 5.6 MiB of heap
	// for a moment (the soak measured a 22 -> 28 MiB RSS spike at a re-open,
	// live heap after GC flat across ten re-opens), which the runtime's
	// scavenger returns only over minutes. Give it back now.
	debug.FreeOSMemory()
	w.log.Warn("Cilium's CT maps were re-created (agent restart?): re-opened; every indexed IP marked incomplete, their next scrubs sweep",
		"ct_root", cur.Root, "map_ids", ids, "ips_marked_incomplete", n)
	return true, nil
}

// moveExpiry moves the expiry pass to maps; when it cannot, the pass stops
// (expiry.Runner.Reopen) and run retries every CTMapsCheckEvery.
func (w *ctWatch) moveExpiry(maps *ctmap.Maps) {
	if w.exp == nil {
		return
	}
	err := w.exp.Reopen(maps)
	if err != nil && !w.expStale {
		w.log.Error("Cilium's CT maps re-created: the expiry pass could not move to them and stops until it can (retried with every check)", "err", err)
	} else if err == nil && w.expStale {
		w.log.Info("the expiry pass moved to Cilium's re-created CT maps")
	}
	w.expStale = err != nil
}

// ciliumBackend is the Cilium backend as the daemon runs it: each scrub first
// checks that the CT maps are still the pinned ones, and Close closes the
// expiry pass and the CT maps with the backend that uses them.
type ciliumBackend struct {
	*cilium.Backend
	watch *ctWatch
	exp   *expiry.Runner
}

func (c ciliumBackend) Scrub(ctx context.Context, req scrub.Request) (scrub.Result, error) {
	c.watch.check()
	return c.Backend.Scrub(ctx, req)
}

func (c ciliumBackend) Close() error {
	maps := c.Backend.Maps()
	return errors.Join(c.exp.Close(), c.Backend.Close(), maps.Close())
}
