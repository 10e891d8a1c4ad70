package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// transient reports whether err is the API server or etcd being slow or
// busy (on a shared 2-core machine etcd times out now and then), worth a
// retry.
func transient(err error) bool {
	var st apierrors.APIStatus
	if errors.As(err, &st) && st.Status().Code >= 500 { // "etcdserver: request timed out" is a 500
		return true
	}
	return apierrors.IsServerTimeout(err) || apierrors.IsTimeout(err) || apierrors.IsTooManyRequests(err) ||
		apierrors.IsInternalError(err) || apierrors.IsServiceUnavailable(err) || errors.Is(err, context.DeadlineExceeded)
}

// retry runs f until it succeeds, fails for good, or failed 5 times,
// waiting 0.5, 1, 2, 4 s between tries.
func retry(ctx context.Context, f func() error) error {
	wait := 500 * time.Millisecond
	for try := 1; ; try++ {
		err := f()
		if err == nil || !transient(err) || try == 5 || ctx.Err() != nil {
			return err
		}
		time.Sleep(wait)
		wait *= 2
	}
}

// parallel runs f(0..n-1) on at most width goroutines and returns the
// first error.
func parallel(n, width int, f func(i int) error) error {
	var wg sync.WaitGroup
	var once sync.Once
	var first error
	next := atomic.Int64{}
	for range width {
		wg.Go(func() {
			for {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				if err := f(i); err != nil {
					once.Do(func() { first = err })
					return
				}
			}
		})
	}
	wg.Wait()
	return first
}

// sliceChurn owns the synthetic Services' slices and deletes backends at a
// rate: each deletion is two writes of the backend's slice, as the
// EndpointSlice controller makes them when a pod is deleted: the endpoint
// marked terminating (not ready, not serving), and after `terminating`
// the endpoint dropped, its replacement (a new address) added in the same
// write. The slice keeps its size.
type sliceChurn struct {
	cs          kubernetes.Interface
	ns          string
	endpoints   int
	terminating time.Duration

	mu   []sync.Mutex
	cur  []*discoveryv1.EndpointSlice
	next atomic.Uint32 // the next backend number

	sem                      chan struct{}
	writes, fails, deletions atomic.Int64
	started                  atomic.Int64
	wg                       sync.WaitGroup
}

func newSliceChurn(cs kubernetes.Interface, ns string, services, endpoints int, terminating time.Duration) *sliceChurn {
	c := &sliceChurn{cs: cs, ns: ns, endpoints: endpoints, terminating: terminating,
		mu: make([]sync.Mutex, services), cur: make([]*discoveryv1.EndpointSlice, services), sem: make(chan struct{}, 16)}
	c.next.Store(uint32(services * endpoints))
	return c
}

// create makes the Services and their slices.
func (c *sliceChurn) create(ctx context.Context) error {
	return parallel(len(c.cur), 16, func(i int) error {
		if err := retry(ctx, func() error {
			_, err := c.cs.CoreV1().Services(c.ns).Create(ctx, service(c.ns, i), metav1.CreateOptions{})
			if apierrors.IsAlreadyExists(err) { // an earlier try's
				return nil
			}
			return err
		}); err != nil {
			return fmt.Errorf("create service %d: %w", i, err)
		}
		want := slice(c.ns, i, uint32(i*c.endpoints), c.endpoints)
		return retry(ctx, func() error {
			s, err := c.cs.DiscoveryV1().EndpointSlices(c.ns).Create(ctx, want, metav1.CreateOptions{})
			if apierrors.IsAlreadyExists(err) {
				s, err = c.cs.DiscoveryV1().EndpointSlices(c.ns).Get(ctx, want.Name, metav1.GetOptions{})
			}
			if err != nil {
				return fmt.Errorf("create slice %d: %w", i, err)
			}
			c.cur[i] = s
			return nil
		})
	})
}

// run starts a deletion every 1/rate s, round robin over the slices (a
// slice is written again only after len(slices)/rate s), until ctx ends;
// wait then waits for the deletions under way.
func (c *sliceChurn) run(ctx context.Context, rate float64) {
	t := time.NewTicker(time.Duration(float64(time.Second) / rate))
	defer t.Stop()
	for i := 0; ; i++ {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		c.started.Add(1)
		c.wg.Go(func() { c.deletion(i % len(c.cur)) })
	}
}

func (c *sliceChurn) wait() { c.wg.Wait() }

func (c *sliceChurn) deletion(svc int) {
	ctx := context.Background()
	c.mu[svc].Lock()
	s := c.cur[svc].DeepCopy()
	gone := s.Endpoints[0].Addresses[0]
	s.Endpoints[0] = terminating(s.Endpoints[0])
	ok := c.update(ctx, svc, s)
	c.mu[svc].Unlock()
	if !ok {
		return
	}
	time.Sleep(c.terminating)
	c.mu[svc].Lock()
	defer c.mu[svc].Unlock()
	s = c.cur[svc].DeepCopy()
	kept := s.Endpoints[:0]
	for _, e := range s.Endpoints {
		if e.Addresses[0] != gone {
			kept = append(kept, e)
		}
	}
	s.Endpoints = append(kept, endpoint(c.ns, svc, c.next.Add(1)-1))
	if c.update(ctx, svc, s) {
		c.deletions.Add(1)
	}
}

// update writes s (Service svc's slice); on failure it reads the slice
// back so the next write starts from the API's version.
func (c *sliceChurn) update(ctx context.Context, svc int, s *discoveryv1.EndpointSlice) bool {
	c.sem <- struct{}{}
	defer func() { <-c.sem }()
	got, err := c.cs.DiscoveryV1().EndpointSlices(c.ns).Update(ctx, s, metav1.UpdateOptions{})
	if err == nil {
		c.cur[svc] = got
		c.writes.Add(1)
		return true
	}
	if c.fails.Add(1) <= 5 {
		log.Printf("slice %s: %v", s.Name, err)
	}
	if got, err := c.cs.DiscoveryV1().EndpointSlices(c.ns).Get(ctx, s.Name, metav1.GetOptions{}); err == nil {
		c.cur[svc] = got
	}
	return false
}

// podChurn keeps `standing` synthetic pods and replaces them at a rate:
// each replacement creates a pod, writes its status (running, ready, its
// address) and deletes the oldest pod: three writes, each an event to
// every watcher of pods (a real pod's life makes about six: created,
// scheduled, started, ready, terminating, deleted).
type podChurn struct {
	cs kubernetes.Interface
	ns string

	mu   sync.Mutex
	fifo []uint32
	next atomic.Uint32

	sem                         chan struct{}
	writes, fails, replacements atomic.Int64
	wg                          sync.WaitGroup
}

func newPodChurn(cs kubernetes.Interface, ns string) *podChurn {
	return &podChurn{cs: cs, ns: ns, sem: make(chan struct{}, 16)}
}

// start creates pod n and writes its status.
func (c *podChurn) start(ctx context.Context, n uint32) error {
	c.sem <- struct{}{}
	defer func() { <-c.sem }()
	var p *corev1.Pod
	if err := retry(ctx, func() error {
		var err error
		p, err = c.cs.CoreV1().Pods(c.ns).Create(ctx, pod(c.ns, n), metav1.CreateOptions{})
		if apierrors.IsAlreadyExists(err) { // an earlier try's
			p, err = c.cs.CoreV1().Pods(c.ns).Get(ctx, podName(n), metav1.GetOptions{})
		}
		return err
	}); err != nil {
		return fmt.Errorf("create pod %d: %w", n, err)
	}
	c.writes.Add(1)
	running(p, n)
	if err := retry(ctx, func() error {
		_, err := c.cs.CoreV1().Pods(c.ns).UpdateStatus(ctx, p, metav1.UpdateOptions{})
		if apierrors.IsConflict(err) { // an earlier try's went through
			return nil
		}
		return err
	}); err != nil {
		return fmt.Errorf("pod %d status: %w", n, err)
	}
	c.writes.Add(1)
	c.mu.Lock()
	c.fifo = append(c.fifo, n)
	c.mu.Unlock()
	return nil
}

// create makes the standing pods.
func (c *podChurn) create(ctx context.Context, standing int) error {
	c.next.Store(uint32(standing))
	return parallel(standing, 16, func(i int) error { return c.start(ctx, uint32(i)) })
}

func (c *podChurn) run(ctx context.Context, rate float64) {
	t := time.NewTicker(time.Duration(float64(time.Second) / rate))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		c.wg.Go(c.replace)
	}
}

func (c *podChurn) wait() { c.wg.Wait() }

func (c *podChurn) replace() {
	ctx := context.Background()
	if err := c.start(ctx, c.next.Add(1)-1); err != nil {
		if c.fails.Add(1) <= 5 {
			log.Print(err)
		}
		return
	}
	c.mu.Lock()
	old := c.fifo[0]
	c.fifo = c.fifo[1:]
	c.mu.Unlock()
	c.sem <- struct{}{}
	defer func() { <-c.sem }()
	// Never scheduled, so deleted at once (no grace period to wait out).
	err := c.cs.CoreV1().Pods(c.ns).Delete(ctx, podName(old), metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		if c.fails.Add(1) <= 5 {
			log.Printf("delete pod %d: %v", old, err)
		}
		return
	}
	c.writes.Add(1)
	c.replacements.Add(1)
}

// waitServiceAccount waits for the namespace's default ServiceAccount,
// without which the API refuses pods.
func waitServiceAccount(ctx context.Context, cs kubernetes.Interface, ns string) error {
	deadline := time.Now().Add(2 * time.Minute)
	for {
		_, err := cs.CoreV1().ServiceAccounts(ns).Get(ctx, "default", metav1.GetOptions{})
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no default ServiceAccount in %s after 2 min: %w", ns, err)
		}
		time.Sleep(500 * time.Millisecond)
	}
}
