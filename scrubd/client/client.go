// Package client is the one client of scrubd's API, shared by the CNI plugin
// and the operator CLI.
package client

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"sync/atomic"
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
	hc      *http.Client
	dialed  atomic.Int64 // the last request's connect, ns
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
	c := &Client{Socket: socket}
	c.hc = &http.Client{Transport: &unixTransport{socket: socket, dialed: &c.dialed}}
	return c
}

// unixTransport makes each request on a connection of its own, written and
// read on the caller's goroutine. http.Transport hands a request to a
// dialing goroutine and then to a connection's read and write loops: three
// goroutine wake-ups per request, which a short-lived plugin pays cold, and
// waits for on a loaded node (about 1 ms of each ADD's and DEL's round
// trips in bench-cni's trace).
type unixTransport struct {
	socket string
	dialed *atomic.Int64
}

func (t *unixTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	ctx := req.Context()
	start := time.Now()
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", t.socket)
	t.dialed.Store(int64(time.Since(start)))
	if err != nil {
		return nil, err
	}
	// The end of the caller's context (deadline or cancel) unblocks the
	// connection's reads and writes; it runs once ctx.Err() is set, so the
	// caller sees the context's error, not the connection's.
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
	fail := func(err error) (*http.Response, error) {
		stop()
		conn.Close()
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, err
	}
	req.Close = true // one request per connection: the server closes it after the answer
	if err := req.Write(conn); err != nil {
		return fail(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), req)
	if err != nil {
		return fail(err)
	}
	resp.Body = &connBody{ReadCloser: resp.Body, conn: conn, stop: stop}
	return resp, nil
}

// connBody closes the request's connection with the answer's body.
type connBody struct {
	io.ReadCloser
	conn net.Conn
	stop func() bool
}

func (b *connBody) Close() error {
	b.stop()
	err := b.ReadCloser.Close()
	b.conn.Close()
	return err
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
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://scrubd"+path, body)
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	if dl, ok := ctx.Deadline(); ok {
		req.Header.Set(api.DeadlineHeader, dl.UTC().Format(time.RFC3339Nano))
	}
	start := time.Now()
	resp, err := c.hc.Do(req)
	if c.Trace {
		defer func() {
			t := Timing{Path: path, Dial: time.Duration(c.dialed.Load()), Total: time.Since(start)}
			if resp != nil {
				t.Server = api.ParseTiming(resp.Header.Get(api.TimingHeader))
			}
			c.Timings = append(c.Timings, t)
		}()
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
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return fmt.Errorf("scrubd at %s: read answer: %w", c.Socket, err)
	}
	if resp.StatusCode/100 != 2 {
		e := &api.Error{}
		if json.Unmarshal(data, e) != nil || e.Message == "" {
			e = &api.Error{Code: api.CodeInternal, Message: fmt.Sprintf("scrubd answered %s: %s", resp.Status, bytes.TrimSpace(data))}
		}
		return e
	}
	if out != nil {
		if err := json.Unmarshal(data, out); err != nil {
			return fmt.Errorf("scrubd at %s: decode answer: %w", c.Socket, err)
		}
	}
	return nil
}

// Scrub asks for every CT entry of req.IPs to be deleted.
func (c *Client) Scrub(ctx context.Context, req api.ScrubRequest) (*api.ScrubResponse, error) {
	out := &api.ScrubResponse{}
	return out, c.do(ctx, http.MethodPost, api.PathScrub, req, out)
}

// IndexStart attaches the recorder to a pod interface.
func (c *Client) IndexStart(ctx context.Context, req api.IndexStartRequest) error {
	return c.do(ctx, http.MethodPost, api.PathIndexStart, req, nil)
}

// IndexStop detaches the recorder from a pod interface.
func (c *Client) IndexStop(ctx context.Context, req api.IndexStopRequest) error {
	return c.do(ctx, http.MethodPost, api.PathIndexStop, req, nil)
}

// Del is a whole CNI DEL in one request (req.Del set, see api.CNIDel).
func (c *Client) Del(ctx context.Context, req api.IndexStopRequest) (*api.DelResponse, error) {
	out := &api.DelResponse{}
	return out, c.do(ctx, http.MethodPost, api.PathIndexStop, req, out)
}

// IndexList lists the indexed pod interfaces.
func (c *Client) IndexList(ctx context.Context) (*api.IndexList, error) {
	out := &api.IndexList{}
	return out, c.do(ctx, http.MethodGet, api.PathIndexList, nil, out)
}

// IndexIP tells what the index holds for one IP.
func (c *Client) IndexIP(ctx context.Context, ip netip.Addr) (*api.IPState, error) {
	out := &api.IPState{}
	return out, c.do(ctx, http.MethodGet, api.PathIndexIP+"?ip="+url.QueryEscape(ip.String()), nil, out)
}

// IndexPod returns what scrubd remembers of one attachment, indexed now or
// stopped recently (its Stopped time is then set): a DEL that comes without
// prevResult learns the pod's IPs from it. An unknown attachment is an
// *api.Error with Code api.CodeNotFound.
func (c *Client) IndexPod(ctx context.Context, a api.Attachment) (*api.IndexedPod, error) {
	out := &api.IndexedPod{}
	q := url.Values{"container_id": {a.ContainerID}, "ifname": {a.IfName}}
	return out, c.do(ctx, http.MethodGet, api.PathIndexPod+"?"+q.Encode(), nil, out)
}

// Status returns the daemon's status.
func (c *Client) Status(ctx context.Context) (*api.Status, error) {
	out := &api.Status{}
	return out, c.do(ctx, http.MethodGet, api.PathStatus, nil, out)
}

// GC drops state for every attachment not in valid.
func (c *Client) GC(ctx context.Context, network string, valid []api.Attachment) (*api.GCResponse, error) {
	out := &api.GCResponse{}
	return out, c.do(ctx, http.MethodPost, api.PathGC, api.GCRequest{Network: network, ValidAttachments: valid}, out)
}

// CTStats returns entries and capacity per CT map.
func (c *Client) CTStats(ctx context.Context) (*api.CTStats, error) {
	out := &api.CTStats{}
	return out, c.do(ctx, http.MethodGet, api.PathCTStats, nil, out)
}

// Audit runs an on-demand audit of ips (see api.AuditRequest).
func (c *Client) Audit(ctx context.Context, ips []netip.Addr) (*api.AuditResponse, error) {
	var out api.AuditResponse
	return &out, c.do(ctx, http.MethodPost, api.PathAudit, api.AuditRequest{IPs: ips}, &out)
}
