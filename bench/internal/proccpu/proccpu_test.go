package proccpu

import (
	"os"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestParseStat(t *testing.T) {
	// A comm with a space and parentheses: the fields start after the last ')'.
	line := "4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 500 0 0 0 170 30 7 3 20 0 12 0 98765 123456 789 18446744073709551615\n"
	comm, start, ticks, err := ParseStat([]byte(line))
	if err != nil {
		t.Fatal(err)
	}
	if comm != "a) b (c)" || start != 98765 || ticks != 170+30+7+3 {
		t.Errorf("ParseStat = %q, start %d, ticks %d; want \"a) b (c)\", 98765, 210", comm, start, ticks)
	}
	for _, bad := range []string{"", "1 comm S 1", "1 (x) S 1 2 3"} {
		if _, _, _, err := ParseStat([]byte(bad)); err == nil {
			t.Errorf("ParseStat(%q): no error", bad)
		}
	}
}

func TestCPUSeconds(t *testing.T) {
	before := []Proc{{PID: 10, Start: 100, Ticks: 500}, {PID: 11, Start: 100, Ticks: 50}}
	after := []Proc{
		{PID: 10, Start: 100, Ticks: 650}, // the same process: 150 ticks
		{PID: 11, Start: 900, Ticks: 40},  // PID reused by a new process: all of it
		{PID: 12, Start: 950, Ticks: 10},  // started in the window (a restart): all of it
	}
	if got := Seconds(before, after); got != 2.0 {
		t.Errorf("Seconds = %v, want 2.0 (150 + 40 + 10 ticks)", got)
	}
	if got := Seconds(nil, nil); got != 0 {
		t.Errorf("Seconds of nothing = %v", got)
	}
}

// Find finds this test process in the real /proc by its comm and
// cgroup, and sees the CPU it burns.
func TestProcessesCPUSeesThisProcess(t *testing.T) {
	comm, err := os.ReadFile("/proc/self/comm")
	if err != nil {
		t.Skip("no /proc:", err)
	}
	cg, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	// The last line's path (cgroup v2's "0::/path", or v1's last controller).
	lines := strings.Split(strings.TrimSpace(string(cg)), "\n")
	path := lines[len(lines)-1][strings.LastIndexByte(lines[len(lines)-1], ':')+1:]
	name := strings.TrimSpace(string(comm))
	find := func() []Proc {
		t.Helper()
		ps, err := Find("/proc", name, path)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range ps {
			if p.PID == os.Getpid() {
				return []Proc{p}
			}
		}
		t.Fatalf("Find(/proc, %q, %q) = %v: this process (%d) is not among them", name, path, ps, os.Getpid())
		return nil
	}
	before := find()
	// Burn 0.3 s of CPU, as the kernel counts it for this process
	// (getrusage), however long a shared machine takes to give it.
	cpuNow := func() float64 {
		var ru syscall.Rusage
		if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
			t.Fatal(err)
		}
		return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()).Seconds()
	}
	start := cpuNow()
	x := 0
	for cpuNow()-start < 0.3 {
		for i := range 100000 {
			x += i
		}
	}
	_ = x
	burnt := cpuNow() - start
	// /proc/<pid>/stat counts in 10 ms ticks: allow that, and a little for
	// the Go runtime's other threads.
	if got := Seconds(before, find()); got < burnt-0.05 || got > burnt+0.5 {
		t.Errorf("CPU seen in /proc for a burn of %.2fs (getrusage): %.2fs", burnt, got)
	}
	if ps, err := Find("/proc", name, "no-such-cgroup-"+path); err != nil || len(ps) != 0 {
		t.Errorf("another cgroup: %v, %v; want none", ps, err)
	}
}

func TestParseRSS(t *testing.T) {
	st := "Name:\tkube-proxy\nVmPeak:\t  900 kB\nVmRSS:\t   51200 kB\nRssAnon:\t 40000 kB\n"
	if got, err := parseRSS([]byte(st)); err != nil || got != 51200<<10 {
		t.Errorf("parseRSS = %d, %v; want %d", got, err, 51200<<10)
	}
	for _, bad := range []string{"Name:\tkthreadd\n", "VmRSS:\t12 MB\n", "VmRSS:\tx kB\n"} {
		if _, err := parseRSS([]byte(bad)); err == nil {
			t.Errorf("parseRSS(%q): no error", bad)
		}
	}
	if rss, err := RSS("/proc", os.Getpid()); err != nil || rss <= 0 {
		t.Errorf("RSS of this process: %d, %v", rss, err)
	}
}

func TestCgroupCPUFiles(t *testing.T) {
	v1 := "12:pids:/docker/abc/x.scope\n2:cpu,cpuacct:/docker/abc/x.scope\n1:name=systemd:/docker/abc/x.scope\n"
	got := cgroupCPUFiles(v1, "/sys/fs/cgroup")
	if len(got) != 3 || got[0] != "/sys/fs/cgroup/cpuacct/docker/abc/x.scope/cpuacct.usage" {
		t.Errorf("v1: %v", got)
	}
	got = cgroupCPUFiles("0::/kubepods.slice/p.slice/cri-x.scope\n", "/sys/fs/cgroup")
	if len(got) != 1 || got[0] != "/sys/fs/cgroup/kubepods.slice/p.slice/cri-x.scope/cpu.stat" {
		t.Errorf("v2: %v", got)
	}
	for _, tc := range []struct {
		name, body string
		want       float64
	}{
		{"cpuacct.usage", "38842527309\n", 38.842527309},
		{"cpu.stat", "usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n", 2.5},
	} {
		if s, err := parseCgroupCPU(tc.name, []byte(tc.body)); err != nil || s != tc.want {
			t.Errorf("parseCgroupCPU(%s) = %v, %v; want %v", tc.name, s, err, tc.want)
		}
	}
	if _, err := parseCgroupCPU("cpu.stat", []byte("nr_periods 0\n")); err == nil {
		t.Error("cpu.stat without usage_usec: no error")
	}
}

// This process's own cgroup counts at least the CPU it burnt.
func TestCgroupCPUOfThisProcess(t *testing.T) {
	before, err := CgroupCPU("/proc", "/sys/fs/cgroup", os.Getpid())
	if err != nil {
		t.Skip("no cgroup CPU accounting here:", err)
	}
	deadline := time.Now().Add(200 * time.Millisecond)
	x := 0
	for time.Now().Before(deadline) {
		x++
	}
	_ = x
	after, err := CgroupCPU("/proc", "/sys/fs/cgroup", os.Getpid())
	if err != nil || after-before < 0.05 {
		t.Errorf("cgroup CPU %.3f -> %.3f (%v): want at least 0.05 s more after a busy loop", before, after, err)
	}
}
