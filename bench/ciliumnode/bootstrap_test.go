package main

import "testing"

func TestParseBootstrap(t *testing.T) {
	running := `# HELP ctscrub_bootstrap_running 1 while ...
# TYPE ctscrub_bootstrap_running gauge
ctscrub_bootstrap_running 1
ctscrub_bootstrap_entries_total 1.5e+06
ctscrub_bootstrap_duration_seconds 2.5
`
	if s := parseBootstrap(running); s.done() || !s.running || s.entries != 1.5e6 || s.duration != 2.5 {
		t.Errorf("a running pass: %+v, done %v", s, s.done())
	}
	over := "ctscrub_bootstrap_running 0\nctscrub_bootstrap_entries_total 4.194e+06\nctscrub_bootstrap_duration_seconds 5.25\n"
	if s := parseBootstrap(over); !s.done() || s.duration != 5.25 {
		t.Errorf("a pass over: %+v, done %v", s, s.done())
	}
	// A scrubd whose pass has not begun: running 0, but nothing read yet.
	if s := parseBootstrap("ctscrub_bootstrap_running 0\nctscrub_bootstrap_entries_total 0\n"); s.done() {
		t.Errorf("a pass not begun counts as done: %+v", s)
	}
}
