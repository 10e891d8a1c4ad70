// Package scrub is the contract every conntrack backend serves: a request to
// delete every entry of a set of IPs, and the result it reports (method,
// entries deleted per map, outcome). The backends are scrubd/cilium (Cilium's
// BPF CT maps) and scrubd/nfct (the kernel's nf_conntrack). It links no BPF
// code, so the CNI plugin and the CLI can share the API types cheaply.
package scrub

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"time"
)

// Method says how a scrub found the entries it deleted.
type Method string

const (
	MethodIndex Method = "index"
	MethodSweep Method = "sweep"
)

// Reason is why a scrub was asked for (the CNI command behind it).
type Reason string

const (
	ReasonAdd Reason = "add"
	ReasonDel Reason = "del"
	ReasonGC  Reason = "gc"
	// ReasonDelLate is scrubd's own second scrub of a deleted pod's IP once
	// its interface is gone (the DEL window, docs/daemon.md); callers of the
	// API cannot ask for it.
	ReasonDelLate Reason = "del-late"
)

// Outcome is the result label of a scrub.
type Outcome string

const (
	Complete  Outcome = "complete"
	Cancelled Outcome = "cancelled"
	Failed    Outcome = "error"
)

// Request asks for the entries of IPs to be deleted.
type Request struct {
	IPs    []netip.Addr
	Reason Reason
	DryRun bool // count what would be deleted, delete nothing
	// IndexOnly: scrub only the IPs whose index is complete, through it;
	// never sweep. The other IPs are left alone (not in Result.PerIP).
	IndexOnly bool
	// Still, when set, is asked for each IP once the backend holds the IP's
	// scrub lock (no other scrub of it runs; nfct, which has none: before it
	// touches the IP); false: the IP is left alone (not in Result.PerIP).
	Still func(netip.Addr) bool
}

// Result reports one scrub. A scrub is Complete only when no entry with any of
// the IPs is left; Cancelled carries what was deleted before it stopped.
type Result struct {
	Backend string         `json:"backend"`
	Method  Method         `json:"method"`
	Outcome Outcome        `json:"result"`
	Deleted map[string]int `json:"deleted"` // per map (Cilium map name, or "nf_conntrack")
	Total   int            `json:"total"`
	// NATDeleted counts, per SNAT map (Cilium's cilium_snat_v4_external,
	// cilium_snat_v6_external), the mappings deleted with the CT entries:
	// those Cilium's own scrub deletes with each TUPLE_F_OUT entry. Not in
	// Total, which counts CT entries.
	NATDeleted map[string]int    `json:"nat_deleted,omitempty"`
	Duration   time.Duration     `json:"duration_ns"`
	PerIP      map[string]Method `json:"per_ip,omitempty"` // method used for each IP
	// SweptWhy says, for each IP that swept, why the index could not be
	// trusted for it (an index reason: not tracked, recorder not running,
	// records lost, ...).
	SweptWhy map[string]string `json:"swept_why,omitempty"`
	Error    string            `json:"error,omitempty"`
}

// Backend is one conntrack implementation ctscrub can scrub: Cilium's BPF CT
// maps or the kernel's nf_conntrack. The daemon serves every backend through
// the same API and metrics.
type Backend interface {
	// Name labels metrics and results: "cilium" or "nfct".
	Name() string
	// Scrub deletes the entries of req.IPs. It honours ctx: when ctx ends it
	// stops promptly and returns Cancelled with what it deleted so far.
	Scrub(ctx context.Context, req Request) (Result, error)
	// Close releases the backend's resources; pinned state stays.
	Close() error
}

// ErrBadRequest marks a request that cannot be served as asked (an invalid
// IP, a family whose maps are absent). Nothing was deleted.
var ErrBadRequest = errors.New("bad scrub request")

// CheckIPs validates the IPs of a request and returns them deduplicated, with
// IPv4-mapped IPv6 addresses unmapped (CT maps store IPv4 flows as IPv4).
// Every backend calls it before deleting anything.
func CheckIPs(ips []netip.Addr) ([]netip.Addr, error) {
	if len(ips) == 0 {
		return nil, fmt.Errorf("%w: no IP given; pass the pod's IPs", ErrBadRequest)
	}
	out := make([]netip.Addr, 0, len(ips))
	seen := make(map[netip.Addr]bool, len(ips))
	for i, ip := range ips {
		switch {
		case !ip.IsValid():
			return nil, fmt.Errorf("%w: IP #%d is not a valid address (zero value); nothing deleted", ErrBadRequest, i+1)
		case ip.Zone() != "":
			return nil, fmt.Errorf("%w: %s has a zone; CT entries hold no zone, pass the bare address; nothing deleted", ErrBadRequest, ip)
		case ip.Unmap().IsUnspecified():
			return nil, fmt.Errorf("%w: %s is the unspecified address, not a pod IP; nothing deleted", ErrBadRequest, ip)
		}
		ip = ip.Unmap()
		if !seen[ip] {
			seen[ip] = true
			out = append(out, ip)
		}
	}
	return out, nil
}
