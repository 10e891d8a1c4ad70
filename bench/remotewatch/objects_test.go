package main

import (
	"context"
	"net/netip"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/ctscrub/ctscrub/scrubd/endpoints"
)

func TestNthAddr(t *testing.T) {
	for _, tc := range []struct {
		n    uint32
		want string
	}{{0, "10.128.0.0"}, {255, "10.128.0.255"}, {256, "10.128.1.0"}, {1 << 16, "10.129.0.0"}} {
		if got := nthAddr(backendBase, tc.n); got != netip.MustParseAddr(tc.want) {
			t.Errorf("nthAddr(%d) = %v, want %s", tc.n, got, tc.want)
		}
	}
}

// A synthetic slice is what kube-proxy and scrubd read as a Service's
// backends: the Service's label, distinct addresses, every endpoint ready;
// and kube-proxy's label selector takes it.
func TestSliceShape(t *testing.T) {
	s := slice("ns", 7, 700, 100)
	if s.Labels["kubernetes.io/service-name"] != serviceName(7) || len(s.Endpoints) != 100 {
		t.Fatalf("slice %s: labels %v, %d endpoints", s.Name, s.Labels, len(s.Endpoints))
	}
	if got := endpoints.Addresses(s); len(got) != 100 || got[0] != nthAddr(backendBase, 700) {
		t.Errorf("addresses: %d, first %v", len(got), got)
	}
	for _, e := range s.Endpoints {
		if !*e.Conditions.Ready || !*e.Conditions.Serving || *e.Conditions.Terminating || e.TargetRef == nil || e.NodeName == nil {
			t.Fatalf("endpoint %+v: want ready, serving, a pod on a node", e)
		}
	}
	sel, err := labels.Parse(kubeProxySelector())
	if err != nil || !sel.Matches(labels.Set(s.Labels)) {
		t.Errorf("kube-proxy's selector %q (%v) does not take the slice's labels %v", kubeProxySelector(), err, s.Labels)
	}
	if e := terminating(s.Endpoints[0]); *e.Conditions.Ready || *e.Conditions.Serving || !*e.Conditions.Terminating || *s.Endpoints[0].Conditions.Terminating {
		t.Errorf("terminating: %+v (the original %+v must stay as it was)", e.Conditions, s.Endpoints[0].Conditions)
	}
}

// One deletion is two writes of the slice: the endpoint terminating (still
// listed: scrubd keeps its flows), then gone and replaced (scrubd hands its
// address out once the hold runs out); the slice keeps its size.
func TestSliceChurnDeletion(t *testing.T) {
	ctx := context.Background()
	cs := fake.NewClientset()
	c := newSliceChurn(cs, "ns", 2, 10, 10*time.Millisecond)
	if err := c.create(ctx); err != nil {
		t.Fatal(err)
	}
	p := endpoints.NewPresence(0)
	now := time.Now()
	for _, s := range c.cur {
		p.Set(s, now)
	}
	first := nthAddr(backendBase, 10) // service 1's first backend
	w, err := cs.DiscoveryV1().EndpointSlices("ns").Watch(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	c.deletion(1)
	if c.writes.Load() != 2 || c.deletions.Load() != 1 || c.fails.Load() != 0 {
		t.Fatalf("writes %d, deletions %d, fails %d; want 2, 1, 0", c.writes.Load(), c.deletions.Load(), c.fails.Load())
	}
	for i := range 2 {
		ev := <-w.ResultChan()
		s, ok := ev.Object.(*discoveryv1.EndpointSlice)
		if !ok || ev.Type != watch.Modified {
			t.Fatalf("event %d: %s %T", i, ev.Type, ev.Object)
		}
		p.Set(s, now)
		if due := p.Due(now.Add(time.Hour)); i == 0 && (len(due) != 0 || !p.Present(first)) {
			t.Fatalf("after the terminating write: %v handed out, %v present %v", due, first, p.Present(first))
		} else if i == 1 && (len(due) != 1 || due[0].Addr != first) {
			t.Fatalf("after the second write: %v handed out, want only %v", due, first)
		}
	}
	got, err := cs.DiscoveryV1().EndpointSlices("ns").Get(ctx, c.cur[1].Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	addrs := endpoints.Addresses(got)
	if len(addrs) != 10 {
		t.Fatalf("%d endpoints after a deletion, want 10", len(addrs))
	}
	for _, a := range addrs {
		if a == first {
			t.Errorf("the deleted backend %v is still listed", a)
		}
	}
	if addrs[9] != nthAddr(backendBase, 20) {
		t.Errorf("replacement %v, want the next backend %v", addrs[9], nthAddr(backendBase, 20))
	}
}

// A replacement is three writes (create, status, delete of the oldest) and
// keeps the standing count; stripPod keeps what a deletion watch reads.
func TestPodChurn(t *testing.T) {
	ctx := context.Background()
	cs := fake.NewClientset()
	c := newPodChurn(cs, "ns")
	if err := c.create(ctx, 5); err != nil {
		t.Fatal(err)
	}
	oldest := []string{podName(c.fifo[0]), podName(c.fifo[1])}
	c.replace()
	c.replace()
	if c.writes.Load() != 5*2+2*3 || c.replacements.Load() != 2 || c.fails.Load() != 0 {
		t.Fatalf("writes %d, replacements %d, fails %d", c.writes.Load(), c.replacements.Load(), c.fails.Load())
	}
	l, err := cs.CoreV1().Pods("ns").List(ctx, metav1.ListOptions{})
	if err != nil || len(l.Items) != 5 {
		t.Fatalf("%d pods (%v), want 5", len(l.Items), err)
	}
	for _, p := range l.Items {
		if p.Name == oldest[0] || p.Name == oldest[1] {
			t.Errorf("the oldest pod %s was not deleted", p.Name)
		}
		if p.Status.PodIP == "" || p.Status.Phase != corev1.PodRunning || p.Spec.SchedulerName != noScheduler {
			t.Errorf("pod %s: IP %q, phase %s, scheduler %q", p.Name, p.Status.PodIP, p.Status.Phase, p.Spec.SchedulerName)
		}
		o, _ := stripPod(&p)
		s := o.(*corev1.Pod)
		if s.Name != p.Name || s.Status.PodIPs[0] != p.Status.PodIPs[0] || s.Status.Phase != p.Status.Phase || len(s.Spec.Containers) != 0 || s.Labels != nil {
			t.Errorf("stripPod(%s) = %+v", p.Name, s)
		}
	}
}

// A timeout is tried again, up to five times; an invalid object is not.
func TestRetry(t *testing.T) {
	ctx := context.Background()
	n := 0
	err := retry(ctx, func() error {
		if n++; n == 1 {
			return apierrors.NewTimeoutError("slow", 1)
		} else if n == 2 {
			return &apierrors.StatusError{ErrStatus: metav1.Status{Status: metav1.StatusFailure, Code: 500, Message: "etcdserver: request timed out"}}
		}
		return nil
	})
	if err != nil || n != 3 {
		t.Errorf("retry of two timeouts: %v after %d tries, want nil after 3", err, n)
	}
	n = 0
	bad := apierrors.NewBadRequest("invalid")
	if err := retry(ctx, func() error { n++; return bad }); err != bad || n != 1 {
		t.Errorf("retry of a bad request: %v after %d tries, want it after 1", err, n)
	}
}
