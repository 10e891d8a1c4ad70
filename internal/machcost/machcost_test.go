package machcost

import "testing"

// The probes run and give figures in a sane range: a fault and a process
// start cost something, and a syscall less than a process start.
func TestMeasure(t *testing.T) {
	c, err := Measure()
	if err != nil {
		t.Fatal(err)
	}
	t.Log(c)
	if c.FaultUs <= 0 || c.SyscallUs <= 0 || c.SpawnUs <= 0 {
		t.Fatalf("%+v: every cost must be positive", c)
	}
	if c.SyscallUs >= c.SpawnUs {
		t.Fatalf("%+v: a syscall costs less than a process start", c)
	}
	if c.SpawnUs > 1e6 {
		t.Fatalf("%+v: a process start over a second", c)
	}
}
