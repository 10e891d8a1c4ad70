package kind

import (
	"encoding/json"
	"strings"
	"testing"
)

// passCount is what a scrubd's log says about the scrubs that swept
// after its bootstrap pass ended (issue 36: O(k) from the first minute).
type passCount struct {
	// Done: the log has the pass's end ("bootstrap pass done"); Free:
	// it vouched for the free addresses (free_addresses_trusted).
	Done, Free bool
	// Vouched and Complete are the pass's own counts.
	Vouched, Complete int
	// Adds and AddsSwept are the CNI ADD scrubs after the pass (a
	// container ID), Creates and CreatesSwept the delegate's
	// endpoint-create scrubs (no container ID), and how many of each
	// swept.
	Adds, AddsSwept, Creates, CreatesSwept int
	// Why is the swept_why of the scrubs that swept, by reason text.
	Why map[string]int
}

// countAfterPass reads a scrubd log (JSON lines, in order) from its last
// "bootstrap pass done" on.
func countAfterPass(log string) passCount {
	lines := strings.Split(log, "\n")
	at := -1
	var pc passCount
	for i, l := range lines {
		var s struct {
			Msg      string `json:"msg"`
			Free     bool   `json:"free_addresses_trusted"`
			Vouched  int    `json:"vouched"`
			Complete int    `json:"complete"`
		}
		if json.Unmarshal([]byte(l), &s) == nil && s.Msg == "bootstrap pass done" {
			at = i
			pc = passCount{Done: true, Free: s.Free, Vouched: s.Vouched, Complete: s.Complete}
		}
	}
	if at < 0 {
		return pc
	}
	pc.Why = map[string]int{}
	for _, l := range lines[at+1:] {
		var s scrubLine
		if json.Unmarshal([]byte(l), &s) != nil || s.Msg != "scrub" || s.Reason != "add" || s.DryRun {
			continue
		}
		swept := s.Method == "sweep"
		if s.ContainerID != "" {
			pc.Adds++
			if swept {
				pc.AddsSwept++
			}
		} else {
			pc.Creates++
			if swept {
				pc.CreatesSwept++
			}
		}
		if swept {
			for _, why := range s.SweptWhy {
				pc.Why[why]++
			}
		}
	}
	return pc
}

// json gives the counts as the step's JSON fields.
func (pc passCount) json() map[string]any {
	return map[string]any{
		"bootstrap_pass_done":        pc.Done,
		"free_addresses_trusted":     pc.Free,
		"adds_after_pass":            pc.Adds,
		"adds_swept_after_pass":      pc.AddsSwept,
		"creates_after_pass":         pc.Creates,
		"creates_swept_after_pass":   pc.CreatesSwept,
		"swept_why_after_pass":       pc.Why,
		"bootstrap_vouched_complete": pc.Complete,
	}
}

// check fails the step when a scrub swept after the pass ended, or the
// pass never ended, or nothing was scrubbed after it to count.
func (pc passCount) check(t *testing.T, step string) {
	t.Helper()
	switch {
	case !pc.Done:
		t.Errorf("%s: scrubd's log has no \"bootstrap pass done\": the pass did not end", step)
	case pc.Adds+pc.Creates == 0:
		t.Errorf("%s: no ADD scrub after the bootstrap pass to count", step)
	case pc.AddsSwept+pc.CreatesSwept > 0:
		t.Errorf("%s: after the bootstrap pass %d of %d ADDs and %d of %d creates swept (free addresses trusted: %v; why: %v): want 0",
			step, pc.AddsSwept, pc.Adds, pc.CreatesSwept, pc.Creates, pc.Free, pc.Why)
	}
}

func TestCountAfterPass(t *testing.T) {
	log := strings.Join([]string{
		`{"msg":"scrub","reason":"add","method":"sweep","container_id":"before"}`,
		`{"msg":"bootstrap pass done","vouched":30,"complete":28,"free_addresses_trusted":true}`,
		`not json`,
		`{"msg":"scrub","reason":"add","method":"index","container_id":"a"}`,
		`{"msg":"scrub","reason":"add","method":"sweep","container_id":"b","swept_why":{"10.0.0.9":"owner unknown"}}`,
		`{"msg":"scrub","reason":"del","method":"sweep","container_id":"c"}`,
		`{"msg":"scrub","reason":"add","method":"index"}`,
		`{"msg":"scrub","reason":"add","method":"sweep","dry_run":true}`,
	}, "\n")
	pc := countAfterPass(log)
	want := passCount{Done: true, Free: true, Vouched: 30, Complete: 28, Adds: 2, AddsSwept: 1, Creates: 1, Why: map[string]int{"owner unknown": 1}}
	if pc.Done != want.Done || pc.Free != want.Free || pc.Vouched != want.Vouched || pc.Complete != want.Complete ||
		pc.Adds != want.Adds || pc.AddsSwept != want.AddsSwept || pc.Creates != want.Creates || pc.CreatesSwept != want.CreatesSwept ||
		len(pc.Why) != 1 || pc.Why["owner unknown"] != 1 {
		t.Fatalf("countAfterPass: %+v, want %+v", pc, want)
	}
	if got := countAfterPass(`{"msg":"scrub","reason":"add","method":"sweep","container_id":"x"}`); got.Done || got.AddsSwept != 0 {
		t.Fatalf("no pass in the log: %+v", got)
	}
}
