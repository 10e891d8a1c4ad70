// Package endpoints learns from the Kubernetes API that a Service backend's
// address left the cluster, so scrubd can delete the CT entries its node's
// clients keep towards it (docs/remote.md). The watch is of EndpointSlices,
// as kube-proxy and Cilium's agent keep on every node; Presence, the rule
// that decides when an address is gone, is a pure function of the slices
// seen and the time, with no I/O (watch.go feeds it).
//
// The rule: an address is gone once it has been named by no EndpointSlice
// at all, of any Service, for Hold. An endpoint a slice still names,
// whatever its conditions (ready, serving, terminating), is present: a
// terminating pod that still serves keeps its flows until the
// EndpointSlice controller drops it, which it does when the pod is deleted.
// Whole-cluster rather than per-Service presence: a pod that backs two
// Services and leaves one still serves the other, and its address-wide
// entries are that other Service's flows too.
package endpoints

import (
	"net/netip"
	"slices"
	"time"

	discoveryv1 "k8s.io/api/discovery/v1"
)

// DefaultHold is how long an address must stay out of every slice before it
// is gone. The EndpointSlice controller moves an endpoint between a
// Service's slices in separate writes (a watch may see it leave one before
// it joins the other), and Services are re-created by tools in two steps.
const DefaultHold = time.Second

// Addresses lists the IP addresses s names, each once, whatever their
// endpoints' conditions. An FQDN slice names none.
func Addresses(s *discoveryv1.EndpointSlice) []netip.Addr {
	if s == nil || (s.AddressType != discoveryv1.AddressTypeIPv4 && s.AddressType != discoveryv1.AddressTypeIPv6) {
		return nil
	}
	var out []netip.Addr
	for i := range s.Endpoints {
		for _, a := range s.Endpoints[i].Addresses {
			ip, err := netip.ParseAddr(a)
			if err != nil {
				continue
			}
			ip = ip.Unmap()
			if !slices.Contains(out, ip) {
				out = append(out, ip)
			}
		}
	}
	return out
}

// SliceKey is a slice's identity in Presence: namespace/name.
func SliceKey(s *discoveryv1.EndpointSlice) string { return s.Namespace + "/" + s.Name }

// ServiceOf is the Service a slice belongs to (its kubernetes.io/service-name
// label; "" for a slice no Service owns).
func ServiceOf(s *discoveryv1.EndpointSlice) string {
	if n := s.Labels[discoveryv1.LabelServiceName]; n != "" {
		return s.Namespace + "/" + n
	}
	return ""
}

// Gone is an address that left every slice.
type Gone struct {
	Addr netip.Addr
	// Since is when the watch delivered the change that took the address
	// out of its last slice (the start of the metric's latency).
	Since time.Time
	// Service is that last slice's Service (logs).
	Service string
}

// Presence is what the watched EndpointSlices name: by slice its addresses,
// by address how many slices name it, and the addresses waiting out Hold.
// Not safe for concurrent use: watch.go calls it from one goroutine.
type Presence struct {
	hold    time.Duration
	slices  map[string]sliceState
	refs    map[netip.Addr]int
	waiting map[netip.Addr]Gone
}

type sliceState struct {
	service string
	addrs   []netip.Addr
}

// NewPresence returns an empty Presence; hold < 0 means DefaultHold.
func NewPresence(hold time.Duration) *Presence {
	if hold < 0 {
		hold = DefaultHold
	}
	return &Presence{hold: hold, slices: map[string]sliceState{}, refs: map[netip.Addr]int{}, waiting: map[netip.Addr]Gone{}}
}

// Set records s as it is now (added or updated), at now.
func (p *Presence) Set(s *discoveryv1.EndpointSlice, now time.Time) {
	p.set(SliceKey(s), sliceState{service: ServiceOf(s), addrs: Addresses(s)}, now)
}

// Delete records that the slice key is gone, at now.
func (p *Presence) Delete(key string, now time.Time) { p.set(key, sliceState{}, now) }

func (p *Presence) set(key string, st sliceState, now time.Time) {
	old := p.slices[key]
	// New references first: an address the slice keeps never drops to 0.
	for _, a := range st.addrs {
		p.refs[a]++
		delete(p.waiting, a)
	}
	for _, a := range old.addrs {
		if p.refs[a]--; p.refs[a] <= 0 {
			delete(p.refs, a)
			p.waiting[a] = Gone{Addr: a, Since: now, Service: old.service}
		}
	}
	if len(st.addrs) == 0 && st.service == "" {
		delete(p.slices, key)
	} else {
		p.slices[key] = st
	}
}

// Present reports whether a slice names a.
func (p *Presence) Present(a netip.Addr) bool { return p.refs[a.Unmap()] > 0 }

// Due hands out the addresses named by no slice for Hold by now, each once;
// an address that comes back before then is never handed out.
func (p *Presence) Due(now time.Time) []Gone {
	var out []Gone
	for a, g := range p.waiting {
		if now.Sub(g.Since) >= p.hold && p.refs[a] == 0 {
			out = append(out, g)
			delete(p.waiting, a)
		}
	}
	slices.SortFunc(out, func(x, y Gone) int { return x.Addr.Compare(y.Addr) })
	return out
}

// Next is when the earliest waiting address falls due (false: none waits).
func (p *Presence) Next() (time.Time, bool) {
	var t time.Time
	for _, g := range p.waiting {
		if d := g.Since.Add(p.hold); t.IsZero() || d.Before(t) {
			t = d
		}
	}
	return t, !t.IsZero()
}

// Addrs is the number of distinct addresses the slices name (status).
func (p *Presence) Addrs() int { return len(p.refs) }

// Slices is the number of slices seen (status).
func (p *Presence) Slices() int { return len(p.slices) }

// Waiting is the number of addresses waiting out Hold (status).
func (p *Presence) Waiting() int { return len(p.waiting) }
