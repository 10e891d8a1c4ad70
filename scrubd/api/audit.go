package api

import (
	"net/netip"
	"time"
)

// PathAudit audits IPs on demand: POST AuditRequest, answer AuditResponse.
const PathAudit = "/v1/audit"

// AuditRequest asks for an on-demand audit of IPs: one read-only pass over
// the CT maps, compared with the index. No IPs: only the recent misses.
type AuditRequest struct {
	IPs []netip.Addr `json:"ips"`
}

// AuditKey is one CT key, as the map it lives in and its decoded form.
type AuditKey struct {
	Map string `json:"map"`
	Key string `json:"key"`
}

// Verdicts of an IP's audit.
const (
	VerdictCovered    = "covered"    // the index is complete and covers every key found
	VerdictMissing    = "missing"    // the index is complete but misses keys: a scrub would leave them
	VerdictIncomplete = "incomplete" // the index does not claim completeness: the next scrub sweeps
)

// IPAudit is one IP's on-demand audit.
type IPAudit struct {
	IP         netip.Addr  `json:"ip"`
	Owner      *Attachment `json:"owner,omitempty"`
	Complete   bool        `json:"complete"`
	Incomplete string      `json:"incomplete,omitempty"`
	Found      []AuditKey  `json:"found"`   // CT keys of the IP in the kernel
	Indexed    []AuditKey  `json:"indexed"` // the index's keys of the IP
	Missing    []AuditKey  `json:"missing"` // found, not covered by a scrub of the index's keys
	Extra      []AuditKey  `json:"extra"`   // indexed, not found (stale: Cilium's GC or LRU removed them)
	Verdict    string      `json:"verdict"`
}

// AuditMiss is one miss the continuous audit found (a key of a complete IP
// the index did not cover; the IP was marked incomplete).
type AuditMiss struct {
	IP        netip.Addr `json:"ip"`
	Map       string     `json:"map"`
	Key       string     `json:"key"`
	Direction string     `json:"direction"`
	Related   bool       `json:"related"`
	Protocol  string     `json:"protocol"`
	Owned     bool       `json:"owned"`
	At        time.Time  `json:"at"`
}

// AuditResponse is the answer to POST PathAudit.
type AuditResponse struct {
	IPs     []IPAudit   `json:"ips"`
	Missing int         `json:"missing"` // missing keys over all IPs
	Recent  []AuditMiss `json:"recent"`  // the continuous audit's last misses
}
