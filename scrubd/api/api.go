// Package api defines scrubd's HTTP/JSON API on its unix socket: the server
// (scrubd/daemon) and the one client (scrubd/client) speak it; the plugin, the
// CLI and the benchmarks use its types and call scrubd through that client.
//
// The caller's deadline travels in the DeadlineHeader of every request, and the
// server also cancels work when the caller disconnects.
package api

import (
	"net/netip"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// DefaultSocket is where scrubd listens.
const DefaultSocket = "/run/ctscrub/scrubd.sock"

// DeadlineHeader carries the caller's deadline (RFC 3339, nanoseconds).
const DeadlineHeader = "X-Ctscrub-Deadline"

// Paths.
const (
	PathScrub      = "/v1/scrub"
	PathIndexStart = "/v1/index/start"
	PathIndexStop  = "/v1/index/stop"
	PathIndexList  = "/v1/index"
	PathIndexIP    = "/v1/index/ip"  // ?ip=X
	PathIndexPod   = "/v1/index/pod" // ?container_id=X&ifname=Y
	PathStatus     = "/v1/status"
	PathGC         = "/v1/gc"
	PathCTStats    = "/v1/ct/stats"
)

// Attachment names one pod interface as CNI does.
type Attachment struct {
	ContainerID string `json:"container_id"`
	IfName      string `json:"ifname"`
}

// ScrubRequest asks for every CT entry of IPs to be deleted.
type ScrubRequest struct {
	IPs         []netip.Addr `json:"ips"`
	Reason      scrub.Reason `json:"reason"` // add, del, gc
	ContainerID string       `json:"container_id,omitempty"`
	Netns       string       `json:"netns,omitempty"`
	IfName      string       `json:"ifname,omitempty"`
	DryRun      bool         `json:"dry_run,omitempty"`
}

// ScrubResponse is the outcome of a scrub, one per backend that ran.
type ScrubResponse struct {
	Results []scrub.Result `json:"results"`
}

// IndexStartRequest asks scrubd to attach the recorder to a pod interface.
type IndexStartRequest struct {
	Attachment
	Netns string       `json:"netns"`
	IPs   []netip.Addr `json:"ips"`
	// Network is the CNI network name (the conflist's "name"): a GC for a
	// network drops only that network's attachments.
	Network string `json:"network,omitempty"`
	// Scrub makes scrubd first scrub IPs as an ADD's scrub (reason add) and
	// attach only when that scrub completes: a CNI ADD in one round trip
	// instead of two. A failed or cancelled scrub is answered as POST
	// PathScrub answers it (Error.Results set) and nothing is attached.
	Scrub bool `json:"scrub,omitempty"`
}

// IndexStopRequest detaches the recorder. Netns may be gone or empty (the
// second DEL of a pod); scrubd then uses the netns it recorded at start.
type IndexStopRequest struct {
	Attachment
	Netns string `json:"netns,omitempty"`
	// Del makes the stop a whole CNI DEL in one request (the answer is then
	// a DelResponse): see CNIDel.
	Del *CNIDel `json:"del,omitempty"`
}

// CNIDel is a CNI DEL done by scrubd in one request: an attachment already
// stopped (a second DEL) is left alone; otherwise the IPs (prevResult's, or
// the ones recorded at start when none are given) are scrubbed (reason
// del) when Scrub is set, except those another attachment now holds (a
// repeated DEL of a pod scrubd never indexed, after its IP was reused), and
// then the attachment is stopped. A failed or cancelled scrub is answered
// as POST PathScrub answers it, and nothing is stopped.
type CNIDel struct {
	IPs   []netip.Addr `json:"ips,omitempty"`
	Scrub bool         `json:"scrub"`
}

// DelResponse is the answer to an IndexStopRequest with Del.
type DelResponse struct {
	// AlreadyStopped: an earlier DEL (or GC) scrubbed and stopped it.
	AlreadyStopped bool `json:"already_stopped,omitempty"`
	// Known: scrubd indexed the attachment.
	Known bool `json:"known"`
	// Skipped are IPs not scrubbed because another attachment holds them.
	Skipped []IPOwner      `json:"skipped,omitempty"`
	Results []scrub.Result `json:"results,omitempty"`
}

// IPOwner is an IP and the attachment that holds it.
type IPOwner struct {
	IP    netip.Addr `json:"ip"`
	Owner Attachment `json:"owner"`
}

// IndexedPod is one attachment scrubd records flows of.
type IndexedPod struct {
	Attachment
	Netns   string       `json:"netns"`
	IPs     []netip.Addr `json:"ips"`
	Ifindex int          `json:"ifindex"`
	// Network is the CNI network the attachment belongs to ("" when it was
	// started by a client older than GC scoping: no GC drops it).
	Network string    `json:"network,omitempty"`
	Since   time.Time `json:"since"`
	// Stopped is when indexing stopped; zero while it runs. Stopped
	// attachments are remembered for a while so that a DEL without
	// prevResult can still learn the pod's IPs (GET PathIndexPod).
	Stopped time.Time `json:"stopped,omitzero"`
}

// IndexList is the answer to GET PathIndexList.
type IndexList struct {
	Pods    []IndexedPod `json:"pods"`
	Stopped []IndexedPod `json:"stopped,omitempty"` // recently stopped
}

// IPState is the answer to GET PathIndexIP.
type IPState struct {
	IP         netip.Addr  `json:"ip"`
	Keys       int         `json:"keys"`
	Complete   bool        `json:"complete"`
	Incomplete string      `json:"incomplete,omitempty"`
	Owner      *Attachment `json:"owner,omitempty"`
}

// GCRequest carries CNI GC's cni.dev/valid-attachments for one network:
// scrubd drops every attachment of that network not listed. Both fields are
// required: a missing network or an empty list is refused (bad_request),
// because it would drop (and scrub) every pod of the node.
type GCRequest struct {
	Network          string       `json:"network"`
	ValidAttachments []Attachment `json:"valid_attachments"`
}

// GCResponse lists the attachments dropped.
type GCResponse struct {
	Dropped []Attachment `json:"dropped"`
	// Results of scrubbing the dropped attachments' IPs (reason gc), except
	// IPs a valid attachment holds now.
	Results []scrub.Result `json:"results,omitempty"`
	// Skipped are dropped attachments' IPs left alone: an ADD took them
	// while the GC ran, and their new pod's entries are live; or a sign of
	// an unseen owner came after the dropped attachment's start, so a pod
	// scrubd never saw may hold them (they are marked incomplete instead).
	Skipped []netip.Addr `json:"skipped,omitempty"`
}

// MapStats is one CT map's occupancy.
type MapStats struct {
	Backend    string `json:"backend"`
	Map        string `json:"map"`
	Entries    int64  `json:"entries"`
	MaxEntries int64  `json:"max_entries"`
}

// CTStats is the answer to GET PathCTStats.
type CTStats struct {
	Maps []MapStats `json:"maps"`
}

// Status is the answer to GET PathStatus.
type Status struct {
	Version       string         `json:"version"`
	Backends      []string       `json:"backends"`
	Ready         bool           `json:"ready"`
	PodCIDRs      []netip.Prefix `json:"pod_cidrs"`
	IndexedPods   int            `json:"indexed_pods"`
	IndexKeys     int64          `json:"index_keys"`
	IncompleteIPs int64          `json:"incomplete_ips"`
	InFlight      int            `json:"in_flight"`
	QueueLimit    int            `json:"queue_limit"`
	Uptime        string         `json:"uptime"`
	Metrics       string         `json:"metrics"`
	// UncoveredFeatures are the Cilium features on this node whose CT
	// entries the index does not cover (labels of
	// ctscrub_uncovered_feature): the IPs they reach are marked incomplete
	// and the delegate does not vouch for them.
	UncoveredFeatures []string `json:"uncovered_features"`

	// Bootstrap: the pass over the CT maps at start (scrubd/bootstrap);
	// absent before the first.
	Bootstrap *BootstrapStatus `json:"bootstrap,omitempty"`

	// RemoteBackends: the remote-backend watch; absent when off.
	RemoteBackends *RemoteBackendsStatus `json:"remote_backends,omitempty"`
}

// BootstrapStatus is the bootstrap pass, running or last ended.
type BootstrapStatus struct {
	Running bool      `json:"running"`
	Passes  int       `json:"passes"` // ended so far
	Start   time.Time `json:"start"`
	Done    time.Time `json:"done,omitzero"`
	// DurationS: the pass's wall time (so far, while it runs).
	DurationS float64 `json:"duration_s"`
	Visited   int64   `json:"entries_read"`
	Keys      int64   `json:"keys_filed"`      // (address, key) pairs added
	Addresses int     `json:"addresses_whole"` // vouched for at its end
	Error     string  `json:"error,omitempty"`
}

// Error codes in Error.Code. The plugin maps them to CNI error codes.
const (
	CodeBadRequest = "bad_request" // malformed request; CNI 7 / 4
	CodeNotPodIP   = "not_pod_ip"  // IP outside the pod CIDRs
	CodeTryAgain   = "try_again"   // queue full: try again later (CNI 11)
	CodeCancelled  = "cancelled"   // caller's deadline passed or it went away
	CodeInternal   = "internal"    // backend failure
	CodeNotFound   = "not_found"   // unknown attachment
	CodeForbidden  = "forbidden"   // caller is not root (SO_PEERCRED)
)

// Error is every non-2xx answer's body.
type Error struct {
	Code    string `json:"code"`
	Message string `json:"error"`
	// Partial results of a cancelled or failed scrub, if any.
	Results []scrub.Result `json:"results,omitempty"`
}

func (e *Error) Error() string { return e.Message }

// RemoteBackendsStatus is the remote-backend watch (docs/remote.md), when on.
type RemoteBackendsStatus struct {
	Synced    bool   `json:"synced"` // every EndpointSlice listed once
	Events    uint64 `json:"events"`
	Slices    int    `json:"slices"`
	Addresses int    `json:"addresses"` // distinct addresses the slices name
	Waiting   int    `json:"waiting"`   // in no slice, waiting out the hold
	// Scrubbed: addresses whose entries on this node were deleted;
	// EntriesDeleted: those entries.
	Scrubbed       uint64              `json:"scrubbed"`
	EntriesDeleted uint64              `json:"entries_deleted"`
	Last           *RemoteBackendScrub `json:"last,omitempty"`
}

// RemoteBackendScrub is one address's deletion.
type RemoteBackendScrub struct {
	Addr    netip.Addr `json:"addr"`
	Service string     `json:"service"` // the Service of the slice it left last
	Since   time.Time  `json:"since"`   // the watch received that change
	Done    time.Time  `json:"done"`
	Seconds float64    `json:"seconds"`
	Deleted int        `json:"deleted"`
	Error   string     `json:"error,omitempty"`
}
