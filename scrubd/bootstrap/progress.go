package bootstrap

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// Progress follows the passes of one daemon: the live figures of a running
// pass and the last one's result, for /metrics (Register) and `scrubd
// status` (Status). The zero value is ready to use.
type Progress struct {
	running   atomic.Bool
	visited   atomic.Int64 // entries read, every pass
	visitedAt int64        // visited when the current pass began
	pairsDone atomic.Int64 // pairs filed by the passes that ended

	mu     sync.Mutex
	filing *index.Filing // the running pass's, for its live pairs
	passes int
	start  time.Time
	last   api.BootstrapStatus
}

func (p *Progress) begin(start time.Time, f *index.Filing) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.filing, p.start = f, start
	p.visitedAt = p.visited.Load()
	p.running.Store(true)
}

func (p *Progress) end(r Result, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	pairs := int64(0)
	if p.filing != nil {
		pairs = p.filing.Pairs()
	}
	p.pairsDone.Add(pairs)
	p.filing = nil
	p.passes++
	p.last = api.BootstrapStatus{
		Passes:    p.passes,
		Start:     r.Start.UTC(),
		Done:      r.Done.UTC(),
		DurationS: r.Done.Sub(r.Start).Seconds(),
		Visited:   p.visited.Load() - p.visitedAt,
		Keys:      pairs,
		Addresses: len(r.Addrs),
	}
	if err != nil {
		p.last.Error = err.Error()
	}
	p.running.Store(false)
}

// pairs is every (address, key) pair the passes filed, the running one's so
// far included.
func (p *Progress) pairs() int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := p.pairsDone.Load()
	if p.filing != nil {
		n += p.filing.Pairs()
	}
	return n
}

// Status is the pass as `scrubd status` shows it: the running one's figures
// so far, else the last one's; nil before the first pass.
func (p *Progress) Status() *api.BootstrapStatus {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.running.Load() {
		st := api.BootstrapStatus{
			Running:   true,
			Passes:    p.passes,
			Start:     p.start.UTC(),
			DurationS: time.Since(p.start).Seconds(),
			Visited:   p.visited.Load() - p.visitedAt,
		}
		if p.filing != nil {
			st.Keys = p.filing.Pairs()
		}
		return &st
	}
	if p.passes == 0 {
		return nil
	}
	st := p.last
	return &st
}

// Register adds the pass's metrics to reg:
//
//	ctscrub_bootstrap_running             1 while a pass runs
//	ctscrub_bootstrap_keys_total          (address, key) pairs the passes filed
//	ctscrub_bootstrap_entries_total       CT entries the passes read
//	ctscrub_bootstrap_duration_seconds    the last pass's wall time (so far, while one runs)
func (p *Progress) Register(reg prometheus.Registerer) error {
	cs := []prometheus.Collector{
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "ctscrub_bootstrap_running",
			Help: "1 while the bootstrap pass over Cilium's CT maps runs (scrubs sweep or wait meanwhile).",
		}, func() float64 {
			if p.running.Load() {
				return 1
			}
			return 0
		}),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "ctscrub_bootstrap_keys_total",
			Help: "(address, CT key) pairs the bootstrap passes filed into the index.",
		}, func() float64 { return float64(p.pairs()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "ctscrub_bootstrap_entries_total",
			Help: "CT entries the bootstrap passes read.",
		}, func() float64 { return float64(p.visited.Load()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "ctscrub_bootstrap_duration_seconds",
			Help: "Wall time of the last bootstrap pass (of the running one so far).",
		}, func() float64 {
			if st := p.Status(); st != nil {
				return st.DurationS
			}
			return 0
		}),
	}
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}
