package expiry

import (
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// passBuckets span a pass over a near-empty map (1 ms) to 16 M entries on a
// loaded node (tens of seconds).
var passBuckets = []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50}

type metrics struct {
	entries   *prometheus.GaugeVec
	oldest    *prometheus.GaugeVec
	duration  *prometheus.HistogramVec
	deleted   *prometheus.CounterVec
	natDel    *prometheus.CounterVec
	refreshed *prometheus.CounterVec
	passes    *prometheus.CounterVec
	clock     *prometheus.GaugeVec
	withheld  prometheus.Gauge
	last      prometheus.Gauge
}

// NewEntriesGauge is ctscrub_ct_entries{backend,map,state}: the one metric of
// that name. The expiry pass writes state="live"/"expired" for the Cilium
// maps it walks; a table nobody splits (nf_conntrack, or Cilium with expiry
// off) is written as state="all". Exactly one state family per (backend,map),
// so sum by (map) is always the occupancy.
func NewEntriesGauge() *prometheus.GaugeVec {
	return prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "ctscrub_ct_entries",
		Help: "Entries in each CT table: state live/expired from the expiry pass (Cilium maps), or all where nothing splits them.",
	}, []string{"backend", "map", "state"})
}

func newMetrics(reg prometheus.Registerer, entries *prometheus.GaugeVec, cfg Config) (*metrics, error) {
	m := &metrics{
		entries: entries,
		oldest: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "ctscrub_ct_oldest_expired_seconds",
			Help: "Age of the oldest expired entry each expiry pass found (0: none).",
		}, []string{"map"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "ctscrub_expiry_sweep_duration_seconds",
			Help:    "Time one expiry pass held a CPU on one map.",
			Buckets: passBuckets,
		}, []string{"map", "mode"}),
		deleted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ctscrub_expiry_deleted_total",
			Help: "Expired CT entries the expiry pass deleted.",
		}, []string{"map"}),
		natDel: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ctscrub_expiry_nat_deleted_total",
			Help: "Cilium SNAT mappings the expiry pass deleted with the expired CT entries of map (TUPLE_F_OUT entries' forward and reverse mappings, as Cilium's GC deletes them).",
		}, []string{"map"}),
		refreshed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ctscrub_expiry_refreshed_total",
			Help: "Entries expired when counted but live again (or gone) when re-read right before the delete; kept.",
		}, []string{"map"}),
		passes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ctscrub_expiry_passes_total",
			Help: "Expiry passes per map by result: swept, reported (counted only), stopped (stop flag: shutdown or deadline), error.",
		}, []string{"map", "result"}),
		clock: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "ctscrub_ct_clock",
			Help: "1 for the clock CT lifetimes are judged in (ktime or jiffies) and whether the entries confirmed it.",
		}, []string{"clock", "confirmed"}),
		withheld: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "ctscrub_expiry_sweep_withheld",
			Help: "1 when mode is sweep but the clock is not trusted (ambiguous or refuted): the pass only counts.",
		}),
		last: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "ctscrub_expiry_last_pass_timestamp_seconds",
			Help: "Unix time the last complete expiry pass over a map finished.",
		}),
	}
	if reg == nil {
		if m.entries == nil {
			m.entries = NewEntriesGauge()
		}
		return m, nil
	}
	cs := []prometheus.Collector{m.oldest, m.duration, m.deleted, m.natDel, m.refreshed, m.passes, m.clock, m.withheld, m.last,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "ctscrub_expiry_interval_seconds",
			Help: "Configured interval between expiry passes (fixed).",
		}, func() float64 { return cfg.Interval.Seconds() }),
	}
	if m.entries == nil {
		m.entries = NewEntriesGauge()
		cs = append(cs, m.entries)
	}
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			var are prometheus.AlreadyRegisteredError
			if errors.As(err, &are) {
				continue
			}
			return nil, err
		}
	}
	return m, nil
}

func (m *metrics) pass(mapName, result string) {
	if m == nil {
		return
	}
	m.passes.WithLabelValues(mapName, result).Inc()
}

func (m *metrics) observe(r MapReport, sweep bool) {
	if m == nil {
		return
	}
	mode := "report"
	if sweep {
		mode = "sweep"
	}
	m.duration.WithLabelValues(r.Map, mode).Observe(r.Duration.Seconds())
	m.deleted.WithLabelValues(r.Map).Add(float64(r.Deleted))
	m.natDel.WithLabelValues(r.Map).Add(float64(r.NATDeleted))
	m.refreshed.WithLabelValues(r.Map).Add(float64(r.Refreshed))
	if r.Stopped {
		m.pass(r.Map, "stopped")
		return // partial counts would read as a sudden drop
	}
	m.pass(r.Map, map[bool]string{true: "swept", false: "reported"}[sweep])
	// After a sweep the expired ones are gone: report what is left.
	m.entries.WithLabelValues("cilium", r.Map, "live").Set(float64(r.Live))
	m.entries.WithLabelValues("cilium", r.Map, "expired").Set(float64(r.Expired - min(r.Expired, r.Deleted)))
	m.oldest.WithLabelValues(r.Map).Set(r.OldestExpired.Seconds())
	m.last.Set(float64(time.Now().Unix()))
}

func (m *metrics) setDecision(d Decision, mode Mode) {
	if m == nil {
		return
	}
	m.clock.Reset()
	m.clock.WithLabelValues(string(d.Clock), map[bool]string{true: "true", false: "false"}[d.Confirmed]).Set(1)
	w := 0.0
	if mode == ModeSweep && !d.Delete {
		w = 1
	}
	m.withheld.Set(w)
}
