package daemon

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ctscrub/ctscrub/scrubd/cilium"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/expiry"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
)

// Open builds the daemon a node needs from cfg: the index, the backends the
// config asks for (or finds, with backends: auto), and the recorder.
func Open(cfg Config, log *slog.Logger, version string) (*Daemon, error) {
	cidrs, err := cfg.Validate()
	if err != nil {
		return nil, err
	}
	want, _ := ParseBackends(cfg.Backends)
	auto := want == nil
	ix := index.New(index.Config{PodCIDRs: cidrs})
	if cfg.RemoteBackends.Enabled {
		ix.EnablePeers() // before any key: the snapshot, the pass, the recorder
	}
	opts := Options{Config: cfg, Index: ix, Logger: log, Version: version}
	var closers []func() error
	fail := func(err error) (*Daemon, error) {
		for _, c := range slices.Backward(closers) {
			c()
		}
		return nil, err
	}

	opts.Registry = prometheus.NewRegistry()
	opts.CTEntries = expiry.NewEntriesGauge()
	if auto || slices.Contains(want, "cilium") {
		maps, err := ctmap.Open(cfg.CTRoot)
		if auto && errors.Is(err, os.ErrNotExist) {
			maps, err = waitCiliumMaps(cfg, log, err)
		}
		switch {
		case err == nil:
			closers = append(closers, maps.Close)
			c, err := cilium.New(maps, ix, cilium.Options{})
			if err != nil {
				return fail(fmt.Errorf("cilium backend: load the sweep programs: %w", err))
			}
			closers = append(closers, c.Close)
			c.Features().SetNodeConfig(cfg.CiliumNodeConfig)
			if err := c.DeleteError(); err != nil {
				log.Warn("cilium backend: the kernel refused the delete program; index scrubs delete with BPF_MAP_DELETE_BATCH, one syscall per absent key", "err", err)
			}
			if err := c.CountError(); err != nil {
				log.Warn("cilium backend: no kernel entry counter; ctscrub_ct_entries counts by a walk of each map", "err", err)
			}
			var fill func(ctmap.Kind) (int64, error)
			if c.CountIsCheap() {
				fill = c.Count // the kernel's element counter: microseconds
			} else {
				log.Warn("recorder: no kernel entry counter, so the CT maps' fill is not watched: flows to a service without backends mark their pods incomplete")
			}
			rec, err := recorder.Load(recorder.Options{PinDir: cfg.PinDir, CTRoot: cfg.CTRoot, Log: log, CT: maps, RingBytes: cfg.RingBytes, NodeNetns: cfg.NodeNetns,
				NodeConfig: cfg.CiliumNodeConfig, CTFill: fill,
				L7LB: func() bool { return c.Features().NodeConfig().L7LB }})
			if err != nil {
				return fail(err)
			}
			closers = append(closers, rec.Close)
			exp, err := openExpiry(cfg, maps, opts, log)
			if err != nil {
				return fail(err)
			}
			closers = append(closers, exp.Close)
			if exp.Config().Mode != expiry.ModeOff {
				opts.Tasks = append(opts.Tasks, Task{Name: "expiry", Run: exp.Run})
				opts.EntriesSplit = append(opts.EntriesSplit, "cilium")
			}
			watch, err := newCTWatch(c, exp, rec, ix, log, opts.Registry)
			if err != nil {
				return fail(err)
			}
			opts.Tasks = append(opts.Tasks, Task{Name: "ct-maps-watch", Run: watch.run})
			if err := registerFeatureMarks(opts.Registry, c.Features()); err != nil {
				return fail(err)
			}
			opts.Backends = append(opts.Backends, ciliumBackend{c, watch, exp})
			opts.Expiry = exp
			opts.Stats = append(opts.Stats, CiliumStats(maps, c))
			opts.Recorder = rec
			closers = closers[:0] // owned by the backend and the recorder now
		case auto && errors.Is(err, os.ErrNotExist):
			log.Info("Cilium's CT maps not found: cilium backend off", "ct_root", cfg.CTRoot)
		default:
			return fail(fmt.Errorf("cilium backend: %w", err))
		}
	}
	if auto || slices.Contains(want, "nfct") {
		n, err := OpenNFCT(cidrs, cfg.NFCTFallback, auto, len(opts.Backends) > 0, cfg.RemoteBackends.Enabled, log)
		if err != nil {
			for _, b := range opts.Backends {
				b.Close()
			}
			if opts.Recorder != nil {
				opts.Recorder.Close()
			}
			return nil, err
		}
		if n != nil {
			opts.Backends = append(opts.Backends, n)
			opts.Stats = append(opts.Stats, NFCTStats(n))
			opts.Indexes = append(opts.Indexes, IndexSource{Backend: n.Name(), Figures: func() IndexFigures {
				st := n.Stats()
				return IndexFigures{Keys: int64(st.Keys), IncompleteIPs: int64(st.IncompleteIPs), Lost: st.Lost}
			}})
		}
	}
	d, err := New(opts)
	if err != nil {
		for _, b := range opts.Backends {
			b.Close()
		}
		if opts.Recorder != nil {
			opts.Recorder.Close()
		}
		return nil, err
	}
	return d, nil
}

// ciliumMapsWait bounds how long scrubd waits, at start with backends:
// auto, for Cilium's agent to create its CT maps when the node's CNI config
// runs cilium-cni.
var ciliumMapsWait = 2 * time.Minute

// waitCiliumMaps: with backends auto and no CT maps, scrubd would run
// with nf_conntrack alone for the rest of its life. On a node whose CNI
// config runs cilium-cni that is wrong: the maps are missing because
// Cilium's agent has not created them yet (a node restart empties bpffs, and
// the kubelet may start scrubd before the agent). So scrubd waits for them,
// and fails, for the kubelet to restart it, rather than start without
// Cilium's backend. Without cilium-cni in the config it returns the
// not-found error at once (an nf_conntrack node).
func waitCiliumMaps(cfg Config, log *slog.Logger, notFound error) (*ctmap.Maps, error) {
	file, ok := conflistRuns(cfg.CNIConfDir, "cilium-cni")
	if !ok {
		return nil, notFound
	}
	log.Info("Cilium's CT maps not found though the node's CNI config runs cilium-cni: waiting for Cilium's agent to create them",
		"ct_root", cfg.CTRoot, "cni_conf", file, "wait", ciliumMapsWait.String())
	deadline := time.Now().Add(ciliumMapsWait)
	for {
		maps, err := ctmap.Open(cfg.CTRoot)
		if err == nil || !errors.Is(err, os.ErrNotExist) {
			if err == nil {
				log.Info("Cilium's CT maps found", "ct_root", cfg.CTRoot)
			}
			return maps, err
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("Cilium's CT maps not found in %s after %s, though %s runs cilium-cni: is Cilium's agent running on this node? (scrubd exits rather than run without Cilium's backend; set backends: nfct if this node has no Cilium)",
				cfg.CTRoot, ciliumMapsWait, file)
		}
		time.Sleep(time.Second)
	}
}

// openExpiry builds the expiry pass; its metrics go on the daemon's registry
// and it writes the live/expired split of ctscrub_ct_entries.
func openExpiry(cfg Config, maps *ctmap.Maps, opts Options, log *slog.Logger) (*expiry.Runner, error) {
	ecfg := expiry.DefaultConfig()
	if cfg.Expiry.Mode != "" {
		m, err := expiry.ParseMode(cfg.Expiry.Mode)
		if err != nil {
			return nil, err
		}
		ecfg.Mode = m
	}
	if cfg.Expiry.Clock != "" {
		c, err := expiry.ParseClock(cfg.Expiry.Clock)
		if err != nil {
			return nil, err
		}
		ecfg.Clock = c
	}
	if cfg.Expiry.Interval.Duration != 0 {
		ecfg.Interval = cfg.Expiry.Interval.Duration
	}
	if cfg.Expiry.MaxLifetime.Duration != 0 {
		ecfg.MaxLifetime = cfg.Expiry.MaxLifetime.Duration
	}
	r, err := expiry.New(maps, ecfg, expiry.Options{Registerer: opts.Registry, Entries: opts.CTEntries, Logger: log})
	if err != nil {
		return nil, fmt.Errorf("expiry pass: %w", err)
	}
	return r, nil
}

// registerFeatureMarks exports, per Cilium feature that keeps entries out of
// the index's reach, how many times a scrub marked an IP incomplete for it.
func registerFeatureMarks(reg prometheus.Registerer, f *cilium.Features) error {
	for _, r := range cilium.FeatureReasons {
		c := prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "ctscrub_index_feature_marks_total",
			Help:        HelpFeatureMarks,
			ConstLabels: prometheus.Labels{"backend": "cilium", "reason": r.Label},
		}, func() float64 { return float64(f.Marks(r.Label)) })
		if err := reg.Register(c); err != nil {
			return fmt.Errorf("feature marks metric: %w", err)
		}
	}
	for _, u := range f.UncoveredFeatures() {
		label := u.Label
		g := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name:        "ctscrub_uncovered_feature",
			Help:        HelpUncoveredFeature,
			ConstLabels: prometheus.Labels{"backend": "cilium", "feature": label},
		}, func() float64 {
			for _, u := range f.UncoveredFeatures() {
				if u.Label == label && u.On {
					return 1
				}
			}
			return 0
		})
		if err := reg.Register(g); err != nil {
			return fmt.Errorf("uncovered feature metric: %w", err)
		}
	}
	return nil
}

// HelpUncoveredFeature is the help of ctscrub_uncovered_feature.
const HelpUncoveredFeature = "1 while a Cilium feature whose CT entries the index does not cover is on (l7_proxy: an endpoint has a proxy port; host_firewall; nodeport_backends: NodePort on, its routable services' backends are marked; nodeport_dsr: DSR on, every IP is marked; endpoint_ct_maps, per_cluster_ct_maps). The IPs it reaches are marked incomplete (their scrubs sweep) and the delegate answers incomplete for them."

// HelpFeatureMarks is the help of ctscrub_index_feature_marks_total.
const HelpFeatureMarks = "IPs a scrub marked incomplete because a Cilium feature keeps their CT entries out of the index's reach, per reason (l7_proxy: the endpoint's traffic goes to the L7 proxy; endpoint_ct_maps, per_cluster_ct_maps: CT maps other than the four global ones are in use); they sweep while it lasts."
