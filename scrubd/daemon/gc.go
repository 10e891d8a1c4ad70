package daemon

import (
	"context"
	"fmt"
	"net/http"
	"net/netip"
	"sync"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/owner"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// handleGC serves CNI GC for one network: it drops every attachment of
// req.Network not in the valid list (cni.dev/valid-attachments), detaches the
// recorder and scrubs the dropped pods' IPs with reason gc, except IPs an
// attachment that stays holds now (the IP was reused; its new pod's flows
// must stay).
//
// The runtime sends one GC per network, listing that network's attachments
// only. So the daemon refuses, with nothing dropped:
//   - a GC without a network name: it cannot tell which attachments the list
//     speaks for, and every pod of every other network would be dropped;
//   - a GC with no valid attachment (missing or empty list): it would drop
//     and scrub every pod of the network on the node. A runtime that sends GC
//     with pods running always lists them; an empty list is far more likely
//     a broken caller than a node with no pod left, and a node without pods
//     has nothing for a GC to free but a little state (index stop does it).
//
// Attachments started without a network name (by a plugin older than GC
// scoping) belong to no network: no GC drops them; their DEL does.
func (d *Daemon) handleGC(w http.ResponseWriter, r *http.Request) {
	var req api.GCRequest
	if e := decode(r, "gc", &req); e != nil {
		writeError(w, e)
		return
	}
	if e := checkGC(&req); e != nil {
		d.m.refused.WithLabelValues(e.Code).Inc()
		d.log.Warn("gc refused", "network", req.Network, "valid", len(req.ValidAttachments), "code", e.Code, "err", e.Message)
		writeError(w, e)
		return
	}
	valid := make(map[api.Attachment]bool, len(req.ValidAttachments))
	for _, a := range req.ValidAttachments {
		valid[a] = true
	}
	drop := func(pod api.IndexedPod) bool { return pod.Network == req.Network && !valid[pod.Attachment] }
	active, stopped := d.pods.list()
	keep := make(map[netip.Addr]bool)
	for _, pod := range active {
		if !drop(pod) {
			for _, ip := range pod.IPs {
				keep[ip] = true
			}
		}
	}
	for _, ip := range d.foundIPs() { // pods found at start hold theirs
		keep[ip] = true
	}
	resp := api.GCResponse{Dropped: []api.Attachment{}}
	var scrubIPs []netip.Addr
	var tickets []*owner.Ticket
	defer func() {
		// Whatever the scrub did: the dropped attachments' IPs are not
		// released (their DEL was never seen), and those the rule would
		// not let the GC scrub are marked incomplete.
		for _, t := range tickets {
			_, distrust := t.End(false)
			for _, ip := range distrust {
				d.ix.MarkIncomplete(ip, index.ReasonOwner)
			}
		}
	}()
	for _, pod := range active {
		if !drop(pod) {
			continue
		}
		if d.rec != nil {
			if err := d.rec.Detach(pod.Netns, pod.IfName); err != nil {
				d.log.Error("gc: detach recorder", "container_id", pod.ContainerID, "ifname", pod.IfName, "err", err)
				writeError(w, &api.Error{Code: api.CodeInternal, Message: fmt.Sprintf("gc: detach recorder from %s in %s: %v", pod.IfName, pod.Netns, err)})
				return
			}
		}
		var ips []netip.Addr
		for _, ip := range pod.IPs {
			if !keep[ip] && d.checkPodIP(ip) == nil {
				ips = append(ips, ip)
			}
		}
		// Before the attachment goes: the rule judges it by its epoch.
		t := d.own.Begin(owner.GC, pod.Attachment, ips)
		tickets = append(tickets, t)
		if err := d.forgetPod(pod.Attachment); err != nil {
			writeError(w, &api.Error{Code: api.CodeInternal, Message: err.Error()})
			return
		}
		resp.Dropped = append(resp.Dropped, pod.Attachment)
		for _, ip := range ips {
			if t.Verdict(ip) == owner.Trust {
				scrubIPs = append(scrubIPs, ip)
			} else {
				resp.Skipped = append(resp.Skipped, ip)
				d.log.Info("gc: not scrubbing an IP a pod scrubd never saw may hold now (a sign of an unseen owner came after the dropped attachment's start); it sweeps at its next owner",
					"ip", ip, "container_id", pod.ContainerID, "ifname", pod.IfName)
			}
		}
	}
	for _, pod := range stopped {
		if drop(pod) {
			if err := d.forgetPod(pod.Attachment); err != nil {
				writeError(w, &api.Error{Code: api.CodeInternal, Message: err.Error()})
				return
			}
			resp.Dropped = append(resp.Dropped, pod.Attachment)
		}
	}
	d.log.Info("gc", "network", req.Network, "valid", len(req.ValidAttachments), "dropped", len(resp.Dropped), "scrub_ips", scrubIPs, "skipped", resp.Skipped)
	if len(scrubIPs) > 0 {
		release, e := d.admit()
		if e != nil {
			writeError(w, e)
			return
		}
		defer release()
		results, skipped := d.scrubGC(r.Context(), tickets, scrubIPs)
		resp.Results = results
		resp.Skipped = append(resp.Skipped, skipped...)
		if !completed(results) {
			d.answerScrub(w, r.Context(), results)
			return
		}
	}
	writeJSON(w, http.StatusOK, resp)
}

// scrubGC scrubs the IPs a GC dropped, except the IPs an event gave a new
// owner since the GC's listing (an ADD's scrub or index start, a delegate
// create): asked per IP under the backend's scrub lock of the IP, as the
// late DEL asks (late.go). Nothing is released: the dropped attachments'
// DELs were never seen (scrubd/owner).
func (d *Daemon) scrubGC(ctx context.Context, tickets []*owner.Ticket, ips []netip.Addr) (results []scrub.Result, skipped []netip.Addr) {
	var mu sync.Mutex
	newOwner := map[netip.Addr]bool{}
	still := func(ip netip.Addr) bool {
		ok := d.holderOf(ip) == nil
		for _, t := range tickets {
			if _, mine := t.Has(ip); mine && !t.Still(ip) {
				ok = false
			}
		}
		if !ok {
			mu.Lock()
			newOwner[ip] = true
			mu.Unlock()
		}
		return ok
	}
	results = d.scrub(ctx, ips, scrub.ReasonGC, false, "", still)
	mu.Lock()
	defer mu.Unlock()
	for _, ip := range ips {
		if newOwner[ip] {
			skipped = append(skipped, ip)
		}
	}
	if len(skipped) > 0 {
		d.log.Info("gc: not scrubbing IPs an ADD took while the GC ran", "ips", skipped)
	}
	return results, skipped
}

// checkGC refuses a GC that would drop more than its network's stale pods.
func checkGC(req *api.GCRequest) *api.Error {
	if req.Network == "" {
		return &api.Error{Code: api.CodeBadRequest, Message: `gc request has no "network": a GC speaks for one CNI network (the conflist's "name"); nothing dropped`}
	}
	if len(req.ValidAttachments) == 0 {
		return &api.Error{Code: api.CodeBadRequest, Message: fmt.Sprintf(`gc request for network %q has no "valid_attachments": it would drop and scrub every pod of the network on this node; refused, nothing dropped`, req.Network)}
	}
	for _, a := range req.ValidAttachments {
		if a.ContainerID == "" || a.IfName == "" {
			return &api.Error{Code: api.CodeBadRequest, Message: fmt.Sprintf("gc request for network %q: valid attachment %+v lacks container_id or ifname; nothing dropped", req.Network, a)}
		}
	}
	return nil
}
