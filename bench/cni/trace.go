package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/client"
)

// The ctscrub plugin's trace (plugin/trace.go; CTSCRUB_TRACE in its
// environment): one stderr line per ADD or DEL.
const (
	pluginTraceEnv    = "CTSCRUB_TRACE"
	pluginTracePrefix = "ctscrub-trace "
)

type pluginTrace struct {
	Cmd     string `json:"cmd"`
	StartNS int64  `json:"start_unix_ns"`
	EntryNS int64  `json:"entry_unix_ns"`
	Steps   []struct {
		Name string        `json:"name"`
		Dur  time.Duration `json:"dur_ns"`
	} `json:"steps"`
	Requests []client.Timing `json:"requests"`
	EndNS    int64           `json:"end_unix_ns"`
}

// stepSamples collects, per step name, one duration per call, and the
// order in which step names were first seen.
type stepSamples struct {
	order []string
	d     map[string][]time.Duration
}

func (s *stepSamples) add(name string, d time.Duration) {
	if s.d == nil {
		s.d = map[string][]time.Duration{}
	}
	if _, ok := s.d[name]; !ok {
		s.order = append(s.order, name)
	}
	s.d[name] = append(s.d[name], d)
}

// addCall breaks one plugin call down: from the fork (forked) to the Go
// runtime running ("exec"), skel's reading of stdin and the environment
// ("skel"), the plugin's steps, and each request to scrubd as
// "<path>.dial", "<path>.<scrubd's step>" and "<path>.client" (the rest of
// the round trip: the HTTP exchange on both sides, wake-ups), and from the
// trace's end to the exit seen by the runtime ("exit").
func (s *stepSamples) addCall(stderr []byte, forked, exited time.Time) error {
	var line []byte
	for _, l := range bytes.Split(stderr, []byte("\n")) {
		if rest, ok := bytes.CutPrefix(l, []byte(pluginTracePrefix)); ok {
			line = rest
		}
	}
	if line == nil {
		return fmt.Errorf("no %q line on the plugin's stderr (was it built from this tree?): %s", strings.TrimSpace(pluginTracePrefix), bytes.TrimSpace(stderr))
	}
	var t pluginTrace
	if err := json.Unmarshal(line, &t); err != nil {
		return fmt.Errorf("plugin trace %s: %w", line, err)
	}
	s.add("exec", time.Duration(t.StartNS-forked.UnixNano()))
	s.add("skel", time.Duration(t.EntryNS-t.StartNS))
	for _, st := range t.Steps {
		if st.Name != "requests" && st.Name != "finish" {
			s.add(st.Name, st.Dur)
		}
	}
	for _, r := range t.Requests {
		p := strings.ReplaceAll(strings.TrimPrefix(r.Path, "/v1/"), "/", "_")
		if i := strings.IndexByte(p, '?'); i >= 0 {
			p = p[:i]
		}
		s.add(p+".dial", r.Dial)
		rest := r.Total - r.Dial
		for _, st := range r.Server {
			s.add(p+"."+st.Name, st.Dur)
			rest -= st.Dur
		}
		s.add(p+".client", rest)
	}
	s.add("exit", exited.Sub(time.Unix(0, t.EndNS)))
	return nil
}

// p50 is each step's median, in seconds.
func (s *stepSamples) p50() map[string]float64 {
	out := map[string]float64{}
	for name, d := range s.d {
		out[name] = q(d, 0.5).Seconds()
	}
	return out
}

// print writes a table of each step's p50, p99 and mean.
func (s *stepSamples) print(w io.Writer, what string, total []time.Duration) {
	fmt.Fprintf(w, "\n%s, per step (%d calls; a request's steps run in order, scrubd's inside its round trip):\n", what, len(total))
	fmt.Fprintf(w, "  %-28s %10s %10s %10s\n", "step", "p50 ms", "p99 ms", "mean ms")
	var sum time.Duration
	for _, name := range s.order {
		d := s.d[name]
		var tot time.Duration
		for _, x := range d {
			tot += x
		}
		mean := tot / time.Duration(len(d))
		sum += mean
		fmt.Fprintf(w, "  %-28s %10.3f %10.3f %10.3f\n", name, ms(q(d, 0.5)), ms(q(d, 0.99)), ms(mean))
	}
	var tot time.Duration
	for _, x := range total {
		tot += x
	}
	if len(total) > 0 {
		fmt.Fprintf(w, "  %-28s %10.3f %10.3f %10.3f   (sum of the means %.3f ms)\n", "whole call", ms(q(total, 0.5)), ms(q(total, 0.99)), ms(tot/time.Duration(len(total))), ms(sum))
	}
}

func ms(d time.Duration) float64 { return float64(d) / 1e6 }
