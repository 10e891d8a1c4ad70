package recorder

import (
	"errors"
	"fmt"
	"net/netip"
	"sync"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// Prune drops from ip's index the keys Cilium no longer holds (its LRU or
// GC removed them) and makes the recorder forget ip's cached flows, so a
// flow that comes back is recorded again. Run calls it on its own, from a
// background worker, whenever an IP's set has doubled since its last prune
// (index.NeedsPrune) and Options.CT is set; that bounds stale keys to half
// of a set at O(1) amortised lookups per added key.
//
// The lookups run without ip's lock (index.Prune copies the keys first), so
// the ring buffer reader's Apply never waits for them. A key is dropped only
// when it is missing both before and after ip's cached flows were forgotten
// (one generation bump, at the first missing key), and was not recorded
// again meanwhile: a packet that re-creates the entry in between either
// finds the flow still cached (the entry then exists at the second lookup
// and the key stays) or is recorded again (its Add during the prune makes
// index.Prune keep the key). The bump makes every live flow of ip send one
// record again; the index dedups them.
func (r *Recorder) Prune(ix *index.Index, ct *ctmap.Maps, ip netip.Addr) (dropped int, err error) {
	var errs []error
	exists := func(kind ctmap.Kind, key any) bool {
		m := ct.Map(kind)
		if m == nil {
			return false
		}
		var v ctmap.Entry
		lerr := m.Lookup(key, &v)
		if lerr != nil && !errors.Is(lerr, ebpf.ErrKeyNotExist) {
			errs = append(errs, lerr)
			return true // unsure: keep the key
		}
		return lerr == nil
	}
	forgotten, failed := false, false
	forget := func() bool {
		if !forgotten && !failed {
			if err := r.ForgetIPs(ip); err != nil {
				errs = append(errs, err)
				failed = true
			} else {
				forgotten = true
			}
		}
		return forgotten
	}
	gone4 := func(k ctmap.CTKey4) bool {
		return !exists(k.Kind(), k) && forget() && !exists(k.Kind(), k)
	}
	gone6 := func(k ctmap.CTKey6) bool {
		return !exists(k.Kind(), k) && forget() && !exists(k.Kind(), k)
	}
	dropped = ix.Prune(ip, gone4, gone6)
	if failed {
		ix.MarkIncomplete(ip, ReasonForgetFailed)
	}
	if err := errors.Join(errs...); err != nil {
		return dropped, fmt.Errorf("recorder: prune %s: %w", ip, err)
	}
	return dropped, nil
}

// pruneQueue hands IPs to the prune worker without blocking the ring
// buffer reader; an IP already queued is not queued twice, and when the
// queue is full the IP's next record offers it again.
type pruneQueue struct {
	mu      sync.Mutex
	pending map[netip.Addr]bool
	ch      chan netip.Addr
}

func newPruneQueue() *pruneQueue {
	return &pruneQueue{ch: make(chan netip.Addr, 1024), pending: make(map[netip.Addr]bool)}
}

func (q *pruneQueue) offer(ip netip.Addr) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.pending[ip] {
		return
	}
	select {
	case q.ch <- ip:
		q.pending[ip] = true
	default:
	}
}

// taken is called by the worker before it prunes ip, so growth during the
// prune can queue it again.
func (q *pruneQueue) taken(ip netip.Addr) {
	q.mu.Lock()
	delete(q.pending, ip)
	q.mu.Unlock()
}
