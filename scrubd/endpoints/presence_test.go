package endpoints

import (
	"net/netip"
	"slices"
	"testing"
	"time"

	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// ep is an endpoint with the conditions a slice carries.
type ep struct {
	addr                        string
	ready, serving, terminating bool
}

func slice(ns, name, svc string, eps ...ep) *discoveryv1.EndpointSlice {
	s := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: ns, Name: name, Labels: map[string]string{discoveryv1.LabelServiceName: svc}},
		AddressType: discoveryv1.AddressTypeIPv4,
	}
	for _, e := range eps {
		r, sv, t := e.ready, e.serving, e.terminating
		s.Endpoints = append(s.Endpoints, discoveryv1.Endpoint{
			Addresses:  []string{e.addr},
			Conditions: discoveryv1.EndpointConditions{Ready: &r, Serving: &sv, Terminating: &t},
		})
	}
	return s
}

func live(a string) ep        { return ep{a, true, true, false} }
func draining(a string) ep    { return ep{a, false, true, true} }  // terminating, still serving
func terminating(a string) ep { return ep{a, false, false, true} } // terminating, not serving

var t0 = time.Unix(1_000_000, 0)

func dueAddrs(p *Presence, at time.Time) []string {
	var out []string
	for _, g := range p.Due(at) {
		out = append(out, g.Addr.String())
	}
	return out
}

func TestGoneWhenInNoSlice(t *testing.T) {
	p := NewPresence(time.Second)
	p.Set(slice("ns", "web-a", "web", live("10.1.0.5"), live("10.1.0.6")), t0)
	p.Set(slice("ns", "web-a", "web", live("10.1.0.6")), t0.Add(time.Second))
	if got := dueAddrs(p, t0.Add(1500*time.Millisecond)); len(got) != 0 {
		t.Fatalf("due before the hold ran out: %v", got)
	}
	if got := dueAddrs(p, t0.Add(2*time.Second)); !slices.Equal(got, []string{"10.1.0.5"}) {
		t.Fatalf("due = %v, want [10.1.0.5]", got)
	}
	if got := dueAddrs(p, t0.Add(time.Hour)); len(got) != 0 {
		t.Fatalf("handed out twice: %v", got)
	}
}

func TestTerminatingEndpointKeepsItsFlows(t *testing.T) {
	p := NewPresence(0)
	p.Set(slice("ns", "web-a", "web", live("10.1.0.5")), t0)
	p.Set(slice("ns", "web-a", "web", draining("10.1.0.5")), t0.Add(time.Second))
	p.Set(slice("ns", "web-a", "web", terminating("10.1.0.5")), t0.Add(2*time.Second))
	if got := dueAddrs(p, t0.Add(time.Hour)); len(got) != 0 {
		t.Fatalf("a terminating endpoint still in its slice was handed out: %v", got)
	}
	// The controller drops it once the pod is deleted.
	p.Set(slice("ns", "web-a", "web"), t0.Add(3*time.Second))
	if got := dueAddrs(p, t0.Add(3*time.Second)); !slices.Equal(got, []string{"10.1.0.5"}) {
		t.Fatalf("due = %v, want [10.1.0.5]", got)
	}
}

func TestMoveBetweenSlicesWithinHold(t *testing.T) {
	p := NewPresence(time.Second)
	p.Set(slice("ns", "web-a", "web", live("10.1.0.5")), t0)
	// The controller rewrites web-a first, then web-b: the watch sees
	// the address in no slice for 200 ms.
	p.Set(slice("ns", "web-a", "web"), t0.Add(time.Second))
	p.Set(slice("ns", "web-b", "web", live("10.1.0.5")), t0.Add(1200*time.Millisecond))
	if got := dueAddrs(p, t0.Add(time.Hour)); len(got) != 0 {
		t.Fatalf("an address that moved between slices was handed out: %v", got)
	}
}

func TestAddressOfAnotherService(t *testing.T) {
	p := NewPresence(0)
	p.Set(slice("ns", "web-a", "web", live("10.1.0.5")), t0)
	p.Set(slice("ns", "api-a", "api", live("10.1.0.5")), t0)
	p.Delete("ns/web-a", t0.Add(time.Second))
	if got := dueAddrs(p, t0.Add(time.Hour)); len(got) != 0 {
		t.Fatalf("an address another Service's slice names was handed out: %v", got)
	}
	p.Delete("ns/api-a", t0.Add(2*time.Second))
	g := p.Due(t0.Add(2 * time.Second))
	if len(g) != 1 || g[0].Addr != netip.MustParseAddr("10.1.0.5") || g[0].Service != "ns/api" || !g[0].Since.Equal(t0.Add(2*time.Second)) {
		t.Fatalf("due = %+v, want 10.1.0.5 from ns/api at t0+2s", g)
	}
}

func TestComesBackBeforeDue(t *testing.T) {
	p := NewPresence(time.Second)
	p.Set(slice("ns", "web-a", "web", live("10.1.0.5")), t0)
	p.Delete("ns/web-a", t0.Add(time.Second))
	if n, ok := p.Next(); !ok || !n.Equal(t0.Add(2*time.Second)) {
		t.Fatalf("Next = %v %v", n, ok)
	}
	p.Set(slice("ns", "web-a", "web", live("10.1.0.5")), t0.Add(1500*time.Millisecond))
	if got := dueAddrs(p, t0.Add(time.Hour)); len(got) != 0 {
		t.Fatalf("an address back before its hold ran out was handed out: %v", got)
	}
	if _, ok := p.Next(); ok {
		t.Fatal("Next reports a waiting address after it came back")
	}
}

func TestAddressesSkipsFQDNAndDuplicates(t *testing.T) {
	s := slice("ns", "web-a", "web", live("10.1.0.5"), live("10.1.0.5"), live("not-an-ip"))
	if got := Addresses(s); len(got) != 1 {
		t.Fatalf("Addresses = %v", got)
	}
	s.AddressType = discoveryv1.AddressTypeFQDN
	if got := Addresses(s); got != nil {
		t.Fatalf("FQDN slice: Addresses = %v", got)
	}
}

func TestStripKeepsWhatPresenceReads(t *testing.T) {
	s := slice("ns", "web-a", "web", draining("10.1.0.5"))
	s.Labels["other"] = "x"
	s.Annotations = map[string]string{"a": "b"}
	s.ManagedFields = []metav1.ManagedFieldsEntry{{Manager: "m"}}
	node := "n1"
	s.Endpoints[0].NodeName = &node
	s.Ports = []discoveryv1.EndpointPort{{}}
	o, err := Strip(s)
	if err != nil {
		t.Fatal(err)
	}
	st := o.(*discoveryv1.EndpointSlice)
	if len(st.Labels) != 1 || st.Annotations != nil || st.ManagedFields != nil || st.Ports != nil || st.Endpoints[0].NodeName != nil {
		t.Fatalf("Strip kept fields Presence does not read: %+v", st)
	}
	if !slices.Equal(Addresses(st), Addresses(s)) || ServiceOf(st) != "ns/web" || !*st.Endpoints[0].Conditions.Serving {
		t.Fatalf("Strip lost what Presence reads: %+v", st)
	}
}
