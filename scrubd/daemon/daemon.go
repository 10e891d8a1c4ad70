// Package daemon is scrubd: the node daemon that serves scrubs of pod IPs over
// an HTTP/JSON API on a unix socket, keeps the IP-to-CT-key index fed by the
// recorder, and measures every scrub.
//
// Why HTTP/JSON and not gRPC: the standard library serves and calls it (no
// generated code, a small plugin binary that starts fast on every CNI call),
// operators can poke it with `curl --unix-socket`, the caller's deadline is one
// header, and net/http already cancels a request's context when its caller
// disconnects.
package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ctscrub/ctscrub/internal/netnsid"
	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/bootstrap"
	"github.com/ctscrub/ctscrub/scrubd/expiry"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/owner"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// Recorder is the kernel side of the index (scrubd/recorder.Recorder): it
// records the CT keys of each new flow on attached pod interfaces.
type Recorder interface {
	Attach(netnsPath, ifname string) (ifindex int, err error)
	// AttachSteps is Attach reporting each of its steps to mark.
	AttachSteps(netnsPath, ifname string, mark func(step string)) (ifindex int, err error)
	Detach(netnsPath, ifname string) error
	Run(ctx context.Context, ix *index.Index) error
	Lost() uint64
	Close() error
}

// StatsSource reports a backend's CT tables: entries and capacity.
type StatsSource interface {
	CTStats(ctx context.Context) ([]api.MapStats, error)
}

// IndexFigures are one backend's index figures for metrics and status.
type IndexFigures struct {
	Keys, IncompleteIPs int64
	Lost                uint64
}

// IndexSource reports the index of one backend (the Cilium backend's is the
// daemon's Index fed by the recorder; nf_conntrack keeps its own).
type IndexSource struct {
	Backend string
	Figures func() IndexFigures
}

// Task is work the daemon runs beside the API for its whole life (the expiry
// pass, for one): started by Run, its context cancelled on shutdown.
type Task struct {
	Name string
	Run  func(ctx context.Context) error
}

// Options builds a Daemon. Index, Config and at least one backend are needed;
// the recorder is optional (a node without Cilium indexes through its
// nf_conntrack backend's own means, or not at all).
type Options struct {
	Config   Config
	Index    *index.Index
	Backends []scrub.Backend
	Stats    []StatsSource
	Recorder Recorder
	Indexes  []IndexSource
	Tasks    []Task
	Logger   *slog.Logger
	Version  string
	// Registry serves /metrics; parts built before the daemon (the expiry
	// pass) register on it. New makes one when nil.
	Registry *prometheus.Registry
	// CTEntries is ctscrub_ct_entries{backend,map,state}, shared with the
	// expiry pass (which writes state live/expired for the maps it walks);
	// the daemon writes state="all" for the tables of SplitBy-less backends.
	CTEntries *prometheus.GaugeVec
	// EntriesSplit names the backends whose entries the expiry pass splits
	// into live/expired: the daemon does not write state="all" for them.
	EntriesSplit []string
	// Expiry is the Cilium backend's expiry pass: the continuous audit runs
	// in it and the on-demand audit reads through it (audit.go).
	Expiry *expiry.Runner
}

// Daemon is scrubd.
type Daemon struct {
	cfg      Config
	cidrs    []netip.Prefix
	ix       *index.Index
	backends []scrub.Backend
	stats    []StatsSource
	rec      Recorder
	indexes  []IndexSource
	tasks    []Task

	svcReloads prometheus.Counter // nil without a recorder that reloads

	ctEntries    *prometheus.GaugeVec
	entriesSplit map[string]bool
	log          *slog.Logger
	version      string
	m            *metrics
	pods         *pods
	flights      flights
	slots        chan struct{} // MaxInFlight running flights
	admitted     atomic.Int64  // requests admitted, running or queued
	ready        atomic.Bool
	exp          *expiry.Runner // nil without the Cilium backend
	own          *owner.Rule    // the ownership rule: which IPs the index may vouch for (ownership.go)
	late         sync.WaitGroup // late DEL scrubs waiting or running (late.go)
	chained      prometheus.Gauge
	started      time.Time
	metricsLn    atomic.Pointer[net.Addr] // where /metrics listens (port 0 resolved)

	hostMu    sync.Mutex
	hostAddrs map[netip.Addr]bool
	hostAt    time.Time

	ownNetns netnsid.ID // scrubd's own network namespace (netns.go); zero if unknown

	// remote is the remote-backend watch (remote.go); nil when off.
	remote *remoteBackends

	// boot follows the bootstrap pass over the CT maps (scrubd/bootstrap):
	// its metrics and `scrubd status`.
	boot bootstrap.Progress
	// bs is the bootstrap's state: the pods found at start, the rule's
	// judgement at the pass's end (boot.go).
	bs bootState

	// workCtx is the parent of every request and flight: cancelled when the
	// shutdown grace runs out.
	workCtx    context.Context
	cancelWork context.CancelFunc
}

// New builds a daemon; Run serves it.
func New(opts Options) (*Daemon, error) {
	cidrs, err := opts.Config.Validate()
	if err != nil {
		return nil, err
	}
	if opts.Index == nil {
		return nil, errors.New("daemon: no index")
	}
	if len(opts.Backends) == 0 {
		return nil, errors.New("daemon: no backend: neither Cilium's CT maps nor nf_conntrack are usable on this node (check --ct-root and --backends)")
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.NewJSONHandler(os.Stderr, nil))
	}
	d := &Daemon{
		cfg:      opts.Config,
		cidrs:    cidrs,
		ix:       opts.Index,
		backends: opts.Backends,
		stats:    opts.Stats,
		rec:      opts.Recorder,
		log:      opts.Logger,
		version:  opts.Version,
		pods:     newPods(opts.Config.StateFile, opts.Config.StoppedTTL.Duration),
		own:      owner.New(),
		bs:       bootState{poke: make(chan struct{}, 1)},
		flights:  flights{m: make(map[flightKey]*flight)},
		slots:    make(chan struct{}, opts.Config.MaxInFlight),
		indexes:  opts.Indexes,
		tasks:    opts.Tasks,

		ctEntries:    opts.CTEntries,
		entriesSplit: map[string]bool{},
	}
	for _, b := range opts.EntriesSplit {
		d.entriesSplit[b] = true
	}
	if id, err := netnsid.Self(); err == nil {
		d.ownNetns = id
	} else {
		opts.Logger.Warn("cannot read scrubd's own network namespace: an index start naming it is not refused", "err", err)
	}
	if d.ctEntries == nil {
		d.ctEntries = prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "ctscrub_ct_entries",
			Help: "Entries in each CT table (state: all, or live/expired from the expiry pass).",
		}, []string{"backend", "map", "state"})
	}
	for _, b := range opts.Backends {
		if b.Name() == "cilium" {
			// The Cilium backend's index is the daemon's, fed by the recorder.
			d.indexes = append([]IndexSource{{Backend: "cilium", Figures: d.ciliumIndexFigures}}, d.indexes...)
		}
	}
	d.workCtx, d.cancelWork = context.WithCancel(context.Background())
	d.m = newMetrics(d, opts.Registry)
	if d.cfg.RemoteBackends.Enabled {
		if d.remote, err = newRemoteBackends(d, d.m.reg); err != nil {
			return nil, fmt.Errorf("remote backends: %w", err)
		}
		d.tasks = append(d.tasks, Task{Name: "remote-backends", Run: d.remote.run})
	}
	if err := d.boot.Register(d.m.reg); err != nil {
		return nil, fmt.Errorf("register the bootstrap pass's metrics: %w", err)
	}
	if err := d.enableAudit(opts.Expiry); err != nil {
		return nil, err
	}
	if err := d.enableConflistWatch(); err != nil {
		return nil, err
	}
	if err := d.enableServiceMapsWatch(); err != nil {
		return nil, err
	}
	return d, nil
}

func (d *Daemon) ciliumIndexFigures() IndexFigures {
	f := IndexFigures{Keys: d.ix.Keys(), IncompleteIPs: d.ix.IncompleteIPs()}
	if d.rec != nil {
		f.Lost = d.rec.Lost()
	}
	return f
}

// MetricsAddr is the address /metrics listens on, once Run serves ("" when
// off or not yet listening).
func (d *Daemon) MetricsAddr() string {
	if a := d.metricsLn.Load(); a != nil {
		return (*a).String()
	}
	return ""
}

// Backends are the daemon's backends, in the order results are reported.
func (d *Daemon) Backends() []scrub.Backend { return d.backends }

// Registerer is where other parts of scrubd (the expiry pass, extra backends)
// register their metrics; they are served on /metrics with the daemon's own.
func (d *Daemon) Registerer() prometheus.Registerer { return d.m.reg }

// Gatherer serves the registry (tests read metrics from it).
func (d *Daemon) Gatherer() prometheus.Gatherer { return d.m.reg }

// Index is the daemon's IP-to-CT-key index.
func (d *Daemon) Index() *index.Index { return d.ix }

// AddTask adds work to run beside the API; call it before Run.
func (d *Daemon) AddTask(t Task) { d.tasks = append(d.tasks, t) }

// Logger is the daemon's structured logger.
func (d *Daemon) Logger() *slog.Logger { return d.log }

// Run serves the API until ctx ends (SIGTERM), then shuts down: it stops
// accepting, lets in-flight scrubs finish within ShutdownGrace, cancels the
// rest, and leaves every pinned object in place.
func (d *Daemon) Run(ctx context.Context) error {
	d.started = time.Now()
	// The socket first: a second scrubd on the same node fails here, before
	// it touches the state file, the snapshot or the recorder's links.
	apiLn, err := listenAPI(d.cfg.Socket)
	if err != nil {
		return err
	}
	var delegateLn net.Listener
	if d.cfg.DelegateSocket != "" {
		if delegateLn, err = listenUnix(d.cfg.DelegateSocket); err != nil {
			apiLn.discard()
			return fmt.Errorf("delegate socket: %w", err)
		}
	}
	if err := d.restore(); err != nil {
		apiLn.discard()
		if delegateLn != nil {
			delegateLn.Close()
		}
		return err
	}
	// The API: each request served on the thread that accepted it
	// (direct.go); at most one goroutine per admitted request and the
	// spares wait in accept, the rest in the socket's backlog.
	apiSrv := newDirectServer(d.rootOnly(d.apiHandler()), func() context.Context { return d.workCtx },
		directConnContext, d.log, d.cfg.QueueLimit+directSpares)

	// The delegate socket: its one path, for root only, as the API.
	var delegateSrv *http.Server
	if delegateLn != nil {
		delegateSrv = &http.Server{
			Handler:           d.rootOnly(d.delegateHandler()),
			BaseContext:       func(net.Listener) context.Context { return d.workCtx },
			ConnContext:       func(ctx context.Context, c net.Conn) context.Context { return peerCredContext(acceptContext(ctx), c) },
			ReadHeaderTimeout: 10 * time.Second,
		}
	}

	var metricsSrv *http.Server
	if d.cfg.MetricsAddr != "" && d.cfg.MetricsAddr != "off" {
		mln, err := net.Listen("tcp", d.cfg.MetricsAddr)
		if err != nil {
			apiLn.discard()
			if delegateLn != nil {
				delegateLn.Close()
			}
			return fmt.Errorf("metrics address %s: %w (set --metrics-addr, or off)", d.cfg.MetricsAddr, err)
		}
		addr := mln.Addr()
		d.metricsLn.Store(&addr)
		metricsSrv = &http.Server{Handler: d.metricsHandler(), ReadHeaderTimeout: 10 * time.Second}
		go metricsSrv.Serve(mln)
	}

	var bg sync.WaitGroup
	bgCtx, stopBG := context.WithCancel(context.Background())
	defer stopBG()
	if d.rec != nil {
		bg.Go(func() { d.runRecorder(bgCtx) })
	}
	if d.bs.rule != nil {
		// The pass waits for the reader (index.Sync) at its end.
		bg.Go(func() { d.runBootstrap(bgCtx) })
	}
	if d.bootOn() && !d.bs.noSightLoop {
		bg.Go(func() { d.sightLoop(bgCtx) })
	}
	for _, t := range d.tasks {
		bg.Go(func() {
			if err := t.Run(bgCtx); err != nil && bgCtx.Err() == nil {
				d.log.Error("task stopped", "task", t.Name, "err", err)
			}
		})
	}
	bg.Go(func() { d.statsLoop(bgCtx) })

	serveErr := make(chan error, 1)
	go func() { serveErr <- apiSrv.Serve(apiLn) }()
	// Stopped before the API's shutdown, which removes the socket.
	watchCtx, stopWatch := context.WithCancel(context.Background())
	watchDone := make(chan struct{})
	go func() {
		d.watchSocket(watchCtx, d.cfg.Socket, func() (func() error, error) {
			ln, err := listenAPI(d.cfg.Socket)
			if err != nil {
				return nil, err
			}
			return func() error { return apiSrv.Serve(ln) }, nil
		})
		close(watchDone)
	}()
	delegateDone := make(chan struct{})
	if delegateSrv != nil {
		go func() {
			if err := delegateSrv.Serve(delegateLn); err != nil && !errors.Is(err, http.ErrServerClosed) {
				d.log.Error("serve delegate API", "socket", d.cfg.DelegateSocket, "err", err)
			}
		}()
		go func() {
			d.watchSocket(watchCtx, d.cfg.DelegateSocket, func() (func() error, error) {
				ln, err := listenUnix(d.cfg.DelegateSocket)
				if err != nil {
					return nil, err
				}
				return func() error { return delegateSrv.Serve(ln) }, nil
			})
			close(delegateDone)
		}()
	} else {
		close(delegateDone)
	}
	d.ready.Store(true)
	d.log.Info("scrubd serving", "socket", d.cfg.Socket, "delegate_socket", d.cfg.DelegateSocket, "metrics", d.cfg.MetricsAddr, "backends", d.backendNames(),
		"pod_cidrs", d.cidrs, "recorder", d.rec != nil, "indexed_pods", d.pods.activeCount(), "version", d.version)

	var runErr error
	select {
	case <-ctx.Done():
	case runErr = <-serveErr:
		runErr = fmt.Errorf("serve API: %w", runErr)
	}
	d.ready.Store(false)
	stopWatch()
	<-watchDone
	<-delegateDone
	if delegateSrv != nil {
		// The agent falls back to its own walk at once: a delegate request
		// is not worth the shutdown grace.
		delegateSrv.Close()
	}

	// Stop accepting; in-flight scrubs get ShutdownGrace, then are cancelled
	// (they stop within the backend's bound and answer "cancelled").
	d.log.Info("scrubd stopping", "in_flight", d.admitted.Load(), "grace", d.cfg.ShutdownGrace.Duration.String())
	graceCtx, cancelGrace := context.WithTimeout(context.Background(), d.cfg.ShutdownGrace.Duration)
	if err := apiSrv.Shutdown(graceCtx); err != nil {
		d.log.Warn("shutdown grace over: cancelling in-flight scrubs", "in_flight", d.admitted.Load())
		d.cancelWork()
		finalCtx, cancelFinal := context.WithTimeout(context.Background(), 2*time.Second)
		if apiSrv.Shutdown(finalCtx) != nil {
			apiSrv.Close()
		}
		cancelFinal()
	}
	cancelGrace()
	d.cancelWork()
	if metricsSrv != nil {
		metricsSrv.Close()
	}
	stopBG()
	bg.Wait()
	d.late.Wait() // cancelled with the work: each gave its keys back
	d.snapshotAtStop()
	return runErr
}

// Recorder restart backoff: the first retry after recorderRetryMin, doubling
// to recorderRetryMax; a run that lasted recorderRetryMax starts over.
const (
	recorderRetryMin = 500 * time.Millisecond
	recorderRetryMax = 30 * time.Second
)

// runRecorder runs the recorder's reader until ctx ends, restarting it when
// it stops with an error. While it is down the index has no hooks, so
// Index.Sync fails and every scrub sweeps (fails closed) and /readyz says
// so; the kernel side keeps recording into the pinned ring buffer, and the
// records made meanwhile are applied when it runs again (losses are
// counted per IP and mark those IPs).
func (d *Daemon) runRecorder(ctx context.Context) {
	wait := recorderRetryMin
	for {
		began := time.Now()
		err := d.rec.Run(ctx, d.ix)
		if ctx.Err() != nil {
			return
		}
		if err == nil {
			err = errors.New("returned without an error before shutdown")
		}
		d.m.recorderRestarts.Inc()
		if time.Since(began) >= recorderRetryMax {
			wait = recorderRetryMin
		}
		d.log.Error("recorder stopped: no IP's index is trusted, every scrub sweeps until it runs again",
			"err", err, "restart_in", wait.String())
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		wait = min(2*wait, recorderRetryMax)
	}
}

// recorderUp reports whether the recorder feeds the index now (true when
// the daemon runs without one).
func (d *Daemon) recorderUp() bool { return d.rec == nil || d.ix.Fed() }

// isReady is /readyz's answer: serving, and the recorder running.
func (d *Daemon) isReady() bool { return d.ready.Load() && d.recorderUp() }

// Close releases the backends and the recorder. Pins stay in place.
func (d *Daemon) Close() error {
	var errs []error
	for _, b := range d.backends {
		errs = append(errs, b.Close())
	}
	if d.rec != nil {
		errs = append(errs, d.rec.Close())
	}
	return errors.Join(errs...)
}

func (d *Daemon) backendNames() []string {
	out := make([]string, len(d.backends))
	for i, b := range d.backends {
		out[i] = b.Name()
	}
	return out
}

// restore reads the attachments of an earlier run and re-attaches the
// recorder to them. After a clean stop the index comes back from its
// snapshot (see snapshot.go); otherwise the records the dead process had read
// are gone, so every attached IP is marked incomplete and its next scrub
// sweeps.
func (d *Daemon) restore() error {
	if err := d.pods.load(); err != nil {
		return err
	}
	restored, err := d.loadSnapshot()
	if err != nil {
		return err
	}
	if restored {
		d.log.Info("index restored from the snapshot of a clean stop", "keys", d.ix.Keys(), "incomplete_ips", d.ix.IncompleteIPs())
	}
	// The restored pods hold their IPs (before any mark: a mark drops a
	// slot no pod holds); a restored slot no pod holds is kept only when
	// complete (index.Release).
	active, _ := d.pods.list()
	for _, pod := range active {
		d.own.Start(pod.Attachment, pod.IPs)
		for _, ip := range pod.IPs {
			d.ix.Hold(ip)
		}
	}
	for _, pod := range active {
		if !restored {
			for _, ip := range pod.IPs {
				d.ix.MarkIncomplete(ip, index.ReasonRestart)
			}
		}
		if pod.Netns != "" && d.rec != nil {
			// Re-attach: a no-op for links that survived in the pin dir, a
			// move to this binary's programs after an upgrade, and a fresh
			// attach when the pins were lost.
			if _, err := os.Stat(pod.Netns); err == nil {
				ifindex, err := d.rec.Attach(pod.Netns, pod.IfName)
				if err != nil {
					// Fail closed: not recording the pod (or recording
					// behind cached flows of an earlier holder of its
					// IPs), the index misses flows; its IPs sweep.
					for _, ip := range pod.IPs {
						if errors.Is(err, recorder.ErrForget) && !errors.Is(err, recorder.ErrHostSide) {
							d.ix.MarkIncomplete(ip, reattachFailed(err))
						} else {
							// Nothing records the pod: no sweep may
							// make its IPs complete while it lives.
							d.ix.Unrecorded(ip, reattachFailed(err))
						}
					}
					d.log.Error("re-attach recorder after restart: the pod's IPs are marked incomplete", "container_id", pod.ContainerID, "ifname", pod.IfName, "netns", pod.Netns, "ips", pod.IPs, "err", err)
				}
				if ifindex != 0 && ifindex != pod.Ifindex {
					pod.Ifindex = ifindex
					if _, err := d.startPod(pod); err != nil {
						return err
					}
				}
			}
		}
		if pod.Netns != "" {
			if _, err := os.Stat(pod.Netns); errors.Is(err, os.ErrNotExist) {
				// The pod went away while scrubd was down: drop its link.
				if d.rec != nil {
					if err := d.rec.Detach(pod.Netns, pod.IfName); err != nil {
						d.log.Warn("detach recorder of a pod gone while scrubd was down", "container_id", pod.ContainerID, "ifname", pod.IfName, "err", err)
					}
				}
				if _, _, err := d.stopPod(pod.Attachment); err != nil {
					return err
				}
			}
		}
	}
	if d.bootOn() {
		d.findAtStart() // boot.go
	}
	for _, ip := range d.ix.IPs() {
		if d.holderOf(ip) == nil { // incl. pods gone while scrubd was down
			d.ix.Release(ip)
		}
	}
	if len(active) > 0 && !restored {
		d.log.Info("restored attachments; their IPs are marked incomplete until a sweep", "pods", len(active))
	}
	return nil
}

// listenUnix creates the API socket 0600 in a 0700 directory. A stale socket
// left by a killed daemon is replaced; a live one is an error.
func listenUnix(path string) (net.Listener, error) {
	if err := prepareSocket(path); err != nil {
		return nil, err
	}
	// The umask makes the socket 0600 from its first instant; Chmod repeats it
	// for file systems that ignore the umask on sockets.
	old := syscall.Umask(0o177)
	ln, err := net.Listen("unix", path)
	syscall.Umask(old)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("chmod socket %s: %w", path, err)
	}
	return ln, nil
}

// listenAPI is listenUnix for the direct server (direct.go).
func listenAPI(path string) (*directListener, error) {
	if err := prepareSocket(path); err != nil {
		return nil, err
	}
	l, err := listenDirect(path)
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(path, 0o600); err != nil {
		l.discard()
		return nil, fmt.Errorf("chmod socket %s: %w", path, err)
	}
	return l, nil
}

// prepareSocket makes path's directory and removes a stale socket there;
// it fails while another scrubd serves it.
func prepareSocket(path string) error {
	dir := filepath.Dir(path)
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return fmt.Errorf("socket directory %s: %w", dir, err)
		}
	}
	if _, err := os.Lstat(path); err == nil {
		if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
			c.Close()
			return fmt.Errorf("socket %s: another scrubd is serving it (stop it first, or set --socket)", path)
		}
		if err := os.Remove(path); err != nil {
			return fmt.Errorf("remove stale socket %s: %w", path, err)
		}
	}
	return nil
}

// statsLoop refreshes ctscrub_ct_entries and ctscrub_ct_max_entries.
func (d *Daemon) statsLoop(ctx context.Context) {
	every := d.cfg.StatsInterval.Duration
	if every <= 0 || len(d.stats) == 0 {
		return
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		d.refreshStats(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (d *Daemon) refreshStats(ctx context.Context) []api.MapStats {
	var all []api.MapStats
	for _, s := range d.stats {
		ms, err := s.CTStats(ctx)
		if err != nil {
			d.log.Warn("read CT table occupancy", "err", err)
			if len(ms) > 0 {
				d.m.statsError.WithLabelValues(ms[0].Backend).Inc()
			} else {
				d.m.statsError.WithLabelValues("unknown").Inc()
			}
		}
		for _, st := range ms {
			if st.Entries >= 0 && !d.entriesSplit[st.Backend] {
				d.m.ctEntries.WithLabelValues(st.Backend, st.Map, "all").Set(float64(st.Entries))
			}
			d.m.ctMax.WithLabelValues(st.Backend, st.Map).Set(float64(st.MaxEntries))
		}
		all = append(all, ms...)
	}
	return all
}

// BootstrapProgress is where the bootstrap pass reports (bootstrap.Options
// Progress): /metrics and `scrubd status` show it.
func (d *Daemon) BootstrapProgress() *bootstrap.Progress { return &d.boot }
