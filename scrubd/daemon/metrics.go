package daemon

import (
	"regexp"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// durationBuckets span an index scrub of a few keys (100 µs) to a sweep of a
// 16 M-entry map under load (100 s).
var durationBuckets = []float64{
	0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
	0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100,
}

// stepBuckets span a map lookup (1 µs) to a sweep under load (10 s).
var stepBuckets = []float64{
	0.000001, 0.0000025, 0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005,
	0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 10,
}

type metrics struct {
	reg *prometheus.Registry

	duration         *prometheus.HistogramVec
	steps            *prometheus.HistogramVec
	deleted          *prometheus.CounterVec
	refused          *prometheus.CounterVec
	shared           prometheus.Counter
	ctEntries        *prometheus.GaugeVec
	ctMax            *prometheus.GaugeVec
	statsError       *prometheus.CounterVec
	late             *prometheus.CounterVec
	recorderRestarts prometheus.Counter
	natDeleted       *prometheus.CounterVec
	delegateRequests *prometheus.CounterVec
	delegateDuration *prometheus.HistogramVec
}

func newMetrics(d *Daemon, reg *prometheus.Registry) *metrics {
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	// go_gc_heap_live_bytes (the heap the last GC found live) beside the
	// default go_memstats_*: RSS moves with the GC's heap goal and the
	// scavenger, the live heap is what grows when scrubd leaks.
	reg.MustRegister(collectors.NewGoCollector(collectors.WithGoCollectorRuntimeMetrics(
		collectors.GoRuntimeMetricsRule{Matcher: regexp.MustCompile(`^/gc/heap/live:bytes$`)})),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	m := &metrics{
		reg: reg,
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "ctscrub_scrub_duration_seconds",
			Help:    "Time a scrub request took per backend, as its caller saw it (including a wait in the queue or on a shared scrub).",
			Buckets: durationBuckets,
		}, []string{"backend", "method", "reason", "result"}),
		steps: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "ctscrub_api_step_seconds",
			Help:    "Time each step of an API request took (read: accept to handler; decode, check, attach, journal, sync, delete, ...; write: the answer), per path: where a CNI ADD or DEL spends its time in scrubd.",
			Buckets: stepBuckets,
		}, []string{"path", "step"}),
		deleted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ctscrub_scrub_deleted_entries_total",
			Help: "CT entries deleted by scrubs (each deletion counted once, however many callers shared the scrub).",
		}, []string{"backend", "map", "method"}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ctscrub_scrub_refused_total",
			Help: "Scrub requests refused before any work: bad_request, not_pod_ip, try_again (queue full).",
		}, []string{"code"}),
		shared: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ctscrub_scrub_shared_total",
			Help: "Per-IP scrubs that joined a scrub of the same IP already in flight.",
		}),
		ctEntries: d.ctEntries,
		ctMax: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "ctscrub_ct_max_entries",
			Help: "Capacity of each CT table.",
		}, []string{"backend", "map"}),
		statsError: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ctscrub_ct_stats_errors_total",
			Help: "Failed reads of a backend's CT table occupancy.",
		}, []string{"backend"}),
		late: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ctscrub_del_late_total",
			Help: "Late DEL scrubs (once the deleted pod's interface is gone, docs/daemon.md) per IP: scrubbed, new_owner (an ADD of the IP came first: left alone), incomplete (index incomplete: left to the next ADD's sweep), failed.",
		}, []string{"result"}),
	}
	m.recorderRestarts = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "ctscrub_recorder_restarts_total",
		Help: "Times the recorder's reader stopped with an error and was restarted (every scrub sweeps while it is down).",
	})
	m.natDeleted = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ctscrub_scrub_nat_deleted_total",
		Help: "Cilium SNAT mappings deleted by scrubs with the CT entries that owned them (what Cilium's own scrub deletes with each TUPLE_F_OUT entry), per SNAT map.",
	}, []string{"backend", "map", "method"})
	m.delegateRequests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ctscrub_delegate_requests_total",
		Help: "Delegate API requests (docs/delegate-api.md) per caller, event and outcome: complete (every IP complete: the caller skips its walk), incomplete (some IP not: it walks), late (finished past the caller's deadline: not answered), bad_request, busy.",
	}, []string{"caller", "event", "outcome"})
	m.delegateDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "ctscrub_delegate_request_duration_seconds",
		Help:    "Time from a delegate request's arrival to its answer (or to giving up on it), per caller and event.",
		Buckets: durationBuckets,
	}, []string{"caller", "event"})
	reg.MustRegister(m.duration, m.steps, m.deleted, m.refused, m.shared, m.ctMax, m.statsError, m.late, m.recorderRestarts,
		m.natDeleted, m.delegateRequests, m.delegateDuration)
	// The delegate's and the SNAT deletes' series exist at 0 from the start
	// (Prometheus's advice for known label values): on a node whose Cilium
	// does not call the delegate, or has no SNAT map, the dashboard's
	// panels and the alerts read 0 instead of no data.
	for _, ev := range []string{"endpoint-create", "endpoint-delete"} {
		m.delegateDuration.WithLabelValues("cilium-agent", ev)
		for _, oc := range []string{"complete", "incomplete"} {
			m.delegateRequests.WithLabelValues("cilium-agent", ev, oc)
		}
	}
	for _, mp := range []string{"cilium_snat_v4_external", "cilium_snat_v6_external"} {
		m.natDeleted.WithLabelValues("cilium", mp, "index")
	}
	// The entries gauge may be shared with (and registered by) the expiry pass.
	if err := reg.Register(m.ctEntries); err != nil {
		if _, ok := err.(prometheus.AlreadyRegisteredError); !ok {
			panic(err)
		}
	}
	reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "ctscrub_scrubs_in_flight",
			Help: "Scrub requests admitted and not yet answered (running or queued).",
		}, func() float64 { return float64(d.admitted.Load()) }),
		indexCollector{d},
		// The alert on a stopped recorder reads this: while scrubd runs,
		// the recorder stopping is what takes readiness away.
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "ctscrub_ready",
			Help: "1 while scrubd is ready (/readyz): CT maps open, programs loaded, recorder running; 0 once the recorder stopped or while shutting down.",
		}, func() float64 { return b2f(d.isReady()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "ctscrub_ownership_blind",
			Help: "1 while a pod no recorder sees may run (after a sign of an unseen owner, until scrubd's find has put the recorder on every pod of the node): every scrub sweeps meanwhile.",
		}, func() float64 { return b2f(d.own.Blind()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "ctscrub_recorder_running",
			Help: "1 while the recorder feeds the index (or scrubd runs without one); 0 while it is down and every scrub sweeps.",
		}, func() float64 {
			if d.recorderUp() {
				return 1
			}
			return 0
		}),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "ctscrub_recorder_foreign_sources_total",
			Help: "New flows pods sent from an address their interface does not own (forged sources): filed under the receiver only, the claimed address marked incomplete.",
		}, func() float64 {
			if fs, ok := d.rec.(interface{ ForeignSources() uint64 }); ok {
				return float64(fs.ForeignSources())
			}
			return 0
		}),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "ctscrub_service_unresolved_total",
			Help: "Times a pod IP was marked incomplete because a flow of its through a per-packet load-balanced VIP went to a backend the index could not learn for certain (index.ReasonServiceUnresolved).",
		}, func() float64 {
			if su, ok := d.rec.(interface{ ServiceUnresolved() uint64 }); ok {
				return float64(su.ServiceUnresolved())
			}
			return 0
		}),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "ctscrub_service_no_entry_total",
			Help: "Flows to a per-packet load-balanced VIP settled as ones Cilium made no CT entry for (a service without backends dropped them), so their pod IP stayed complete (docs/recorder.md, \"A service without backends\").",
		}, func() float64 {
			if ne, ok := d.rec.(interface{ ServiceNoEntries() uint64 }); ok {
				return float64(ne.ServiceNoEntries())
			}
			return 0
		}),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "ctscrub_service_repick_confirmed_total",
			Help: "Flows to a per-packet load-balanced VIP whose backend was removed before their pod's scrub, confirmed at the scrub to have made no pick the index missed (or the pick made meanwhile deleted with them), so their pod IP stayed complete (docs/recorder.md, \"A backend removed before the scrub\").",
		}, func() float64 {
			if rc, ok := d.rec.(interface{ RepicksConfirmed() uint64 }); ok {
				return float64(rc.RepicksConfirmed())
			}
			return 0
		}),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "ctscrub_service_early_resolve_dropped_total",
			Help: "Service records whose pod IP the early resolution's full queue did not take; the IP's next scrub or audit resolves it (or marks it incomplete).",
		}, func() float64 {
			if q, ok := d.rec.(interface{ EarlyResolveDropped() uint64 }); ok {
				return float64(q.EarlyResolveDropped())
			}
			return 0
		}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "ctscrub_index_ips",
			Help: "IP slots in the Cilium index: this node's pods' IPs and released IPs kept complete.",
		}, func() float64 { return float64(d.ix.Slots()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "ctscrub_indexed_pods",
			Help: "Pod interfaces the recorder is attached to.",
		}, func() float64 { return float64(d.pods.activeCount()) }),
	)
	return m
}

var (
	descIndexKeys       = prometheus.NewDesc("ctscrub_index_keys", HelpIndexKeys, []string{"backend"}, nil)
	descIndexIncomplete = prometheus.NewDesc("ctscrub_index_incomplete_ips", HelpIndexIncomplete, []string{"backend"}, nil)
	descIndexLost       = prometheus.NewDesc("ctscrub_index_lost_total", HelpIndexLost, []string{"backend"}, nil)
)

// indexCollector reads every backend's index figures at scrape time.
type indexCollector struct{ d *Daemon }

func (c indexCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descIndexKeys
	ch <- descIndexIncomplete
	ch <- descIndexLost
}

func (c indexCollector) Collect(ch chan<- prometheus.Metric) {
	for _, src := range c.d.indexes {
		f := src.Figures()
		ch <- prometheus.MustNewConstMetric(descIndexKeys, prometheus.GaugeValue, float64(f.Keys), src.Backend)
		ch <- prometheus.MustNewConstMetric(descIndexIncomplete, prometheus.GaugeValue, float64(f.IncompleteIPs), src.Backend)
		ch <- prometheus.MustNewConstMetric(descIndexLost, prometheus.CounterValue, float64(f.Lost), src.Backend)
	}
}

// observe records one caller's view of one backend's scrub.
func (m *metrics) observe(reason scrub.Reason, r scrub.Result) {
	method := string(r.Method)
	if method == "" {
		method = string(scrub.MethodIndex)
	}
	m.duration.WithLabelValues(r.Backend, method, string(reason), string(r.Outcome)).Observe(r.Duration.Seconds())
}

// count records what a flight deleted (once per flight, not per caller).
func (m *metrics) count(r scrub.Result) {
	method := string(r.Method)
	if method == "" {
		method = string(scrub.MethodIndex)
	}
	for mp, n := range r.Deleted {
		m.deleted.WithLabelValues(r.Backend, mp, method).Add(float64(n))
	}
	for mp, n := range r.NATDeleted {
		m.natDeleted.WithLabelValues(r.Backend, mp, method).Add(float64(n))
	}
}
