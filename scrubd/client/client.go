// Package client is the one client of scrubd's API, shared by the CNI plugin
// and the operator CLI.
package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"net/url"
	"strings"
	"syscall"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/api"
)

// Client talks to scrubd over its unix socket.
type Client struct {
	Socket string
	// Trace makes the client keep a Timing of every request in Timings.
	Trace   bool
	Timings []Timing
}

// Timing is one request as the client saw it: the connect, the whole round
// trip (connect included) and the steps scrubd reported (api.TimingHeader).
type Timing struct {
	Path   string        `json:"path"`
	Dial   time.Duration `json:"dial_ns"`
	Total  time.Duration `json:"total_ns"`
	Server []api.Step    `json:"server"`
}

// New returns a client for the socket (api.DefaultSocket when empty).
func New(socket string) *Client {
	if socket == "" {
		socket = api.DefaultSocket
	}
	return &Client{Socket: socket}
}

// ErrUnavailable wraps every failure to reach the daemon (socket missing,
// connection refused): the daemon is down or not installed.
var ErrUnavailable = errors.New("scrubd unavailable")

// IsUnavailable reports whether err means the daemon could not be reached.
func IsUnavailable(err error) bool { return errors.Is(err, ErrUnavailable) }

// APIError returns the daemon's error answer inside err, if any.
func APIError(err error) (*api.Error, bool) {
	var e *api.Error
	ok := errors.As(err, &e)
	return e, ok
}

func (c *Client) do(ctx context.Context, method, path string, in, out any) error {
	var body []byte
	if in != nil {
		var err error
		if body, err = json.Marshal(in); err != nil {
			return err
		}
	}
	header := [][2]string{{"Content-Type", "application/json"}}
	if dl, ok := ctx.Deadline(); ok {
		header = append(header, [2]string{api.DeadlineHeader, dl.UTC().Format(time.RFC3339Nano)})
	}
	start := time.Now()
	a, dial, err := roundTrip(ctx, c.Socket, method, path, header, body)
	if c.Trace {
		t := Timing{Path: path, Dial: dial, Total: time.Since(start)}
		if a != nil {
			t.Server = api.ParseTiming(a.header[strings.ToLower(api.TimingHeader)])
		}
		c.Timings = append(c.Timings, t)
	}
	if err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("scrubd at %s: %w", c.Socket, ctx.Err())
		}
		if errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EACCES) {
			return fmt.Errorf("%w: %s: %v (is the ctscrub DaemonSet running on this node?)", ErrUnavailable, c.Socket, err)
		}
		return fmt.Errorf("%w: %s: %v", ErrUnavailable, c.Socket, err)
	}
	if a.status/100 != 2 {
		e := &api.Error{}
		if json.Unmarshal(a.body, e) != nil || e.Message == "" {
			e = &api.Error{Code: api.CodeInternal, Message: fmt.Sprintf("scrubd answered %d %s: %s", a.status, a.text, bytes.TrimSpace(a.body))}
		}
		return e
	}
	if out != nil {
		if err := json.Unmarshal(a.body, out); err != nil {
			return fmt.Errorf("scrubd at %s: decode answer: %w", c.Socket, err)
		}
	}
	return nil
}

// Scrub asks for every CT entry of req.IPs to be deleted.
func (c *Client) Scrub(ctx context.Context, req api.ScrubRequest) (*api.ScrubResponse, error) {
	out := &api.ScrubResponse{}
	return out, c.do(ctx, "POST", api.PathScrub, req, out)
}

// IndexStart attaches the recorder to a pod interface.
func (c *Client) IndexStart(ctx context.Context, req api.IndexStartRequest) error {
	return c.do(ctx, "POST", api.PathIndexStart, req, nil)
}

// IndexStop detaches the recorder from a pod interface.
func (c *Client) IndexStop(ctx context.Context, req api.IndexStopRequest) error {
	return c.do(ctx, "POST", api.PathIndexStop, req, nil)
}

// Del is a whole CNI DEL in one request (req.Del set, see api.CNIDel).
func (c *Client) Del(ctx context.Context, req api.IndexStopRequest) (*api.DelResponse, error) {
	out := &api.DelResponse{}
	return out, c.do(ctx, "POST", api.PathIndexStop, req, out)
}

// IndexList lists the indexed pod interfaces.
func (c *Client) IndexList(ctx context.Context) (*api.IndexList, error) {
	out := &api.IndexList{}
	return out, c.do(ctx, "GET", api.PathIndexList, nil, out)
}

// IndexIP tells what the index holds for one IP.
func (c *Client) IndexIP(ctx context.Context, ip netip.Addr) (*api.IPState, error) {
	out := &api.IPState{}
	return out, c.do(ctx, "GET", api.PathIndexIP+"?ip="+url.QueryEscape(ip.String()), nil, out)
}

// IndexPod returns what scrubd remembers of one attachment, indexed now or
// stopped recently (its Stopped time is then set): a DEL that comes without
// prevResult learns the pod's IPs from it. An unknown attachment is an
// *api.Error with Code api.CodeNotFound.
func (c *Client) IndexPod(ctx context.Context, a api.Attachment) (*api.IndexedPod, error) {
	out := &api.IndexedPod{}
	q := url.Values{"container_id": {a.ContainerID}, "ifname": {a.IfName}}
	return out, c.do(ctx, "GET", api.PathIndexPod+"?"+q.Encode(), nil, out)
}

// Status returns the daemon's status.
func (c *Client) Status(ctx context.Context) (*api.Status, error) {
	out := &api.Status{}
	return out, c.do(ctx, "GET", api.PathStatus, nil, out)
}

// GC drops state for every attachment not in valid.
func (c *Client) GC(ctx context.Context, network string, valid []api.Attachment) (*api.GCResponse, error) {
	out := &api.GCResponse{}
	return out, c.do(ctx, "POST", api.PathGC, api.GCRequest{Network: network, ValidAttachments: valid}, out)
}

// CTStats returns entries and capacity per CT map.
func (c *Client) CTStats(ctx context.Context) (*api.CTStats, error) {
	out := &api.CTStats{}
	return out, c.do(ctx, "GET", api.PathCTStats, nil, out)
}

// Audit runs an on-demand audit of ips (see api.AuditRequest).
func (c *Client) Audit(ctx context.Context, ips []netip.Addr) (*api.AuditResponse, error) {
	var out api.AuditResponse
	return &out, c.do(ctx, "POST", api.PathAudit, api.AuditRequest{IPs: ips}, &out)
}
