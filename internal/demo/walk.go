package demo

import (
	"context"
	"net/netip"
	"time"

	"github.com/ctscrub/ctscrub/internal/ciliumwalk"
)

// walkResult is one full walk over the four CT maps, the way Cilium scrubs an
// IP (internal/ciliumwalk, the baseline every benchmark shares): every entry
// is read, the ones with the IP are what it would delete.
type walkResult struct {
	Entries  int // entries read
	Matches  int // entries holding one of the IPs
	Duration time.Duration
}

func timed(st ciliumwalk.Stats, start time.Time) walkResult {
	return walkResult{Entries: st.Visited, Matches: st.Matched, Duration: time.Since(start)}
}

// nextKeyWalk is Cilium 1.16's walk (two syscalls per entry). It deletes
// nothing: the demo times the walk, ctscrub does the delete.
func nextKeyWalk(ctx context.Context, m *ctMaps, ips []netip.Addr) (walkResult, error) {
	start := time.Now()
	st, err := ciliumwalk.NextKey(m.maps, ciliumwalk.HasIP(ips...), ciliumwalk.Options{CountOnly: true, Ctx: ctx})
	return timed(st, start), err
}

// batchWalkAll is Cilium 1.18+'s batched walk, deleting nothing.
func batchWalkAll(m *ctMaps, ips []netip.Addr) (walkResult, error) {
	start := time.Now()
	st, err := ciliumwalk.Batch(m.maps, ciliumwalk.HasIP(ips...), ciliumwalk.Options{CountOnly: true})
	return timed(st, start), err
}

// entriesOf counts the entries holding ip in all four maps (a check, not a
// scrub: the demo uses it to show what a reused IP inherits).
func entriesOf(m *ctMaps, ips ...netip.Addr) (int, error) {
	r, err := batchWalkAll(m, ips)
	return r.Matches, err
}
