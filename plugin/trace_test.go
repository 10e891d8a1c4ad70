package main

import (
	"encoding/json"
	"net/http"
	"os"
	"os/exec"
	"reflect"
	"strings"
	"testing"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/client"
)

// With CTSCRUB_TRACE set, ADD prints one trace line on stderr: its own
// steps and each request with scrubd's steps (what bench-cni reads).
func TestTraceLine(t *testing.T) {
	sock, _ := startFaultDaemon(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set(api.TimingHeader, "read;dur=0.2, attach;dur=0.7")
		w.Write([]byte(`{}`))
	})
	t.Setenv(TraceEnv, "1")
	_, logged, err := run(t, cmdAdd, cmdArgs(stdin(t, "1.0.0", map[string]any{"socket": sock}, prevResult("1.0.0"))))
	if err != nil {
		t.Fatal(err)
	}
	tr := traceLine(t, logged)
	if tr.Cmd != "ADD" || len(tr.Requests) != 1 || tr.Requests[0].Path != api.PathIndexStart || len(tr.Requests[0].Server) != 2 ||
		tr.Requests[0].Server[1].Name != "attach" || tr.EndNS < tr.EntryNS || tr.EntryNS < tr.StartNS {
		t.Errorf("trace %+v", tr)
	}
	var steps []string
	for _, s := range tr.Steps {
		steps = append(steps, s.Name)
	}
	if strings.Join(steps, ",") != "parse,requests,print,finish" {
		t.Errorf("plugin steps %v", steps)
	}
	// Without the variable: nothing on stderr.
	os.Unsetenv(TraceEnv)
	if _, logged, _ := run(t, cmdAdd, cmdArgs(stdin(t, "1.0.0", map[string]any{"socket": sock}, prevResult("1.0.0")))); strings.Contains(logged, TracePrefix) {
		t.Errorf("trace printed without %s: %q", TraceEnv, logged)
	}
}

// The bare start (VERSION) prints its trace too, through the real main.
func TestTraceVersion(t *testing.T) {
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "CTSCRUB_TEST_AS_PLUGIN=1", "CNI_COMMAND=VERSION", TraceEnv+"=1")
	cmd.Stdin = strings.NewReader(`{"cniVersion":"1.0.0"}`)
	var errOut strings.Builder
	cmd.Stderr = &errOut
	if err := cmd.Run(); err != nil {
		t.Fatalf("VERSION: %v: %s", err, errOut.String())
	}
	if tr := traceLine(t, errOut.String()); tr.Cmd != "VERSION" || tr.EndNS < tr.StartNS {
		t.Errorf("trace %+v", tr)
	}
}

func traceLine(t *testing.T, stderr string) trace {
	t.Helper()
	for _, l := range strings.Split(stderr, "\n") {
		if rest, ok := strings.CutPrefix(l, TracePrefix); ok {
			var tr trace
			if err := json.Unmarshal([]byte(rest), &tr); err != nil {
				t.Fatalf("trace line %q: %v", rest, err)
			}
			return tr
		}
	}
	t.Fatalf("no trace line in stderr %q", stderr)
	return trace{}
}

// The hand-written trace line is what encoding/json makes of the trace.
func TestTraceJSONAsEncodingJSON(t *testing.T) {
	tr := &trace{Cmd: "DEL \"x\"", StartNS: 1, EntryNS: 2, EndNS: 9, Threads: 4,
		Steps:    []traceStep{{"parse", 3}, {"finish", 4}},
		Requests: []client.Timing{{Path: "/v1/index/stop", Dial: 5, Total: 8, Server: []api.Step{{Name: "read", Dur: 6}, {Name: "journal", Dur: 7}}}, {Path: "/v1/x", Server: []api.Step{}}}}
	want, err := json.Marshal(tr)
	if err != nil {
		t.Fatal(err)
	}
	var a, b any
	json.Unmarshal(want, &a)
	if err := json.Unmarshal(tr.appendJSON(nil), &b); err != nil {
		t.Fatalf("%s: %v", tr.appendJSON(nil), err)
	}
	if !reflect.DeepEqual(a, b) {
		t.Errorf("hand-written\n%s\nencoding/json\n%s", tr.appendJSON(nil), want)
	}
}
