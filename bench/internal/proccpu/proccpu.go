// Package proccpu reads the CPU time of processes by name from /proc, as
// the kind benchmarks need it: the processes of a kind node (Cilium's
// agent, scrubd, kube-proxy, the API server) run in the node container's
// cgroup, and the host sees them in its own /proc.
package proccpu

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// UserHZ is the unit of /proc/<pid>/stat's times: USER_HZ, 100 on every
// Linux architecture this runs on (what sysconf(_SC_CLK_TCK) returns).
const UserHZ = 100

// Proc is one process's CPU time as the kernel counts it.
type Proc struct {
	PID   int
	Start uint64 // starttime (ticks after boot): a reused PID is another process
	Ticks uint64 // utime + stime + cutime + cstime: its own and its reaped children's
}

// ParseStat reads comm, starttime and the four CPU times from a
// /proc/<pid>/stat line. comm sits in parentheses and may hold spaces and
// parentheses itself: the fields start after the last ')'.
func ParseStat(b []byte) (comm string, start, ticks uint64, err error) {
	open, end := bytes.IndexByte(b, '('), bytes.LastIndexByte(b, ')')
	if open < 0 || end < open {
		return "", 0, 0, fmt.Errorf("stat %q: no (comm)", b)
	}
	comm = string(b[open+1 : end])
	f := strings.Fields(string(b[end+1:]))
	// f[0] is field 3 (state): utime..cstime are fields 14-17, starttime 22.
	if len(f) < 20 {
		return "", 0, 0, fmt.Errorf("stat of %s: %d fields after comm, want 20 or more", comm, len(f))
	}
	for _, i := range []int{11, 12, 13, 14} {
		v, err := strconv.ParseUint(f[i], 10, 64)
		if err != nil {
			return "", 0, 0, fmt.Errorf("stat of %s: field %d: %w", comm, i+3, err)
		}
		ticks += v
	}
	if start, err = strconv.ParseUint(f[19], 10, 64); err != nil {
		return "", 0, 0, fmt.Errorf("stat of %s: starttime: %w", comm, err)
	}
	return comm, start, ticks, nil
}

// Find reads the CPU time of every process under procRoot named comm whose
// cgroup path holds cgroupHas (a kind node's container ID). Processes that
// exit while it reads are skipped.
func Find(procRoot, comm, cgroupHas string) ([]Proc, error) {
	ents, err := os.ReadDir(procRoot)
	if err != nil {
		return nil, err
	}
	var out []Proc
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		dir := filepath.Join(procRoot, e.Name())
		c, err := os.ReadFile(filepath.Join(dir, "comm"))
		if err != nil || strings.TrimSpace(string(c)) != comm {
			continue
		}
		cg, err := os.ReadFile(filepath.Join(dir, "cgroup"))
		if err != nil || !strings.Contains(string(cg), cgroupHas) {
			continue
		}
		st, err := os.ReadFile(filepath.Join(dir, "stat"))
		if err != nil {
			continue
		}
		_, start, ticks, err := ParseStat(st)
		if err != nil {
			return nil, err
		}
		out = append(out, Proc{PID: pid, Start: start, Ticks: ticks})
	}
	return out, nil
}

// Seconds is the CPU the processes of after used since before: a process
// in both, its difference; one started since (a restart), all of its time.
// A process that exited in between counts nothing past its reading in
// before (its last seconds are not seen).
func Seconds(before, after []Proc) float64 {
	var ticks uint64
	for _, a := range after {
		d := a.Ticks
		for _, b := range before {
			if b.PID == a.PID && b.Start == a.Start && b.Ticks <= a.Ticks {
				d = a.Ticks - b.Ticks
			}
		}
		ticks += d
	}
	return float64(ticks) / UserHZ
}

// RSS is a process's resident set in bytes (VmRSS of /proc/<pid>/status).
func RSS(procRoot string, pid int) (int64, error) {
	b, err := os.ReadFile(filepath.Join(procRoot, strconv.Itoa(pid), "status"))
	if err != nil {
		return 0, err
	}
	return parseRSS(b)
}

func parseRSS(status []byte) (int64, error) {
	for _, l := range strings.Split(string(status), "\n") {
		rest, ok := strings.CutPrefix(l, "VmRSS:")
		if !ok {
			continue
		}
		f := strings.Fields(rest)
		if len(f) != 2 || f[1] != "kB" {
			return 0, fmt.Errorf("VmRSS line %q: want \"<n> kB\"", l)
		}
		kb, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("VmRSS line %q: %w", l, err)
		}
		return kb << 10, nil
	}
	return 0, fmt.Errorf("no VmRSS line (a kernel thread, or a zombie)")
}

// CgroupCPU is the CPU time of every process in pid's cgroup since the
// cgroup was made, running or gone (cgroup v1 cpuacct.usage, v2 cpu.stat
// usage_usec, under sysfs, normally /sys/fs/cgroup): a container's whole
// CPU, its children included while they run (kube-proxy's
// iptables-restore), which /proc/<pid>/stat counts only once reaped.
func CgroupCPU(procRoot, sysfs string, pid int) (float64, error) {
	b, err := os.ReadFile(filepath.Join(procRoot, strconv.Itoa(pid), "cgroup"))
	if err != nil {
		return 0, err
	}
	files := cgroupCPUFiles(string(b), sysfs)
	for _, f := range files {
		v, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		return parseCgroupCPU(filepath.Base(f), v)
	}
	return 0, fmt.Errorf("pid %d: no CPU accounting file of its cgroup (tried %v)", pid, files)
}

// cgroupCPUFiles lists where a /proc/<pid>/cgroup's CPU accounting may be:
// v1's cpuacct hierarchy (mounted alone or with cpu), then v2's.
func cgroupCPUFiles(procCgroup, sysfs string) []string {
	var v1, v2 []string
	for _, l := range strings.Split(strings.TrimSpace(procCgroup), "\n") {
		f := strings.SplitN(l, ":", 3)
		if len(f) != 3 {
			continue
		}
		if f[0] == "0" && f[1] == "" {
			v2 = append(v2, filepath.Join(sysfs, f[2], "cpu.stat"))
			continue
		}
		for _, c := range strings.Split(f[1], ",") {
			if c == "cpuacct" {
				for _, mnt := range []string{"cpuacct", "cpu,cpuacct", "cpuacct,cpu"} {
					v1 = append(v1, filepath.Join(sysfs, mnt, f[2], "cpuacct.usage"))
				}
			}
		}
	}
	return append(v1, v2...)
}

// parseCgroupCPU reads seconds from cpuacct.usage (nanoseconds) or
// cpu.stat (its usage_usec line).
func parseCgroupCPU(name string, b []byte) (float64, error) {
	if name == "cpuacct.usage" {
		ns, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("cpuacct.usage %q: %w", b, err)
		}
		return float64(ns) / 1e9, nil
	}
	for _, l := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(l, "usage_usec "); ok {
			us, err := strconv.ParseUint(strings.TrimSpace(rest), 10, 64)
			if err != nil {
				return 0, fmt.Errorf("cpu.stat %q: %w", l, err)
			}
			return float64(us) / 1e6, nil
		}
	}
	return 0, fmt.Errorf("cpu.stat without usage_usec")
}
