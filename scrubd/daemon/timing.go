package daemon

import (
	"context"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/api"
)

// Every API request is timed step by step (api.Steps): the handlers mark
// their steps, the answer carries them (api.TimingHeader), each is observed
// in ctscrub_api_step_seconds and the whole list is logged at debug level.
// Always on: a mark is a clock read and an append, about 50 ns.

type acceptKey struct{}

// afterKey holds a request's work for after its answer (afterAnswer).
type afterKey struct{}

type afterList struct {
	mu  sync.Mutex
	fns []func()
}

// afterAnswer runs fn once the answer of ctx's request is sent: its log
// lines, which the caller (a CNI ADD or DEL waiting on a pod's
// start or removal) need not wait for. Outside a request it runs fn at once.
func afterAnswer(ctx context.Context, fn func()) {
	if l, ok := ctx.Value(afterKey{}).(*afterList); ok {
		l.mu.Lock()
		l.fns = append(l.fns, fn)
		l.mu.Unlock()
		return
	}
	fn()
}

var knownPaths = map[string]bool{
	api.PathScrub: true, api.PathIndexStart: true, api.PathIndexStop: true, api.PathIndexList: true,
	api.PathIndexIP: true, api.PathIndexPod: true, api.PathStatus: true, api.PathGC: true,
	api.PathCTStats: true, api.PathAudit: true, "/healthz": true, "/readyz": true,
}

// acceptContext notes when the connection was accepted: the API's clients
// open one connection per request, so "read" (accept to handler: the
// connection's goroutine, reading the request line and headers) is a step
// of the request.
func acceptContext(ctx context.Context) context.Context {
	return context.WithValue(ctx, acceptKey{}, time.Now())
}

// timingWriter sets the timing header before the answer's status line.
type timingWriter struct {
	http.ResponseWriter
	steps *api.Steps
	wrote bool
}

func (w *timingWriter) WriteHeader(code int) {
	if !w.wrote {
		w.wrote = true
		w.steps.Mark("handler") // whatever the handler did after its last mark
		w.Header().Set(api.TimingHeader, w.steps.Header())
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *timingWriter) Write(b []byte) (int, error) {
	if !w.wrote {
		w.WriteHeader(http.StatusOK)
	}
	return w.ResponseWriter.Write(b)
}

func (d *Daemon) withTiming(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		steps := api.NewSteps(start)
		if at, ok := r.Context().Value(acceptKey{}).(time.Time); ok {
			steps.Add("read", start.Sub(at))
		}
		tw := &timingWriter{ResponseWriter: w, steps: steps}
		after := &afterList{}
		ctx := context.WithValue(api.WithSteps(r.Context(), steps), afterKey{}, after)
		next.ServeHTTP(tw, r.WithContext(ctx))
		steps.Mark("write")
		path := r.URL.Path
		if !knownPaths[path] {
			path = "other" // bounded label values
		}
		list := steps.List()
		for _, st := range list {
			d.m.steps.WithLabelValues(path, st.Name).Observe(st.Dur.Seconds())
		}
		// The answer (sized by Content-Length, writeJSON) leaves now, so the
		// client reads it while the logs below are written. Its metrics are
		// in already: a scrape right after the answer sees them.
		if tw.wrote {
			http.NewResponseController(w).Flush()
		}
		after.mu.Lock()
		fns := after.fns
		after.mu.Unlock()
		for _, fn := range fns {
			fn()
		}
		if d.log.Enabled(r.Context(), slog.LevelDebug) {
			attrs := make([]any, 0, 2*len(list)+2)
			attrs = append(attrs, "path", path)
			for _, st := range list {
				attrs = append(attrs, st.Name+"_s", st.Dur.Seconds())
			}
			d.log.Debug("api steps", attrs...)
		}
	})
}
