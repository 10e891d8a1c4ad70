package daemon

import (
	"context"
	"net/netip"
	"sync"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// A flight is the scrub of one IP on every backend. Requests for an IP whose
// flight is running join it instead of starting another (per-IP singleflight):
// no lock is shared between IPs, so flights of different IPs run at once, and
// IPs that need the sweep at the same moment meet in the backend's Sweeper.
//
// A flight runs under its own context, not its first caller's: it lives as
// long as at least one caller still waits for it. Each caller waits under its
// own deadline; when the last one leaves (deadline passed, disconnected) the
// flight is cancelled and stops within the backend's bound.
type flight struct {
	key    flightKey
	reason scrub.Reason
	still  func(netip.Addr) bool // scrub.Request.Still; set iff key.guarded
	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{}

	seq       uint64 // the flight's number (flights.seq when it started)
	waiters   int    // guarded by flights.mu
	abandoned bool   // guarded by flights.mu: cancelled, no longer joinable

	// Set before done is closed.
	results []scrub.Result
	start   time.Time
	end     time.Time
}

type flightKey struct {
	ip  netip.Addr
	dry bool // a dry run never shares a real scrub's answer, nor the reverse
	// guarded: the flight may leave the IP alone (its Still, a GC's); a
	// caller that needs the IP scrubbed must not join it.
	guarded bool
}

type flights struct {
	mu sync.Mutex
	m  map[flightKey]*flight
	// live holds every flight whose work has not returned, including the
	// abandoned ones (gone from m, no caller left, still stopping): they may
	// hold keys they took from the index. Nil until the first flight.
	live map[*flight]struct{}
	seq  uint64 // flights started so far
}

// started is the number of the last flight started: every flight with a
// number up to it may have made its decision already.
func (g *flights) started() uint64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.seq
}

// settle waits until no flight for key numbered up to seq is running (or
// ctx ends): a caller that marked the IP since must not join a flight that
// may have judged the index before the mark.
func (g *flights) settle(ctx context.Context, key flightKey, seq uint64) error {
	for {
		g.mu.Lock()
		f := g.m[key]
		g.mu.Unlock()
		if f == nil || f.seq > seq {
			return nil
		}
		select {
		case <-f.done:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// join returns ip's running flight, or starts one with run. shared reports
// whether the caller joined a flight that was already running.
func (g *flights) join(root context.Context, key flightKey, reason scrub.Reason, still func(netip.Addr) bool, run func(f *flight)) (f *flight, shared bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if f = g.m[key]; f != nil && !f.abandoned {
		f.waiters++
		return f, true
	}
	ctx, cancel := context.WithCancel(root)
	g.seq++
	f = &flight{key: key, reason: reason, still: still, ctx: ctx, cancel: cancel, done: make(chan struct{}), waiters: 1, seq: g.seq}
	g.m[key] = f
	if g.live == nil {
		g.live = make(map[*flight]struct{})
	}
	g.live[f] = struct{}{}
	go func() {
		defer cancel()
		run(f)
		g.mu.Lock()
		if g.m[key] == f {
			delete(g.m, key)
		}
		delete(g.live, f)
		g.mu.Unlock()
		close(f.done)
	}()
	return f, false
}

// wait waits for f under the caller's ctx. When ctx ends first and the caller
// was the flight's last waiter, the flight is cancelled and wait returns its
// partial results (the backends stop promptly); when others still wait, the
// flight goes on for them and this caller gets no results of its own.
func (g *flights) wait(ctx context.Context, f *flight) (results []scrub.Result, finished bool) {
	select {
	case <-f.done:
		g.leave(f)
		return f.results, true
	case <-ctx.Done():
	}
	if !g.leave(f) {
		return nil, false
	}
	// Last waiter: the cancelled backends return what they did. The bound
	// guards against a backend that breaks its promise to stop promptly.
	select {
	case <-f.done:
		return f.results, true
	case <-time.After(2 * time.Second):
		return nil, false
	}
}

// leave drops one waiter; it reports whether that was the last one, in which
// case the flight is cancelled and no one can join it any more.
func (g *flights) leave(f *flight) (last bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	f.waiters--
	if f.waiters > 0 {
		return false
	}
	select {
	case <-f.done:
		return true
	default:
	}
	f.abandoned = true
	if g.m[f.key] == f {
		delete(g.m, f.key)
	}
	f.cancel()
	return true
}

// running is the number of flights whose work has not returned, abandoned
// ones included.
func (g *flights) running() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.live)
}

// liveIPs are the IPs of the flights whose work has not returned.
func (g *flights) liveIPs() []netip.Addr {
	g.mu.Lock()
	defer g.mu.Unlock()
	var out []netip.Addr
	for f := range g.live {
		out = append(out, f.key.ip)
	}
	return out
}
