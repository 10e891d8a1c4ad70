package daemon

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/owner"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// The delegate API (docs/delegate-api.md): Cilium's agent, started with
// --conntrack-scrub-delegate, asks scrubd to scrub an endpoint's IPs and
// skips its own walk of every CT map only when each IP comes back complete.
// Anything else makes it walk as stock Cilium does, so every doubt here is
// answered with complete:false, never with a guess.

// Bounds of a delegate request.
const (
	// delegateDefaultTimeout applies when the caller sends no timeout_ms.
	delegateDefaultTimeout = time.Second
	// delegateMaxTimeout caps timeout_ms: the caller walks itself when
	// scrubd is slow, so a long wait here only delays its fallback.
	delegateMaxTimeout = time.Minute
	// delegateMaxIPs bounds one request's IPs (an endpoint has one per
	// family; a few more are tolerated).
	delegateMaxIPs = 16
)

// delegateCallers are the caller labels of the delegate metrics; any other
// caller is counted as "other" (the label values stay bounded).
var delegateCallers = map[string]bool{"cilium-agent": true}

func delegateCallerLabel(c string) string {
	if delegateCallers[c] {
		return c
	}
	return "other"
}

// delegateEvent maps the caller's event to its metrics label, to the scrub
// reason of the scrub metrics and logs, and to the ownership rule's event.
// An event this scrubd does not know is counted as "unknown" and judged by
// the rule's strictest case (owner.Unknown: the index only for a released
// IP, no change of state).
func delegateEvent(e string) (label string, reason scrub.Reason, ev owner.Event) {
	switch e {
	case api.DelegateEventCreate:
		return e, scrub.ReasonAdd, owner.Create
	case api.DelegateEventDelete:
		return e, scrub.ReasonDel, owner.Delete
	}
	return api.DelegateEventUnknown, scrub.ReasonDel, owner.Unknown
}

// delegateHandler serves the delegate socket: its one path, nothing else of
// the API (the socket is mounted into the agent's pod).
func (d *Daemon) delegateHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST "+api.PathDelegateScrub, d.handleDelegate)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeDelegateError(w, http.StatusNotFound, fmt.Sprintf("no delegate API at %s %s: this socket serves POST %s only (docs/delegate-api.md)", r.Method, r.URL.Path, api.PathDelegateScrub))
	})
	return mux
}

func writeDelegateError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, api.DelegateError{Error: msg})
}

func (d *Daemon) handleDelegate(w http.ResponseWriter, r *http.Request) {
	arrived := time.Now()
	var req api.DelegateRequest
	// Unknown fields are ignored: the contract lets a newer caller add some.
	err := json.NewDecoder(io.LimitReader(r.Body, maxBody)).Decode(&req)
	caller := delegateCallerLabel(req.Caller)
	event, reason, ev := delegateEvent(req.Event)
	outcome := "complete"
	defer func() {
		d.m.delegateRequests.WithLabelValues(caller, event, outcome).Inc()
		d.m.delegateDuration.WithLabelValues(caller, event).Observe(time.Since(arrived).Seconds())
	}()
	refuse := func(status int, msg string) {
		outcome = "bad_request"
		if status == http.StatusTooManyRequests {
			outcome = "busy"
		}
		d.log.Warn("delegate request refused", "caller", req.Caller, "event", req.Event, "endpoint_id", req.EndpointID, "ips", req.IPs, "status", status, "err", msg)
		writeDelegateError(w, status, msg)
	}
	if err != nil {
		refuse(http.StatusBadRequest, fmt.Sprintf("decode request: %v (send the JSON object of docs/delegate-api.md)", err))
		return
	}
	if req.APIVersion != api.DelegateAPIVersion {
		refuse(http.StatusBadRequest, fmt.Sprintf("api_version %d: this scrubd serves api_version %d only", req.APIVersion, api.DelegateAPIVersion))
		return
	}
	timeout := time.Duration(req.TimeoutMS) * time.Millisecond
	switch {
	case req.TimeoutMS < 0:
		refuse(http.StatusBadRequest, fmt.Sprintf("timeout_ms %d is negative", req.TimeoutMS))
		return
	case req.TimeoutMS == 0:
		timeout = delegateDefaultTimeout
	case timeout > delegateMaxTimeout:
		timeout = delegateMaxTimeout
	}
	if len(req.IPs) == 0 || len(req.IPs) > delegateMaxIPs {
		refuse(http.StatusBadRequest, fmt.Sprintf("ips: %d given, want 1 to %d (the endpoint's addresses)", len(req.IPs), delegateMaxIPs))
		return
	}
	ips := make([]netip.Addr, len(req.IPs))
	for i, s := range req.IPs {
		if ips[i], err = api.ParseDelegateIP(s); err != nil {
			refuse(http.StatusBadRequest, fmt.Sprintf("ips[%d] %q: %v", i, s, err))
			return
		}
	}
	release, e := d.admit()
	if e != nil {
		refuse(http.StatusTooManyRequests, e.Message)
		return
	}
	defer release()

	deadline := arrived.Add(timeout)
	if req.DeadlineUnixMS > 0 {
		// The caller's own deadline counts the time the request waited
		// before scrubd read it.
		if own := time.UnixMilli(req.DeadlineUnixMS); own.Before(deadline) {
			deadline = own
		}
		if !time.Now().Before(deadline) {
			outcome = "late"
			d.log.Warn("delegate request read after the caller's deadline: not answered", "caller", req.Caller, "event", req.Event,
				"endpoint_id", req.EndpointID, "ips", req.IPs, "deadline_unix_ms", req.DeadlineUnixMS)
			panic(http.ErrAbortHandler)
		}
	}
	// The work stops a little before the deadline so that the answer, with
	// whatever was done, still reaches the caller in time (as withDeadline).
	margin := min(time.Until(deadline)/4, 50*time.Millisecond)
	ctx, cancel := context.WithDeadline(r.Context(), deadline.Add(-margin))
	defer cancel()
	answers := make([]api.DelegateIP, len(ips))
	var pod []netip.Addr
	for _, ip := range ips {
		if d.checkPodIP(ip) == nil {
			pod = append(pod, ip)
		}
	}
	// The ownership rule first, for the request's pod IPs at once; then
	// each IP's scrub, after any flight that may have judged the index
	// before the rule's marks (it would answer with that earlier decision).
	t := d.own.Begin(ev, api.Attachment{}, pod)
	d.applyVerdicts(t, ev, pod, "caller", req.Caller, "endpoint_id", req.EndpointID)
	seq := d.flights.started()
	var wg sync.WaitGroup
	for i, ip := range ips {
		wg.Go(func() {
			answers[i] = d.delegateIP(ctx, ip, reason, seq)
			answers[i].IP = req.IPs[i]
		})
	}
	wg.Wait()
	complete := map[netip.Addr]bool{}
	for i, ip := range ips {
		complete[ip] = answers[i].Complete
	}
	t.EndEach(func(ip netip.Addr) bool { return complete[ip] })
	for _, a := range answers {
		if !a.Complete {
			outcome = "incomplete"
		}
	}
	if time.Now().After(deadline) {
		// Past the caller's deadline: it walks on its own; an answer now
		// would be read (if at all) after it gave up. Not answering at all
		// is the contract.
		outcome = "late"
		d.log.Warn("delegate scrub finished past the caller's deadline: not answered", "caller", req.Caller, "event", req.Event,
			"endpoint_id", req.EndpointID, "ips", req.IPs, "timeout_ms", req.TimeoutMS, "took_s", time.Since(arrived).Seconds())
		panic(http.ErrAbortHandler)
	}
	afterAnswer(r.Context(), func() {
		d.log.Info("delegate scrub", "caller", req.Caller, "event", req.Event, "endpoint_id", req.EndpointID, "ips", answers,
			"timeout_ms", req.TimeoutMS, "duration_s", time.Since(arrived).Seconds(), "outcome", outcome)
	})
	writeJSON(w, http.StatusOK, api.DelegateResponse{APIVersion: api.DelegateAPIVersion, IPs: answers})
}

// natGapper is the Cilium backend's NATGap (scrubd/cilium).
type natGapper interface{ NATGap(ipv6 bool) string }

// delegateIP scrubs one IP through the same path as the CNI's scrubs (the
// per-IP flight: index, fail-closed marks, the sweep) and says whether it
// is complete in the contract's sense: every CT entry of the IP gone from
// Cilium's global maps, and the SNAT mappings of those deleted with them.
func (d *Daemon) delegateIP(ctx context.Context, ip netip.Addr, reason scrub.Reason, seq uint64) api.DelegateIP {
	if e := d.checkPodIP(ip); e != nil {
		return api.DelegateIP{Reason: "not scrubbed: " + e.Message}
	}
	j := -1
	for i, b := range d.backends {
		if b.Name() == "cilium" {
			j = i
		}
	}
	if j < 0 {
		return api.DelegateIP{Reason: "scrubd runs no Cilium backend on this node (backends " + strings.Join(d.backendNames(), ",") + ")"}
	}
	if u, ok := d.backends[j].(uncoveredReasoner); ok {
		if r := u.UncoveredReason(ip); r != "" {
			// Not vouched for: Cilium's own walk reaches what the index
			// cannot. The CNI's scrubs of the IP sweep meanwhile; a sweep
			// here would only delay the caller's walk.
			return api.DelegateIP{Reason: "uncovered Cilium feature: " + r}
		}
	}
	if err := d.flights.settle(ctx, flightKey{ip: ip}, seq); err != nil {
		return api.DelegateIP{Reason: "cancelled while an earlier scrub of the IP finished (deadline or caller gone)"}
	}
	res := d.scrub(ctx, []netip.Addr{ip}, reason, false, "", nil)[j]
	a := api.DelegateIP{CTDeleted: res.Total}
	for _, n := range res.NATDeleted {
		a.NATDeleted += n
	}
	switch {
	case res.Outcome == scrub.Cancelled:
		a.Reason = fmt.Sprintf("cancelled before the scrub finished (deadline or caller gone), method %s", res.Method)
		if why := res.SweptWhy[ip.String()]; why != "" {
			a.Reason += " (index not trusted: " + why + ")"
		}
	case res.Outcome != scrub.Complete:
		a.Reason = "scrub failed: " + res.Error
	case res.PerIP[ip.String()] == "":
		a.Reason = "the backend did not scrub the IP"
	default:
		if o, ok := d.backends[j].(outsideGlobal); ok {
			if r := o.OutsideGlobalMaps(); r != "" {
				a.Reason = r + "; scrubd scrubs the global CT maps only"
			}
		}
		if g, ok := d.backends[j].(natGapper); ok && a.Reason == "" {
			a.Reason = g.NATGap(ip.Is6())
		}
		a.Complete = a.Reason == ""
	}
	return a
}

// uncoveredReasoner is the Cilium backend's UncoveredReason (scrubd/cilium).
type uncoveredReasoner interface{ UncoveredReason(ip netip.Addr) string }

// outsideGlobal is the Cilium backend's OutsideGlobalMaps (scrubd/cilium).
type outsideGlobal interface{ OutsideGlobalMaps() string }
