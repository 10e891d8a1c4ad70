package main

import (
	"fmt"
	"log"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/ctscrub/ctscrub/bench/internal/proccpu"
)

// The cold delegate variants (issue 36): scrubd started right before the
// pods, on the full table, and its bootstrap pass running while they start.

// killScrubd kills the worker's scrubd with SIGKILL (from this host: the
// node's processes are in its PID namespace too) and waits until its
// container is back and serving: a crash, an OOM kill. No snapshot is
// written, so only the bootstrap pass tells the new process anything.
func killScrubd(k *kube) error {
	procs, err := proccpu.Find("/proc", "scrubd", k.containerID)
	if err != nil {
		return err
	}
	if len(procs) != 1 {
		return fmt.Errorf("kill scrubd: %d scrubd processes on the worker, want 1", len(procs))
	}
	old := procs[0]
	if err := syscall.Kill(old.PID, syscall.SIGKILL); err != nil {
		return fmt.Errorf("kill scrubd (pid %d): %w", old.PID, err)
	}
	log.Printf("scrubd (pid %d) killed with SIGKILL", old.PID)
	return waitNewScrubd(k, old, 3*time.Minute)
}

// rollScrubd rolls the DaemonSet (an upgrade: SIGTERM, a clean stop that
// writes the snapshot, and a new pod) and waits until the new one serves.
func rollScrubd(k *kube) error {
	procs, err := proccpu.Find("/proc", "scrubd", k.containerID)
	if err != nil {
		return err
	}
	if len(procs) != 1 {
		return fmt.Errorf("roll scrubd: %d scrubd processes on the worker, want 1", len(procs))
	}
	if _, err := k.kubectl(time.Minute, "-n", "kube-system", "rollout", "restart", "ds/ctscrub"); err != nil {
		return err
	}
	if _, err := k.kubectl(6*time.Minute, "-n", "kube-system", "rollout", "status", "ds/ctscrub", "--timeout=5m"); err != nil {
		return err
	}
	log.Printf("ctscrub's DaemonSet rolled")
	return waitNewScrubd(k, procs[0], 3*time.Minute)
}

// waitNewScrubd waits for a scrubd process other than old whose metrics
// answer (its API and delegate socket are up by then: they listen before
// the metrics).
func waitNewScrubd(k *kube, old proccpu.Proc, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for ; ; time.Sleep(200 * time.Millisecond) {
		procs, err := proccpu.Find("/proc", "scrubd", k.containerID)
		if err != nil {
			return err
		}
		fresh := len(procs) == 1 && (procs[0].PID != old.PID || procs[0].Start != old.Start)
		if fresh {
			if _, err := k.scrubdMetrics(); err == nil {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no new scrubd serving %s after it was stopped (processes %v)", timeout, procs)
		}
	}
}

// bootstrapWatch follows the new scrubd's bootstrap pass while the pods
// start: it polls scrubd's metrics until the pass is over, then reads
// scrubd's CPU time (its start to the pass's end).
type bootstrapWatch struct {
	done chan struct{}
	pass float64
	cpu  float64
	err  error
}

func watchBootstrap(k *kube) *bootstrapWatch {
	w := &bootstrapWatch{done: make(chan struct{})}
	go func() {
		defer close(w.done)
		deadline := time.Now().Add(10 * time.Minute)
		for ; ; time.Sleep(250 * time.Millisecond) {
			text, err := k.scrubdMetrics()
			if err == nil {
				if st := parseBootstrap(text); st.done() {
					procs, err := proccpu.Find("/proc", "scrubd", k.containerID)
					if err != nil {
						w.err = err
						return
					}
					var newest proccpu.Proc
					for _, p := range procs {
						if p.Start >= newest.Start {
							newest = p
						}
					}
					w.pass, w.cpu = st.duration, float64(newest.Ticks)/proccpu.UserHZ
					return
				}
			}
			if time.Now().After(deadline) {
				w.err = fmt.Errorf("scrubd's bootstrap pass not over 10 min after scrubd started (last metrics error: %v)", err)
				return
			}
		}
	}()
	return w
}

// result is the pass's wall time and scrubd's CPU up to its end, once the
// pass is over.
func (w *bootstrapWatch) result() (pass, cpu float64, err error) {
	<-w.done
	return w.pass, w.cpu, w.err
}

// bootstrapState is what scrubd's metrics say of its bootstrap pass.
type bootstrapState struct {
	running  bool
	entries  float64 // CT entries the passes read
	duration float64 // the last pass's wall time (so far, while one runs)
}

// done: a pass ran (it read entries) and none runs now.
func (s bootstrapState) done() bool { return !s.running && s.entries > 0 }

func parseBootstrap(metrics string) bootstrapState {
	var s bootstrapState
	for _, l := range strings.Split(metrics, "\n") {
		name, value, ok := strings.Cut(l, " ")
		if !ok {
			continue
		}
		v, err := strconv.ParseFloat(strings.TrimSpace(value), 64)
		if err != nil {
			continue
		}
		switch name {
		case "ctscrub_bootstrap_running":
			s.running = v != 0
		case "ctscrub_bootstrap_entries_total":
			s.entries = v
		case "ctscrub_bootstrap_duration_seconds":
			s.duration = v
		}
	}
	return s
}
