package daemon

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/endpoints"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// RemoteBackendsConfig turns on the remote-backend watch (docs/remote.md):
// scrubd watches EndpointSlices and, when a backend address leaves every
// slice, deletes the entries this node's pods keep towards it.
type RemoteBackendsConfig struct {
	Enabled bool `yaml:"enabled"`
	// Hold: how long an address must be in no slice before it counts as
	// gone (0: endpoints.DefaultHold, 1 s).
	Hold Duration `yaml:"hold"`
	// Kubeconfig reaches the API from outside a pod (tests on a laptop
	// against a cluster); "": the pod's service account.
	Kubeconfig string `yaml:"kubeconfig"`
}

// peerScrubber is a backend that deletes local clients' entries towards an
// address (cilium.Backend, nfct.NFCT).
type peerScrubber interface {
	Name() string
	ScrubPeer(ctx context.Context, peer netip.Addr) (scrub.Result, error)
}

// remoteBackends is the watch's action and its figures.
type remoteBackends struct {
	d *Daemon
	w *endpoints.Watch

	backends atomic.Uint64 // scrubbed
	entries  atomic.Uint64 // deleted
	last     atomic.Pointer[api.RemoteBackendScrub]

	mScrubbed *prometheus.CounterVec // outcome
	mDeleted  *prometheus.CounterVec // backend
	mLatency  prometheus.Histogram   // from the slice change to the entries gone
	mSkipped  *prometheus.CounterVec // why
	mSynced   prometheus.GaugeFunc
}

func newRemoteBackends(d *Daemon, reg prometheus.Registerer) (*remoteBackends, error) {
	hold := d.cfg.RemoteBackends.Hold.Duration
	if hold == 0 {
		hold = endpoints.DefaultHold
	}
	r := &remoteBackends{d: d, w: endpoints.NewWatch(hold)}
	r.mScrubbed = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ctscrub_remote_backends_scrubbed_total",
		Help: "Backend addresses that left every EndpointSlice whose entries on this node were deleted (outcome: complete, failed).",
	}, []string{"outcome"})
	r.mDeleted = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ctscrub_remote_backend_entries_deleted_total",
		Help: "CT entries of this node's pods towards backends that left the cluster, deleted.",
	}, []string{"backend"})
	r.mLatency = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "ctscrub_remote_backend_scrub_seconds",
		Help:    "From the EndpointSlice change that took an address out of its last slice (as the watch received it) to its entries on this node gone; includes the hold.",
		Buckets: []float64{0.5, 1, 1.1, 1.25, 1.5, 2, 3, 5, 10, 30},
	})
	r.mSkipped = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "ctscrub_remote_backends_skipped_total",
		Help: "Addresses the watch found gone but left alone (why: local_pod, a pod of this node holds it; back, a slice names it again).",
	}, []string{"why"})
	r.mSynced = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "ctscrub_remote_backend_watch_synced",
		Help: "1 once the EndpointSlice watch has listed every slice.",
	}, func() float64 {
		if r.w.Synced() {
			return 1
		}
		return 0
	})
	for _, o := range []string{"complete", "failed"} {
		r.mScrubbed.WithLabelValues(o)
	}
	for _, w := range []string{"local_pod", "back"} {
		r.mSkipped.WithLabelValues(w)
	}
	for _, b := range d.backends {
		if p, ok := b.(peerScrubber); ok {
			r.mDeleted.WithLabelValues(p.Name())
		}
	}
	for _, c := range []prometheus.Collector{r.mScrubbed, r.mDeleted, r.mLatency, r.mSkipped, r.mSynced} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return r, nil
}

// run is the daemon task: the informer, then the action for each address.
func (r *remoteBackends) run(ctx context.Context) error {
	var cfg *rest.Config
	var err error
	if p := r.d.cfg.RemoteBackends.Kubeconfig; p != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", p)
	} else {
		cfg, err = rest.InClusterConfig()
	}
	if err != nil {
		return fmt.Errorf("remote_backends: reach the API server: %w (in a pod: the chart's ServiceAccount; outside: remote_backends.kubeconfig)", err)
	}
	cfg.UserAgent = "ctscrub-scrubd/" + r.d.version
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return fmt.Errorf("remote_backends: %w", err)
	}
	r.d.log.Info("remote-backend watch: listing EndpointSlices", "hold", r.d.cfg.RemoteBackends.Hold.Duration)
	return r.w.Run(ctx, cs, r.act)
}

// act deletes the entries this node's pods keep towards g.Addr on every
// backend that can, unless a pod of this node holds the address (its own
// DEL and ADD scrubs cover it: the address may already be a new local
// pod's) or a slice names it again.
func (r *remoteBackends) act(ctx context.Context, g endpoints.Gone) {
	if r.d.pods.owner(g.Addr) != nil || r.d.ix.Held(g.Addr) {
		r.mSkipped.WithLabelValues("local_pod").Inc()
		return
	}
	if r.w.Present(g.Addr) {
		r.mSkipped.WithLabelValues("back").Inc()
		return
	}
	sc := api.RemoteBackendScrub{Addr: g.Addr, Service: g.Service, Since: g.Since}
	var errs []error
	for _, b := range r.d.backends {
		p, ok := b.(peerScrubber)
		if !ok {
			continue
		}
		res, err := p.ScrubPeer(ctx, g.Addr)
		sc.Deleted += res.Total
		r.mDeleted.WithLabelValues(p.Name()).Add(float64(res.Total))
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", p.Name(), err))
		}
	}
	sc.Done = time.Now()
	sc.Seconds = sc.Done.Sub(g.Since).Seconds()
	r.entries.Add(uint64(sc.Deleted))
	if err := errors.Join(errs...); err != nil {
		sc.Error = err.Error()
		r.mScrubbed.WithLabelValues("failed").Inc()
		r.d.log.Warn("remote backend: deleting its entries on this node failed", "addr", g.Addr, "service", g.Service, "err", err)
	} else {
		r.backends.Add(1)
		r.mScrubbed.WithLabelValues("complete").Inc()
		r.mLatency.Observe(sc.Seconds)
		r.d.log.Info("remote backend left the cluster: its entries on this node deleted", "addr", g.Addr, "service", g.Service, "entries", sc.Deleted, "seconds", sc.Seconds)
	}
	r.last.Store(&sc)
}

// status is `scrubd status`'s remote_backends.
func (r *remoteBackends) status() *api.RemoteBackendsStatus {
	st := r.w.Status()
	return &api.RemoteBackendsStatus{
		Synced: st.Synced, Events: st.Events, Slices: st.Slices, Addresses: st.Addrs, Waiting: st.Waiting,
		Scrubbed: r.backends.Load(), EntriesDeleted: r.entries.Load(), Last: r.last.Load(),
	}
}
