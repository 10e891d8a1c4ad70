// Command remotewatch (make bench-remote-watch) measures what scrubd's
// EndpointSlice watch (remote_backends, docs/remote.md) costs a node, beside
// kube-proxy's own watch of the same slices, on a one-node kind cluster
// (bench/remotewatch/run.sh makes it) with SERVICES synthetic Services of
// one slice of ENDPOINTS endpoints each, backed by no pod, and extrapolates
// to PROJ_NODES nodes.
//
// Backends are deleted at RATE a second (two writes of the slice each:
// terminating, then gone and replaced). For WINDOW s, beside kube-proxy,
// watchers in processes of their own (child.go): the daemon's code
// (scrubd/endpoints Watch.Run) on a client built as scrubd/daemon builds
// it, the same in JSON, and an informer as kube-proxy makes it (the watch
// alone, without kube-proxy's rules). From the node: kube-proxy's
// container's CPU (its cgroup: rules included) and bytes (tcp_info of its
// connection), the API server's CPU. Then FANOUT raw watch streams (FANOUT
// more nodes) are opened and closed in turns, FANOUT_CYCLES times
// FANOUT_WINDOW s each way: the API server's CPU per event per watcher is
// the difference.
//
// Then PODS synthetic pods, never scheduled, replaced at POD_RATE a second
// for POD_WINDOW s, with a cluster-wide Pod watch in a child: what a watch
// of pod deletions for direct pod-to-pod flows would cost (PODS=0: not).
//
// The last line is JSON. Environment: KUBECONFIG, NODE (the kind node's
// container), and the variables above; PROJ_NODES, PROJ_RATE (deletions a
// second cluster-wide), PROJ_ENDPOINTS, PROJ_PODS, POD_EVENTS for the
// extrapolation (extrapolate.go).
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"maps"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"slices"
	"strconv"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

const benchNS = "ctscrub-remotewatch"

type config struct {
	Services    int     `json:"services"`
	Endpoints   int     `json:"endpoints_per_slice"`
	Rate        float64 `json:"deletions_per_s"`
	Window      float64 `json:"window_s"`
	Terminating float64 `json:"terminating_s"`
	Fanout      int     `json:"fanout"`
	Pods        int     `json:"pods"`
	PodRate     float64 `json:"pod_replacements_per_s"`
	PodWindow   float64 `json:"pod_window_s"`
	Nodes       int     `json:"proj_nodes"`
	ProjRate    float64 `json:"proj_deletions_per_s"`
	ProjEPs     int     `json:"proj_endpoints"`
	ProjPods    int     `json:"proj_pods"`
	PodEvents   float64 `json:"proj_pod_events_per_life"`
	ProxyMode   string  `json:"kube_proxy_mode"`
	FanCycles   int     `json:"fanout_cycles"`
	FanWindow   float64 `json:"fanout_window_s"`
}

// writesPerDeletion: the harness's deletion is two writes of the slice
// (churn.go), so each watcher gets two events per deleted backend.
const writesPerDeletion = 2

func envNum[T int | float64](name string, def T) T {
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	v, err := strconv.ParseFloat(s, 64)
	if err != nil || v < 0 {
		log.Fatalf("%s=%q: want a non-negative number", name, s)
	}
	return T(v)
}

func loadConfig() config {
	return config{
		Services: envNum("SERVICES", 1000), Endpoints: envNum("ENDPOINTS", 100),
		Rate: envNum("RATE", 50.0), Window: envNum("WINDOW", 60.0), Terminating: envNum("TERMINATING_S", 2.0),
		Fanout: envNum("FANOUT", 30), FanCycles: envNum("FANOUT_CYCLES", 3), FanWindow: envNum("FANOUT_WINDOW", 15.0),
		Pods: envNum("PODS", 2000), PodRate: envNum("POD_RATE", 50.0), PodWindow: envNum("POD_WINDOW", 30.0),
		Nodes: envNum("PROJ_NODES", 5000), ProjRate: envNum("PROJ_RATE", 100.0), ProjEPs: envNum("PROJ_ENDPOINTS", 150000),
		ProjPods: envNum("PROJ_PODS", 150000), PodEvents: envNum("POD_EVENTS", 6.0),
		ProxyMode: os.Getenv("KUBE_PROXY_MODE"),
	}
}

// child is a watcher process (child.go) and its pipes.
type child struct {
	kind  string
	cmd   *exec.Cmd
	in    io.WriteCloser
	out   *json.Decoder
	first snapshot
}

func startChild(kind string, fanout int) (*child, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe, "-child", kind, "-fanout", strconv.Itoa(fanout))
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	return &child{kind: kind, cmd: cmd, in: in, out: json.NewDecoder(bufio.NewReader(out))}, nil
}

func (c *child) read() (snapshot, error) {
	var s snapshot
	if err := c.out.Decode(&s); err != nil {
		return s, fmt.Errorf("watcher %s: %w", c.kind, err)
	}
	if s.Err != "" {
		return s, fmt.Errorf("watcher %s: %s", c.kind, s.Err)
	}
	return s, nil
}

func (c *child) ask(cmd string) (snapshot, error) {
	if _, err := fmt.Fprintln(c.in, cmd); err != nil {
		return snapshot{}, fmt.Errorf("watcher %s: %w", c.kind, err)
	}
	return c.read()
}

func (c *child) stop() {
	fmt.Fprintln(c.in, "quit")
	c.in.Close()
	done := make(chan struct{})
	go func() { c.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		c.cmd.Process.Kill()
		<-done
	}
}

// window is the readings at a measurement window's two ends.
type window struct {
	node         [2]nodeReading
	writes       [2]int64
	kids         [2]map[string]snapshot
	seconds      float64
	loadStart    string
	loadEnd      string
	writesInside int64
}

func measure(ctx context.Context, n *node, d time.Duration, writes func() int64, kids []*child) (window, error) {
	var w window
	for i := range 2 {
		if i == 1 {
			time.Sleep(d)
		}
		w.kids[i] = map[string]snapshot{}
		for _, k := range kids {
			s, err := k.ask("snap")
			if err != nil {
				return w, err
			}
			w.kids[i][k.kind] = s
		}
		r, err := n.read(ctx)
		if err != nil {
			return w, err
		}
		w.node[i], w.writes[i] = r, writes()
	}
	w.seconds = w.node[1].at.Sub(w.node[0].at).Seconds()
	w.loadStart, w.loadEnd = w.node[0].load, w.node[1].load
	w.writesInside = w.writes[1] - w.writes[0]
	return w, nil
}

// nodeFigures is a window's figures from the node's own processes.
type nodeFigures struct {
	Seconds         float64 `json:"seconds"`
	Writes          int64   `json:"writes"`
	WritesPerS      float64 `json:"writes_per_s"`
	KubeProxyCPU    float64 `json:"kube_proxy_cpu_s"` // its container: rules included
	KubeProxyProc   float64 `json:"kube_proxy_process_cpu_s"`
	KubeProxyRX     int64   `json:"kube_proxy_rx_bytes"`
	KubeProxyTX     int64   `json:"kube_proxy_tx_bytes"`
	APIServerCPU    float64 `json:"apiserver_cpu_s"`
	EtcdCPU         float64 `json:"etcd_cpu_s"`
	ControllerCPU   float64 `json:"controller_manager_cpu_s"`
	LoadStart       string  `json:"loadavg_start"`
	LoadEnd         string  `json:"loadavg_end"`
	KubeProxyRSS    int64   `json:"kube_proxy_rss_bytes"`
	APIServerRSS    int64   `json:"apiserver_rss_bytes"`
	KubeProxySocket int     `json:"kube_proxy_connections"`
}

func (w window) figures() nodeFigures {
	a, b := w.node[0], w.node[1]
	rx, tx := sockDelta(a.socks, b.socks)
	return nodeFigures{
		Seconds: w.seconds, Writes: w.writesInside, WritesPerS: div(float64(w.writesInside), w.seconds),
		KubeProxyCPU: a.cpu(b, "kube-proxy"), KubeProxyProc: a.procCPU(b, "kube-proxy"), KubeProxyRX: rx, KubeProxyTX: tx,
		APIServerCPU: a.cpu(b, "kube-apiserver"), EtcdCPU: a.cpu(b, "etcd"), ControllerCPU: a.cpu(b, "kube-controller"),
		LoadStart: w.loadStart, LoadEnd: w.loadEnd,
		KubeProxyRSS: b.rss("kube-proxy"), APIServerRSS: b.rss("kube-apiserver"), KubeProxySocket: len(b.socks),
	}
}

// watcherFigures is one watcher child's window and sync.
type watcherFigures struct {
	Events         uint64  `json:"events"`
	Gone           uint64  `json:"gone,omitempty"`
	CPU            float64 `json:"cpu_s"`
	RX             int64   `json:"rx_bytes"`
	CPUPerEventUS  float64 `json:"cpu_per_event_us"`
	BytesPerEvent  float64 `json:"bytes_per_event"`
	Held           int     `json:"held"`
	Objects        int     `json:"objects"`
	HeapBytes      uint64  `json:"heap_bytes"`
	BytesPerObject float64 `json:"heap_bytes_per_held"`
	SyncS          float64 `json:"sync_s"`
	SyncCPU        float64 `json:"sync_cpu_s"`
	SyncRX         int64   `json:"sync_rx_bytes"`
	Conns          int64   `json:"connections"`
	// Lag: the window's writes minus the events this watcher got in it
	// (near 0 when the API server keeps up).
	Lag int64 `json:"lag_events"`
}

func (w window) watcher(c *child) watcherFigures {
	a, b := w.kids[0][c.kind], w.kids[1][c.kind]
	f := watcherFigures{
		Events: b.Events - a.Events, Gone: b.Gone - a.Gone, CPU: b.CPU - a.CPU, RX: b.RX - a.RX,
		Held: c.first.Held, Objects: c.first.Objects, SyncS: c.first.SyncS, SyncCPU: c.first.CPU, SyncRX: c.first.RX, Conns: b.Conns,
	}
	f.CPUPerEventUS = div(f.CPU, float64(f.Events)) * 1e6
	f.Lag = w.writesInside - int64(f.Events)
	if c.kind == "fanout" && f.Conns > 0 {
		f.Lag = w.writesInside - int64(f.Events)/f.Conns
	}
	f.BytesPerEvent = div(float64(f.RX), float64(f.Events))
	if c.first.Heap > c.first.BaseHeap {
		f.HeapBytes = c.first.Heap - c.first.BaseHeap
		f.BytesPerObject = div(float64(f.HeapBytes), float64(c.first.Held))
	}
	return f
}

func (f watcherFigures) cost(apiPerEvent float64) WatchCost {
	return WatchCost{CPUPerEvent: f.CPUPerEventUS / 1e6, BytesPerEvent: f.BytesPerEvent, BytesPerObject: f.BytesPerObject, APIServerCPUPerEvent: apiPerEvent}
}

type result struct {
	Date       string                    `json:"date"`
	Commit     string                    `json:"commit"`
	K8s        string                    `json:"k8s_version"`
	CPUs       int                       `json:"cpus"`
	Config     config                    `json:"config"`
	Setup      map[string]float64        `json:"setup_s"`
	With       nodeFigures               `json:"slices_window"`
	Fanout     *fanToggle                `json:"fanout_switched"`
	Deletions  int64                     `json:"deletions_in_window"`
	WritesPerD float64                   `json:"writes_per_deletion"`
	WriteFails int64                     `json:"write_fails"`
	Watchers   map[string]watcherFigures `json:"watchers"`
	KubeProxy  map[string]float64        `json:"kube_proxy"`
	APIPerEvUS float64                   `json:"apiserver_cpu_per_watcher_event_us"`
	Ratios     map[string]float64        `json:"ratios"`
	Pods       *podFigures               `json:"pods,omitempty"`
	PodsError  string                    `json:"pods_error,omitempty"`
	Scenario   map[string]Scenario       `json:"scenario"`
	Projection map[string]Projection     `json:"projection"`
	DurationS  float64                   `json:"duration_s"`
}

type podFigures struct {
	Node    nodeFigures    `json:"node"`
	Watch   watcherFigures `json:"watch"`
	Replace int64          `json:"replacements"`
	Fails   int64          `json:"fails"`
}

func main() {
	kind := flag.String("child", "", "run as a watcher process of this kind (child.go)")
	fanout := flag.Int("fanout", 0, "watch streams of a fanout child")
	flag.Parse()
	log.SetFlags(log.Ltime | log.Lmicroseconds)
	if *kind != "" {
		log.SetPrefix(*kind + ": ")
		if err := runChild(*kind, os.Getenv("KUBECONFIG"), *fanout); err != nil {
			log.Fatal(err)
		}
		return
	}
	log.SetPrefix("bench-remote-watch: ")
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, loadConfig()); err != nil {
		log.Fatal(err)
	}
}

func run(ctx context.Context, cfg config) error {
	start := time.Now()
	kubeconfig, nodeName := os.Getenv("KUBECONFIG"), os.Getenv("NODE")
	if kubeconfig == "" || nodeName == "" {
		return fmt.Errorf("KUBECONFIG and NODE (the kind node's container) must be set: run it with make bench-remote-watch")
	}
	n, err := findNode(ctx, nodeName)
	if err != nil {
		return err
	}
	rc, err := restConfig(kubeconfig, protobuf, &counter{})
	if err != nil {
		return err
	}
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return err
	}
	res := result{Date: time.Now().UTC().Format(time.RFC3339), Commit: os.Getenv("GIT_COMMIT"), CPUs: runtime.NumCPU(), Config: cfg,
		Setup: map[string]float64{}, Watchers: map[string]watcherFigures{}, Scenario: map[string]Scenario{}, Projection: map[string]Projection{}}
	if v, err := cs.Discovery().ServerVersion(); err == nil {
		res.K8s = v.GitVersion
	}
	r, err := n.read(ctx)
	if err != nil {
		return err
	}
	if len(r.procs["kube-proxy"]) == 0 || len(r.procs["kube-apiserver"]) == 0 {
		return fmt.Errorf("node %s: no kube-proxy or kube-apiserver process in its cgroup (%s)", nodeName, n.containerID)
	}
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: benchNS}}, metav1.CreateOptions{}); err != nil {
		return err
	}

	// The Services and slices, then kube-proxy's first sync of them.
	t := time.Now()
	sc := newSliceChurn(cs, benchNS, cfg.Services, cfg.Endpoints, time.Duration(cfg.Terminating*float64(time.Second)))
	if err := sc.create(ctx); err != nil {
		return err
	}
	res.Setup["create"] = time.Since(t).Seconds()
	log.Printf("%d Services, %d slices of %d endpoints created in %.1fs", cfg.Services, cfg.Services, cfg.Endpoints, res.Setup["create"])
	t = time.Now()
	if err := settle(ctx, n, 4*time.Minute); err != nil {
		return err
	}
	res.Setup["kube_proxy_settle"] = time.Since(t).Seconds()

	// The churn, and the watchers, each listing every slice while it goes
	// on; the fan-out's streams are closed again once open.
	churnCtx, stopChurn := context.WithCancel(ctx)
	defer stopChurn()
	go sc.run(churnCtx, cfg.Rate)
	kinds := []string{"scrubd", "scrubd-json", "kubeproxy", "fanout"}
	var kids []*child
	defer func() {
		for _, k := range kids {
			k.stop()
		}
	}()
	for _, k := range kinds {
		c, err := startChild(k, cfg.Fanout)
		if err != nil {
			return err
		}
		kids = append(kids, c)
	}
	for _, c := range kids {
		if c.first, err = c.read(); err != nil {
			return err
		}
		log.Printf("%s synced in %.1fs: %d bytes, %.2fs CPU, holds %d (heap %d bytes)", c.kind, c.first.SyncS, c.first.RX, c.first.CPU, c.first.Held, c.first.Heap-c.first.BaseHeap)
	}
	decoders, fan := kids[:3], kids[3]
	if _, err := fan.ask("off"); err != nil {
		return err
	}
	sleep(ctx, 5*time.Second)

	// Window B: scrubd's watch, the same in JSON and kube-proxy's informer
	// beside kube-proxy itself, on the same events.
	wd := time.Duration(cfg.Window * float64(time.Second))
	log.Printf("window B (%.0fs): %.0f deletions/s; kube-proxy, scrubd's watch (and in JSON), kube-proxy's informer", cfg.Window, cfg.Rate)
	del0 := sc.deletions.Load()
	wb, err := measure(ctx, n, wd, sc.writes.Load, decoders)
	if err != nil {
		return err
	}
	res.Deletions = sc.deletions.Load() - del0
	res.With = wb.figures()
	res.WritesPerD = div(float64(res.With.Writes), float64(res.Deletions))
	for _, c := range decoders {
		res.Watchers[c.kind] = wb.watcher(c)
	}
	log.Printf("B: %d writes (%.1f/s), kube-proxy %.2fs CPU, API server %.2fs; load %s -> %s",
		res.With.Writes, res.With.WritesPerS, res.With.KubeProxyCPU, res.With.APIServerCPU, wb.loadStart, wb.loadEnd)

	// The fan-out switched: FANOUT streams closed, then open, in turns.
	sub := time.Duration(cfg.FanWindow * float64(time.Second))
	ft := &fanToggle{Cycles: cfg.FanCycles, Streams: cfg.Fanout}
	for i := range cfg.FanCycles {
		off, err := measure(ctx, n, sub, sc.writes.Load, []*child{fan})
		if err != nil {
			return err
		}
		if _, err := fan.ask("on"); err != nil {
			return err
		}
		sleep(ctx, 2*time.Second)
		on, err := measure(ctx, n, sub, sc.writes.Load, []*child{fan})
		if err != nil {
			return err
		}
		if _, err := fan.ask("off"); err != nil {
			return err
		}
		sleep(ctx, 2*time.Second)
		ft.add(off.figures(), on.figures(), on.watcher(fan))
		log.Printf("fan-out cycle %d: API server %.2fs CPU for %d writes with %d more streams, %.2fs for %d without",
			i+1, ft.OnCPU[i], ft.OnWrites[i], cfg.Fanout, ft.OffCPU[i], ft.OffWrites[i])
	}
	ft.finish()
	res.Fanout = ft
	stopChurn()
	sc.wait()
	res.WriteFails = sc.fails.Load()
	for _, c := range kids {
		c.stop()
	}
	kids = nil

	sd, sj, ki := res.Watchers["scrubd"], res.Watchers["scrubd-json"], res.Watchers["kubeproxy"]
	// kube-proxy's events: its bytes over the bytes of an event of the same
	// stream (the informer's that reads as kube-proxy does).
	stream := ki.BytesPerEvent
	kpB := div(float64(res.With.KubeProxyRX), stream)
	res.KubeProxy = map[string]float64{
		"events":                   kpB,
		"cpu_per_event_us":         div(res.With.KubeProxyCPU, kpB) * 1e6,
		"process_cpu_per_event_us": div(res.With.KubeProxyProc, kpB) * 1e6,
		"bytes_per_event":          div(float64(res.With.KubeProxyRX), kpB),
		"rss_bytes":                float64(res.With.KubeProxyRSS),
		"rss_bytes_per_endpoint":   div(float64(res.With.KubeProxyRSS), float64(cfg.Services*cfg.Endpoints)),
	}
	kp := res.KubeProxy
	api := ft.MarginalUS / 1e6
	res.APIPerEvUS = ft.MarginalUS
	res.Ratios = map[string]float64{
		"cpu_scrubd_vs_kube_proxy":          div(sd.CPUPerEventUS, kp["cpu_per_event_us"]),
		"cpu_scrubd_vs_kubeproxy_informer":  div(sd.CPUPerEventUS, ki.CPUPerEventUS),
		"cpu_scrubd_json_vs_scrubd":         div(sj.CPUPerEventUS, sd.CPUPerEventUS),
		"bytes_scrubd_vs_kube_proxy":        div(sd.BytesPerEvent, kp["bytes_per_event"]),
		"bytes_scrubd_json_vs_scrubd":       div(sj.BytesPerEvent, sd.BytesPerEvent),
		"heap_scrubd_vs_kubeproxy_informer": div(sd.BytesPerObject, ki.BytesPerObject),
		"heap_scrubd_vs_kube_proxy_rss":     div(sd.BytesPerObject, kp["rss_bytes_per_endpoint"]),
	}

	// The API server's cost per event to one more watcher, per byte sent
	// (encrypting and writing is most of it once the watch cache has
	// encoded the event): for a JSON watcher and pods, by their bytes.
	perByte := div(api, ft.StreamBytesPerEvent)
	sliceScen := Scenario{Nodes: cfg.Nodes, ChangesPerS: cfg.ProjRate, EventsPerChange: writesPerDeletion, ObjectsHeld: cfg.ProjEPs}
	res.Scenario["slices"] = sliceScen
	res.Projection["scrubd"] = Project(sd.cost(api), sliceScen)
	res.Projection["scrubd_json"] = Project(sj.cost(perByte*sj.BytesPerEvent), sliceScen)
	res.Projection["kubeproxy_informer"] = Project(ki.cost(api), sliceScen)
	res.Projection["kube_proxy"] = Project(WatchCost{CPUPerEvent: kp["cpu_per_event_us"] / 1e6, BytesPerEvent: kp["bytes_per_event"],
		BytesPerObject: kp["rss_bytes_per_endpoint"], APIServerCPUPerEvent: api}, sliceScen)

	if cfg.Pods > 0 {
		pf, err := podPhase(ctx, cs, n, cfg)
		if err != nil {
			// The slices' figures stand without it.
			log.Printf("pod phase failed: %v", err)
			res.PodsError = err.Error()
		}
		res.Pods = pf
	}
	if res.Pods != nil {
		pf := res.Pods
		pods := Scenario{Nodes: cfg.Nodes, ChangesPerS: cfg.ProjRate, EventsPerChange: cfg.PodEvents, ObjectsHeld: cfg.ProjPods}
		res.Scenario["pods"] = pods
		res.Projection["pods"] = Project(pf.Watch.cost(perByte*pf.Watch.BytesPerEvent), pods)
	}
	res.DurationS = time.Since(start).Seconds()
	report(res)
	b, err := json.Marshal(res)
	if err != nil {
		return err
	}
	fmt.Println(string(b))
	return nil
}

// podPhase: the standing pods, a Pod watch, their replacement at POD_RATE.
func podPhase(ctx context.Context, cs kubernetes.Interface, n *node, cfg config) (*podFigures, error) {
	if err := waitServiceAccount(ctx, cs, benchNS); err != nil {
		return nil, err
	}
	t := time.Now()
	pc := newPodChurn(cs, benchNS)
	if err := pc.create(ctx, cfg.Pods); err != nil {
		return nil, err
	}
	log.Printf("%d pods created (and their status written) in %.1fs", cfg.Pods, time.Since(t).Seconds())
	c, err := startChild("pods", 0)
	if err != nil {
		return nil, err
	}
	defer c.stop()
	if c.first, err = c.read(); err != nil {
		return nil, err
	}
	log.Printf("pods synced in %.1fs: %d bytes, %.2fs CPU, holds %d (heap %d bytes)", c.first.SyncS, c.first.RX, c.first.CPU, c.first.Held, c.first.Heap-c.first.BaseHeap)
	churnCtx, stopChurn := context.WithCancel(ctx)
	go pc.run(churnCtx, cfg.PodRate)
	sleep(ctx, 5*time.Second)
	log.Printf("window P (%.0fs): %.0f pod replacements/s, a Pod watch", cfg.PodWindow, cfg.PodRate)
	r0 := pc.replacements.Load()
	w, err := measure(ctx, n, time.Duration(cfg.PodWindow*float64(time.Second)), pc.writes.Load, []*child{c})
	r1 := pc.replacements.Load()
	stopChurn()
	pc.wait()
	if err != nil {
		return nil, err
	}
	return &podFigures{Node: w.figures(), Watch: w.watcher(c), Replace: r1 - r0, Fails: pc.fails.Load()}, nil
}

// settle waits until kube-proxy has programmed the new Services: its
// container's CPU (iptables-restore or nft included) below a tenth of a
// core over 5 s, twice in a row.
func settle(ctx context.Context, n *node, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	quiet := 0
	prev, err := n.read(ctx)
	if err != nil {
		return err
	}
	for quiet < 2 {
		if time.Now().After(deadline) {
			log.Printf("kube-proxy still busy after %s: measuring anyway", limit)
			return nil
		}
		sleep(ctx, 5*time.Second)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		cur, err := n.read(ctx)
		if err != nil {
			return err
		}
		if prev.cpu(cur, "kube-proxy") < 0.5 {
			quiet++
		} else {
			quiet = 0
		}
		log.Printf("kube-proxy: %.2fs CPU in the last 5 s", prev.cpu(cur, "kube-proxy"))
		prev = cur
	}
	return nil
}

func sleep(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}

// report prints the figures for a reader; the JSON line follows.
func report(r result) {
	p := func(format string, a ...any) { fmt.Printf(format+"\n", a...) }
	p("")
	p("EndpointSlice watch, %d slices x %d endpoints, %.0f deletions/s (%.2f writes each), %.0f s windows; kube-proxy %s; %s, %s",
		r.Config.Services, r.Config.Endpoints, r.Config.Rate, r.WritesPerD, r.Config.Window, r.Config.ProxyMode, r.K8s, r.Commit)
	f := r.With
	p("  window: %d writes (%.1f/s), kube-proxy %.2fs CPU (process %.2fs), API server %.2fs, etcd %.2fs, controller manager %.2fs; load %s -> %s",
		f.Writes, f.WritesPerS, f.KubeProxyCPU, f.KubeProxyProc, f.APIServerCPU, f.EtcdCPU, f.ControllerCPU, f.LoadStart, f.LoadEnd)
	p("  %-18s %10s %8s %12s %12s %14s %10s %10s", "watcher", "events", "lag", "CPU us/ev", "bytes/ev", "heap B/held", "sync s", "sync MB")
	p("  %-18s %10.0f %8s %12.1f %12.0f %14.0f %10s %10s", "kube-proxy (real)", r.KubeProxy["events"], "-", r.KubeProxy["cpu_per_event_us"], r.KubeProxy["bytes_per_event"], r.KubeProxy["rss_bytes_per_endpoint"], "-", "-")
	for _, k := range []string{"scrubd", "scrubd-json", "kubeproxy"} {
		w := r.Watchers[k]
		p("  %-18s %10d %8d %12.1f %12.0f %14.0f %10.1f %10.1f", k, w.Events, w.Lag, w.CPUPerEventUS, w.BytesPerEvent, w.BytesPerObject, w.SyncS, float64(w.SyncRX)/1e6)
	}
	p("  (kube-proxy: its container's CPU, rules included; heap column: its RSS per endpoint)")
	if ft := r.Fanout; ft != nil {
		p("  %d raw streams switched on and off, %d x %.0f s each: API server %.1f us CPU per event per stream (cycles %.1f us); a stream reads %.0f bytes, %.1f us CPU an event",
			ft.Streams, ft.Cycles, r.Config.FanWindow, ft.MarginalUS, ft.PerCycleUS, ft.StreamBytesPerEvent, ft.StreamCPUPerEventUS)
	}
	for _, k := range slices.Sorted(maps.Keys(r.Ratios)) {
		p("  %-36s %.2f", k, r.Ratios[k])
	}
	if r.Pods != nil {
		w := r.Pods.Watch
		p("Pod watch, %d pods, %.0f replacements/s: %d writes, %d events (%.2f a replacement), %.1f us CPU/event, %.0f bytes/event, %.0f heap bytes/pod; API server %.2fs CPU",
			r.Config.Pods, r.Config.PodRate, r.Pods.Node.Writes, w.Events, div(float64(w.Events), float64(r.Pods.Replace)), w.CPUPerEventUS, w.BytesPerEvent, w.BytesPerObject, r.Pods.Node.APIServerCPU)
	}
	for _, k := range []string{"kube_proxy", "kubeproxy_informer", "scrubd", "scrubd_json", "pods"} {
		pr, ok := r.Projection[k]
		if !ok {
			continue
		}
		p("  at %d nodes, %-18s per node %4.0f events/s, %.3f cores, %5.2f MB/s, heap %4.0f MB; API server fan-out %5.2f GB/s, %5.1f cores",
			r.Config.Nodes, k+":", pr.EventsPerS, pr.NodeCPUCores, pr.NodeBytesPerS/1e6, pr.NodeHeapBytes/1e6, pr.FanoutBytesPerS/1e9, pr.APIServerCores)
	}
}
