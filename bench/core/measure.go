package main

import (
	"fmt"
	"math"
	"os"
	"runtime"
	"runtime/metrics"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// threadCPU is the calling thread's CPU time (user + system).
func threadCPU() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts); err != nil {
		return 0
	}
	return time.Duration(ts.Nano())
}

// processCPU is the whole process's CPU time (user + system, every thread):
// the bootstrap pass runs on several goroutines.
func processCPU() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_PROCESS_CPUTIME_ID, &ts); err != nil {
		return 0
	}
	return time.Duration(ts.Nano())
}

// runDelay is how long the calling thread has been runnable but waiting for
// a CPU (the second field of /proc/thread-self/schedstat).
func runDelay() time.Duration {
	b, err := os.ReadFile("/proc/thread-self/schedstat")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) < 2 {
		return 0
	}
	v, _ := strconv.ParseInt(f[1], 10, 64)
	return time.Duration(v)
}

var gcSample = []metrics.Sample{{Name: "/gc/cycles/total:gc-cycles"}}

// gcCycles reads the GC cycle count without stopping the world.
func gcCycles() uint64 {
	metrics.Read(gcSample)
	return gcSample[0].Value.Uint64()
}

func median(d []time.Duration) time.Duration { return quantile(d, 0.5) }

// quantile is the nearest-rank quantile.
func quantile(d []time.Duration, q float64) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	i := int(math.Ceil(q*float64(len(s)))) - 1
	return s[max(0, min(i, len(s)-1))]
}

func fmtDur(d time.Duration) string {
	switch {
	case d >= time.Second:
		return fmt.Sprintf("%.2f s", d.Seconds())
	case d >= time.Millisecond:
		return fmt.Sprintf("%.3f ms", float64(d.Microseconds())/1000)
	default:
		return fmt.Sprintf("%.1f µs", float64(d.Nanoseconds())/1000)
	}
}

func secs(s float64) string { return fmtDur(time.Duration(s * float64(time.Second))) }

func machine() string {
	cpu := "?"
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, "model name") {
				cpu = strings.TrimSpace(strings.SplitN(l, ":", 2)[1])
				break
			}
		}
	}
	var u syscall.Utsname
	kernel := "?"
	if syscall.Uname(&u) == nil {
		b := make([]byte, 0, len(u.Release))
		for _, c := range u.Release {
			if c == 0 {
				break
			}
			b = append(b, byte(c))
		}
		kernel = string(b)
	}
	var si syscall.Sysinfo_t
	mem := "?"
	if syscall.Sysinfo(&si) == nil {
		mem = fmt.Sprintf("%.0f GiB", float64(si.Totalram)*float64(si.Unit)/(1<<30))
	}
	return fmt.Sprintf("%d CPUs %s, %s, Linux %s", runtime.NumCPU(), cpu, mem, kernel)
}
