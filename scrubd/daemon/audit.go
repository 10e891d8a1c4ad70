package daemon

import (
	"errors"
	"net/http"
	"net/netip"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/expiry"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// The audit: the expiry pass compares a rotating sample of complete IPs'
// CT keys with the index (scrubd/expiry/audit.go); the daemon tells it which
// IPs have an owner and which are being scrubbed, and serves the on-demand
// audit (POST api.PathAudit, `scrubd audit --ip`).

// enableAudit switches the continuous audit on in the expiry pass.
func (d *Daemon) enableAudit(exp *expiry.Runner) error {
	d.exp = exp
	if exp == nil || exp.Config().Mode == expiry.ModeOff {
		return nil
	}
	return exp.EnableAudit(expiry.AuditConfig{Index: d.ix, Owned: d.owned, Busy: d.scrubbing}, d.m.reg)
}

// owned reports whether an attached pod holds ip.
func (d *Daemon) owned(ip netip.Addr) bool { return d.pods.owner(ip) != nil }

// scrubbing reports whether a (real) scrub of ip is running.
func (d *Daemon) scrubbing(ip netip.Addr) bool {
	d.flights.mu.Lock()
	defer d.flights.mu.Unlock()
	_, ok := d.flights.m[flightKey{ip: ip}]
	return ok
}

func (d *Daemon) handleAudit(w http.ResponseWriter, r *http.Request) {
	var req api.AuditRequest
	if e := decode(r, "audit", &req); e != nil {
		writeError(w, e)
		return
	}
	resp := api.AuditResponse{IPs: []api.IPAudit{}, Recent: []api.AuditMiss{}}
	if d.exp != nil {
		for _, m := range d.exp.RecentMisses() {
			resp.Recent = append(resp.Recent, api.AuditMiss(m))
		}
	}
	if len(req.IPs) == 0 {
		writeJSON(w, http.StatusOK, resp)
		return
	}
	ips, e := d.checkIPs(req.IPs)
	if e != nil {
		writeError(w, e)
		return
	}
	if d.exp == nil {
		writeError(w, &api.Error{Code: api.CodeBadRequest, Message: "audit: no Cilium backend with an expiry pass on this node (the audit reads Cilium's CT maps in the expiry program; expiry.mode must be report or sweep)"})
		return
	}
	// The kernel first, then the index: a key recorded in between is
	// covered; the other order would report keys Cilium created after the
	// index was read.
	found, err := d.exp.CollectKeys(r.Context(), ips)
	if err != nil {
		code := api.CodeInternal
		if r.Context().Err() != nil {
			code = api.CodeCancelled
		} else if errors.Is(err, expiry.ErrAuditOff) {
			code = api.CodeBadRequest
		}
		writeError(w, &api.Error{Code: code, Message: err.Error()})
		return
	}
	for _, ip := range ips {
		a := auditIP(d.ix, ip, found)
		a.Owner = d.pods.owner(ip)
		if a.Verdict == api.VerdictMissing {
			// An incomplete IP's next scrub sweeps: its keys are not missed.
			resp.Missing += len(a.Missing)
		}
		resp.IPs = append(resp.IPs, a)
	}
	d.log.Info("audit", "ips", ips, "missing", resp.Missing)
	writeJSON(w, http.StatusOK, resp)
}

// auditIP compares the keys of ip found in the kernel with the index.
func auditIP(ix *index.Index, ip netip.Addr, found []expiry.FoundKey) api.IPAudit {
	raw4, raw6, st := ix.KeysOf(ip)
	c4, c6 := index.Covered(raw4, raw6)
	cov4 := make(map[ctmap.CTKey4]bool, len(c4))
	for _, k := range c4 {
		cov4[k] = true
	}
	cov6 := make(map[ctmap.CTKey6]bool, len(c6))
	for _, k := range c6 {
		cov6[k] = true
	}
	a := api.IPAudit{IP: ip, Complete: st.Complete, Incomplete: st.Incomplete,
		Found: []api.AuditKey{}, Indexed: []api.AuditKey{}, Missing: []api.AuditKey{}, Extra: []api.AuditKey{}}
	in4 := map[ctmap.CTKey4]bool{}
	in6 := map[ctmap.CTKey6]bool{}
	for _, f := range found {
		if !f.Has(ip) {
			continue
		}
		var k api.AuditKey
		covered := false
		if f.V6 {
			in6[f.K6] = true
			k = api.AuditKey{Map: f.Map.Name(), Key: f.K6.String()}
			covered = cov6[f.K6]
		} else {
			in4[f.K4] = true
			k = api.AuditKey{Map: f.Map.Name(), Key: f.K4.String()}
			covered = cov4[f.K4]
		}
		a.Found = append(a.Found, k)
		if !covered {
			a.Missing = append(a.Missing, k)
		}
	}
	for _, k := range raw4 {
		ak := api.AuditKey{Map: k.Kind().Name(), Key: k.String()}
		a.Indexed = append(a.Indexed, ak)
		if !in4[k] {
			a.Extra = append(a.Extra, ak)
		}
	}
	for _, k := range raw6 {
		ak := api.AuditKey{Map: k.Kind().Name(), Key: k.String()}
		a.Indexed = append(a.Indexed, ak)
		if !in6[k] {
			a.Extra = append(a.Extra, ak)
		}
	}
	switch {
	case !st.Complete:
		a.Verdict = api.VerdictIncomplete
	case len(a.Missing) > 0:
		a.Verdict = api.VerdictMissing
	default:
		a.Verdict = api.VerdictCovered
	}
	return a
}
