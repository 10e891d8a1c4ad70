package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// userHZ is the unit of /proc/<pid>/stat's times: USER_HZ, 100 on every
// Linux architecture this runs on (what sysconf(_SC_CLK_TCK) returns).
const userHZ = 100

// procCPU is one process's CPU time as the kernel counts it.
type procCPU struct {
	PID   int
	Start uint64 // starttime (ticks after boot): a reused PID is another process
	Ticks uint64 // utime + stime + cutime + cstime: its own and its reaped children's
}

// parseStat reads comm, starttime and the four CPU times from a
// /proc/<pid>/stat line. comm sits in parentheses and may hold spaces and
// parentheses itself: the fields start after the last ')'.
func parseStat(b []byte) (comm string, start, ticks uint64, err error) {
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

// processesCPU reads the CPU time of every process under procRoot named
// comm whose cgroup path holds cgroupHas (the worker node's container ID:
// the agent and scrubd run in its pods, and this host sees them in its own
// /proc). Processes that exit while it reads are skipped.
func processesCPU(procRoot, comm, cgroupHas string) ([]procCPU, error) {
	ents, err := os.ReadDir(procRoot)
	if err != nil {
		return nil, err
	}
	var out []procCPU
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
		_, start, ticks, err := parseStat(st)
		if err != nil {
			return nil, err
		}
		out = append(out, procCPU{PID: pid, Start: start, Ticks: ticks})
	}
	return out, nil
}

// cpuSeconds is the CPU the processes of after used since before: a
// process in both, its difference; one started since (a restart), all of
// its time. A process that exited in between counts nothing past its
// reading in before (its last seconds are not seen).
func cpuSeconds(before, after []procCPU) float64 {
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
	return float64(ticks) / userHZ
}

// cpuWatch is the agent's and scrubd's CPU readings at a window's start.
type cpuWatch struct {
	procRoot, cgroupHas string
	agent, scrubd       []procCPU
}

func startCPUWatch(procRoot, cgroupHas string) (*cpuWatch, error) {
	w := &cpuWatch{procRoot: procRoot, cgroupHas: cgroupHas}
	var err error
	if w.agent, err = processesCPU(procRoot, "cilium-agent", cgroupHas); err != nil {
		return nil, err
	}
	if len(w.agent) == 0 {
		return nil, fmt.Errorf("no cilium-agent process in the worker's cgroup (%s) under %s", cgroupHas, procRoot)
	}
	w.scrubd, err = processesCPU(procRoot, "scrubd", cgroupHas)
	return w, err
}

// stop returns the agent's and scrubd's CPU seconds since the start; scrubd's
// is 0 when no scrubd runs at the end (ctscrub not installed).
func (w *cpuWatch) stop() (agent, scrubd float64, err error) {
	a, err := processesCPU(w.procRoot, "cilium-agent", w.cgroupHas)
	if err != nil {
		return 0, 0, err
	}
	s, err := processesCPU(w.procRoot, "scrubd", w.cgroupHas)
	if err != nil {
		return 0, 0, err
	}
	return cpuSeconds(w.agent, a), cpuSeconds(w.scrubd, s), nil
}
