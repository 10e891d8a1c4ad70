package main

import (
	"math"
	"testing"
)

func near(a, b float64) bool { return math.Abs(a-b) <= 1e-9*math.Max(1, math.Abs(b)) }

// The arithmetic on round numbers: 100 deletions/s of 2 events each is
// 200 events/s on every node; 5,000 nodes make the API server send
// 1,000,000 events/s.
func TestProject(t *testing.T) {
	c := WatchCost{CPUPerEvent: 50e-6, BytesPerEvent: 10_000, BytesPerObject: 100, APIServerCPUPerEvent: 2e-6}
	s := Scenario{Nodes: 5000, ChangesPerS: 100, EventsPerChange: 2, ObjectsHeld: 150_000}
	p := Project(c, s)
	for _, tc := range []struct {
		name      string
		got, want float64
	}{
		{"events/s per node", p.EventsPerS, 200},
		{"node cores", p.NodeCPUCores, 0.01},
		{"node CPU s/hour", p.NodeCPUPerHour, 36},
		{"node bytes/s", p.NodeBytesPerS, 2e6},
		{"node heap", p.NodeHeapBytes, 15e6},
		{"fan-out events/s", p.FanoutEventsPerS, 1e6},
		{"fan-out bytes/s", p.FanoutBytesPerS, 1e10},
		{"API server cores", p.APIServerCores, 2},
	} {
		if !near(tc.got, tc.want) {
			t.Errorf("%s = %v, want %v", tc.name, tc.got, tc.want)
		}
	}
	if z := Project(c, Scenario{}); z != (Projection{}) {
		t.Errorf("an empty scenario costs %+v", z)
	}
}

func TestDivAndMarginal(t *testing.T) {
	if div(1, 0) != 0 || div(6, 3) != 2 {
		t.Errorf("div: %v %v", div(1, 0), div(6, 3))
	}
	// 12 s of CPU for 6,000 writes with 13 watchers added, 6 s for 6,000
	// without: 1 ms a write more, 1/13 ms per watcher.
	if got := marginal(12, 6000, 6, 6000, 13); !near(got, 1e-3/13) {
		t.Errorf("marginal = %v, want %v", got, 1e-3/13)
	}
	// Noise that makes the window with watchers cheaper is no negative cost.
	if got := marginal(5, 6000, 6, 6000, 13); got != 0 {
		t.Errorf("marginal of a cheaper window = %v, want 0", got)
	}
	if got := marginal(5, 0, 6, 0, 0); got != 0 {
		t.Errorf("marginal without writes = %v", got)
	}
}

// Two cycles: with 10 streams the API server spent 6 s on 1,000 writes and
// 6.6 s on 1,000 more; without, 5 s and 5.2 s: 1 ms and 1.4 ms a write
// more, 120 us per event per stream over both.
func TestFanToggle(t *testing.T) {
	ft := &fanToggle{Cycles: 2, Streams: 10}
	ft.add(nodeFigures{APIServerCPU: 5, Writes: 1000}, nodeFigures{APIServerCPU: 6, Writes: 1000}, watcherFigures{Events: 10000, RX: 150_000_000, CPU: 0.5})
	ft.add(nodeFigures{APIServerCPU: 5.2, Writes: 1000}, nodeFigures{APIServerCPU: 6.6, Writes: 1000}, watcherFigures{Events: 10000, RX: 150_000_000, CPU: 0.7})
	ft.finish()
	if len(ft.PerCycleUS) != 2 || !near(ft.PerCycleUS[0], 100) || !near(ft.PerCycleUS[1], 140) {
		t.Errorf("per cycle %v, want [100 140]", ft.PerCycleUS)
	}
	if !near(ft.MarginalUS, 120) || !near(ft.StreamBytesPerEvent, 15000) || !near(ft.StreamCPUPerEventUS, 60) {
		t.Errorf("marginal %v us (want 120), stream %v bytes (15000) and %v us (60) an event", ft.MarginalUS, ft.StreamBytesPerEvent, ft.StreamCPUPerEventUS)
	}
	noisy := &fanToggle{Cycles: 1, Streams: 10}
	noisy.add(nodeFigures{APIServerCPU: 6, Writes: 1000}, nodeFigures{APIServerCPU: 5, Writes: 1000}, watcherFigures{})
	noisy.finish()
	if noisy.PerCycleUS[0] >= 0 || noisy.MarginalUS != 0 {
		t.Errorf("a cheaper window with the streams: cycle %v (shown negative), marginal %v (want 0)", noisy.PerCycleUS, noisy.MarginalUS)
	}
}
