package expiry

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// Options are the Runner's collaborators.
type Options struct {
	// Registerer receives the metrics; nil registers none.
	Registerer prometheus.Registerer
	// Entries, when set, is the daemon's ctscrub_ct_entries{backend,map,state}
	// gauge; the Runner writes the live/expired split of the Cilium maps into
	// it instead of registering its own.
	Entries *prometheus.GaugeVec
	Logger  *slog.Logger
}

// Runner runs the expiry pass over every CT map on a fixed interval.
type Runner struct {
	cfg    Config
	maps   *ctmap.Maps
	passes [ctmap.NumKinds]*mapPass
	log    *slog.Logger
	m      *metrics

	mu       sync.Mutex // serialises passes and guards the state below
	decision Decision
	hz       int
	walks    int  // walks so far: each starts one map further on
	decided  bool // a decision from evidence was made (and logged)

	// reopenErr: the last Reopen failed, no pass runs until one succeeds.
	reopenErr error

	audit *auditor // nil until EnableAudit (audit.go)
}

// MapReport is one pass over one map, judged in the decision's clock.
type MapReport struct {
	Map           string
	Entries       uint64 // entries the pass visited
	Live, Expired uint64 // as found, before deletes
	Deleted       uint64
	NATDeleted    uint64 // SNAT mappings deleted with them
	Refreshed     uint64 // expired when counted, live again (or gone) when re-read before the delete
	Guarded       uint64 // expired in the clock but impossible in it: kept
	OldestExpired time.Duration
	Duration      time.Duration
	Stopped       bool

	raw   passArgs
	kind  ctmap.Kind
	audit auditFound
}

// Report is one pass over all maps.
type Report struct {
	Maps     []MapReport
	Decision Decision // the clock the report is judged in, after this pass's evidence
	Swept    bool     // deletes were allowed in the pass reported
	Stopped  bool
	Evidence Evidence

	now [numClocks]uint32 // the clocks' readings at the last map's pass
}

// NowIn is the reading of clock c (ktime or jiffies; auto reads as ktime)
// taken by the pass, in the units ct_entry.lifetime is kept in: what an entry
// written now with a timeout of t expires at is NowIn(c) plus t in those
// units. 0 when no map was walked.
func (r Report) NowIn(c Clock) uint32 { return r.now[clockIndex(c)] }

// Total sums the maps.
func (r Report) Total() MapReport {
	var t MapReport
	t.Map = "all"
	for _, m := range r.Maps {
		t.Entries += m.Entries
		t.Live += m.Live
		t.Expired += m.Expired
		t.Deleted += m.Deleted
		t.NATDeleted += m.NATDeleted
		t.Refreshed += m.Refreshed
		t.Guarded += m.Guarded
		t.Duration += m.Duration
		t.OldestExpired = max(t.OldestExpired, m.OldestExpired)
		t.Stopped = t.Stopped || m.Stopped
	}
	return t
}

// New loads the pass for every map in maps. The caller keeps ownership of
// maps. With cfg.Mode off nothing is loaded and Run returns at once.
func New(maps *ctmap.Maps, cfg Config, opts Options) (*Runner, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	r := &Runner{cfg: cfg, maps: maps, log: opts.Logger}
	if r.log == nil {
		r.log = slog.New(slog.DiscardHandler)
	}
	r.log = r.log.With("component", "expiry")
	r.decision = Decide(cfg.Clock, Evidence{}, cfg.MinEvidence)
	if cfg.Mode == ModeOff {
		return r, nil
	}
	if maps == nil {
		return nil, errors.New("expiry: no CT maps given")
	}
	for _, k := range ctmap.Kinds {
		m := maps.Map(k)
		if m == nil {
			continue
		}
		p, err := loadPass(k, m, maps.NAT(k.IPv6()))
		if err != nil {
			r.Close()
			return nil, err
		}
		r.passes[k] = p
	}
	m, err := newMetrics(opts.Registerer, opts.Entries, cfg)
	if err != nil {
		r.Close()
		return nil, err
	}
	r.m = m
	r.m.setDecision(r.decision, cfg.Mode)
	return r, nil
}

// Reopen moves the pass to maps (Cilium re-created its CT maps): it waits
// for a pass in progress, loads the programs on maps and unloads the old
// ones. The old maps stay the caller's, and the Runner no longer uses them
// even on error: Cilium left them, a pass over them would report (and
// delete in) a table no datapath uses, and the caller must be free to close
// them. Until a Reopen succeeds every Pass fails with the error.
func (r *Runner) Reopen(maps *ctmap.Maps) error {
	if maps == nil {
		return errors.New("expiry: no CT maps given")
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cfg.Mode == ModeOff {
		r.maps = maps
		return nil
	}
	var passes [ctmap.NumKinds]*mapPass
	for _, k := range ctmap.Kinds {
		m := maps.Map(k)
		if m == nil {
			continue
		}
		p, err := loadPass(k, m, maps.NAT(k.IPv6()))
		if err != nil {
			for _, p := range passes {
				if p != nil {
					p.Close()
				}
			}
			r.Close()
			r.maps, r.reopenErr = nil, err
			return err
		}
		passes[k] = p
	}
	r.Close()
	r.passes, r.maps, r.reopenErr = passes, maps, nil
	return nil
}

// Config is the effective configuration.
func (r *Runner) Config() Config { return r.cfg }

// Decision is the clock decision the next pass starts from.
func (r *Runner) Decision() Decision {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.decision
}

// Close unloads the programs. The maps stay open (they are the caller's).
func (r *Runner) Close() error {
	for i, p := range r.passes {
		if p != nil {
			p.Close()
			r.passes[i] = nil
		}
	}
	return nil
}

// Run runs a pass every Interval until ctx ends. The interval is fixed:
// nothing adapts it, so the gap between passes never exceeds Interval (plus a
// pass's own time when a pass overruns). Errors are logged and counted; Run
// returns nil when ctx ends.
func (r *Runner) Run(ctx context.Context) error {
	if r.cfg.Mode == ModeOff {
		return nil
	}
	r.log.Info("expiry pass running", "mode", r.cfg.Mode, "interval", r.cfg.Interval, "clock", r.cfg.Clock, "pass_timeout", r.cfg.PassTimeout)
	t := time.NewTicker(r.cfg.Interval)
	defer t.Stop()
	for {
		rep, err := r.Pass(ctx)
		if err != nil && ctx.Err() == nil {
			r.log.Error("expiry pass failed", "err", err)
		} else if err == nil {
			tot := rep.Total()
			r.log.Debug("expiry pass", "clock", rep.Decision.Clock, "confirmed", rep.Decision.Confirmed, "swept", rep.Swept,
				"entries", tot.Entries, "live", tot.Live, "expired", tot.Expired, "deleted", tot.Deleted, "nat_deleted", tot.NATDeleted,
				"refreshed", tot.Refreshed, "oldest_expired", tot.OldestExpired, "duration", tot.Duration, "stopped", tot.Stopped)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// Pass runs one pass over every map: deletes expired entries when the mode
// is sweep and the clock is trusted (from the previous pass's evidence, or
// configured), counts in any case, then updates the clock decision from what
// it saw. When the first pass (or one after an ambiguous spell) confirms the
// clock in sweep mode, a sweeping pass follows at once. ctx and PassTimeout
// bound it: the stop flag ends the pass in progress.
func (r *Runner) Pass(ctx context.Context) (Report, error) {
	if r.cfg.Mode == ModeOff {
		return Report{Decision: r.Decision()}, nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.reopenErr != nil {
		return Report{Decision: r.decision}, fmt.Errorf("expiry: no pass since Cilium re-created its CT maps: moving to them failed: %w", r.reopenErr)
	}
	parent := ctx // the audit's confirm wait is not part of the walk's deadline
	ctx, cancel := context.WithTimeout(ctx, r.cfg.PassTimeout)
	defer cancel()

	now := time.Now()
	smp := r.loadAudit(now)
	sweep := r.cfg.Mode == ModeSweep && r.decision.Delete
	rep, err := r.walk(ctx, sweep, r.decision.Clock)
	if !rep.Stopped && err == nil {
		r.decide(rep.Evidence)
		if r.cfg.Mode == ModeSweep && !sweep && r.decision.Delete && ctx.Err() == nil {
			r.judge(&rep, r.decision.Clock) // the counting pass, in the metrics too
			var err2 error
			rep, err2 = r.walk(ctx, true, r.decision.Clock)
			if err2 == nil && !rep.Stopped {
				r.decide(rep.Evidence)
			}
			err = err2
		}
	}
	r.judge(&rep, r.decision.Clock)
	rep.Decision = r.decision
	if r.m != nil {
		r.m.setDecision(r.decision, r.cfg.Mode)
	}
	r.checkAudit(parent, smp, rep, err == nil && !rep.Stopped, now)
	return rep, err
}

// decide updates the decision from evidence, logging changes.
func (r *Runner) decide(e Evidence) {
	d := Decide(r.cfg.Clock, e, r.cfg.MinEvidence)
	// Log changes of the outcome, not of the counts in the reason.
	if d.Clock != r.decision.Clock || d.Confirmed != r.decision.Confirmed || d.Delete != r.decision.Delete || !r.decided {
		lvl := slog.LevelInfo
		if !d.Delete && r.cfg.Mode == ModeSweep {
			lvl = slog.LevelWarn
		}
		r.log.Log(context.Background(), lvl, "expiry clock decision", "clock", d.Clock, "confirmed", d.Confirmed, "delete", d.Delete, "why", d.Why)
	}
	r.decision = d
	r.decided = true
}

// params builds the program's input.
func (r *Runner) params(sweep bool, clock Clock) passArgs {
	hz := r.hz
	if hz == 0 {
		hz = 1024 // unknown: the widest window, so no jiffies entry is judged implausibly far
	}
	life := r.cfg.MaxLifetime.Seconds()
	a := passArgs{Clock: uint32(clockIndex(clock))}
	if sweep {
		a.Flags |= flagSweep
	}
	for c := range numClocks {
		a.MaxFuture[c] = uint32(min(math.Ceil(secondsToUnits(c, life, hz)), math.MaxUint32))
	}
	a.Floor[clockJiffies] = jiffiesFloor
	return a
}

// walk runs the program once over every map. The per-map reports are judged
// in Clock after the caller's decision (judge), so a pass that settles the
// clock reports in it.
func (r *Runner) walk(ctx context.Context, sweep bool, clock Clock) (Report, error) {
	rep := Report{Swept: sweep}
	var errs []error
	// Each walk starts at the next map, so a deadline that stops walks on a
	// huge first map does not starve the others.
	var order []*mapPass
	for _, p := range r.passes {
		if p != nil {
			order = append(order, p)
		}
	}
	if len(order) > 0 {
		k := r.walks % len(order)
		order = append(order[k:], order[:k]...)
	}
	r.walks++
	for _, p := range order {
		out, took, err := p.run(ctx, r.params(sweep, clock))
		if err != nil {
			errs = append(errs, err)
			r.m.pass(p.kind.Name(), "error")
			if ctx.Err() != nil {
				rep.Stopped = true
				break
			}
			continue
		}
		if hz := kernelHZ(out.NowJiffies64, out.NowKtimeNs); hz != 0 {
			r.hz = hz
		}
		found, aerr := p.readAudit(out)
		if aerr != nil {
			r.log.Error("audit: read the keys found", "err", aerr)
		}
		rep.Maps = append(rep.Maps, MapReport{Map: p.kind.Name(), Duration: took, raw: out, kind: p.kind, audit: found})
		rep.now = out.Now
		rep.Evidence.add(out)
		if out.Stopped != 0 {
			rep.Stopped = true
			break
		}
	}
	if rep.Stopped && len(errs) == 0 {
		errs = append(errs, fmt.Errorf("expiry pass: %w (%v)", errStopped, context.Cause(ctx)))
	}
	return rep, errors.Join(errs...)
}

// judge fills the per-map figures in clock and records them in the metrics.
func (r *Runner) judge(rep *Report, clock Clock) {
	c := clockIndex(clock)
	for i := range rep.Maps {
		mr := &rep.Maps[i]
		out := mr.raw
		mr.Entries = out.Visited
		mr.Live = out.C[c].Live
		mr.Expired = out.C[c].Expired
		mr.Deleted = out.Deleted
		mr.NATDeleted = out.NATDeleted
		mr.Refreshed = out.Refreshed
		mr.Guarded = out.Guarded
		mr.Stopped = out.Stopped != 0
		mr.OldestExpired = 0
		if min := out.C[c].MinExpired; min != math.MaxUint32 && min < out.Now[c] {
			mr.OldestExpired = r.unitsToDuration(c, out.Now[c]-min)
		}
		r.m.observe(*mr, rep.Swept)
	}
}

func (r *Runner) unitsToDuration(c int, units uint32) time.Duration {
	s := float64(units)
	if c == clockJiffies {
		hz := r.hz
		if hz == 0 {
			hz = 250 // Debian's and most distributions' CONFIG_HZ
		}
		s = s * 256 / float64(hz)
	}
	return time.Duration(s * float64(time.Second))
}
