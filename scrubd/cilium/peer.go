package cilium

import (
	"context"
	"errors"
	"net/netip"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// ErrNoPeerTable: ScrubPeer needs the index's peer table
// (index.EnablePeers), which the daemon turns on with the remote-backend
// watch.
var ErrNoPeerTable = errors.New("cilium: the index keeps no peer table (remote_backends is off)")

// ScrubPeer deletes the CT entries this node's pods hold towards peer, a
// Service backend on another node that left the cluster (docs/remote.md):
// every key the index's peer table lists for it (OUT, IN and RELATED, in
// the forms index.Covered adds, with their SNAT mappings, by the delete
// program), and the SERVICE entries of local clients' flows whose learnt
// backend is peer while they still name its backend ID (a flow Cilium
// re-picked to a live backend keeps its entry). O(k): k = those keys; no
// walk. It takes no key out of the index: a client's set keeps them (its
// own scrub finds them gone), so no client's completeness changes. The
// caller makes sure no pod of this node holds peer.
func (c *Backend) ScrubPeer(ctx context.Context, peer netip.Addr) (scrub.Result, error) {
	start := time.Now()
	c.mu.RLock()
	defer c.mu.RUnlock()
	s := &scrubRun{c: c, ctx: ctx, res: scrub.Result{
		Backend: c.Name(),
		Method:  scrub.MethodIndex,
		Outcome: scrub.Complete,
		Deleted: map[string]int{},
	}}
	k4, k6, svcs, ok := c.ix.PeerKeys(peer)
	if !ok {
		return s.finish(start, ErrNoPeerTable)
	}
	x4, x6 := index.Covered(k4, k6)
	for _, sv := range svcs {
		var e ctmap.Entry
		if sv.V6 {
			if m := c.maps.Map(sv.K6.Kind()); m != nil && m.Lookup(sv.K6, &e) == nil && uint32(e.Decode().BackendID) == sv.ID {
				x6 = append(x6, sv.K6)
			}
			continue
		}
		if m := c.maps.Map(sv.K4.Kind()); m != nil && m.Lookup(sv.K4, &e) == nil && uint32(e.Decode().BackendID) == sv.ID {
			x4 = append(x4, sv.K4)
		}
	}
	_, _, err := c.deleteKeys(ctx, x4, x6, s.res.Deleted, nil)
	return s.finish(start, err)
}
