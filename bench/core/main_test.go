package main

import (
	"os"
	"testing"

	"github.com/cilium/ebpf/rlimit"
)

// TestSmallBench runs the whole benchmark at a small size: every method must
// delete exactly the target's entries (run checks it and fails otherwise).
// Figures at this size mean nothing; `make bench` is where they are read.
func TestSmallBench(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates BPF maps and runs BPF programs")
	}
	if err := rlimit.RemoveMemlock(); err != nil {
		t.Skip(err)
	}
	res, err := run(config{entries: 1 << 16, perIP: 200, pods: 64, indexReps: 20})
	if err != nil {
		t.Fatal(err)
	}
	if res.Entries != 1<<16 || res.IndexReps != 20 || res.IndexMedianS <= 0 || res.SweepS <= 0 || res.BatchWalkS <= 0 || res.NextKeyWalkS <= 0 {
		t.Errorf("incomplete result: %+v", res)
	}
	if res.DeleteFloorNsKey <= 0 || res.DeleteFloorParNsKey <= 0 || res.SocketOverFloor <= 0 {
		t.Errorf("no delete floor: %+v", res)
	}
	if _, ok := res.Targets["socket_median_le_2x_floor"]; !ok {
		t.Errorf("no floor target in %v", res.Targets)
	}
	if res.BootstrapS <= 0 || res.BootstrapWalkS <= 0 || res.BootstrapKeys <= 0 || res.BootstrapBytesKey <= 0 {
		t.Errorf("no bootstrap figures: %+v", res)
	}
	if res.IndexKeys != 1<<16 {
		t.Errorf("index holds %d keys, want one per entry (%d)", res.IndexKeys, 1<<16)
	}
}

// TestMain lets the test binary be the bench's client process too: the
// bench starts its own executable with clientEnv set (client.go).
func TestMain(m *testing.M) {
	if socket := os.Getenv(clientEnv); socket != "" {
		os.Exit(clientChild(socket))
	}
	os.Exit(m.Run())
}
