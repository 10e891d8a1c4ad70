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
