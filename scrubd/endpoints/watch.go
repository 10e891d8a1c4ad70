package endpoints

import (
	"context"
	"fmt"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

// Strip is the informer's transform: it keeps of an EndpointSlice only what
// Presence reads (name, namespace, the service-name label, the address
// type, each endpoint's addresses and conditions) and drops the rest
// (managed fields, ports, hints, node and zone, target references), as
// kube-proxy and Cilium trim what their caches hold. Other objects pass
// unchanged.
func Strip(obj any) (any, error) {
	s, ok := obj.(*discoveryv1.EndpointSlice)
	if !ok {
		return obj, nil
	}
	out := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{
			Name:            s.Name,
			Namespace:       s.Namespace,
			UID:             s.UID,
			ResourceVersion: s.ResourceVersion,
		},
		AddressType: s.AddressType,
		Endpoints:   make([]discoveryv1.Endpoint, len(s.Endpoints)),
	}
	if n := s.Labels[discoveryv1.LabelServiceName]; n != "" {
		out.Labels = map[string]string{discoveryv1.LabelServiceName: n}
	}
	for i := range s.Endpoints {
		out.Endpoints[i] = discoveryv1.Endpoint{Addresses: s.Endpoints[i].Addresses, Conditions: s.Endpoints[i].Conditions}
	}
	return out, nil
}

// Watch feeds a Presence from an EndpointSlice informer's events and hands
// each address that falls due to its action, one at a time.
type Watch struct {
	mu  sync.Mutex
	p   *Presence
	now func() time.Time

	kick   chan struct{}
	synced atomic.Bool
	events atomic.Uint64
}

// NewWatch returns a Watch over a new Presence (hold as NewPresence).
func NewWatch(hold time.Duration) *Watch {
	return &Watch{p: NewPresence(hold), now: time.Now, kick: make(chan struct{}, 1)}
}

// OnAdd, OnUpdate and OnDelete are the informer's handlers
// (cache.ResourceEventHandler).
func (w *Watch) OnAdd(obj any, _ bool) { w.set(obj) }

// OnUpdate records the slice's new state.
func (w *Watch) OnUpdate(_, obj any) { w.set(obj) }

// OnDelete records that the slice is gone, also when the informer learnt
// it only at a relist (cache.DeletedFinalStateUnknown).
func (w *Watch) OnDelete(obj any) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	s, ok := obj.(*discoveryv1.EndpointSlice)
	if !ok {
		return
	}
	w.events.Add(1)
	w.mu.Lock()
	w.p.Delete(SliceKey(s), w.now())
	w.mu.Unlock()
	w.poke()
}

func (w *Watch) set(obj any) {
	s, ok := obj.(*discoveryv1.EndpointSlice)
	if !ok {
		return
	}
	w.events.Add(1)
	w.mu.Lock()
	w.p.Set(s, w.now())
	w.mu.Unlock()
	w.poke()
}

func (w *Watch) poke() {
	select {
	case w.kick <- struct{}{}:
	default:
	}
}

// Status is what the watch reports (scrubd status, metrics).
type Status struct {
	Synced                 bool
	Events                 uint64
	Slices, Addrs, Waiting int
}

// Status returns the watch's figures now.
func (w *Watch) Status() Status {
	w.mu.Lock()
	defer w.mu.Unlock()
	return Status{Synced: w.synced.Load(), Events: w.events.Load(), Slices: w.p.Slices(), Addrs: w.p.Addrs(), Waiting: w.p.Waiting()}
}

// Present reports whether a slice names a now: the action checks it again
// right before it deletes.
func (w *Watch) Present(a netip.Addr) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.p.Present(a)
}

// Synced reports whether the watch has seen every slice of the first list.
func (w *Watch) Synced() bool { return w.synced.Load() }

// Run watches EndpointSlices through cs (one informer, fields stripped) and
// calls act for each address that falls due, in order, until ctx ends. No
// address is acted on before the first list is complete: until then an
// absent address may just not be listed yet.
func (w *Watch) Run(ctx context.Context, cs kubernetes.Interface, act func(context.Context, Gone)) error {
	f := informers.NewSharedInformerFactoryWithOptions(cs, 0, informers.WithTransform(Strip))
	inf := f.Discovery().V1().EndpointSlices().Informer()
	reg, err := inf.AddEventHandler(w)
	if err != nil {
		return fmt.Errorf("endpointslice informer: %w", err)
	}
	f.Start(ctx.Done())
	defer f.Shutdown()
	// The handler's sync, not the informer's: the store has the first list
	// before this handler has been handed all of it.
	if !cache.WaitForCacheSync(ctx.Done(), reg.HasSynced) {
		return ctx.Err()
	}
	w.synced.Store(true)
	w.Loop(ctx, act)
	return nil
}

// Loop hands due addresses to act until ctx ends (Run calls it once the
// informer synced; tests call it with events they make).
func (w *Watch) Loop(ctx context.Context, act func(context.Context, Gone)) {
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		w.mu.Lock()
		due := w.p.Due(w.now())
		next, ok := w.p.Next()
		w.mu.Unlock()
		for _, g := range due {
			act(ctx, g)
		}
		wait := time.Hour
		if ok {
			wait = max(time.Until(next), time.Millisecond)
		}
		t.Reset(wait)
		select {
		case <-ctx.Done():
			return
		case <-w.kick:
		case <-t.C:
		}
	}
}
