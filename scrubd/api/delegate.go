package api

import "net/netip"

// The delegate API: how Cilium's agent (with --conntrack-scrub-delegate)
// asks scrubd to scrub an endpoint's IPs instead of walking its CT maps. It
// is served on a socket of its own (only this path), so that the agent's pod
// mounts that directory alone. docs/delegate-api.md is the contract; both
// sides implement exactly it.
const (
	// DefaultDelegateSocket is the path docs/delegate-api.md names.
	DefaultDelegateSocket = "/run/ctscrub-delegate/delegate.sock"
	// PathDelegateScrub is the delegate API's one path (POST).
	PathDelegateScrub = "/v1/conntrack/scrub"
	// DelegateAPIVersion is the only api_version served.
	DelegateAPIVersion = 1
)

// Events a delegate caller names (DelegateRequest.Event).
const (
	DelegateEventCreate  = "endpoint-create"
	DelegateEventDelete  = "endpoint-delete"
	DelegateEventUnknown = "unknown"
)

// DelegateRequest is the body of POST PathDelegateScrub. Unknown fields are
// ignored (a newer caller may send more).
type DelegateRequest struct {
	APIVersion int    `json:"api_version"`
	Caller     string `json:"caller"`
	Event      string `json:"event"`
	EndpointID int64  `json:"endpoint_id"`
	// IPs are strings, not netip.Addr: one bad IP is refused with the
	// whole request (400), by name.
	IPs []string `json:"ips"`
	// TimeoutMS is the caller's deadline, from when the request arrives:
	// scrubd answers within it or not at all.
	TimeoutMS int64 `json:"timeout_ms"`
	// DeadlineUnixMS, when set, is the caller's own deadline (Unix time in
	// milliseconds, the node's clock, which caller and scrubd share): the
	// time the request spent queued before scrubd read it counts against
	// it. scrubd answers before the earlier of the two deadlines, or not at
	// all.
	DeadlineUnixMS int64 `json:"deadline_unix_ms,omitempty"`
}

// DelegateResponse is the 200 answer: one DelegateIP per requested IP, in
// the request's order.
type DelegateResponse struct {
	APIVersion int          `json:"api_version"`
	IPs        []DelegateIP `json:"ips"`
}

// DelegateIP is one IP's outcome. Complete is true only when no CT entry of
// the IP is left in any of Cilium's global CT maps and the SNAT mappings
// Cilium's own scrub would have deleted with the entries deleted are gone;
// Reason says why not otherwise.
type DelegateIP struct {
	IP         string `json:"ip"`
	Complete   bool   `json:"complete"`
	CTDeleted  int    `json:"ct_deleted"`
	NATDeleted int    `json:"nat_deleted"`
	Reason     string `json:"reason"`
}

// DelegateError is the body of every non-200 answer.
type DelegateError struct {
	Error string `json:"error"`
}

// ParseDelegateIP parses one IP of a DelegateRequest (unmapped).
func ParseDelegateIP(s string) (netip.Addr, error) {
	ip, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Addr{}, err
	}
	return ip.Unmap(), nil
}
