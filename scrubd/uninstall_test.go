package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// An httptest server stands in for the API server in these tests: what they
// check is scrubd's decision on each answer the API server can give to the
// DaemonSet's GET and watch, and the faults among them (403 after the
// RoleBinding is gone, 401, no API server at all) cannot be caused on demand
// against a real one in a unit test. The kind e2e (TestKindUninstall) runs
// the real thing: helm uninstall, then pods must start.

const dsPath = "/apis/apps/v1/namespaces/kube-system/daemonsets"

func testWatch(t *testing.T, h http.Handler) (*daemonSetWatch, *httptest.Server) {
	t.Helper()
	srv := httptest.NewTLSServer(h)
	t.Cleanup(srv.Close)
	token := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(token, []byte("tok-1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	w := newDaemonSetWatch(srv.URL, "kube-system", "ctscrub", token,
		srv.Client().Transport.(*http.Transport).TLSClientConfig.Clone(), slog.New(slog.NewTextHandler(io.Discard, nil)))
	w.backoff = 10 * time.Millisecond
	return w, srv
}

func TestDaemonSetDecide(t *testing.T) {
	for _, c := range []struct {
		name    string
		status  int
		body    string
		removed bool
		err     string
	}{
		{name: "rolling update", status: 200, body: `{"kind":"DaemonSet","metadata":{"name":"ctscrub"}}`},
		{name: "deleted", status: 404, body: `{"kind":"Status","code":404}`, removed: true},
		{name: "foreground deletion", status: 200, body: `{"kind":"DaemonSet","metadata":{"name":"ctscrub","deletionTimestamp":"2026-12-02T10:00:00Z"}}`, removed: true},
		{name: "RoleBinding gone", status: 403, body: `{"kind":"Status","code":403}`, err: "HTTP 403"},
		{name: "ServiceAccount gone", status: 401, body: `{"kind":"Status","code":401}`, err: "HTTP 401"},
		{name: "API server failing", status: 500, body: `oops`, err: "HTTP 500"},
	} {
		t.Run(c.name, func(t *testing.T) {
			w, _ := testWatch(t, http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
				if r.URL.Path != dsPath+"/ctscrub" || r.Header.Get("Authorization") != "Bearer tok-1" {
					http.Error(rw, "unexpected request "+r.URL.String(), http.StatusBadRequest)
					return
				}
				rw.WriteHeader(c.status)
				io.WriteString(rw, c.body)
			}))
			removed, why, err := w.decide(context.Background())
			if removed != c.removed || (c.err == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), c.err)) {
				t.Errorf("decide: removed %v (%q), err %v; want removed %v, err with %q", removed, why, err, c.removed, c.err)
			}
		})
	}
}

// No API server at all: the chain stays, with an error saying why.
func TestDaemonSetDecideUnreachable(t *testing.T) {
	w, srv := testWatch(t, http.NotFoundHandler())
	srv.Close()
	removed, _, err := w.decide(context.Background())
	if removed || err == nil {
		t.Errorf("unreachable API server: removed %v, err %v; want false and an error", removed, err)
	}
}

// Helm deletes the DaemonSet, then its Role, RoleBinding and ServiceAccount,
// before the pods get SIGTERM: the watch sees the DELETED event while the
// permission holds, and the decision at SIGTERM stands on it though the GET
// is refused by then.
func TestDaemonSetWatchSeesDeletion(t *testing.T) {
	deleted := make(chan struct{})
	w, _ := testWatch(t, http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.URL.Path == dsPath && r.URL.Query().Get("watch") == "1" {
			if r.URL.Query().Get("fieldSelector") != "metadata.name=ctscrub" {
				http.Error(rw, "the Role names one DaemonSet: watch it by name", http.StatusForbidden)
				return
			}
			rw.Header().Set("Content-Type", "application/json")
			fmt.Fprintln(rw, `{"type":"ADDED","object":{"kind":"DaemonSet","metadata":{"name":"ctscrub"}}}`)
			rw.(http.Flusher).Flush()
			select {
			case <-deleted:
				fmt.Fprintln(rw, `{"type":"DELETED","object":{"kind":"DaemonSet","metadata":{"name":"ctscrub"}}}`)
			case <-r.Context().Done():
			}
			return
		}
		http.Error(rw, `{"kind":"Status","code":403}`, http.StatusForbidden)
	}))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan struct{})
	go func() { w.run(ctx); close(done) }()
	for !w.synced.Load() {
		time.Sleep(5 * time.Millisecond)
	}
	if removed, _, _ := w.decide(context.Background()); removed {
		t.Fatal("decided on an uninstall before the DaemonSet was deleted")
	}
	close(deleted)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the watch did not end on the DELETED event")
	}
	removed, why, err := w.decide(context.Background())
	if !removed || err != nil {
		t.Errorf("after the DELETED event: removed %v (%q), err %v; want true", removed, why, err)
	}
}

// An ERROR event (410: the resourceVersion is too old) is not a deletion:
// the watch starts over without a resourceVersion. A stream the server ends
// is resumed from the last resourceVersion seen, so a deletion between two
// streams is still delivered.
func TestDaemonSetWatchResumes(t *testing.T) {
	var mu sync.Mutex
	var rvs []string
	w, _ := testWatch(t, http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		mu.Lock()
		rvs = append(rvs, r.URL.Query().Get("resourceVersion"))
		n := len(rvs)
		mu.Unlock()
		ev := func(typ string, obj map[string]any) {
			b, _ := json.Marshal(map[string]any{"type": typ, "object": obj})
			rw.Write(append(b, '\n'))
		}
		ds := func(rv string) map[string]any {
			return map[string]any{"kind": "DaemonSet", "metadata": map[string]any{"name": "ctscrub", "resourceVersion": rv}}
		}
		switch n {
		case 1: // the server's timeout ends the stream
			ev("ADDED", ds("10"))
		case 2: // resumed from 10, then too old
			ev("MODIFIED", ds("11"))
			ev("ERROR", map[string]any{"kind": "Status", "code": 410})
		case 3: // started over
			ev("ADDED", ds("12"))
			ev("DELETED", ds("13"))
		}
	}))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	w.run(ctx)
	mu.Lock()
	defer mu.Unlock()
	if !w.removed.Load() || fmt.Sprint(rvs) != "[ 10 ]" {
		t.Errorf("removed %v, watches from resourceVersions %q; want true after [\"\" 10 \"\"]", w.removed.Load(), rvs)
	}
}
