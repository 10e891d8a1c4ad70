package netnsnode

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/client"
)

// Daemon is scrubd running as the demo's child, on private paths.
type Daemon struct {
	cmd     *exec.Cmd
	Socket  string
	Metrics string // host:port
	LogPath string
	StateFS string // the file system of its state file: tmpfs, unless STATE_DIR says otherwise
	Client  *client.Client
	exited  chan struct{}
	waitErr error

	mu    sync.Mutex
	log   []byte // unread tail of the log
	off   int64
	lines []ScrubLine
}

// DaemonConfig is where scrubd runs and on what (NodeDaemonConfig: this
// node's).
type DaemonConfig struct {
	Bin      string
	WorkDir  string
	PinDir   string
	CTRoot   string
	PodCIDRs []netip.Prefix
	// RingBytes: the recorder's ring buffer (0: scrubd's default).
	RingBytes int
	// NodeNetns: where the pods' host-side veths are (scrubd runs in the
	// machine's namespace, the node is a netns of its own): the recorder's
	// host-side links go there.
	NodeNetns string
}

// NodeDaemonConfig is scrubd on this node: the binary in binDir, its socket
// and log in WorkDir, its pins under BPFDir, the CT maps pinned at ctRoot,
// the node's pod CIDRs.
func NodeDaemonConfig(binDir, ctRoot string) DaemonConfig {
	return DaemonConfig{
		Bin:       filepath.Join(binDir, "scrubd"),
		WorkDir:   WorkDir,
		PinDir:    filepath.Join(BPFDir, "scrubd"),
		CTRoot:    ctRoot,
		PodCIDRs:  []netip.Prefix{PodCIDR4, PodCIDR6},
		NodeNetns: NetnsPath(NodeNS),
	}
}

// freePort asks the kernel for a free loopback port for the metrics server.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// StartDaemon starts scrubd as a child in its own process group, pushes
// its stop on c, and waits until it says it is ready.
func StartDaemon(ctx context.Context, c *Cleanup, cfg DaemonConfig) (*Daemon, error) {
	if _, err := os.Stat(cfg.Bin); err != nil {
		return nil, fmt.Errorf("scrubd binary %s: %w (run `make build`)", cfg.Bin, err)
	}
	stateDir, stateFS, err := prepareStateDir(c)
	if err != nil {
		return nil, err
	}
	port, err := freePort()
	if err != nil {
		return nil, fmt.Errorf("find a free port for scrubd's metrics: %w", err)
	}
	d := &Daemon{
		Socket:  filepath.Join(cfg.WorkDir, "scrubd.sock"),
		Metrics: fmt.Sprintf("127.0.0.1:%d", port),
		LogPath: filepath.Join(cfg.WorkDir, "scrubd.log"),
		StateFS: stateFS,
		exited:  make(chan struct{}),
	}
	args := []string{
		"--socket", d.Socket,
		"--ct-root", cfg.CTRoot,
		"--pin-dir", cfg.PinDir,
		"--state-file", filepath.Join(stateDir, "attachments.json"),
		"--metrics-addr", d.Metrics,
		"--backends", "cilium",
	}
	for _, p := range cfg.PodCIDRs {
		args = append(args, "--pod-cidr", p.String())
	}
	if cfg.RingBytes > 0 {
		args = append(args, "--ring-bytes", fmt.Sprint(cfg.RingBytes))
	}
	if cfg.NodeNetns != "" {
		args = append(args, "--node-netns", cfg.NodeNetns)
	}
	logf, err := os.Create(d.LogPath)
	if err != nil {
		return nil, err
	}
	d.cmd = exec.Command(cfg.Bin, args...)
	d.cmd.Stdout, d.cmd.Stderr = logf, logf
	// Its own process group: a Ctrl-C in the terminal reaches the demo, which
	// stops the daemon in order (it must outlive the pods' CNI DEL).
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := d.cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start %s: %w", cfg.Bin, err)
	}
	logf.Close()
	_ = os.WriteFile(filepath.Join(cfg.WorkDir, "scrubd.pid"), []byte(fmt.Sprint(d.cmd.Process.Pid)), 0o600)
	go func() { d.waitErr = d.cmd.Wait(); close(d.exited) }()
	c.Push(fmt.Sprintf("stop scrubd (pid %d)", d.cmd.Process.Pid), d.Stop)
	d.Client = client.New(d.Socket)

	// Ready when its status says so: CT maps open, programs loaded. The
	// bound is generous: on a loaded 2-CPU machine the program loads alone
	// took 18.6 s (load 12), and a bound is only for a daemon that hangs.
	deadline := time.Now().Add(90 * time.Second)
	for {
		select {
		case <-d.exited:
			return nil, fmt.Errorf("scrubd exited at start (%v); its log %s ends with:\n%s", d.waitErr, d.LogPath, tail(d.LogPath, 15))
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
		sctx, cancel := context.WithTimeout(ctx, time.Second)
		st, err := d.Client.Status(sctx)
		cancel()
		if err == nil && st.Ready {
			return d, nil
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("scrubd not ready after 90 s (last: %v); its log %s ends with:\n%s", err, d.LogPath, tail(d.LogPath, 15))
		}
	}
}

// Pid is the scrubd process's.
func (d *Daemon) Pid() int { return d.cmd.Process.Pid }

// Signal sends sig to scrubd (the soak's faults stop, continue and kill it).
func (d *Daemon) Signal(sig os.Signal) error { return d.cmd.Process.Signal(sig) }

// Exited is closed once scrubd has exited.
func (d *Daemon) Exited() <-chan struct{} { return d.exited }

// Stop sends SIGTERM (scrubd then finishes in-flight scrubs and keeps its pins)
// and SIGKILL if it has not exited after 10 s.
func (d *Daemon) Stop() error {
	select {
	case <-d.exited:
		return nil
	default:
	}
	_ = d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-d.exited:
		return nil
	case <-time.After(10 * time.Second):
		_ = d.cmd.Process.Kill()
		<-d.exited
		return errors.New("scrubd did not stop within 10 s of SIGTERM; killed")
	}
}

func tail(path string, n int) string {
	data, _ := os.ReadFile(path)
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return "    " + strings.Join(lines, "\n    ")
}

// ScrubLine is one scrub as scrubd logged it.
type ScrubLine struct {
	Time     time.Time
	IPs      []string
	Reason   string
	Backend  string
	Method   string
	Result   string
	Deleted  int
	Duration time.Duration
	Raw      map[string]any
}

// NewScrubs returns the scrubs scrubd logged since the last call.
func (d *Daemon) NewScrubs() []ScrubLine {
	d.mu.Lock()
	defer d.mu.Unlock()
	f, err := os.Open(d.LogPath)
	if err != nil {
		return nil
	}
	defer f.Close()
	if _, err := f.Seek(d.off, 0); err != nil {
		return nil
	}
	var out []ScrubLine
	r := bufio.NewReader(f)
	for {
		line, err := r.ReadBytes('\n')
		if err != nil {
			break // a partial last line is read again next time
		}
		d.off += int64(len(line))
		if s, ok := parseScrubLine(line); ok {
			out = append(out, s)
			d.lines = append(d.lines, s)
		}
	}
	return out
}

// parseScrubLine reads one of scrubd's JSON log lines; ok is false for lines
// that are not a scrub.
func parseScrubLine(line []byte) (ScrubLine, bool) {
	var m map[string]any
	if json.Unmarshal(line, &m) != nil {
		return ScrubLine{}, false
	}
	if msg, _ := m["msg"].(string); msg != "scrub" {
		return ScrubLine{}, false
	}
	s := ScrubLine{Raw: m}
	s.Reason, _ = m["reason"].(string)
	s.Backend, _ = m["backend"].(string)
	s.Method, _ = m["method"].(string)
	s.Result, _ = m["result"].(string)
	if t, ok := m["time"].(string); ok {
		s.Time, _ = time.Parse(time.RFC3339Nano, t)
	}
	switch v := m["ips"].(type) {
	case []any:
		for _, x := range v {
			s.IPs = append(s.IPs, fmt.Sprint(x))
		}
	case string:
		s.IPs = strings.Split(v, ",")
	}
	for _, k := range []string{"total", "deleted"} {
		if f, ok := m[k].(float64); ok {
			s.Deleted = int(f)
			break
		}
	}
	switch {
	case m["duration_s"] != nil: // scrubd's field
		f, _ := m["duration_s"].(float64)
		s.Duration = time.Duration(f * float64(time.Second))
	case m["duration_ms"] != nil:
		f, _ := m["duration_ms"].(float64)
		s.Duration = time.Duration(f * float64(time.Millisecond))
	case m["duration"] != nil:
		switch v := m["duration"].(type) {
		case float64: // slog writes a time.Duration as nanoseconds
			s.Duration = time.Duration(v)
		case string:
			s.Duration, _ = time.ParseDuration(v)
		}
	}
	return s, true
}
