package main

// The extrapolation from one node's measured watch to a cluster: pure
// arithmetic, so its assumptions are the Scenario's fields and nothing
// else.

// WatchCost is one watcher's measured cost per watch event, and per object
// its cache holds.
type WatchCost struct {
	// CPUPerEvent: the watching process's CPU seconds per event (decode,
	// cache, handlers).
	CPUPerEvent float64 `json:"cpu_per_event_s"`
	// BytesPerEvent: bytes it received per event at its socket (TLS and
	// HTTP/2 framing included; bookmarks spread over the events).
	BytesPerEvent float64 `json:"bytes_per_event"`
	// BytesPerObject: its heap per object held (an endpoint address, a
	// pod); 0: not measured.
	BytesPerObject float64 `json:"bytes_per_object"`
	// APIServerCPUPerEvent: the API server's CPU seconds to send one event
	// to one more watcher of this kind (its marginal cost, measured by
	// adding watchers).
	APIServerCPUPerEvent float64 `json:"apiserver_cpu_per_event_s"`
}

// Scenario is the cluster extrapolated to.
type Scenario struct {
	// Nodes: every node runs one such watch.
	Nodes int `json:"nodes"`
	// ChangesPerS: backend (or pod) deletions per second, cluster-wide.
	ChangesPerS float64 `json:"changes_per_s"`
	// EventsPerChange: watch events each watcher receives per deletion
	// (the object's writes it takes: a slice marked terminating, then
	// the endpoint dropped; a pod's life).
	EventsPerChange float64 `json:"events_per_change"`
	// ObjectsHeld: what each watcher's cache holds (endpoint addresses,
	// pods) cluster-wide.
	ObjectsHeld int `json:"objects_held"`
}

// Projection is the Scenario's cost: per node, and at the API server for
// all nodes together.
type Projection struct {
	EventsPerS float64 `json:"events_per_s"` // per node (each node gets every event)
	// Per node.
	NodeCPUCores   float64 `json:"node_cpu_cores"`
	NodeBytesPerS  float64 `json:"node_bytes_per_s"`
	NodeHeapBytes  float64 `json:"node_heap_bytes"`
	NodeCPUPerHour float64 `json:"node_cpu_s_per_hour"`
	// The API server's fan-out to every node.
	FanoutEventsPerS float64 `json:"fanout_events_per_s"`
	FanoutBytesPerS  float64 `json:"fanout_bytes_per_s"`
	APIServerCores   float64 `json:"apiserver_cores"`
}

// Project is c's cost in s: each node receives every event, so per node it
// is the event rate times the per-event cost, and at the API server the
// same times the nodes.
func Project(c WatchCost, s Scenario) Projection {
	ev := s.ChangesPerS * s.EventsPerChange
	n := float64(s.Nodes)
	return Projection{
		EventsPerS:       ev,
		NodeCPUCores:     ev * c.CPUPerEvent,
		NodeBytesPerS:    ev * c.BytesPerEvent,
		NodeHeapBytes:    float64(s.ObjectsHeld) * c.BytesPerObject,
		NodeCPUPerHour:   ev * c.CPUPerEvent * 3600,
		FanoutEventsPerS: ev * n,
		FanoutBytesPerS:  ev * n * c.BytesPerEvent,
		APIServerCores:   ev * n * c.APIServerCPUPerEvent,
	}
}

// div is a / b, 0 when b is 0 (a window without events: JSON has no NaN).
func div(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}

// marginal is the API server's CPU per event per added watcher: its CPU per
// write with added watchers minus without, over the watchers added (every
// write is one event to each watcher). Never below 0: on a shared machine
// the two windows' noise can exceed a small difference.
func marginal(cpuWith, writesWith, cpuWithout, writesWithout float64, added int) float64 {
	return max(rawMarginal(cpuWith, writesWith, cpuWithout, writesWithout, added), 0)
}

// rawMarginal is marginal's difference, negative when noise makes it so
// (a cycle's own figure, shown as it came).
func rawMarginal(cpuWith, writesWith, cpuWithout, writesWithout float64, added int) float64 {
	return div(div(cpuWith, writesWith)-div(cpuWithout, writesWithout), float64(added))
}

// fanToggle is the API server's CPU with Streams more watch streams and
// without, in turns (Cycles of each), and its cost per event per stream.
type fanToggle struct {
	Cycles  int `json:"cycles"`
	Streams int `json:"streams"`
	// Per cycle: the API server's CPU seconds and the writes (events) of
	// each sub-window.
	OffCPU    []float64 `json:"off_apiserver_cpu_s"`
	OffWrites []int64   `json:"off_writes"`
	OnCPU     []float64 `json:"on_apiserver_cpu_s"`
	OnWrites  []int64   `json:"on_writes"`
	// PerCycleUS: each cycle's API server CPU per event per stream, in us.
	PerCycleUS []float64 `json:"per_cycle_us"`
	// MarginalUS: over all cycles (sums), never below 0.
	MarginalUS float64 `json:"marginal_us"`
	// The streams' own side: bytes and the reading process's CPU per event.
	StreamBytesPerEvent float64 `json:"stream_bytes_per_event"`
	StreamCPUPerEventUS float64 `json:"stream_cpu_per_event_us"`

	streamEvents uint64
	streamRX     int64
	streamCPU    float64
}

// add records a cycle: the sub-window without the streams and the one with.
func (t *fanToggle) add(off, on nodeFigures, streams watcherFigures) {
	t.OffCPU, t.OffWrites = append(t.OffCPU, off.APIServerCPU), append(t.OffWrites, off.Writes)
	t.OnCPU, t.OnWrites = append(t.OnCPU, on.APIServerCPU), append(t.OnWrites, on.Writes)
	t.PerCycleUS = append(t.PerCycleUS, 1e6*rawMarginal(on.APIServerCPU, float64(on.Writes), off.APIServerCPU, float64(off.Writes), t.Streams))
	t.streamEvents += streams.Events
	t.streamRX += streams.RX
	t.streamCPU += streams.CPU
}

// finish computes the totals' figures.
func (t *fanToggle) finish() {
	var on, off, onW, offW float64
	for i := range t.OnCPU {
		on, off, onW, offW = on+t.OnCPU[i], off+t.OffCPU[i], onW+float64(t.OnWrites[i]), offW+float64(t.OffWrites[i])
	}
	t.MarginalUS = 1e6 * marginal(on, onW, off, offW, t.Streams)
	t.StreamBytesPerEvent = div(float64(t.streamRX), float64(t.streamEvents))
	t.StreamCPUPerEventUS = 1e6 * div(t.streamCPU, float64(t.streamEvents))
}
