package main

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/client"
)

// started is when the Go runtime had started and this package's variables
// were set: the time before it is exec and runtime start-up.
var started = time.Now()

// TraceEnv, when set in the plugin's environment, makes ADD and DEL print
// one line to stderr with each step's time (TracePrefix + JSON): what
// `make bench-cni` breaks a pod's ADD and DEL down by. Off by default: a
// runtime logs a plugin's stderr.
const (
	TraceEnv    = "CTSCRUB_TRACE"
	TracePrefix = "ctscrub-trace "
)

// trace is one command's steps. Times are wall-clock nanoseconds, so a
// caller that timed the fork and the exit can place them around the steps.
type trace struct {
	on       bool
	Cmd      string          `json:"cmd"`
	StartNS  int64           `json:"start_unix_ns"` // runtime started
	EntryNS  int64           `json:"entry_unix_ns"` // skel called the command
	Steps    []traceStep     `json:"steps"`         // the plugin's own steps, in order
	Requests []client.Timing `json:"requests"`      // each call to scrubd
	EndNS    int64           `json:"end_unix_ns"`
	Threads  int             `json:"threads"` // OS threads at the end: each must be torn down at exit
	last     time.Time
}

type traceStep struct {
	Name string        `json:"name"`
	Dur  time.Duration `json:"dur_ns"`
}

func newTrace(cmd string) *trace {
	now := time.Now()
	return &trace{on: os.Getenv(TraceEnv) != "", Cmd: cmd, StartNS: started.UnixNano(), EntryNS: now.UnixNano(), last: now}
}

func (t *trace) mark(name string) {
	if !t.on {
		return
	}
	now := time.Now()
	t.Steps = append(t.Steps, traceStep{name, now.Sub(t.last)})
	t.last = now
}

// client returns a client for socket that keeps its requests' timings when
// tracing.
func (t *trace) client(socket string) *client.Client {
	cl := client.New(socket)
	cl.Trace = t.on
	return cl
}

// print writes the trace (when on) with cl's requests.
func (t *trace) print(cl *client.Client) {
	if !t.on {
		return
	}
	t.mark("finish")
	if cl != nil {
		t.Requests = cl.Timings
	}
	t.Threads = threads()
	t.EndNS = time.Now().UnixNano()
	fmt.Fprintf(stderr, "%s%s\n", TracePrefix, t.appendJSON(nil))
}

// appendJSON writes the trace as encoding/json would, by hand: the first
// use of encoding/json on a type costs a fresh process its reflection (a
// fraction of a millisecond, more under load), which would land in the
// "exit" the trace is meant to measure.
func (t *trace) appendJSON(b []byte) []byte {
	b = append(b, `{"cmd":`...)
	b = strconv.AppendQuote(b, t.Cmd)
	b = append(b, `,"start_unix_ns":`...)
	b = strconv.AppendInt(b, t.StartNS, 10)
	b = append(b, `,"entry_unix_ns":`...)
	b = strconv.AppendInt(b, t.EntryNS, 10)
	b = append(b, `,"steps":[`...)
	for i, s := range t.Steps {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendStep(b, s.Name, s.Dur)
	}
	b = append(b, `],"requests":[`...)
	for i, r := range t.Requests {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, `{"path":`...)
		b = strconv.AppendQuote(b, r.Path)
		b = append(b, `,"dial_ns":`...)
		b = strconv.AppendInt(b, int64(r.Dial), 10)
		b = append(b, `,"total_ns":`...)
		b = strconv.AppendInt(b, int64(r.Total), 10)
		b = append(b, `,"server":[`...)
		for j, s := range r.Server {
			if j > 0 {
				b = append(b, ',')
			}
			b = appendStep(b, s.Name, s.Dur)
		}
		b = append(b, `]}`...)
	}
	b = append(b, `],"end_unix_ns":`...)
	b = strconv.AppendInt(b, t.EndNS, 10)
	b = append(b, `,"threads":`...)
	b = strconv.AppendInt(b, int64(t.Threads), 10)
	return append(b, '}')
}

func appendStep(b []byte, name string, d time.Duration) []byte {
	b = append(b, `{"name":`...)
	b = strconv.AppendQuote(b, name)
	b = append(b, `,"dur_ns":`...)
	b = strconv.AppendInt(b, int64(d), 10)
	return append(b, '}')
}

// threads is the process's number of OS threads (/proc/self/stat field 20).
func threads() int {
	b, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		return 0
	}
	// The command name (field 2) is in parentheses and may hold spaces.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 18 {
		return 0
	}
	n, _ := strconv.Atoi(f[17])
	return n
}
