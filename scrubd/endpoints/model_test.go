package endpoints

import (
	"flag"
	"net/netip"
	"testing"
	"time"

	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/ctscrub/ctscrub/internal/testsupport/slicemodel"
)

// The model-based test of the remote-backend rule: the reference model's
// random walk (internal/testsupport/slicemodel) drives the Watch's informer
// handlers with real EndpointSlice objects and a clock, and checks every
// address it hands out. -slicemodel.steps and -slicemodel.seeds (or
// CTSCRUB_SLICEMODEL_STEPS, _SEEDS) set its length.
var (
	sliceSteps = flag.Int("slicemodel.steps", slicemodel.EnvInt("CTSCRUB_SLICEMODEL_STEPS", 50000), "steps per seed of the slice model walk")
	sliceSeeds = flag.Int("slicemodel.seeds", slicemodel.EnvInt("CTSCRUB_SLICEMODEL_SEEDS", 20), "seeds of the slice model walk")
)

// watchSystem is the Watch as the informer drives it, with the walk's clock.
type watchSystem struct {
	w   *Watch
	now time.Time
}

func newWatchSystem(hold time.Duration) *watchSystem {
	s := &watchSystem{w: NewWatch(hold)}
	s.w.now = func() time.Time { return s.now }
	return s
}

func (s *watchSystem) OnAdd(obj any, initial bool) { s.w.OnAdd(obj, initial) }
func (s *watchSystem) OnUpdate(old, obj any)       { s.w.OnUpdate(old, obj) }
func (s *watchSystem) OnDelete(obj any)            { s.w.OnDelete(obj) }
func (s *watchSystem) Due(now time.Time) []netip.Addr {
	s.now = now
	s.w.mu.Lock()
	defer s.w.mu.Unlock()
	var out []netip.Addr
	for _, g := range s.w.p.Due(now) {
		out = append(out, g.Addr)
	}
	return out
}

func TestRemoteBackendModel(t *testing.T) {
	var steps, handed int
	for seed := uint64(1); seed <= uint64(*sliceSeeds); seed++ {
		f := slicemodel.Walk(seed, *sliceSteps, newWatchSystem(slicemodel.Hold))
		steps += f.Steps
		handed += f.HandedOut
		if len(f.Violations) > 0 {
			t.Fatalf("seed %d: violations %v; first:\n%s", seed, f.Violations, f.First)
		}
		if f.HandedOut == 0 {
			t.Fatalf("seed %d: nothing handed out in %d steps: the walk does not exercise the rule", seed, f.Steps)
		}
	}
	t.Logf("%d seeds, %d steps, %d addresses handed out, 0 violations", *sliceSeeds, steps, handed)
}

// The walk must catch the rules it exists to refuse.
func TestRemoteBackendModelCatchesWrongRules(t *testing.T) {
	for _, tc := range []struct {
		name string
		sys  func() slicemodel.System
		want string
	}{
		{"no hold", func() slicemodel.System { return newWatchSystem(0) }, "same Service"},
		{"an address out of one slice", func() slicemodel.System { return &perSlice{} }, "serving"},
		{"per Service", func() slicemodel.System { return &perService{newWatchSystem(slicemodel.Hold)} }, "any slice"},
	} {
		found := false
		for seed := uint64(1); seed <= 5 && !found; seed++ {
			f := slicemodel.Walk(seed, 5000, tc.sys())
			found = f.Violations[tc.want] > 0
		}
		if !found {
			t.Errorf("%s: the walk found no %q violation in 5 seeds", tc.name, tc.want)
		}
	}
}

// perSlice hands out every address a slice update drops.
type perSlice struct{ out []netip.Addr }

func (p *perSlice) OnAdd(any, bool) {}
func (p *perSlice) OnUpdate(old, obj any) {
	n := map[netip.Addr]bool{}
	for _, a := range Addresses(obj.(*discoveryv1.EndpointSlice)) {
		n[a] = true
	}
	for _, a := range Addresses(old.(*discoveryv1.EndpointSlice)) {
		if !n[a] {
			p.out = append(p.out, a)
		}
	}
}
func (p *perSlice) OnDelete(obj any) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	p.out = append(p.out, Addresses(obj.(*discoveryv1.EndpointSlice))...)
}
func (p *perSlice) Due(time.Time) []netip.Addr { out := p.out; p.out = nil; return out }

// perService is the Watch with every Service's slices kept apart: an
// address leaves when its Service's slices no longer name it.
type perService struct{ *watchSystem }

func (p *perService) rename(obj any) any {
	s, ok := obj.(*discoveryv1.EndpointSlice)
	if !ok {
		return obj
	}
	s = s.DeepCopy()
	for i := range s.Endpoints {
		for j, a := range s.Endpoints[i].Addresses {
			// One address space per Service: the slice's Service in
			// the address's first octet.
			ip := netip.MustParseAddr(a).As4()
			ip[0] = s.Labels[discoveryv1.LabelServiceName][0]
			s.Endpoints[i].Addresses[j] = netip.AddrFrom4(ip).String()
		}
	}
	return s
}
func (p *perService) OnAdd(obj any, b bool) { p.watchSystem.OnAdd(p.rename(obj), b) }
func (p *perService) OnUpdate(old, obj any) { p.watchSystem.OnUpdate(p.rename(old), p.rename(obj)) }
func (p *perService) OnDelete(obj any) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	p.watchSystem.OnDelete(p.rename(obj))
}
func (p *perService) Due(now time.Time) []netip.Addr {
	out := p.watchSystem.Due(now)
	for i, a := range out {
		ip := a.As4()
		ip[0] = 10
		out[i] = netip.AddrFrom4(ip)
	}
	return out
}
