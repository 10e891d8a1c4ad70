package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/client"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// The timed socket scrubs are sent by a child process of this bench, as the
// plugin sends them from a process of its own: the client reads its answer
// with a blocking read on its thread (scrubd/client), and inside scrubd's
// process that thread would hold one of the Go scheduler's two Ps in its
// syscall until sysmon takes it back, leaving scrubd one P for a scrub that
// deletes from its two CT maps at once. The child is this binary again with
// clientEnv set; one JSON request per line on its stdin, one clientAnswer
// per line on its stdout.
const clientEnv = "CTSCRUB_BENCH_CORE_CLIENT_SOCKET"

type clientAnswer struct {
	Timing client.Timing `json:"timing"`
	Result scrub.Result  `json:"result"`
	Err    string        `json:"err,omitempty"`
}

// clientChild is the child's main: the plugin's client (scrubd/client) on
// the socket named by clientEnv, a Scrub per request line.
func clientChild(socket string) int {
	c := client.New(socket)
	c.Trace = true
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 1<<20)
	out := json.NewEncoder(os.Stdout)
	for in.Scan() {
		var req api.ScrubRequest
		if err := json.Unmarshal(in.Bytes(), &req); err != nil {
			fmt.Fprintln(os.Stderr, "bench client:", err)
			return 1
		}
		resp, err := c.Scrub(context.Background(), req)
		var a clientAnswer
		if n := len(c.Timings); n > 0 {
			a.Timing = c.Timings[n-1]
		}
		c.Timings = c.Timings[:0]
		switch {
		case err != nil:
			a.Err = err.Error()
		case len(resp.Results) != 1:
			a.Err = fmt.Sprintf("%d results, want one (cilium)", len(resp.Results))
		default:
			a.Result = resp.Results[0]
		}
		if err := out.Encode(&a); err != nil {
			return 1
		}
	}
	return 0
}

// clientProc is the parent's side of the child.
type clientProc struct {
	cmd *exec.Cmd
	in  io.WriteCloser
	out *bufio.Scanner
}

func startClient(socket string) (*clientProc, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self)
	cmd.Env = append(os.Environ(), clientEnv+"="+socket)
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start the client process: %w", err)
	}
	sc := bufio.NewScanner(out)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	return &clientProc{cmd: cmd, in: in, out: sc}, nil
}

// scrub sends one request and returns the child's answer; the child timed
// it (Timing.Total), so the pipes are not in the figure.
func (p *clientProc) scrub(req api.ScrubRequest) (clientAnswer, error) {
	var a clientAnswer
	line, err := json.Marshal(req)
	if err != nil {
		return a, err
	}
	if _, err := p.in.Write(append(line, '\n')); err != nil {
		return a, fmt.Errorf("client process: %w", err)
	}
	if !p.out.Scan() {
		return a, fmt.Errorf("client process ended: %v", p.out.Err())
	}
	if err := json.Unmarshal(p.out.Bytes(), &a); err != nil {
		return a, fmt.Errorf("client process: %w", err)
	}
	return a, nil
}

func (p *clientProc) close() {
	p.in.Close()
	done := make(chan struct{})
	go func() { p.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		p.cmd.Process.Kill()
		<-done
	}
}
