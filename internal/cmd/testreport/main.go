// Command testreport keeps `go test` honest about skips. `make test` pipes
// `go test -json` through it: it prints the ordinary `go test` output as it
// arrives (CI reads the closing ok/FAIL lines), keeps the JSON in a file, and
// ends with every skipped test and its reason. With -must-run it reads one or
// more such files and fails when a test that list says must run on this kind
// of machine skipped, or matched no test at all (renamed or deleted).
//
//	go test -json ./... | testreport -json-out bin/test-main.json
//	testreport -must-run .ci/must-run.txt bin/test-main.json bin/test-conformance.json
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"regexp"
	"sort"
	"strings"
)

// event is the part of test2json's output (`go doc test2json`) this reads.
type event struct {
	Action  string
	Package string
	Test    string
	Output  string
}

// result is one test's outcome and, when it skipped, why.
type result struct {
	Package, Test string
	Action        string // "pass", "fail" or "skip"
	Reason        string // the test's own output on a skip (its t.Skip message)
}

func main() {
	jsonOut := flag.String("json-out", "", "stream mode: read `go test -json` on stdin, print its ordinary output, keep the JSON in this file and list the skips")
	mustRun := flag.String("must-run", "", "check mode: the must-run list; the arguments are JSON files written by -json-out")
	flag.Parse()
	switch {
	case *jsonOut != "" && *mustRun == "":
		os.Exit(stream(os.Stdin, os.Stdout, *jsonOut))
	case *mustRun != "" && flag.NArg() > 0:
		os.Exit(check(os.Stdout, *mustRun, flag.Args()))
	default:
		fmt.Fprintln(os.Stderr, "usage: go test -json ... | testreport -json-out FILE\n       testreport -must-run LIST FILE...")
		os.Exit(2)
	}
}

// stream prints what `go test` without -json would (a package's "ok" line,
// and a failed test's output) while keeping the JSON, then lists the skipped
// tests. It does not judge the run: go test's exit code does.
func stream(in io.Reader, w io.Writer, jsonOut string) int {
	f, err := os.Create(jsonOut)
	if err != nil {
		fmt.Fprintf(os.Stderr, "testreport: keep the test JSON: %v\n", err)
		return 1
	}
	defer f.Close()
	p := newPrinter(w)
	r := bufio.NewReader(in)
	var events []event
	for {
		line, err := r.ReadBytes('\n')
		if len(line) > 0 {
			f.Write(line)
			var e event
			if json.Unmarshal(line, &e) != nil || e.Action == "" {
				w.Write(line) // not test2json's: the go command's own words
			} else {
				events = append(events, e)
				p.event(e)
			}
		}
		if err != nil {
			break
		}
	}
	printSkips(w, results(events))
	return 0
}

// printer turns test2json's verbose stream back into go test's ordinary
// output: a test's lines are held until it ends and printed only if it
// failed; a package's own lines ("ok", "FAIL", a panic) pass through.
type printer struct {
	w    io.Writer
	held map[[2]string][]string // package, test: its output so far
	seq  [][2]string            // the tests held, in the order they started
}

func newPrinter(w io.Writer) *printer { return &printer{w: w, held: map[[2]string][]string{}} }

func (p *printer) event(e event) {
	k := [2]string{e.Package, e.Test}
	switch {
	case e.Action == "build-output":
		io.WriteString(p.w, e.Output)
	case e.Test == "" && e.Action == "output":
		if e.Output == "PASS\n" { // -v's; go test without it prints only "ok"
			return
		}
		if strings.HasPrefix(e.Output, "FAIL") || strings.HasPrefix(e.Output, "ok ") {
			p.flush(e.Package) // a test that never ended (a crash, a timeout): show what it said
		}
		io.WriteString(p.w, e.Output)
	case e.Test == "":
	case e.Action == "output":
		if strings.HasPrefix(e.Output, "=== ") { // RUN, PAUSE, CONT, NAME: -v's
			return
		}
		if _, ok := p.held[k]; !ok {
			p.seq = append(p.seq, k)
		}
		p.held[k] = append(p.held[k], e.Output)
	case e.Action == "fail":
		// test2json puts "--- FAIL: TestX" after the test's lines; go test
		// prints it before them.
		lines := p.held[k]
		for i, l := range lines {
			if strings.HasPrefix(strings.TrimSpace(l), "--- FAIL") {
				lines = append(append([]string{l}, lines[:i]...), lines[i+1:]...)
				break
			}
		}
		for _, l := range lines {
			io.WriteString(p.w, l)
		}
		delete(p.held, k)
	case e.Action == "pass" || e.Action == "skip":
		delete(p.held, k)
	}
}

func (p *printer) flush(pkg string) {
	seq := p.seq[:0]
	for _, k := range p.seq {
		lines, ok := p.held[k]
		switch {
		case !ok:
		case k[0] == pkg:
			for _, l := range lines {
				io.WriteString(p.w, l)
			}
			delete(p.held, k)
		default:
			seq = append(seq, k)
		}
	}
	p.seq = seq
}

func printSkips(w io.Writer, rs []result) {
	var skipped []result
	for _, r := range rs {
		if r.Action == "skip" {
			skipped = append(skipped, r)
		}
	}
	if len(skipped) == 0 {
		fmt.Fprintln(w, "--- skipped: none")
		return
	}
	fmt.Fprintf(w, "--- skipped: %d tests\n", len(skipped))
	for _, r := range skipped {
		fmt.Fprintf(w, "  %s %s: %s\n", r.Package, r.Test, r.Reason)
	}
}

// results folds the events into one outcome per test, with a skip's reason
// taken from the test's output (what t.Skip printed, without the "--- SKIP"
// line and file:line prefixes that test2json passes through).
func results(events []event) []result {
	type key struct{ pkg, test string }
	out := map[key][]string{}
	var rs []result
	for _, e := range events {
		if e.Test == "" {
			continue
		}
		k := key{e.Package, e.Test}
		switch e.Action {
		case "output":
			out[k] = append(out[k], e.Output)
		case "pass", "fail", "skip":
			r := result{Package: e.Package, Test: e.Test, Action: e.Action}
			if e.Action == "skip" {
				r.Reason = skipReason(out[k])
			}
			rs = append(rs, r)
		}
	}
	sort.SliceStable(rs, func(i, j int) bool {
		if rs[i].Package != rs[j].Package {
			return rs[i].Package < rs[j].Package
		}
		return rs[i].Test < rs[j].Test
	})
	return rs
}

// fileLine is the "name_test.go:42: " that testing puts before a message.
var fileLine = regexp.MustCompile(`^\s*[\w.-]+\.go:\d+: `)

func skipReason(lines []string) string {
	var msg []string
	for _, l := range lines {
		t := strings.TrimSpace(l)
		if t == "" || strings.HasPrefix(t, "=== ") || strings.HasPrefix(t, "--- SKIP") {
			continue
		}
		msg = append(msg, strings.TrimSpace(fileLine.ReplaceAllString(l, "")))
	}
	if len(msg) == 0 {
		return "(no reason given)"
	}
	return strings.Join(msg, " / ")
}

// rule is one line of the must-run list: tests of Package whose name Test
// matches must not skip, unless the skip's reason contains one of Allow
// (a skip this machine can take legitimately, such as a race the kernel won).
type rule struct {
	Line    int
	Package string
	Test    *regexp.Regexp
	Allow   []string
	Why     string
	matched bool
}

// parseRules reads the list: "package test-regexp [allow=\"substring\"]... # why".
// A package ending in "/..." covers the packages under it.
func parseRules(data []byte) ([]*rule, error) {
	var rs []*rule
	for i, line := range strings.Split(string(data), "\n") {
		why := ""
		if j := strings.Index(line, "#"); j >= 0 {
			line, why = line[:j], strings.TrimSpace(line[j+1:])
		}
		line = strings.TrimSpace(line)
		if line == "" {
			continue
		}
		r := &rule{Line: i + 1, Why: why}
		pkg, rest, _ := strings.Cut(line, " ")
		pat, rest, _ := strings.Cut(strings.TrimSpace(rest), " ")
		rest = strings.TrimSpace(rest)
		r.Package = pkg
		if pat != "" {
			re, err := regexp.Compile(pat)
			if err != nil {
				return nil, fmt.Errorf("line %d: test pattern %q: %v", r.Line, pat, err)
			}
			r.Test = re
		}
		if r.Test == nil {
			return nil, fmt.Errorf("line %d: want \"package test-regexp [allow=\\\"reason\\\"]...\", got %q", r.Line, line)
		}
		for rest != "" {
			if !strings.HasPrefix(rest, `allow="`) {
				return nil, fmt.Errorf("line %d: want allow=\"reason substring\", got %q", r.Line, rest)
			}
			end := strings.Index(rest[len(`allow="`):], `"`)
			if end < 0 {
				return nil, fmt.Errorf("line %d: unterminated allow=\"...\"", r.Line)
			}
			r.Allow = append(r.Allow, rest[len(`allow="`):len(`allow="`)+end])
			rest = strings.TrimSpace(rest[len(`allow="`)+end+1:])
		}
		rs = append(rs, r)
	}
	return rs, nil
}

func (r *rule) covers(pkg, test string) bool {
	if p, ok := strings.CutSuffix(r.Package, "/..."); ok {
		if pkg != p && !strings.HasPrefix(pkg, p+"/") {
			return false
		}
	} else if pkg != r.Package {
		return false
	}
	return r.Test.MatchString(test)
}

// violations lists what breaks the rules: a covered test that skipped for a
// reason no allow names, and a rule that matched no test at all.
func violations(rules []*rule, rs []result) []string {
	var bad []string
	for _, res := range rs {
		for _, r := range rules {
			if !r.covers(res.Package, res.Test) {
				continue
			}
			r.matched = true
			if res.Action != "skip" {
				continue
			}
			allowed := false
			for _, a := range r.Allow {
				allowed = allowed || strings.Contains(res.Reason, a)
			}
			if allowed {
				continue
			}
			bad = append(bad, fmt.Sprintf("%s %s skipped (%s), but must run here (must-run line %d: %s)", res.Package, res.Test, res.Reason, r.Line, r.Why))
		}
	}
	for _, r := range rules {
		if !r.matched {
			bad = append(bad, fmt.Sprintf("must-run line %d (%s %s) matched no test: renamed, deleted, or not run? Fix the list or the run", r.Line, r.Package, r.Test))
		}
	}
	return bad
}

// parseEvents reads a file written by -json-out; lines that are not
// test2json's (the go command's own) are left out.
func parseEvents(b []byte) []event {
	var events []event
	for _, line := range bytes.Split(b, []byte("\n")) {
		var e event
		if json.Unmarshal(line, &e) == nil && e.Action != "" {
			events = append(events, e)
		}
	}
	return events
}

func check(w io.Writer, listPath string, files []string) int {
	data, err := os.ReadFile(listPath)
	if err != nil {
		fmt.Fprintf(os.Stderr, "testreport: read the must-run list: %v\n", err)
		return 1
	}
	rules, err := parseRules(data)
	if err != nil {
		fmt.Fprintf(os.Stderr, "testreport: %s: %v\n", listPath, err)
		return 1
	}
	var rs []result
	for _, p := range files {
		b, err := os.ReadFile(p)
		if err != nil {
			fmt.Fprintf(os.Stderr, "testreport: read %v (run `make test` first)\n", err)
			return 1
		}
		rs = append(rs, results(parseEvents(b))...)
	}
	bad := violations(rules, rs)
	if len(bad) == 0 {
		fmt.Fprintf(w, "testreport: every test %s lists ran (%d rules)\n", listPath, len(rules))
		return 0
	}
	for _, b := range bad {
		fmt.Fprintln(w, "testreport: FAIL:", b)
	}
	fmt.Fprintf(w, "testreport: %d problems with tests that must run on this machine: install what a skip names (scripts/setup.sh), or fix %s\n", len(bad), listPath)
	return 1
}
