// Package machcost measures what this machine charges for the primitives
// every benchmark here is made of: a page fault, a system call and a
// process start. On the project's VMs these move by several times from one
// day to the next (a fault cost 17 µs on one VM and a few µs on another),
// and every figure of the CNI path and of a scrub moves with them. The
// benchmarks print them beside their own figures so runs on different days
// can be read against each other.
package machcost

import (
	"fmt"
	"os/exec"
	"slices"
	"time"

	"golang.org/x/sys/unix"
)

// Costs are medians over a few rounds of each probe.
type Costs struct {
	// FaultUs is one first touch of a fresh anonymous page (a minor fault).
	FaultUs float64 `json:"fault_us"`
	// SyscallUs is one getppid(2).
	SyscallUs float64 `json:"syscall_us"`
	// SpawnUs is starting /bin/true and waiting for it (fork, exec, exit,
	// wait), as a runtime starts a CNI plugin.
	SpawnUs float64 `json:"spawn_us"`
}

func (c Costs) String() string {
	return fmt.Sprintf("page fault %.2f µs, syscall %.3f µs, process start %.0f µs", c.FaultUs, c.SyscallUs, c.SpawnUs)
}

const (
	rounds     = 5
	faultPages = 4096
	syscalls   = 20000
	spawns     = 20
)

// Measure runs each probe a few rounds and keeps the medians. It takes
// about a second on a slow VM.
func Measure() (Costs, error) {
	var f, s, p []float64
	for range rounds {
		v, err := fault()
		if err != nil {
			return Costs{}, err
		}
		f = append(f, v)
		s = append(s, syscall())
	}
	for range rounds {
		v, err := spawn()
		if err != nil {
			return Costs{}, err
		}
		p = append(p, v)
	}
	return Costs{FaultUs: median(f), SyscallUs: median(s), SpawnUs: median(p)}, nil
}

func fault() (float64, error) {
	pg := unix.Getpagesize()
	b, err := unix.Mmap(-1, 0, faultPages*pg, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return 0, fmt.Errorf("mmap: %w", err)
	}
	defer unix.Munmap(b)
	// No transparent huge page: one fault would fill 512 pages.
	unix.Madvise(b, unix.MADV_NOHUGEPAGE)
	t := time.Now()
	for i := 0; i < len(b); i += pg {
		b[i] = 1
	}
	return float64(time.Since(t).Nanoseconds()) / faultPages / 1e3, nil
}

func syscall() float64 {
	t := time.Now()
	for range syscalls {
		unix.Getppid()
	}
	return float64(time.Since(t).Nanoseconds()) / syscalls / 1e3
}

func spawn() (float64, error) {
	path, err := exec.LookPath("true")
	if err != nil {
		return 0, err
	}
	t := time.Now()
	for range spawns {
		if err := exec.Command(path).Run(); err != nil {
			return 0, fmt.Errorf("%s: %w", path, err)
		}
	}
	return float64(time.Since(t).Nanoseconds()) / spawns / 1e3, nil
}

func median(v []float64) float64 {
	v = slices.Clone(v)
	slices.Sort(v)
	return v[len(v)/2]
}
