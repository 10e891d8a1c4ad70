package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/client"
	"github.com/ctscrub/ctscrub/scrubd/daemon"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// scrubd is a real scrubd (the daemon package, as cmd scrubd runs it) over
// the node's maps, serving its API on a private socket: the socket figures
// time every step a CNI DEL's scrub goes through (HTTP over the unix socket,
// the flight, the index take, the recorder's hooks, the backend's deletes,
// the answer).
type scrubd struct {
	d      *daemon.Daemon
	c      *client.Client // in this process: the untimed sweeps of complete
	proc   *clientProc    // in a child process: the timed scrubs
	sock   string
	stop   context.CancelFunc
	runErr chan error
	// steps holds, per step, each socket scrub's time in it: the client's
	// connect ("dial"), scrubd's steps (api.TimingHeader) and the rest of
	// the round trip ("client"). Reset by the caller.
	steps map[string][]time.Duration
}

func startScrubd(dir string) (*scrubd, error) {
	cfg := daemon.DefaultConfig()
	sockDir, err := os.MkdirTemp("", "ctscrub-bench-core-")
	if err != nil {
		return nil, err
	}
	cfg.Socket = filepath.Join(sockDir, "scrubd.sock")
	cfg.StateFile = filepath.Join(sockDir, "attachments.json")
	cfg.CTRoot = dir
	cfg.PinDir = filepath.Join(dir, "ctscrub")
	cfg.PodCIDRs = []string{podCIDR.String()}
	cfg.MetricsAddr = "off"
	cfg.Backends = "cilium"
	cfg.Expiry.Mode = "off"        // no expiry pass competing with the scrubs
	cfg.StatsInterval.Duration = 0 // no occupancy counting either
	d, err := daemon.Open(cfg, slog.New(slog.NewJSONHandler(io.Discard, nil)), "bench")
	if err != nil {
		os.RemoveAll(sockDir)
		return nil, fmt.Errorf("scrubd: %w", err)
	}
	ctx, stop := context.WithCancel(context.Background())
	s := &scrubd{d: d, c: client.New(cfg.Socket), sock: sockDir, stop: stop, runErr: make(chan error, 1)}
	go func() { s.runErr <- d.Run(ctx) }()
	for {
		if st, err := s.c.Status(context.Background()); err == nil && st.Ready {
			if s.proc, err = startClient(cfg.Socket); err != nil {
				s.close()
				return nil, err
			}
			return s, nil
		}
		select {
		case err := <-s.runErr:
			s.runErr <- err
			s.close()
			return nil, fmt.Errorf("scrubd: %w", err)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

func (s *scrubd) close() {
	if s.proc != nil {
		s.proc.close()
	}
	s.stop()
	<-s.runErr
	s.d.Close()
	os.RemoveAll(s.sock)
}

// scrub is one scrub through the socket, as the plugin's DEL sends it,
// from the child process; it returns the child's time for the whole call.
func (s *scrubd) scrub(ips []netip.Addr, reason scrub.Reason) (scrub.Result, time.Duration, error) {
	a, err := s.proc.scrub(api.ScrubRequest{IPs: ips, Reason: reason})
	if err != nil {
		return scrub.Result{}, 0, err
	}
	s.record(a.Timing)
	if a.Err != "" {
		return scrub.Result{}, a.Timing.Total, fmt.Errorf("%s", a.Err)
	}
	return a.Result, a.Timing.Total, nil
}

// record adds one call's steps to s.steps: the client's connect ("dial"),
// scrubd's steps and the rest of the round trip ("client").
func (s *scrubd) record(t client.Timing) {
	if s.steps == nil {
		s.steps = map[string][]time.Duration{}
	}
	s.steps["dial"] = append(s.steps["dial"], t.Dial)
	rest := t.Total - t.Dial
	for _, st := range t.Server {
		s.steps[st.Name] = append(s.steps[st.Name], st.Dur)
		rest -= st.Dur
	}
	s.steps["client"] = append(s.steps["client"], rest)
}

// complete makes ips complete the way scrubd does for a pod it has not seen
// whole: a scrub that sweeps them (here over the still empty maps, as for
// pods started with the node), after which the backend tracks them.
func (s *scrubd) complete(ips []netip.Addr) error {
	const chunk = 256
	for len(ips) > 0 {
		n := min(chunk, len(ips))
		resp, err := s.c.Scrub(context.Background(), api.ScrubRequest{IPs: ips[:n], Reason: scrub.ReasonAdd})
		if err == nil && len(resp.Results) != 1 {
			err = fmt.Errorf("%d results, want one (cilium)", len(resp.Results))
		}
		if err != nil {
			return fmt.Errorf("sweep to make the pods complete: %w", err)
		}
		if r := resp.Results[0]; r.Method != scrub.MethodSweep {
			return fmt.Errorf("scrub of %d unknown IPs: method %s, want sweep", n, r.Method)
		}
		for _, ip := range ips[:n] {
			if st := s.d.Index().State(ip); !st.Complete {
				return fmt.Errorf("%s after its sweep: %+v, want complete", ip, st)
			}
		}
		ips = ips[n:]
	}
	return nil
}
