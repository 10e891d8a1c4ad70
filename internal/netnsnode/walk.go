package netnsnode

import (
	"context"
	"net/netip"
	"time"

	"github.com/ctscrub/ctscrub/internal/ciliumwalk"
)

// WalkResult is one full walk over the four CT maps, the way Cilium scrubs an
// IP (internal/ciliumwalk, the baseline every benchmark shares): every entry
// is read, the ones with the IP are what it would delete.
type WalkResult struct {
	Entries  int // entries read
	Matches  int // entries holding one of the IPs
	Duration time.Duration
}

func timed(st ciliumwalk.Stats, start time.Time) WalkResult {
	return WalkResult{Entries: st.Visited, Matches: st.Matched, Duration: time.Since(start)}
}

// NextKeyWalk is Cilium 1.16's walk (two syscalls per entry). It deletes
// nothing: the demo times the walk, ctscrub does the delete.
func NextKeyWalk(ctx context.Context, m *CTMaps, ips []netip.Addr) (WalkResult, error) {
	start := time.Now()
	st, err := ciliumwalk.NextKey(m.maps, ciliumwalk.HasIP(ips...), ciliumwalk.Options{CountOnly: true, Ctx: ctx})
	return timed(st, start), err
}

// BatchWalkAll is Cilium 1.18+'s batched walk, deleting nothing.
func BatchWalkAll(m *CTMaps, ips []netip.Addr) (WalkResult, error) {
	start := time.Now()
	st, err := ciliumwalk.Batch(m.maps, ciliumwalk.HasIP(ips...), ciliumwalk.Options{CountOnly: true})
	return timed(st, start), err
}

// EntriesOf counts the entries holding ip in all four maps (a check, not a
// scrub: the demo uses it to show what a reused IP inherits).
func EntriesOf(m *CTMaps, ips ...netip.Addr) (int, error) {
	r, err := BatchWalkAll(m, ips)
	return r.Matches, err
}
