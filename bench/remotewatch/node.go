package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/ctscrub/ctscrub/bench/internal/proccpu"
)

// node is the kind node (one: control plane and kube-proxy): its container
// ID (the cgroup path of every process in it) and its init's PID (its
// network namespace).
type node struct {
	name, containerID string
	pid               int
}

func findNode(ctx context.Context, name string) (*node, error) {
	out, err := exec.CommandContext(ctx, "docker", "inspect", "-f", "{{.Id}} {{.State.Pid}}", name).Output()
	if err != nil {
		return nil, fmt.Errorf("docker inspect %s: %w", name, err)
	}
	f := strings.Fields(string(out))
	if len(f) != 2 {
		return nil, fmt.Errorf("docker inspect %s: %q", name, out)
	}
	pid, err := strconv.Atoi(f[1])
	if err != nil || pid <= 0 {
		return nil, fmt.Errorf("docker inspect %s: pid %q (not running?)", name, f[1])
	}
	return &node{name: name, containerID: f[0], pid: pid}, nil
}

// The node's processes whose CPU the benchmark reads, by comm (at most 15
// characters: the controller manager's is cut).
var nodeComms = []string{"kube-proxy", "kube-apiserver", "etcd", "kube-controller"}

// nodeReading is the node's processes' CPU times and kube-proxy's
// connections to the API server at one moment.
type nodeReading struct {
	at    time.Time
	procs map[string][]proccpu.Proc
	cg    map[string]cgroupCPU // by comm: its first process's container
	socks map[string]sock      // kube-proxy's, by local and peer address
	load  string               // /proc/loadavg's first three fields
}

// cgroupCPU is a container's CPU seconds, and whose they are: its oldest
// process of the comm (pid and start time; a restarted container is
// another cgroup, and a child just forked still bears its parent's comm).
type cgroupCPU struct {
	pid   int
	start uint64
	s     float64
}

// oldest is the process of ps that started first.
func oldest(ps []proccpu.Proc) proccpu.Proc {
	o := ps[0]
	for _, p := range ps[1:] {
		if p.Start < o.Start || (p.Start == o.Start && p.PID < o.PID) {
			o = p
		}
	}
	return o
}

func (n *node) read(ctx context.Context) (nodeReading, error) {
	r := nodeReading{at: time.Now(), procs: map[string][]proccpu.Proc{}, cg: map[string]cgroupCPU{}}
	for _, c := range nodeComms {
		ps, err := proccpu.Find("/proc", c, n.containerID)
		if err != nil {
			return r, err
		}
		r.procs[c] = ps
		if len(ps) > 0 {
			o := oldest(ps)
			s, err := proccpu.CgroupCPU("/proc", "/sys/fs/cgroup", o.PID)
			if err != nil {
				return r, fmt.Errorf("%s's cgroup: %w", c, err)
			}
			r.cg[c] = cgroupCPU{pid: o.PID, start: o.Start, s: s}
		}
	}
	out, err := exec.CommandContext(ctx, "nsenter", "-t", strconv.Itoa(n.pid), "-n",
		"ss", "-tinpH", "state", "established", "( dport = :6443 )").Output()
	if err != nil {
		return r, fmt.Errorf("ss in %s's network namespace: %w", n.name, err)
	}
	r.socks = parseSS(string(out), "kube-proxy")
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		if f := strings.Fields(string(b)); len(f) >= 3 {
			r.load = strings.Join(f[:3], " ")
		}
	}
	return r, nil
}

// cpu is the CPU seconds of comm's container from r to s, its children
// included (kube-proxy's iptables-restore or nft); all of the container's
// at s if it is another container than at r (a restart).
func (r nodeReading) cpu(s nodeReading, comm string) float64 {
	return cgroupDelta(r.cg[comm], s.cg[comm])
}

func cgroupDelta(a, b cgroupCPU) float64 {
	if a.pid != b.pid || a.start != b.start || a.s > b.s {
		return b.s
	}
	return b.s - a.s
}

// procCPU is comm's processes' own CPU seconds from r to s (children
// counted only once reaped).
func (r nodeReading) procCPU(s nodeReading, comm string) float64 {
	return proccpu.Seconds(r.procs[comm], s.procs[comm])
}

// rss is comm's resident set at r (its first process's; 0 if none).
func (r nodeReading) rss(comm string) int64 {
	for _, p := range r.procs[comm] {
		if v, err := proccpu.RSS("/proc", p.PID); err == nil {
			return v
		}
	}
	return 0
}

// sock is one TCP connection's byte counts (tcp_info, as ss prints them).
type sock struct{ rx, tx int64 }

var (
	ssUsers = regexp.MustCompile(`users:\(\("([^"]+)",pid=`)
	ssRx    = regexp.MustCompile(`\bbytes_received:(\d+)`)
	ssTx    = regexp.MustCompile(`\bbytes_sent:(\d+)`)
)

// parseSS reads `ss -tinpH` output: a line per socket (its addresses and
// owning processes), then an indented line of tcp_info. It returns the
// sockets comm owns, by their local and peer addresses.
func parseSS(out, comm string) map[string]sock {
	socks := map[string]sock{}
	key := ""
	for _, l := range strings.Split(out, "\n") {
		if l == "" {
			continue
		}
		if l[0] != ' ' && l[0] != '\t' {
			key = ""
			if m := ssUsers.FindStringSubmatch(l); m != nil && m[1] == comm {
				// The two addresses before the processes (the queue
				// sizes before them change from one reading to the next).
				if i := strings.Index(l, "users:"); i > 0 {
					if f := strings.Fields(l[:i]); len(f) >= 2 {
						key = f[len(f)-2] + " " + f[len(f)-1]
					}
				}
			}
			continue
		}
		if key == "" {
			continue
		}
		var s sock
		if m := ssRx.FindStringSubmatch(l); m != nil {
			s.rx, _ = strconv.ParseInt(m[1], 10, 64)
		}
		if m := ssTx.FindStringSubmatch(l); m != nil {
			s.tx, _ = strconv.ParseInt(m[1], 10, 64)
		}
		socks[key] = s
		key = ""
	}
	return socks
}

// sockDelta is the bytes the sockets of after received and sent since
// before: a socket in both, its difference; a new one (a reconnect), all
// of it. A socket closed in between counts nothing past before.
func sockDelta(before, after map[string]sock) (rx, tx int64) {
	for k, a := range after {
		b, ok := before[k]
		if !ok || b.rx > a.rx || b.tx > a.tx {
			b = sock{}
		}
		rx += a.rx - b.rx
		tx += a.tx - b.tx
	}
	return rx, tx
}
