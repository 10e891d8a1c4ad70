package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/ctscrub/ctscrub/scrubd/endpoints"
)

// A watcher runs in a process of its own (this program, re-executed with
// -child), so its CPU time is its alone (getrusage), and it counts the
// bytes its connections to the API server read and wrote, TLS included,
// at the socket: what a node's network carries.
//
// The kinds:
//
//	scrubd           scrubd/endpoints' Watch.Run, the daemon's code, on a
//	                 clientset built as scrubd/daemon/remote.go builds it:
//	                 no content type set, so client-go's default for
//	                 built-in types (protobuf since client-go 0.34)
//	scrubd-json      the same in JSON: what a watch of a JSON-only
//	                 resource (a CRD: CiliumEndpoints) costs per byte
//	kubeproxy        an EndpointSlice informer as kube-proxy makes it:
//	                 protobuf, its label selector, no transform, handlers
//	                 that only count (the watch without kube-proxy's rules)
//	pods             a cluster-wide Pod informer (protobuf, a transform
//	                 keeping what a pod-deletion watch would read): what a
//	                 per-node watch of pod deletions would cost
//	fanout           -n raw EndpointSlice watch streams, each on its own
//	                 connection, read and discarded undecoded: n more
//	                 nodes' watches for the API server to serve

// The protocol with the parent: the child prints one JSON snapshot when its
// watch has synced, then one per line it reads on stdin ("snap"; "mem":
// after a GC, with the heap) until "quit" or EOF.

const protobuf = "application/vnd.kubernetes.protobuf"

type snapshot struct {
	Kind     string  `json:"kind"`
	CPU      float64 `json:"cpu_s"`
	RX       int64   `json:"rx_bytes"`
	TX       int64   `json:"tx_bytes"`
	Events   uint64  `json:"events"`
	Gone     uint64  `json:"gone"`
	Held     int     `json:"held"` // addresses or pods the watch holds
	Objects  int     `json:"objects"`
	Conns    int64   `json:"conns"`
	SyncS    float64 `json:"sync_s,omitempty"`
	BaseHeap uint64  `json:"base_heap,omitempty"`
	Heap     uint64  `json:"heap,omitempty"`
	Err      string  `json:"err,omitempty"`
}

// counter counts a process's bytes to and from the API server.
type counter struct{ rx, tx, conns atomic.Int64 }

type countConn struct {
	net.Conn
	c *counter
}

func (c countConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.c.rx.Add(int64(n))
	return n, err
}

func (c countConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	c.c.tx.Add(int64(n))
	return n, err
}

// restConfig is the kubeconfig's config with every connection counted by
// c. A Dial of its own also gives each config its own transport (client-go
// caches none with a dialer), so each is one more TCP connection, as each
// node has.
// clientset is a typed client over restConfig.
func clientset(kubeconfig, contentType string, c *counter) (*kubernetes.Clientset, error) {
	cfg, err := restConfig(kubeconfig, contentType, c)
	if err != nil {
		return nil, err
	}
	return kubernetes.NewForConfig(cfg)
}

func restConfig(kubeconfig, contentType string, c *counter) (*rest.Config, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, err
	}
	cfg.UserAgent = "ctscrub-bench-remotewatch"
	switch contentType {
	case "":
	case "application/json":
		cfg.ContentType, cfg.AcceptContentTypes = contentType, contentType
	default:
		cfg.ContentType, cfg.AcceptContentTypes = contentType, contentType+",application/json"
	}
	// The benchmark's own writes must not be throttled by client-go.
	cfg.QPS, cfg.Burst = 1000, 2000
	d := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}
	cfg.Dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		c.conns.Add(1)
		return countConn{Conn: conn, c: c}, nil
	}
	return cfg, nil
}

func cpuSelf() float64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()).Seconds()
}

func heapAfterGC() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// watcher is what a child runs: start begins the watch, synced reports
// when its first list is complete, status its counts.
type watcher struct {
	start  func(ctx context.Context) error
	synced func() bool
	status func() (events, gone uint64, held, objects int)
	// toggle closes (on false) or opens again and waits for the streams
	// (fanout only).
	toggle func(ctx context.Context, on bool) error
}

// fanoutStreams is n raw watch streams, each on a connection of its own,
// that can be closed and opened again (the API server's cost of n more
// nodes, switched on and off).
type fanoutStreams struct {
	kubeconfig string
	n          int
	c          *counter

	events atomic.Uint64
	ready  atomic.Int64
	mu     sync.Mutex
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

func (f *fanoutStreams) open(ctx context.Context) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	ctx, f.cancel = context.WithCancel(ctx)
	for range f.n {
		cfg, err := restConfig(f.kubeconfig, protobuf, f.c)
		if err != nil {
			return err
		}
		cs, err := kubernetes.NewForConfig(cfg)
		if err != nil {
			return err
		}
		f.wg.Go(func() {
			up := false
			err := rawWatch(ctx, cs, &f.events, func() { up = true; f.ready.Add(1) })
			if up {
				f.ready.Add(-1)
			}
			if err != nil && ctx.Err() == nil {
				fmt.Fprintln(os.Stderr, "fanout watch:", err)
			}
			// Its connection goes with it: the next open makes new ones.
			cs.DiscoveryV1().RESTClient().(*rest.RESTClient).Client.CloseIdleConnections()
		})
	}
	return nil
}

func (f *fanoutStreams) close() {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.cancel != nil {
		f.cancel()
	}
	f.wg.Wait()
	f.ready.Store(0)
}

// kubeProxySelector is kube-proxy's label selector for EndpointSlices and
// Services (cmd/kube-proxy/app/server.go).
func kubeProxySelector() string {
	noProxyName, _ := labels.NewRequirement("service.kubernetes.io/service-proxy-name", selection.DoesNotExist, nil)
	noHeadless, _ := labels.NewRequirement(corev1.IsHeadlessService, selection.DoesNotExist, nil)
	return labels.NewSelector().Add(*noProxyName, *noHeadless).String()
}

// stripPod keeps of a Pod what a watch of pod deletions would read, as
// endpoints.Strip does for slices.
func stripPod(obj any) (any, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace, UID: p.UID, ResourceVersion: p.ResourceVersion, DeletionTimestamp: p.DeletionTimestamp},
		Spec:       corev1.PodSpec{NodeName: p.Spec.NodeName, HostNetwork: p.Spec.HostNetwork},
		Status:     corev1.PodStatus{Phase: p.Status.Phase, PodIPs: p.Status.PodIPs},
	}, nil
}

// countHandler counts an informer's events.
type countHandler struct{ n atomic.Uint64 }

func (h *countHandler) OnAdd(any, bool)   { h.n.Add(1) }
func (h *countHandler) OnUpdate(_, _ any) { h.n.Add(1) }
func (h *countHandler) OnDelete(any)      { h.n.Add(1) }
func (h *countHandler) count() uint64     { return h.n.Load() }
func newCountHandler() *countHandler      { return &countHandler{} }
func informerStatus(inf cache.SharedIndexInformer, h *countHandler) func() (uint64, uint64, int, int) {
	return func() (uint64, uint64, int, int) { n := len(inf.GetStore().ListKeys()); return h.count(), 0, n, n }
}

func newWatcher(kind, kubeconfig string, fanout int, c *counter) (*watcher, error) {
	switch kind {
	case "scrubd", "scrubd-json":
		ct := ""
		if kind == "scrubd-json" {
			ct = "application/json"
		}
		cfg, err := restConfig(kubeconfig, ct, c)
		if err != nil {
			return nil, err
		}
		cs, err := kubernetes.NewForConfig(cfg)
		if err != nil {
			return nil, err
		}
		w := endpoints.NewWatch(endpoints.DefaultHold)
		var gone atomic.Uint64
		return &watcher{
			start: func(ctx context.Context) error {
				go func() {
					// What the daemon's action is handed; the deletion
					// itself (ScrubPeer) is not this benchmark's.
					_ = w.Run(ctx, cs, func(context.Context, endpoints.Gone) { gone.Add(1) })
				}()
				return nil
			},
			synced: w.Synced,
			status: func() (uint64, uint64, int, int) {
				st := w.Status()
				return st.Events, gone.Load(), st.Addrs, st.Slices
			},
		}, nil
	case "kubeproxy":
		cs, err := clientset(kubeconfig, protobuf, c)
		if err != nil {
			return nil, err
		}
		sel := kubeProxySelector()
		f := informers.NewSharedInformerFactoryWithOptions(cs, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = sel }))
		inf := f.Discovery().V1().EndpointSlices().Informer()
		h := newCountHandler()
		reg, err := inf.AddEventHandler(h)
		if err != nil {
			return nil, err
		}
		return &watcher{
			start:  func(ctx context.Context) error { f.Start(ctx.Done()); return nil },
			synced: reg.HasSynced,
			status: func() (uint64, uint64, int, int) {
				var addrs int
				for _, o := range inf.GetStore().List() {
					addrs += len(o.(*discoveryv1.EndpointSlice).Endpoints)
				}
				return h.count(), 0, addrs, len(inf.GetStore().ListKeys())
			},
		}, nil
	case "pods":
		cs, err := clientset(kubeconfig, protobuf, c)
		if err != nil {
			return nil, err
		}
		f := informers.NewSharedInformerFactoryWithOptions(cs, 0, informers.WithTransform(stripPod))
		inf := f.Core().V1().Pods().Informer()
		h := newCountHandler()
		reg, err := inf.AddEventHandler(h)
		if err != nil {
			return nil, err
		}
		return &watcher{
			start:  func(ctx context.Context) error { f.Start(ctx.Done()); return nil },
			synced: reg.HasSynced,
			status: informerStatus(inf, h),
		}, nil
	case "fanout":
		f := &fanoutStreams{kubeconfig: kubeconfig, n: fanout, c: c}
		return &watcher{
			start:  f.open,
			synced: func() bool { return f.ready.Load() == int64(fanout) },
			status: func() (uint64, uint64, int, int) { return f.events.Load(), 0, 0, 0 },
			toggle: func(ctx context.Context, on bool) error {
				if !on {
					f.close()
					return nil
				}
				if err := f.open(ctx); err != nil {
					return err
				}
				for deadline := time.Now().Add(time.Minute); f.ready.Load() != int64(fanout); time.Sleep(10 * time.Millisecond) {
					if time.Now().After(deadline) {
						return fmt.Errorf("%d of %d streams open after 1 min", f.ready.Load(), fanout)
					}
				}
				return nil
			},
		}, nil
	}
	return nil, fmt.Errorf("watcher kind %q: want scrubd, scrubd-json, kubeproxy, pods or fanout", kind)
}

// rawWatch opens an EndpointSlice watch from the current resource version
// (no initial state) and reads its protobuf frames (a 4-byte length, then
// the event) without decoding them, counting each.
func rawWatch(ctx context.Context, cs *kubernetes.Clientset, events *atomic.Uint64, opened func()) error {
	l, err := cs.DiscoveryV1().EndpointSlices("").List(ctx, metav1.ListOptions{Limit: 1})
	if err != nil {
		return err
	}
	timeout := int64(3600)
	r, err := cs.DiscoveryV1().RESTClient().Get().Resource("endpointslices").
		VersionedParams(&metav1.ListOptions{Watch: true, ResourceVersion: l.ResourceVersion, AllowWatchBookmarks: true, TimeoutSeconds: &timeout}, scheme.ParameterCodec).
		Stream(ctx)
	if err != nil {
		return err
	}
	defer r.Close()
	opened()
	br := bufio.NewReaderSize(r, 64<<10)
	var hdr [4]byte
	for {
		if _, err := io.ReadFull(br, hdr[:]); err != nil {
			return err
		}
		if _, err := io.CopyN(io.Discard, br, int64(binary.BigEndian.Uint32(hdr[:]))); err != nil {
			return err
		}
		events.Add(1)
	}
}

// runChild is the child process: the watch, then snapshots on request.
func runChild(kind, kubeconfig string, fanout int) error {
	c := &counter{}
	w, err := newWatcher(kind, kubeconfig, fanout, c)
	if err != nil {
		return err
	}
	enc := json.NewEncoder(os.Stdout)
	snap := func(withHeap bool) snapshot {
		s := snapshot{Kind: kind, CPU: cpuSelf(), RX: c.rx.Load(), TX: c.tx.Load(), Conns: c.conns.Load()}
		s.Events, s.Gone, s.Held, s.Objects = w.status()
		if withHeap {
			s.Heap = heapAfterGC()
		}
		return s
	}
	base := heapAfterGC()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	start := time.Now()
	if err := w.start(ctx); err != nil {
		return err
	}
	for !w.synced() {
		if time.Since(start) > 10*time.Minute {
			return errors.New("not synced after 10 min")
		}
		time.Sleep(20 * time.Millisecond)
	}
	first := snap(true)
	first.SyncS, first.BaseHeap = time.Since(start).Seconds(), base
	if err := enc.Encode(first); err != nil {
		return err
	}
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		switch in.Text() {
		case "snap":
			err = enc.Encode(snap(false))
		case "mem":
			err = enc.Encode(snap(true))
		case "on", "off":
			if w.toggle == nil {
				err = enc.Encode(snapshot{Kind: kind, Err: kind + " cannot be switched"})
				break
			}
			if terr := w.toggle(ctx, in.Text() == "on"); terr != nil {
				err = enc.Encode(snapshot{Kind: kind, Err: terr.Error()})
				break
			}
			err = enc.Encode(snap(false))
		case "quit":
			return nil
		default:
			err = enc.Encode(snapshot{Kind: kind, Err: "unknown command " + in.Text()})
		}
		if err != nil {
			return err
		}
	}
	return in.Err()
}
