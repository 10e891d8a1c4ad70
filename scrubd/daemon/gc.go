package daemon

import (
	"fmt"
	"net/http"
	"net/netip"

	"github.com/ctscrub/ctscrub/scrubd/api"
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
	resp := api.GCResponse{Dropped: []api.Attachment{}}
	var scrubIPs []netip.Addr
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
		if err := d.pods.forget(pod.Attachment); err != nil {
			writeError(w, &api.Error{Code: api.CodeInternal, Message: err.Error()})
			return
		}
		resp.Dropped = append(resp.Dropped, pod.Attachment)
		for _, ip := range pod.IPs {
			if !keep[ip] && d.checkPodIP(ip) == nil {
				scrubIPs = append(scrubIPs, ip)
			}
		}
	}
	for _, pod := range stopped {
		if drop(pod) {
			if err := d.pods.forget(pod.Attachment); err != nil {
				writeError(w, &api.Error{Code: api.CodeInternal, Message: err.Error()})
				return
			}
			resp.Dropped = append(resp.Dropped, pod.Attachment)
		}
	}
	d.log.Info("gc", "network", req.Network, "valid", len(req.ValidAttachments), "dropped", len(resp.Dropped), "scrub_ips", scrubIPs)
	if len(scrubIPs) > 0 {
		release, e := d.admit()
		if e != nil {
			writeError(w, e)
			return
		}
		defer release()
		resp.Results = d.scrub(r.Context(), scrubIPs, scrub.ReasonGC, false, "")
		d.afterScrub(scrub.ReasonGC, "", scrubIPs, resp.Results) // ownership.go
		for _, res := range resp.Results {
			if res.Outcome != scrub.Complete {
				d.answerScrub(w, r.Context(), resp.Results)
				return
			}
		}
	}
	writeJSON(w, http.StatusOK, resp)
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
