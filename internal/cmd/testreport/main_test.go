package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// What `go test -json` prints for a package with a passing test, a skipped
// test, and a test whose subtest skipped (go 1.26, trimmed to what matters).
const sample = `{"Action":"start","Package":"example.com/m/nfct"}
{"Action":"run","Package":"example.com/m/nfct","Test":"TestScrub"}
{"Action":"output","Package":"example.com/m/nfct","Test":"TestScrub","Output":"=== RUN   TestScrub\n"}
{"Action":"output","Package":"example.com/m/nfct","Test":"TestScrub","Output":"--- PASS: TestScrub (0.01s)\n"}
{"Action":"pass","Package":"example.com/m/nfct","Test":"TestScrub","Elapsed":0.01}
{"Action":"run","Package":"example.com/m/nfct","Test":"TestEvents"}
{"Action":"output","Package":"example.com/m/nfct","Test":"TestEvents","Output":"=== RUN   TestEvents\n"}
{"Action":"output","Package":"example.com/m/nfct","Test":"TestEvents","Output":"    nfct_test.go:564: nf_conntrack_events is \"1\" in a new netns, this test needs 2\n"}
{"Action":"output","Package":"example.com/m/nfct","Test":"TestEvents","Output":"--- SKIP: TestEvents (0.00s)\n"}
{"Action":"skip","Package":"example.com/m/nfct","Test":"TestEvents","Elapsed":0}
{"Action":"run","Package":"example.com/m/nfct","Test":"TestFlush/flush"}
{"Action":"output","Package":"example.com/m/nfct","Test":"TestFlush/flush","Output":"    nfct_test.go:347: filtered flush needs Linux 6.12+\n"}
{"Action":"skip","Package":"example.com/m/nfct","Test":"TestFlush/flush","Elapsed":0}
{"Action":"pass","Package":"example.com/m/nfct","Test":"TestFlush","Elapsed":0}
{"Action":"output","Package":"example.com/m/nfct","Output":"ok  \texample.com/m/nfct\t0.02s\n"}
{"Action":"pass","Package":"example.com/m/nfct","Elapsed":0.02}
{"Action":"run","Package":"example.com/m/cri","Test":"TestBad"}
{"Action":"output","Package":"example.com/m/cri","Test":"TestBad","Output":"=== RUN   TestBad\n"}
{"Action":"output","Package":"example.com/m/cri","Test":"TestBad","Output":"    cri_test.go:9: runp: exit 1\n"}
{"Action":"output","Package":"example.com/m/cri","Test":"TestBad","Output":"--- FAIL: TestBad (0.10s)\n"}
{"Action":"fail","Package":"example.com/m/cri","Test":"TestBad","Elapsed":0.1}
{"Action":"run","Package":"example.com/m/cri","Test":"TestCrash"}
{"Action":"output","Package":"example.com/m/cri","Test":"TestCrash","Output":"panic: boom\n"}
{"Action":"output","Package":"example.com/m/cri","Output":"FAIL\texample.com/m/cri\t0.20s\n"}
{"Action":"fail","Package":"example.com/m/cri","Elapsed":0.2}
`

func sampleResults(t *testing.T) []result {
	var out bytes.Buffer
	p := filepath.Join(t.TempDir(), "test.json")
	if code := stream(strings.NewReader(sample), &out, p); code != 0 {
		t.Fatalf("stream: exit %d", code)
	}
	// go test's ordinary output, as without -json: "ok" for a package that
	// passed, a failed test's own lines, and what a test that never ended said.
	wantOut := "ok  \texample.com/m/nfct\t0.02s\n" +
		"--- FAIL: TestBad (0.10s)\n    cri_test.go:9: runp: exit 1\n" +
		"panic: boom\nFAIL\texample.com/m/cri\t0.20s\n"
	if !strings.HasPrefix(out.String(), wantOut) {
		t.Errorf("output starts\n%s\nwant\n%s", out.String(), wantOut)
	}
	for _, want := range []string{
		"--- skipped: 2 tests",
		`example.com/m/nfct TestEvents: nf_conntrack_events is "1" in a new netns, this test needs 2`,
		"example.com/m/nfct TestFlush/flush: filtered flush needs Linux 6.12+",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	kept, err := os.ReadFile(p)
	if err != nil || string(kept) != sample {
		t.Fatalf("the JSON file is not what go test printed (%v)", err)
	}
	return results(parseEvents(kept))
}

func TestMustRun(t *testing.T) {
	rs := sampleResults(t)
	for _, tc := range []struct {
		name, list string
		bad        []string // substrings, one per violation expected
	}{
		{"a must-run test skipped", "example.com/m/nfct ^TestEvents$ # needs events\n",
			[]string{"TestEvents skipped (nf_conntrack_events is"}},
		{"a must-run subtest skipped", "example.com/m/nfct ^TestFlush/flush$ # kernel 6.18 here\n",
			[]string{"TestFlush/flush skipped (filtered flush needs Linux 6.12+)"}},
		{"the whole package", "example.com/m/... . # real kernel\n",
			[]string{"TestEvents skipped", "TestFlush/flush skipped"}},
		{"an allowed reason", `example.com/m/nfct ^TestEvents$ allow="this test needs 2" # why` + "\n", nil},
		{"passing tests only", "example.com/m/nfct ^TestScrub$\n", nil},
		{"a rule that matches nothing", "example.com/m/nfct ^TestRenamed$ # gone\n",
			[]string{"matched no test"}},
		{"another package", "example.com/m/other . # not run\n",
			[]string{"matched no test"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rules, err := parseRules([]byte(tc.list))
			if err != nil {
				t.Fatal(err)
			}
			bad := violations(rules, rs)
			if len(bad) != len(tc.bad) {
				t.Fatalf("got %d violations %q, want %d", len(bad), bad, len(tc.bad))
			}
			for i, want := range tc.bad {
				if !strings.Contains(bad[i], want) {
					t.Errorf("violation %d is %q, want it to say %q", i, bad[i], want)
				}
			}
		})
	}
}

func TestParseRulesRefuses(t *testing.T) {
	for _, list := range []string{
		"example.com/m/nfct\n",                        // no test pattern
		"example.com/m/nfct ( # bad regexp\n",         // does not compile
		"example.com/m/nfct . because\n",              // a third field that is not allow=
		"example.com/m/nfct . allow=\"unterminated\n", // no closing quote
	} {
		if _, err := parseRules([]byte(list)); err == nil {
			t.Errorf("parseRules(%q) accepted it", list)
		}
	}
}

// The committed list parses, so CI fails on a skip, not on a typo.
func TestCommittedList(t *testing.T) {
	data, err := os.ReadFile("../../../.ci/must-run.txt")
	if err != nil {
		t.Fatal(err)
	}
	rules, err := parseRules(data)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rules {
		if r.Why == "" {
			t.Errorf(".ci/must-run.txt line %d: say why it must run here (a # comment)", r.Line)
		}
	}
}
