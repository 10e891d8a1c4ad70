package endpoints

import (
	"fmt"
	"testing"
	"time"

	discoveryv1 "k8s.io/api/discovery/v1"
)

// BenchmarkWatchEvent100 is the watch's own work for one event of a
// 100-endpoint slice, as the informer hands it over decoded: Strip, then
// the handler (Presence.Set) with one endpoint replaced, among 1,000 such
// slices (docs/remote.md, Scale: what of the measured CPU per event is
// scrubd's and what client-go's decoding).
func BenchmarkWatchEvent100(b *testing.B) {
	const slices, per = 1000, 100
	w := NewWatch(time.Hour)
	mk := func(svc, first int) *discoveryv1.EndpointSlice {
		eps := make([]ep, per)
		for i := range eps {
			n := first + i
			eps[i] = live(fmt.Sprintf("10.%d.%d.%d", 128+n>>16, n>>8&255, n&255))
		}
		return slice("ns", fmt.Sprintf("svc-%d", svc), fmt.Sprintf("svc-%d", svc), eps...)
	}
	for s := range slices {
		w.OnAdd(mk(s, s*per), true)
	}
	// Each event: the slice with its endpoints moved on by one (made
	// beforehand: versions 1..8 of each slice, then round again).
	const versions = 8
	next := make([][]*discoveryv1.EndpointSlice, slices)
	for s := range slices {
		for v := range versions {
			next[s] = append(next[s], mk(s, s*per+1+v))
		}
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		s := i % slices
		o, _ := Strip(next[s][(i/slices)%versions])
		w.OnUpdate(nil, o)
		if i%slices == slices-1 {
			b.StopTimer()
			w.mu.Lock()
			w.p.Due(w.now().Add(2 * time.Hour)) // what Loop hands out
			w.mu.Unlock()
			b.StartTimer()
		}
	}
}
