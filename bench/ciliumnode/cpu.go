package main

import (
	"fmt"

	"github.com/ctscrub/ctscrub/bench/internal/proccpu"
)

// cpuWatch is the agent's and scrubd's CPU readings at a window's start.
type cpuWatch struct {
	procRoot, cgroupHas string
	agent, scrubd       []proccpu.Proc
}

func startCPUWatch(procRoot, cgroupHas string) (*cpuWatch, error) {
	w := &cpuWatch{procRoot: procRoot, cgroupHas: cgroupHas}
	var err error
	if w.agent, err = proccpu.Find(procRoot, "cilium-agent", cgroupHas); err != nil {
		return nil, err
	}
	if len(w.agent) == 0 {
		return nil, fmt.Errorf("no cilium-agent process in the worker's cgroup (%s) under %s", cgroupHas, procRoot)
	}
	w.scrubd, err = proccpu.Find(procRoot, "scrubd", cgroupHas)
	return w, err
}

// stop returns the agent's and scrubd's CPU seconds since the start; scrubd's
// is 0 when no scrubd runs at the end (ctscrub not installed).
func (w *cpuWatch) stop() (agent, scrubd float64, err error) {
	a, err := proccpu.Find(w.procRoot, "cilium-agent", w.cgroupHas)
	if err != nil {
		return 0, 0, err
	}
	s, err := proccpu.Find(w.procRoot, "scrubd", w.cgroupHas)
	if err != nil {
		return 0, 0, err
	}
	return proccpu.Seconds(w.agent, a), proccpu.Seconds(w.scrubd, s), nil
}
