// Package node sets up, for the end-to-end tests of e2e/cni, e2e/cri and e2e/nfct, what
// a Cilium node has besides Cilium's maps (internal/testsupport/standin makes
// those): a real scrubd running as a subprocess on a temp socket, the ctscrub
// plugin binary, network namespaces. Everything it creates is removed by t.Cleanup, also on failure.
package node

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/internal/nsexec"

	"github.com/vishvananda/netns"

	"github.com/ctscrub/ctscrub/scrubd/client"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// RequireRoot skips the test unless it runs as root with bpffs mounted.
func RequireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: BPF maps, network namespaces, scrubd")
	}
	if _, err := os.Stat("/sys/fs/bpf"); err != nil {
		t.Skip("needs bpffs at /sys/fs/bpf (run scripts/setup.sh)")
	}
}

// RequireTool skips the test when a program is not installed and returns its
// path. It also looks in $GOPATH/bin, where scripts/setup.sh puts crictl.
func RequireTool(t *testing.T, name string) string {
	t.Helper()
	if p, err := exec.LookPath(name); err == nil {
		return p
	}
	if out, err := exec.Command("go", "env", "GOPATH").Output(); err == nil {
		p := filepath.Join(strings.TrimSpace(string(out)), "bin", name)
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	t.Skipf("%s is not installed (scripts/setup.sh installs it)", name)
	return ""
}

// Suffix returns a short random suffix for names shared with other tests
// running on the machine (netns, links, bridges).
func Suffix() string {
	b := make([]byte, 3)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// ModuleRoot is the repository's root (where go.mod is).
func ModuleRoot(t *testing.T) string {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", "..", ".."))
}

var (
	buildMu  sync.Mutex
	buildDir string
	built    = map[string]string{}
)

// Build builds a package of this module (./plugin, ./scrubd) once per test
// process and returns the binary's path.
func Build(t *testing.T, pkg, name string) string {
	t.Helper()
	buildMu.Lock()
	defer buildMu.Unlock()
	if p, ok := built[pkg]; ok {
		return p
	}
	if buildDir == "" {
		d, err := os.MkdirTemp("", "ctscrub-e2e-bin-")
		if err != nil {
			t.Fatal(err)
		}
		buildDir = d // removed by CleanupBuilds from TestMain
	}
	out := filepath.Join(buildDir, name)
	cmd := exec.Command("go", "build", "-o", out, pkg)
	cmd.Dir = ModuleRoot(t)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build %s: %v\n%s", pkg, err, b)
	}
	built[pkg] = out
	return out
}

// CleanupBuilds removes what Build built; call it from TestMain.
func CleanupBuilds() {
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
}

// CountEntries counts the CT entries that hold ip, in every map of its
// family.
func CountEntries(t *testing.T, maps *ctmap.Maps, ip netip.Addr) int {
	t.Helper()
	n := 0
	for _, k := range ctmap.Kinds {
		m := maps.Map(k)
		if m == nil || k.IPv6() != ip.Is6() {
			continue
		}
		var val ctmap.Entry
		var err error
		if ip.Is4() {
			var key ctmap.CTKey4
			it := m.Iterate()
			for it.Next(&key, &val) {
				if key.Has(ip) {
					n++
				}
			}
			err = it.Err()
		} else {
			var key ctmap.CTKey6
			it := m.Iterate()
			for it.Next(&key, &val) {
				if key.Has(ip) {
					n++
				}
			}
			err = it.Err()
		}
		if err != nil {
			t.Fatalf("iterate %s: %v", k.Name(), err)
		}
	}
	return n
}

// Scrubd is a scrubd process serving a test.
type Scrubd struct {
	Socket      string
	MetricsAddr string
	PinDir      string
	Client      *client.Client
	log         *os.File
	logPath     string
}

// Options for StartScrubd.
type Options struct {
	CTRoot   string
	PodCIDRs []string
	Args     []string // more flags
}

// StartScrubd runs the scrubd binary on a temp socket, a private pin dir and
// state file, and waits until it is ready. Its log is printed when the test
// fails.
func StartScrubd(t *testing.T, opts Options) *Scrubd {
	t.Helper()
	bin := Build(t, "./scrubd", "scrubd")
	// Unix socket paths are limited to 108 bytes: keep the dir short.
	dir, err := os.MkdirTemp("", "ctscrub-e2e-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	pin, err := os.MkdirTemp("/sys/fs/bpf", "ctscrub-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(pin) })
	s := &Scrubd{
		Socket:      filepath.Join(dir, "scrubd.sock"),
		MetricsAddr: freeAddr(t),
		PinDir:      pin,
		logPath:     filepath.Join(dir, "scrubd.log"),
	}
	s.Client = client.New(s.Socket)
	if s.log, err = os.Create(s.logPath); err != nil {
		t.Fatal(err)
	}
	args := []string{"run",
		"--socket", s.Socket,
		"--ct-root", opts.CTRoot,
		"--pin-dir", pin,
		"--state-file", filepath.Join(dir, "attachments.json"),
		"--metrics-addr", s.MetricsAddr,
		"--pod-cidr", strings.Join(opts.PodCIDRs, ","),
		"--backends", "cilium",
		"--log-level", "debug",
	}
	cmd := exec.Command(bin, append(args, opts.Args...)...)
	cmd.Stdout, cmd.Stderr = s.log, s.log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		cmd.Process.Signal(os.Interrupt)
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-exited
		}
		if t.Failed() {
			b, _ := os.ReadFile(s.logPath)
			t.Logf("scrubd log:\n%s", b)
		}
		s.log.Close()
	})
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		st, err := s.Client.Status(ctx)
		cancel()
		if err == nil && st.Ready {
			return s
		}
		select {
		case err := <-exited:
			b, _ := os.ReadFile(s.logPath)
			t.Fatalf("scrubd exited before it was ready: %v\n%s", err, b)
		default:
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(s.logPath)
			t.Fatalf("scrubd not ready after 30s (last: %v)\n%s", err, b)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// WaitIndexed waits until scrubd's index holds at least want keys of ip and
// can prove completeness: records reach it through a ring buffer.
func (s *Scrubd) WaitIndexed(t *testing.T, ip netip.Addr, want int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		st, err := s.Client.IndexIP(context.Background(), ip)
		if err == nil && st.Complete && st.Keys >= want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("index for %s: %+v, %v; want complete with at least %d keys", ip, st, err, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Log returns scrubd's log so far.
func (s *Scrubd) Log(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(s.logPath)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// WaitLateDel waits until scrubd has finished n late DEL scrubs in all
// (ctscrub_del_late_total, one per released IP): the scrub that follows a
// DEL once the pod's interface is gone.
func (s *Scrubd) WaitLateDel(t *testing.T, n float64) {
	t.Helper()
	deadline := time.Now().Add(40 * time.Second) // scrubd gives up waiting for the interface after 30 s
	for s.Metric(t, "ctscrub_del_late_total", nil) < n {
		if time.Now().After(deadline) {
			t.Fatalf("scrubd did not finish its late DEL scrub (ctscrub_del_late_total %v, want %v)", s.Metric(t, "ctscrub_del_late_total", nil), n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Metric returns the sum of every sample of the metric name whose labels
// include all of labels (Prometheus text format from scrubd's /metrics).
func (s *Scrubd) Metric(t *testing.T, name string, labels map[string]string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + s.MetricsAddr + "/metrics")
	if err != nil {
		t.Fatalf("scrape scrubd metrics: %v", err)
	}
	defer resp.Body.Close()
	var sum float64
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "#") {
			continue
		}
		series, value, ok := strings.Cut(line, " ")
		if !ok {
			continue
		}
		metric, lbls, _ := strings.Cut(series, "{")
		if metric != name {
			continue
		}
		match := true
		for k, v := range labels {
			if !strings.Contains(lbls, fmt.Sprintf("%s=%q", k, v)) {
				match = false
			}
		}
		if !match {
			continue
		}
		f, err := strconv.ParseFloat(strings.Fields(value)[0], 64)
		if err != nil {
			t.Fatalf("metric line %q: %v", line, err)
		}
		sum += f
	}
	return sum
}

// NewNetns creates a named network namespace (under /var/run/netns) and
// deletes it when the test ends. It returns its path, a CNI_NETNS.
func NewNetns(t *testing.T, name string) string {
	t.Helper()
	path, err := nsexec.Create(name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { netns.DeleteNamed(name) })
	return path
}

// Do runs fn on a locked OS thread inside the network namespace at path.
// Programs fn starts (CNI plugins run by libcni) and sockets it opens live in
// that namespace.
func Do(path string, fn func() error) error { return nsexec.Do(path, fn) }
