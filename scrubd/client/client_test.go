package client

import (
	"context"
	"errors"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/api"
)

// serve answers on a unix socket with h (a stand-in for scrubd's server: the
// daemon's own tests exercise the client against the real one).
func serve(t *testing.T, h http.HandlerFunc) *Client {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "s.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return New(sock)
}

func TestUnavailable(t *testing.T) {
	c := New(filepath.Join(t.TempDir(), "missing.sock"))
	_, err := c.Status(context.Background())
	if !IsUnavailable(err) || !strings.Contains(err.Error(), "missing.sock") {
		t.Errorf("status on a missing socket: %v, want ErrUnavailable naming the socket", err)
	}
}

func TestDeadlineTravels(t *testing.T) {
	got := make(chan string, 1)
	c := serve(t, func(w http.ResponseWriter, r *http.Request) {
		got <- r.Header.Get(api.DeadlineHeader)
		w.Write([]byte(`{}`))
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dl, _ := ctx.Deadline()
	if _, err := c.Status(ctx); err != nil {
		t.Fatal(err)
	}
	h := <-got
	parsed, err := time.Parse(time.RFC3339Nano, h)
	if err != nil || !parsed.Equal(dl) {
		t.Errorf("deadline header %q, want %s", h, dl.UTC().Format(time.RFC3339Nano))
	}
	if _, err := c.Status(context.Background()); err != nil {
		t.Fatal(err)
	}
	if h := <-got; h != "" {
		t.Errorf("deadline header %q sent without a deadline", h)
	}
}

func TestErrorAnswers(t *testing.T) {
	c := serve(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == api.PathStatus {
			http.Error(w, "proxy broke", http.StatusBadGateway)
			return
		}
		w.WriteHeader(http.StatusTooManyRequests)
		w.Write([]byte(`{"code":"try_again","error":"busy"}`))
	})
	_, err := c.Scrub(context.Background(), api.ScrubRequest{})
	if e, ok := APIError(err); !ok || e.Code != api.CodeTryAgain || e.Message != "busy" {
		t.Errorf("scrub: %v, want the daemon's try_again error", err)
	}
	_, err = c.Status(context.Background())
	if e, ok := APIError(err); !ok || e.Code != api.CodeInternal || !strings.Contains(e.Message, "502") || !strings.Contains(e.Message, "proxy broke") {
		t.Errorf("status: %v, want an internal error quoting the answer", err)
	}
}

// A server that never answers: the caller's deadline or cancel ends the
// request promptly, with the context's error (the transport reads on the
// caller's goroutine, so only the connection's deadline can stop it).
func TestStuckServerCancelled(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "stuck.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close() // read nothing, answer nothing
		}
	}()
	c := New(sock)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = c.Status(ctx)
	if !errors.Is(err, context.DeadlineExceeded) || time.Since(start) > 2*time.Second {
		t.Errorf("deadline: %v after %v, want context.DeadlineExceeded within about 100 ms", err, time.Since(start))
	}
	ctx, cancel = context.WithCancel(context.Background())
	time.AfterFunc(100*time.Millisecond, cancel)
	start = time.Now()
	_, err = c.Status(ctx)
	if !errors.Is(err, context.Canceled) || time.Since(start) > 2*time.Second {
		t.Errorf("cancel: %v after %v, want context.Canceled within about 100 ms", err, time.Since(start))
	}
}

// Each request has a connection of its own, closed after the answer.
func TestOneConnectionPerRequest(t *testing.T) {
	var conns atomic.Int32
	sock := filepath.Join(t.TempDir(), "s.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write([]byte(`{}`)) }),
		ConnState: func(_ net.Conn, s http.ConnState) {
			if s == http.StateNew {
				conns.Add(1)
			}
		}}
	go srv.Serve(ln)
	defer srv.Close()
	c := New(sock)
	for range 3 {
		if _, err := c.Status(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	if n := conns.Load(); n != 3 {
		t.Errorf("%d connections for 3 requests", n)
	}
}
