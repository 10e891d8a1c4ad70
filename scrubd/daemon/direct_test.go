package daemon

import (
	"bufio"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// startDirect serves h on a fresh socket with the direct server and
// returns the socket's path and the server.
func startDirect(t *testing.T, h http.Handler) (string, *directServer, chan error) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "api.sock")
	ln, err := listenAPI(path)
	if err != nil {
		t.Fatal(err)
	}
	s := newDirectServer(h, context.Background, directConnContext, slog.New(slog.DiscardHandler), 64)
	served := make(chan error, 1)
	go func() { served <- s.Serve(ln) }()
	t.Cleanup(func() { s.Close() })
	return path, s, served
}

func unixClient(path string) *http.Client {
	return &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", path)
		},
	}, Timeout: 10 * time.Second}
}

// Requests beyond the accepting spares are served at once and in
// parallel: each handler waits until all of them are in.
func TestDirectServerServesInParallel(t *testing.T) {
	const n = 20
	var in atomic.Int32
	all := make(chan struct{})
	var once sync.Once
	path, _, _ := startDirect(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if in.Add(1) == n {
			once.Do(func() { close(all) })
		}
		select {
		case <-all:
			io.WriteString(w, "ok")
		case <-time.After(5 * time.Second):
			http.Error(w, "not all requests were in at once", http.StatusGatewayTimeout)
		}
	}))
	c := unixClient(path)
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for range n {
		wg.Go(func() {
			resp, err := c.Get("http://scrubd/x")
			if err != nil {
				errs <- err
				return
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != 200 || string(b) != "ok" {
				errs <- errors.New(resp.Status + ": " + string(b))
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// What http.ReadRequest cannot parse gets net/http's 400, and the server
// goes on serving.
func TestDirectServerMalformedRequest(t *testing.T) {
	path, _, _ := startDirect(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "fine") }))
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	io.WriteString(c, "this is not HTTP\r\n\r\n")
	b, _ := io.ReadAll(c)
	c.Close()
	if !strings.HasPrefix(string(b), "HTTP/1.1 400 Bad Request\r\n") {
		t.Errorf("answer to a malformed request: %q, want a 400", b)
	}
	resp, err := unixClient(path).Get("http://scrubd/")
	if err != nil {
		t.Fatalf("request after a malformed one: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Errorf("request after a malformed one: %s", resp.Status)
	}
}

// A caller that closes its connection cancels its request's context.
func TestDirectServerHangupCancels(t *testing.T) {
	cancelled := make(chan error, 1)
	entered := make(chan struct{})
	path, _, _ := startDirect(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(entered)
		select {
		case <-r.Context().Done():
			cancelled <- r.Context().Err()
		case <-time.After(5 * time.Second):
			cancelled <- nil
		}
	}))
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	io.WriteString(c, "POST /v1/scrub HTTP/1.1\r\nHost: scrubd\r\nContent-Length: 2\r\n\r\n{}")
	<-entered
	c.Close()
	if err := <-cancelled; !errors.Is(err, context.Canceled) {
		t.Errorf("request of a caller that went away: context %v, want cancelled", err)
	}
}

// An answer flushed before the handler returns goes out chunked; one that
// is not has its Content-Length; a body sent with Expect: 100-continue is
// read.
func TestDirectServerAnswerFraming(t *testing.T) {
	path, _, _ := startDirect(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		switch r.URL.Path {
		case "/stream":
			io.WriteString(w, "first,")
			w.(http.Flusher).Flush()
			io.WriteString(w, "second")
		default:
			w.Write(body)
		}
	}))
	c := unixClient(path)
	resp, err := c.Get("http://scrubd/stream")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(b) != "first,second" || len(resp.TransferEncoding) != 1 || resp.TransferEncoding[0] != "chunked" {
		t.Errorf("flushed answer: %q, transfer encoding %v; want both parts, chunked", b, resp.TransferEncoding)
	}
	req, _ := http.NewRequest("POST", "http://scrubd/echo", strings.NewReader(`{"ips":["10.244.0.1"]}`))
	req.Header.Set("Expect", "100-continue")
	resp, err = c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(b) != `{"ips":["10.244.0.1"]}` || resp.ContentLength != int64(len(b)) {
		t.Errorf("echo after 100-continue: %q with Content-Length %d", b, resp.ContentLength)
	}
}

// Shutdown stops accepting at once (the socket's file goes), waits for the
// request in flight, and Serve returns http.ErrServerClosed.
func TestDirectServerShutdown(t *testing.T) {
	release := make(chan struct{})
	entered := make(chan struct{})
	path, s, served := startDirect(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(entered)
		<-release
		io.WriteString(w, "done")
	}))
	answer := make(chan string, 1)
	go func() {
		c, err := net.Dial("unix", path)
		if err != nil {
			answer <- err.Error()
			return
		}
		defer c.Close()
		io.WriteString(c, "GET / HTTP/1.1\r\nHost: scrubd\r\n\r\n")
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			answer <- err.Error()
			return
		}
		b, _ := io.ReadAll(resp.Body)
		answer <- string(b)
	}()
	<-entered
	short, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if err := s.Shutdown(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Shutdown with a request in flight: %v, want its context's deadline", err)
	}
	if _, err := net.Dial("unix", path); err == nil {
		t.Error("a connect after Shutdown succeeded")
	}
	close(release)
	if err := s.Shutdown(context.Background()); err != nil {
		t.Errorf("Shutdown once the request answered: %v", err)
	}
	if got := <-answer; got != "done" {
		t.Errorf("the request in flight at Shutdown got %q, want its answer", got)
	}
	select {
	case err := <-served:
		if !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("Serve returned %v, want http.ErrServerClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Error("Serve did not return after Shutdown")
	}
}

// A handler's panic ends its connection, not the server.
func TestDirectServerHandlerPanic(t *testing.T) {
	path, _, _ := startDirect(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/panic" {
			panic("handler bug")
		}
		io.WriteString(w, "fine")
	}))
	c := unixClient(path)
	if resp, err := c.Get("http://scrubd/panic"); err == nil {
		resp.Body.Close()
		t.Errorf("a panicking handler answered %s, want the connection cut", resp.Status)
	}
	resp, err := c.Get("http://scrubd/after")
	if err != nil {
		t.Fatalf("request after a handler's panic: %v", err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(b) != "fine" {
		t.Errorf("request after a handler's panic: %q", b)
	}
}
