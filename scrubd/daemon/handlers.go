package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/cilium"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// maxBody bounds a request body: the largest real one is a GC with every
// attachment of a node, far below this.
const maxBody = 4 << 20

func (d *Daemon) apiHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST "+api.PathScrub, d.handleScrub)
	mux.HandleFunc("POST "+api.PathIndexStart, d.handleIndexStart)
	mux.HandleFunc("POST "+api.PathIndexStop, d.handleIndexStop)
	mux.HandleFunc("GET "+api.PathIndexList, d.handleIndexList)
	mux.HandleFunc("GET "+api.PathIndexIP, d.handleIndexIP)
	mux.HandleFunc("GET "+api.PathIndexPod, d.handleIndexPod)
	mux.HandleFunc("GET "+api.PathStatus, d.handleStatus)
	mux.HandleFunc("POST "+api.PathGC, d.handleGC)
	mux.HandleFunc("GET "+api.PathCTStats, d.handleCTStats)
	mux.HandleFunc("POST "+api.PathAudit, d.handleAudit)
	// Health on the socket too, for probes that exec the CLI.
	mux.HandleFunc("GET /healthz", d.handleHealthz)
	mux.HandleFunc("GET /readyz", d.handleReadyz)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, &api.Error{Code: api.CodeBadRequest, Message: fmt.Sprintf("no API at %s %s (see scrubd/api for the paths and methods)", r.Method, r.URL.Path)})
	})
	return d.withTiming(withDeadline(mux))
}

func (d *Daemon) metricsHandler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(d.m.reg, promhttp.HandlerOpts{Registry: d.m.reg}))
	mux.HandleFunc("/healthz", d.handleHealthz)
	mux.HandleFunc("/readyz", d.handleReadyz)
	if d.cfg.Pprof {
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	}
	return mux
}

// withDeadline makes the caller's deadline (api.DeadlineHeader) the request
// context's deadline. The work stops a little before it, so that the answer
// with the partial results still reaches the caller in time: a quarter of
// the time left, at most 50 ms (the bound a cancelled scrub stops within). A caller that disconnects cancels the context too
// (net/http does that).
func withDeadline(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := r.Header.Get(api.DeadlineHeader)
		if h == "" {
			next.ServeHTTP(w, r)
			return
		}
		dl, err := time.Parse(time.RFC3339Nano, h)
		if err != nil {
			writeError(w, &api.Error{Code: api.CodeBadRequest, Message: fmt.Sprintf("header %s %q: %v (want RFC 3339 with nanoseconds, UTC)", api.DeadlineHeader, h, err)})
			return
		}
		margin := min(time.Until(dl)/4, 50*time.Millisecond)
		ctx, cancel := context.WithDeadline(r.Context(), dl.Add(-max(margin, 0)))
		defer cancel()
		next.ServeHTTP(w, r.WithContext(ctx))
	})
}

// writeJSON answers v with its Content-Length, so a client has the whole
// answer once it is flushed, before the handler's work after the answer
// (afterAnswer) and the connection's close.
func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		status = http.StatusInternalServerError
		b, _ = json.Marshal(api.Error{Code: api.CodeInternal, Message: "encode answer: " + err.Error()})
	}
	b = append(b, '\n')
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	w.Write(b)
}

func writeError(w http.ResponseWriter, e *api.Error) {
	status := http.StatusInternalServerError
	switch e.Code {
	case api.CodeBadRequest, api.CodeNotPodIP:
		status = http.StatusBadRequest
	case api.CodeTryAgain:
		status = http.StatusTooManyRequests
	case api.CodeCancelled:
		status = http.StatusGatewayTimeout
	case api.CodeNotFound:
		status = http.StatusNotFound
	case api.CodeForbidden:
		status = http.StatusForbidden
	}
	writeJSON(w, status, e)
}

// decode reads a JSON body strictly: unknown fields are errors, so a client
// that misspells "dry_run" is told instead of deleting for real.
func decode(r *http.Request, what string, v any) *api.Error {
	dec := json.NewDecoder(io.LimitReader(r.Body, maxBody))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return &api.Error{Code: api.CodeBadRequest, Message: fmt.Sprintf("decode %s request: %v (send a JSON object as in scrubd/api)", what, err)}
	}
	if dec.More() {
		return &api.Error{Code: api.CodeBadRequest, Message: fmt.Sprintf("decode %s request: data after the JSON object", what)}
	}
	return nil
}

// checkPodIP refuses what is not a local pod IP. A scrub deletes every flow of
// an address: the node's own address or 0.0.0.0 would wipe the node's
// connections, so nothing is deleted for a request with any such IP.
func (d *Daemon) checkPodIP(ip netip.Addr) *api.Error {
	if !ip.IsValid() {
		return &api.Error{Code: api.CodeBadRequest, Message: "empty IP address in request"}
	}
	if ip.Zone() != "" {
		return &api.Error{Code: api.CodeNotPodIP, Message: fmt.Sprintf("IP %s has a zone: a pod IP has none", ip)}
	}
	u := ip.Unmap()
	if u.IsUnspecified() || u.IsLoopback() || u.IsMulticast() || u.IsLinkLocalUnicast() || u.IsLinkLocalMulticast() || u == netip.AddrFrom4([4]byte{255, 255, 255, 255}) {
		return &api.Error{Code: api.CodeNotPodIP, Message: fmt.Sprintf("IP %s is not a pod address (unspecified, loopback, multicast, broadcast or link-local): nothing deleted", ip)}
	}
	in := false
	for _, p := range d.cidrs {
		if p.Contains(u) {
			in = true
			break
		}
	}
	if !in {
		return &api.Error{Code: api.CodeNotPodIP, Message: fmt.Sprintf("IP %s is outside the pod CIDRs %v: nothing deleted (is it the node's address? if it is a pod IP, add its range to --pod-cidr)", ip, d.cidrs)}
	}
	if d.isHostAddr(u) {
		return &api.Error{Code: api.CodeNotPodIP, Message: fmt.Sprintf("IP %s is an address of this node (e.g. cilium_host's router IP), not a pod's: nothing deleted", ip)}
	}
	return nil
}

// isHostAddr reports whether ip is assigned to an interface of the daemon's
// network namespace (the host's). The list is cached a few seconds: it costs a
// netlink dump and changes rarely.
func (d *Daemon) isHostAddr(ip netip.Addr) bool {
	d.hostMu.Lock()
	defer d.hostMu.Unlock()
	if d.hostAddrs == nil || time.Since(d.hostAt) > 5*time.Second {
		m := make(map[netip.Addr]bool)
		if addrs, err := net.InterfaceAddrs(); err == nil {
			for _, a := range addrs {
				if p, err := netip.ParsePrefix(a.String()); err == nil {
					m[p.Addr().Unmap()] = true
				}
			}
		}
		d.hostAddrs, d.hostAt = m, time.Now()
	}
	return d.hostAddrs[ip]
}

func parseReason(r scrub.Reason) *api.Error {
	switch r {
	case scrub.ReasonAdd, scrub.ReasonDel, scrub.ReasonGC:
		return nil
	case "":
		return &api.Error{Code: api.CodeBadRequest, Message: `scrub request has no "reason": want add, del or gc`}
	}
	return &api.Error{Code: api.CodeBadRequest, Message: fmt.Sprintf("scrub reason %q: want add, del or gc", r)}
}

// checkIPs validates a request's IPs and removes duplicates.
func (d *Daemon) checkIPs(ips []netip.Addr) ([]netip.Addr, *api.Error) {
	if len(ips) == 0 {
		return nil, &api.Error{Code: api.CodeBadRequest, Message: `request has no "ips": give at least one pod IP`}
	}
	seen := make(map[netip.Addr]bool, len(ips))
	out := make([]netip.Addr, 0, len(ips))
	for _, ip := range ips {
		if e := d.checkPodIP(ip); e != nil {
			return nil, e
		}
		ip = ip.Unmap()
		if !seen[ip] {
			seen[ip] = true
			out = append(out, ip)
		}
	}
	return out, nil
}

// admit counts a request in the bounded queue, or refuses it at once.
func (d *Daemon) admit() (release func(), e *api.Error) {
	if n := d.admitted.Add(1); n > int64(d.cfg.QueueLimit) {
		d.admitted.Add(-1)
		d.m.refused.WithLabelValues(api.CodeTryAgain).Inc()
		return nil, &api.Error{Code: api.CodeTryAgain, Message: fmt.Sprintf("scrubd is busy: %d scrub requests queued (queue_limit %d); try again later", n-1, d.cfg.QueueLimit)}
	}
	return func() { d.admitted.Add(-1) }, nil
}

func (d *Daemon) handleScrub(w http.ResponseWriter, r *http.Request) {
	steps := api.StepsFrom(r.Context())
	var req api.ScrubRequest
	e := decode(r, "scrub", &req)
	steps.Mark("decode")
	if e != nil {
		d.m.refused.WithLabelValues(e.Code).Inc()
		writeError(w, e)
		return
	}
	e = parseReason(req.Reason)
	var ips []netip.Addr
	if e == nil {
		ips, e = d.checkIPs(req.IPs)
	}
	if e != nil {
		d.m.refused.WithLabelValues(e.Code).Inc()
		d.log.Warn("scrub refused", "ips", req.IPs, "reason", req.Reason, "container_id", req.ContainerID, "code", e.Code, "err", e.Message)
		writeError(w, e)
		return
	}
	release, e := d.admit()
	if e != nil {
		d.log.Warn("scrub refused", "ips", ips, "reason", req.Reason, "container_id", req.ContainerID, "code", e.Code, "err", e.Message)
		writeError(w, e)
		return
	}
	defer release()
	steps.Mark("check")
	t := d.beginScrub(req, ips) // ownership.go
	steps.Mark("ownership")
	results := d.scrub(r.Context(), ips, req.Reason, req.DryRun, req.ContainerID, nil)
	d.endScrub(t, results)
	steps.Mark("release")
	d.answerScrub(w, r.Context(), results)
}

func (d *Daemon) answerScrub(w http.ResponseWriter, ctx context.Context, results []scrub.Result) {
	var failed, cancelled []string
	total := 0
	for _, res := range results {
		total += res.Total
		switch res.Outcome {
		case scrub.Failed:
			failed = append(failed, res.Backend+": "+res.Error)
		case scrub.Cancelled:
			cancelled = append(cancelled, res.Backend)
		}
	}
	switch {
	case len(failed) > 0:
		writeError(w, &api.Error{Code: api.CodeInternal, Message: "scrub failed: " + strings.Join(failed, "; "), Results: results})
	case len(cancelled) > 0:
		why := "the caller's deadline passed"
		if errors.Is(ctx.Err(), context.Canceled) {
			why = "the caller went away or scrubd is shutting down"
		}
		writeError(w, &api.Error{Code: api.CodeCancelled, Message: fmt.Sprintf("scrub cancelled (%s) on %s after deleting %d entries; the next scrub of these IPs finishes the job", why, strings.Join(cancelled, ","), total), Results: results})
	default:
		writeJSON(w, http.StatusOK, api.ScrubResponse{Results: results})
	}
}

// scrub runs (or joins) one flight per IP and merges their results into one
// Result per backend. It logs one line and observes one duration per backend.
// still, when set, is the flights' scrub.Request.Still: such flights are
// shared only with callers that pass one too (a GC's, gc.go).
func (d *Daemon) scrub(ctx context.Context, ips []netip.Addr, reason scrub.Reason, dry bool, containerID string, still func(netip.Addr) bool) []scrub.Result {
	start := time.Now()
	fs := make([]*flight, len(ips))
	sharedAny := false
	for i, ip := range ips {
		// The flight carries the first caller's steps: its backends mark
		// theirs there (a caller that joins a running flight sees "wait").
		key := flightKey{ip: ip, dry: dry, guarded: still != nil}
		f, shared := d.flights.join(api.WithSteps(d.workCtx, api.StepsFrom(ctx)), key, reason, still, d.runFlight)
		if shared {
			d.m.shared.Inc()
			sharedAny = true
		}
		fs[i] = f
	}
	merged := make([]scrub.Result, len(d.backends))
	for i, b := range d.backends {
		merged[i] = scrub.Result{Backend: b.Name(), Outcome: scrub.Complete, Deleted: map[string]int{}, PerIP: map[string]scrub.Method{}}
	}
	var workStart, workEnd time.Time
	for i, f := range fs {
		res, finished := d.flights.wait(ctx, f)
		api.StepsFrom(ctx).Mark("wait") // the flight's end to this goroutine running again
		if finished && !f.start.IsZero() {
			if workStart.IsZero() || f.start.Before(workStart) {
				workStart = f.start
			}
			if f.end.After(workEnd) {
				workEnd = f.end
			}
		}
		for j, b := range d.backends {
			if j < len(res) {
				mergeResult(&merged[j], res[j])
				continue
			}
			// The flight goes on for other callers (or did not stop in
			// time): this caller has nothing of its own to report.
			mergeResult(&merged[j], scrub.Result{Backend: b.Name(), Outcome: scrub.Cancelled, PerIP: map[string]scrub.Method{ips[i].String(): ""}})
		}
	}
	elapsed := time.Since(start)
	for i := range merged {
		r := &merged[i]
		r.Duration = elapsed
		if r.Method == "" {
			r.Method = scrub.MethodIndex
		}
		d.m.observe(reason, *r)
	}
	// Logged once answered (a copy: the caller may change the results it
	// answers with). Observed before: a scrape right after the answer
	// counts the scrub.
	done := slices.Clone(merged)
	afterAnswer(ctx, func() {
		for _, r := range done {
			lvl := slog.LevelInfo
			if r.Outcome == scrub.Failed {
				lvl = slog.LevelError
			} else if r.Outcome == scrub.Cancelled {
				lvl = slog.LevelWarn
			}
			d.log.Log(context.Background(), lvl, "scrub", "ips", ips, "reason", reason, "backend", r.Backend, "method", r.Method,
				"deleted", r.Total, "per_map", r.Deleted, "duration_s", elapsed.Seconds(), "result", r.Outcome,
				"shared", sharedAny, "dry_run", dry, "container_id", containerID, "error", r.Error,
				"work_start", workStart, "work_end", workEnd, "swept_why", r.SweptWhy)
		}
	})
	return merged
}

// runFlight scrubs one IP on every backend (backends in parallel), after
// waiting for one of MaxInFlight slots.
func (d *Daemon) runFlight(f *flight) {
	f.results = make([]scrub.Result, len(d.backends))
	steps := api.StepsFrom(f.ctx)
	steps.Mark("handoff") // the flight's goroutine starting
	select {
	case d.slots <- struct{}{}:
		defer func() { <-d.slots }()
	case <-f.ctx.Done():
		for i, b := range d.backends {
			f.results[i] = scrub.Result{Backend: b.Name(), Outcome: scrub.Cancelled, Error: "cancelled while queued"}
		}
		return
	}
	f.start = time.Now()
	steps.Mark("queue")
	req := scrub.Request{IPs: []netip.Addr{f.key.ip}, Reason: f.reason, DryRun: f.key.dry, Still: f.still}
	// The first backend on this goroutine, any other on one of its own: on
	// most nodes there is one backend (Cilium's), and a goroutine for it is
	// a hand-off that may wait for the other CPU (within make bench's
	// noise, so kept for simplicity, not for a measured gain).
	var wg sync.WaitGroup
	for i, b := range d.backends[1:] {
		wg.Go(func() {
			res, err := b.Scrub(f.ctx, req)
			f.results[i+1] = normalize(b, f.ctx, res, err)
		})
	}
	if len(d.backends) > 0 {
		b := d.backends[0]
		res, err := b.Scrub(f.ctx, req)
		f.results[0] = normalize(b, f.ctx, res, err)
	}
	wg.Wait()
	f.end = time.Now()
	steps.Mark("backends")
	if !f.key.dry {
		for _, res := range f.results {
			d.m.count(res)
		}
	}
}

// normalize fills what a backend left out, so the merge and the metrics see
// one shape.
func normalize(b scrub.Backend, ctx context.Context, res scrub.Result, err error) scrub.Result {
	if res.Backend == "" {
		res.Backend = b.Name()
	}
	if err != nil {
		if ctx.Err() != nil && res.Outcome != scrub.Failed {
			res.Outcome = scrub.Cancelled
		} else {
			res.Outcome = scrub.Failed
		}
		if res.Error == "" {
			res.Error = err.Error()
		}
	}
	if res.Outcome == "" {
		res.Outcome = scrub.Complete
	}
	return res
}

// mergeResult folds one IP's result into the request's result of the same
// backend: counts add up, the worst outcome wins, sweep wins over index.
func mergeResult(dst *scrub.Result, r scrub.Result) {
	for m, n := range r.Deleted {
		dst.Deleted[m] += n
	}
	dst.Total += r.Total
	for mp, n := range r.NATDeleted {
		if dst.NATDeleted == nil {
			dst.NATDeleted = map[string]int{}
		}
		dst.NATDeleted[mp] += n
	}
	for ip, m := range r.PerIP {
		dst.PerIP[ip] = m
	}
	for ip, why := range r.SweptWhy {
		if dst.SweptWhy == nil {
			dst.SweptWhy = map[string]string{}
		}
		dst.SweptWhy[ip] = why
	}
	if r.Method == scrub.MethodSweep || dst.Method == "" {
		dst.Method = r.Method
	}
	rank := map[scrub.Outcome]int{scrub.Complete: 0, scrub.Cancelled: 1, scrub.Failed: 2}
	if rank[r.Outcome] > rank[dst.Outcome] {
		dst.Outcome = r.Outcome
	}
	if r.Error != "" && !strings.Contains(dst.Error, r.Error) {
		if dst.Error != "" {
			dst.Error += "; "
		}
		dst.Error += r.Error
	}
}

func (d *Daemon) handleIndexStart(w http.ResponseWriter, r *http.Request) {
	steps := api.StepsFrom(r.Context())
	var req api.IndexStartRequest
	e := decode(r, "index start", &req)
	steps.Mark("decode")
	if e != nil {
		writeError(w, e)
		return
	}
	if req.ContainerID == "" || req.IfName == "" || req.Netns == "" {
		writeError(w, &api.Error{Code: api.CodeBadRequest, Message: "index start needs container_id, ifname and netns (the CNI_CONTAINERID, CNI_IFNAME and CNI_NETNS of the ADD)"})
		return
	}
	if e := d.checkPodNetns(req.Netns); e != nil {
		d.log.Warn("index start refused", "container_id", req.ContainerID, "ifname", req.IfName, "netns", req.Netns, "err", e.Message)
		writeError(w, e)
		return
	}
	ips, e := d.checkIPs(req.IPs)
	steps.Mark("check")
	if e != nil {
		writeError(w, e)
		return
	}
	// Held from before its scrub: a slot no pod holds is dropped when
	// marked, and this pod's flows must be indexed from its first packet.
	for _, ip := range ips {
		d.ix.Hold(ip)
	}
	started := false
	defer func() {
		if !started {
			d.releaseUnheld(ips)
		}
	}()
	if req.Scrub && !d.scrubBeforeStart(w, r, req, ips) {
		return
	}
	pod := api.IndexedPod{Attachment: req.Attachment, Netns: req.Netns, IPs: ips, Since: time.Now().UTC(), Network: req.Network}
	if d.rec != nil {
		ifindex, err := d.rec.AttachSteps(req.Netns, req.IfName, func(step string) { steps.Mark("attach." + step) })
		hostMissing := errors.Is(err, recorder.ErrHostSide)
		if hostMissing {
			// Recording, except what the pod sends past its tc egress
			// (PACKET_QDISC_BYPASS): no sweep may vouch for its IPs while
			// it lives.
			d.log.Error("attach recorder: no host-side link; the pod's IPs stay incomplete while it lives", "container_id", req.ContainerID, "ips", ips, "err", err)
		}
		if errors.Is(err, recorder.ErrForget) {
			// Recording, but flows cached for an earlier holder of these
			// IPs may hide the new pod's: their scrubs must sweep.
			d.log.Error("attach recorder: the IPs' cached flows could not be forgotten; they are marked incomplete", "container_id", req.ContainerID, "ips", ips, "err", err)
			for _, ip := range ips {
				d.ix.MarkIncomplete(ip, recorder.ReasonForgetFailed)
			}
			err = nil
		}
		if hostMissing {
			err = nil
		}
		if err != nil {
			d.log.Error("attach recorder", "container_id", req.ContainerID, "ifname", req.IfName, "netns", req.Netns, "err", err)
			writeError(w, &api.Error{Code: api.CodeInternal, Message: fmt.Sprintf("attach recorder to %s in %s: %v", req.IfName, req.Netns, err)})
			return
		}
		pod.Ifindex = ifindex
		for _, ip := range ips {
			if hostMissing {
				d.ix.Unrecorded(ip, recorder.ReasonHostSide)
			} else {
				d.ix.Recorded(ip)
			}
		}
	}
	displaced, err := d.startPod(pod) // owned now: no longer released
	steps.Mark("journal")
	if err != nil {
		writeError(w, &api.Error{Code: api.CodeInternal, Message: err.Error()})
		return
	}
	started = true
	for _, old := range displaced {
		d.log.Warn("index start: an older attachment held the same IP; stopped it (its DEL never reached scrubd)",
			"container_id", old.ContainerID, "ifname", old.IfName, "ips", old.IPs, "new_container_id", req.ContainerID)
		if d.rec != nil {
			if err := d.rec.Detach(old.Netns, old.IfName); err != nil {
				d.log.Warn("detach recorder of a displaced attachment", "container_id", old.ContainerID, "err", err)
			}
		}
	}
	afterAnswer(r.Context(), func() {
		d.log.Info("index start", "container_id", req.ContainerID, "ifname", req.IfName, "netns", req.Netns, "ips", ips, "ifindex", pod.Ifindex)
	})
	writeJSON(w, http.StatusOK, pod)
}

// reasonNotReattached marks the IPs of a pod the recorder could not re-attach
// to after a restart: its flows since then are not recorded.
const reasonNotReattached = "recorder could not re-attach to the pod after a restart"

// reattachFailed is the reason a restored pod's IPs are marked incomplete
// when the recorder's re-attach failed with err: attached but behind cached
// flows of an earlier holder of the IPs (recorder.ErrForget), or not at all.
func reattachFailed(err error) string {
	if errors.Is(err, recorder.ErrHostSide) {
		return recorder.ReasonHostSide
	}
	if errors.Is(err, recorder.ErrForget) {
		return recorder.ReasonForgetFailed
	}
	return reasonNotReattached
}

// scrubBeforeStart runs an index start's scrub (api.IndexStartRequest.Scrub)
// as POST PathScrub would run the ADD's scrub. It reports whether the scrub
// completed; when not, it has answered.
func (d *Daemon) scrubBeforeStart(w http.ResponseWriter, r *http.Request, req api.IndexStartRequest, ips []netip.Addr) bool {
	sreq := api.ScrubRequest{IPs: ips, Reason: scrub.ReasonAdd, ContainerID: req.ContainerID, Netns: req.Netns, IfName: req.IfName}
	_, done := d.scrubFor(w, r, sreq)
	return !done
}

// delBeforeStop does what a CNI DEL does before the stop (api.CNIDel). done
// reports that it answered (nothing left to do, or the scrub did not
// complete).
func (d *Daemon) delBeforeStop(w http.ResponseWriter, r *http.Request, req api.IndexStopRequest) (resp api.DelResponse, done bool) {
	me := req.Attachment
	rec, known := d.pods.get(me)
	resp.Known = known
	if known && !rec.Stopped.IsZero() {
		resp.AlreadyStopped = true
		writeJSON(w, http.StatusOK, resp)
		return resp, true
	}
	ips := req.Del.IPs
	if len(ips) > 0 {
		var e *api.Error
		if ips, e = d.checkIPs(ips); e != nil {
			writeError(w, e)
			return resp, true
		}
	} else if known {
		ips = rec.IPs
	}
	if !known && len(ips) > 0 {
		// Not indexed, yet the runtime names IPs: a repeated DEL may come
		// after the IP was released and given to a new pod, whose entries
		// are live and must stay.
		kept := ips[:0:0]
		for _, ip := range ips {
			if o := d.holderOf(ip); o != nil && *o != me {
				resp.Skipped = append(resp.Skipped, api.IPOwner{IP: ip, Owner: *o})
				d.log.Info("DEL: not scrubbing an IP another attachment holds now", "ip", ip, "container_id", me.ContainerID, "ifname", me.IfName, "owner_container_id", o.ContainerID)
				continue
			}
			kept = append(kept, ip)
		}
		ips = kept
	}
	api.StepsFrom(r.Context()).Mark("lookup")
	if !req.Del.Scrub || len(ips) == 0 {
		return resp, false
	}
	sreq := api.ScrubRequest{IPs: ips, Reason: scrub.ReasonDel, ContainerID: me.ContainerID, Netns: req.Netns, IfName: me.IfName}
	resp.Results, done = d.scrubFor(w, r, sreq)
	return resp, done
}

// scrubFor runs a scrub for another request (a CNI ADD's or DEL's) as POST
// PathScrub would; done reports that it answered: refused, or a scrub that
// did not complete.
func (d *Daemon) scrubFor(w http.ResponseWriter, r *http.Request, sreq api.ScrubRequest) (results []scrub.Result, done bool) {
	release, e := d.admit()
	if e != nil {
		d.log.Warn("scrub refused", "ips", sreq.IPs, "reason", sreq.Reason, "container_id", sreq.ContainerID, "code", e.Code, "err", e.Message)
		writeError(w, e)
		return nil, true
	}
	defer release()
	steps := api.StepsFrom(r.Context())
	t := d.beginScrub(sreq, sreq.IPs) // ownership.go
	steps.Mark("ownership")
	results = d.scrub(r.Context(), sreq.IPs, sreq.Reason, false, sreq.ContainerID, nil)
	d.endScrub(t, results)
	steps.Mark("release")
	for _, res := range results {
		if res.Outcome != scrub.Complete {
			d.answerScrub(w, r.Context(), results)
			return results, true
		}
	}
	return results, false
}

func (d *Daemon) handleIndexStop(w http.ResponseWriter, r *http.Request) {
	steps := api.StepsFrom(r.Context())
	var req api.IndexStopRequest
	e := decode(r, "index stop", &req)
	steps.Mark("decode")
	if e != nil {
		writeError(w, e)
		return
	}
	if req.ContainerID == "" || req.IfName == "" {
		writeError(w, &api.Error{Code: api.CodeBadRequest, Message: "index stop needs container_id and ifname"})
		return
	}
	if _, known := d.pods.get(req.Attachment); !known {
		d.adoptFound(req.Attachment, req.Netns) // a pod found at start (boot.go)
	}
	var del api.DelResponse
	if req.Del != nil {
		var done bool
		if del, done = d.delBeforeStop(w, r, req); done {
			return
		}
	}
	pod, known, err := d.stopPod(req.Attachment)
	steps.Mark("journal")
	if err != nil {
		writeError(w, &api.Error{Code: api.CodeInternal, Message: err.Error()})
		return
	}
	if !known {
		if d.goneBeforeDel(req.Netns) {
			d.log.Info("DEL of an attachment scrubd never indexed, whose pod was gone before it: no sign of an unseen owner (every pod running is recorded)",
				"container_id", req.ContainerID, "ifname", req.IfName, "netns", req.Netns)
		} else {
			d.unseenOwner("DEL of an attachment scrubd never indexed", "container_id", req.ContainerID, "ifname", req.IfName)
		}
	}
	d.releaseUnheld(pod.IPs)
	netns := req.Netns
	if netns == "" {
		netns = pod.Netns
	}
	// The recorder stays: DEL runs before the runtime removes the pod's
	// interface and (in reverse chain order) before cilium-cni removes the
	// endpoint, and flows in that window create entries the index must
	// hold. The filters go with the interface.
	// Once the interface is gone, what was recorded since the DEL scrub is
	// scrubbed too (late.go).
	if known {
		d.scheduleLateDel(pod, netns)
	}
	afterAnswer(r.Context(), func() {
		d.log.Info("index stop", "container_id", req.ContainerID, "ifname", req.IfName, "netns", netns, "known", known, "ips", pod.IPs)
	})
	if req.Del != nil {
		del.Known = known
		writeJSON(w, http.StatusOK, del)
		return
	}
	writeJSON(w, http.StatusOK, pod)
}

func (d *Daemon) handleIndexList(w http.ResponseWriter, r *http.Request) {
	active, stopped := d.pods.list()
	writeJSON(w, http.StatusOK, api.IndexList{Pods: active, Stopped: stopped})
}

func (d *Daemon) handleIndexIP(w http.ResponseWriter, r *http.Request) {
	s := r.URL.Query().Get("ip")
	ip, err := netip.ParseAddr(s)
	if err != nil {
		writeError(w, &api.Error{Code: api.CodeBadRequest, Message: fmt.Sprintf("ip %q: %v (give ?ip=<pod IP>)", s, err)})
		return
	}
	ip = ip.Unmap()
	st := d.ix.State(ip)
	writeJSON(w, http.StatusOK, api.IPState{IP: ip, Keys: st.Keys, Complete: st.Complete, Incomplete: st.Incomplete, Owner: d.pods.owner(ip)})
}

func (d *Daemon) handleIndexPod(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	a := api.Attachment{ContainerID: q.Get("container_id"), IfName: q.Get("ifname")}
	if a.ContainerID == "" || a.IfName == "" {
		writeError(w, &api.Error{Code: api.CodeBadRequest, Message: "give ?container_id=X&ifname=Y"})
		return
	}
	pod, ok := d.pods.get(a)
	if !ok {
		writeError(w, &api.Error{Code: api.CodeNotFound, Message: fmt.Sprintf("no attachment %s/%s known (never indexed, or stopped more than %s ago)", a.ContainerID, a.IfName, d.cfg.StoppedTTL.Duration)})
		return
	}
	writeJSON(w, http.StatusOK, pod)
}

// Status is the daemon's status (also served on the socket).
func (d *Daemon) Status() api.Status {
	var keys, incomplete int64
	for _, src := range d.indexes {
		f := src.Figures()
		keys += f.Keys
		incomplete += f.IncompleteIPs
	}
	uncovered := []string{}
	for _, b := range d.backends {
		if u, ok := b.(uncoveredLister); ok {
			for _, f := range u.UncoveredFeatures() {
				if f.On {
					uncovered = append(uncovered, f.Label)
				}
			}
		}
	}
	var rb *api.RemoteBackendsStatus
	if d.remote != nil {
		rb = d.remote.status()
	}
	return api.Status{
		RemoteBackends:    rb,
		UncoveredFeatures: uncovered,
		Version:           d.version,
		Backends:          d.backendNames(),
		Ready:             d.isReady(),
		PodCIDRs:          d.cidrs,
		IndexedPods:       d.pods.activeCount(),
		IndexKeys:         keys,
		IncompleteIPs:     incomplete,
		InFlight:          int(d.admitted.Load()),
		QueueLimit:        d.cfg.QueueLimit,
		Uptime:            time.Since(d.started).Round(time.Second).String(),
		Metrics:           d.cfg.MetricsAddr,
		Bootstrap:         d.boot.Status(),
	}
}

// uncoveredLister is the Cilium backend's UncoveredFeatures.
type uncoveredLister interface {
	UncoveredFeatures() []cilium.Uncovered
}

func (d *Daemon) handleStatus(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, d.Status())
}

func (d *Daemon) handleHealthz(w http.ResponseWriter, r *http.Request) {
	w.Write([]byte("ok\n"))
}

func (d *Daemon) handleReadyz(w http.ResponseWriter, r *http.Request) {
	if !d.ready.Load() {
		http.Error(w, "not ready: CT maps not open, programs not loaded, or shutting down", http.StatusServiceUnavailable)
		return
	}
	if !d.recorderUp() {
		http.Error(w, "not ready: the recorder is not running (scrubs sweep until it runs again; see scrubd's log)", http.StatusServiceUnavailable)
		return
	}
	w.Write([]byte("ready\n"))
}

func (d *Daemon) handleCTStats(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, api.CTStats{Maps: d.refreshStats(r.Context())})
}

// releaseUnheld tells the index that no pod holds those of ips no active
// attachment holds (index.Release).
func (d *Daemon) releaseUnheld(ips []netip.Addr) {
	for _, ip := range ips {
		if d.holderOf(ip) == nil {
			d.ix.Release(ip)
		}
	}
}
