package daemon

import (
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// Ownership: the recorder only sees pods ctscrub attached to. An IP the index
// calls complete may still have had an owner ctscrub never saw (a pod created
// while the conflist did not chain ctscrub, or while scrubd was down under
// failurePolicy ignore) whose entries the index does not hold. So an ADD's
// scrub trusts the index only after a clean handover:
//
//   - released: the IP's last owner was an attachment scrubd indexed, and its
//     DEL (or GC) scrub completed. Set by that scrub.
//   - anything else (owned, never seen, or released and then touched by any
//     sign of an unseen owner) is unknown: the ADD scrub marks the IP
//     incomplete first (index.ReasonOwner), so it sweeps.
//
// Signs of an unseen owner clear every release at once (the daemon cannot
// tell which IP the unseen pod had): a DEL of an attachment scrubd never
// indexed (the plugin reports it with an index stop), and the conflist in
// cni_conf_dir not chaining ctscrub. A DEL scrub of an unknown attachment
// that names IPs marks those IPs incomplete before it runs (it sweeps). The
// continuous audit is the backstop for the rest. Releases live in memory: after
// a restart every IP's first ADD sweeps.
type ownership struct {
	mu       sync.Mutex
	released map[netip.Addr]time.Time
	chained  *bool                 // the last conflist check; nil: not watched
	claims   map[*gcClaim]struct{} // the GCs running now
}

// A gcClaim is a running GC's watch on the IPs an ADD takes: the GC decides
// which IPs to scrub from one listing of the attachments, and an ADD of one
// of them after that listing (its take or forget) gives the IP a new owner the
// listing did not show. The GC leaves such an IP alone: no scrub (the new
// pod's entries are live), no release (it is owned).
type gcClaim struct {
	o     *ownership
	taken map[netip.Addr]bool // guarded by o.mu
	// distrusted: a sign of an unseen owner came while the GC ran; it
	// releases nothing (guarded by o.mu).
	distrusted bool
}

// claim starts watching ADDs for a GC; call it before the GC lists the
// attachments, and end the claim when the GC is done.
func (o *ownership) claim() *gcClaim {
	o.mu.Lock()
	defer o.mu.Unlock()
	c := &gcClaim{o: o, taken: map[netip.Addr]bool{}}
	if o.claims == nil {
		o.claims = map[*gcClaim]struct{}{}
	}
	o.claims[c] = struct{}{}
	return c
}

// untaken reports whether no ADD took ip since the claim started.
func (c *gcClaim) untaken(ip netip.Addr) bool {
	c.o.mu.Lock()
	defer c.o.mu.Unlock()
	return !c.taken[ip]
}

// release releases the IPs no ADD took since the claim started, in the same
// critical section as the check: an ADD after it ends the release as usual.
func (c *gcClaim) release(ips []netip.Addr) {
	c.o.mu.Lock()
	defer c.o.mu.Unlock()
	if c.distrusted {
		return
	}
	for _, ip := range ips {
		if !c.taken[ip] {
			c.o.releaseLocked(ip)
		}
	}
}

func (c *gcClaim) end() {
	c.o.mu.Lock()
	defer c.o.mu.Unlock()
	delete(c.o.claims, c)
}

// takenLocked tells the running GCs that ip has a new owner.
func (o *ownership) takenLocked(ip netip.Addr) {
	for c := range o.claims {
		c.taken[ip] = true
	}
}

func (o *ownership) release(ip netip.Addr) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.releaseLocked(ip)
}

func (o *ownership) releaseLocked(ip netip.Addr) {
	if o.released == nil {
		o.released = map[netip.Addr]time.Time{}
	}
	o.released[ip] = time.Now()
}

// take reports whether ip was released cleanly, and ends the release (the IP
// is getting an owner).
func (o *ownership) take(ip netip.Addr) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	_, ok := o.released[ip]
	delete(o.released, ip)
	o.takenLocked(ip)
	return ok
}

// releasedAt reports when ip was released, if it is released now.
func (o *ownership) releasedAt(ip netip.Addr) (time.Time, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	t, ok := o.released[ip]
	return t, ok
}

// still reports whether ip is still in the release of time at: no ADD,
// index start or sign of an unseen owner since.
func (o *ownership) still(ip netip.Addr, at time.Time) bool {
	t, ok := o.releasedAt(ip)
	return ok && t.Equal(at)
}

// forget ends ip's release: it is owned now, or had an owner scrubd never saw.
func (o *ownership) forget(ip netip.Addr) {
	o.mu.Lock()
	defer o.mu.Unlock()
	delete(o.released, ip)
	o.takenLocked(ip)
}

// distrust ends every release; it returns how many there were.
func (o *ownership) distrust() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	n := len(o.released)
	clear(o.released)
	for c := range o.claims {
		c.distrusted = true
	}
	return n
}

// beforeScrub applies the ownership rules to a scrub request before it runs.
func (d *Daemon) beforeScrub(req api.ScrubRequest, ips []netip.Addr) {
	if req.DryRun {
		return
	}
	switch req.Reason {
	case scrub.ReasonAdd:
		for _, ip := range ips {
			if !d.own.take(ip) && d.ix.Owns(ip) && d.ix.State(ip).Complete {
				d.ix.MarkIncomplete(ip, index.ReasonOwner)
				d.log.Info("ADD scrub: the IP was not released by a DEL scrubd saw; it sweeps", "ip", ip, "container_id", req.ContainerID)
			}
		}
	case scrub.ReasonDel:
		if req.ContainerID == "" {
			return // an operator's scrub: no attachment to judge
		}
		for _, ip := range ips {
			if d.pods.held(req.ContainerID, req.IfName, ip) {
				continue
			}
			// A pod scrubd never indexed had this IP: its flows are not
			// in the index.
			d.own.forget(ip)
			if d.ix.Owns(ip) && d.ix.State(ip).Complete {
				d.ix.MarkIncomplete(ip, index.ReasonOwner)
				d.log.Info("DEL scrub of an attachment scrubd never indexed: the IP sweeps", "ip", ip, "container_id", req.ContainerID, "ifname", req.IfName)
			}
		}
	}
}

// afterScrub releases the IPs of a DEL whose scrub completed on every
// backend: their next ADD may trust the index. (A GC releases through its
// claim: gc.go.)
func (d *Daemon) afterScrub(reason scrub.Reason, containerID string, ips []netip.Addr, results []scrub.Result) {
	if reason != scrub.ReasonDel || containerID == "" || !completed(results) {
		return
	}
	for _, ip := range ips {
		d.own.release(ip)
	}
}

// completed reports whether the scrub completed on every backend.
func completed(results []scrub.Result) bool {
	for _, r := range results {
		if r.Outcome != scrub.Complete {
			return false
		}
	}
	return true
}

// unseenOwner is a sign that a pod ctscrub never saw existed: no released IP
// can be trusted any more.
func (d *Daemon) unseenOwner(why string, attrs ...any) {
	n := d.own.distrust()
	d.log.Warn("a pod scrubd never indexed existed: released IPs are no longer trusted, their next ADD sweeps",
		append([]any{"why", why, "released_ips", n}, attrs...)...)
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// held reports whether an attachment of containerID (with ifname, when
// given) holds ip, active or stopped within the TTL.
//
// A DEL's scrub asks it per IP: with ifname, two map lookups rather than a
// sorted copy of every attachment (the stopped ones of the last stopped_ttl
// included, hundreds on a churning node).
func (p *pods) held(containerID, ifname string, ip netip.Addr) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if ifname != "" {
		a := api.Attachment{ContainerID: containerID, IfName: ifname}
		for _, m := range []map[api.Attachment]api.IndexedPod{p.active, p.stopped} {
			if pod, ok := m[a]; ok && slices.Contains(pod.IPs, ip) {
				return true
			}
		}
		return false
	}
	for _, m := range []map[api.Attachment]api.IndexedPod{p.active, p.stopped} {
		for a, pod := range m {
			if a.ContainerID == containerID && slices.Contains(pod.IPs, ip) {
				return true
			}
		}
	}
	return false
}

// holds reports whether any attachment scrubd indexed (active, or stopped
// within the TTL) holds ip.
func (p *pods) holds(ip netip.Addr) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range []map[api.Attachment]api.IndexedPod{p.active, p.stopped} {
		for _, pod := range m {
			if slices.Contains(pod.IPs, ip) {
				return true
			}
		}
	}
	return false
}
