package api

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"
)

// TimingHeader carries the steps of one request as scrubd timed them, in the
// standard Server-Timing form ("decode;dur=0.012, attach;dur=0.71", in
// milliseconds, in order). Every answer of the API has it: the CNI plugin's
// trace (CTSCRUB_TRACE) and `make bench-cni` break a pod's ADD and DEL down
// by it, and scrubd observes the same steps in ctscrub_api_step_seconds.
const TimingHeader = "Server-Timing"

// Step is one timed step of a request.
type Step struct {
	Name string        `json:"name"`
	Dur  time.Duration `json:"dur_ns"`
}

// Steps times the steps of one request. The zero value is not usable; a nil
// *Steps ignores every call, so code can time steps without knowing whether
// anyone listens. Safe for concurrent use.
type Steps struct {
	mu    sync.Mutex
	last  time.Time
	steps []Step
}

// NewSteps starts timing at start.
func NewSteps(start time.Time) *Steps { return &Steps{last: start} }

// Mark ends the step called name: the time since the previous mark (or the
// start).
func (s *Steps) Mark(name string) {
	if s == nil {
		return
	}
	now := time.Now()
	s.mu.Lock()
	s.steps = append(s.steps, Step{name, now.Sub(s.last)})
	s.last = now
	s.mu.Unlock()
}

// Add records a step timed elsewhere (on another goroutine) and moves the
// mark to now, so the step is not counted twice.
func (s *Steps) Add(name string, d time.Duration) {
	if s == nil {
		return
	}
	now := time.Now()
	s.mu.Lock()
	s.steps = append(s.steps, Step{name, d})
	s.last = now
	s.mu.Unlock()
}

// List returns the steps so far.
func (s *Steps) List() []Step {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Step(nil), s.steps...)
}

// Header is the steps so far in TimingHeader's form.
func (s *Steps) Header() string {
	var b strings.Builder
	for i, st := range s.List() {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s;dur=%.3f", st.Name, float64(st.Dur)/1e6)
	}
	return b.String()
}

// ParseTiming reads a TimingHeader value; what it cannot read is skipped (a
// trace, never an error).
func ParseTiming(h string) []Step {
	var out []Step
	for _, part := range strings.Split(h, ",") {
		fields := strings.Split(strings.TrimSpace(part), ";")
		if fields[0] == "" {
			continue
		}
		st := Step{Name: fields[0]}
		for _, f := range fields[1:] {
			if v, ok := strings.CutPrefix(strings.TrimSpace(f), "dur="); ok {
				if ms, err := strconv.ParseFloat(v, 64); err == nil {
					st.Dur = time.Duration(ms * 1e6)
				}
			}
		}
		out = append(out, st)
	}
	return out
}

type stepsKey struct{}

// WithSteps returns ctx carrying s.
func WithSteps(ctx context.Context, s *Steps) context.Context {
	return context.WithValue(ctx, stepsKey{}, s)
}

// StepsFrom returns the Steps ctx carries, or nil.
func StepsFrom(ctx context.Context) *Steps {
	s, _ := ctx.Value(stepsKey{}).(*Steps)
	return s
}
