package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/internal/netnsnode"
)

// result is the demo's last line (RESULT {...}).
type result struct {
	Entries int `json:"entries"`
	Scrubs  []struct {
		Step    string `json:"step"`
		Pod     string `json:"pod"`
		Reason  string `json:"reason"`
		Method  string `json:"method"`
		Deleted int    `json:"deleted"`
		Latency int64  `json:"latency_ns"`
		Result  string `json:"result"`
	} `json:"scrubs"`
	NextKeyWalkS float64 `json:"nextkey_walk_s"`
	WalkEntries  int     `json:"walk_entries"`
	Reuse        []struct {
		IP        string `json:"ip"`
		OldPod    string `json:"old_pod"`
		NewPod    string `json:"new_pod"`
		OldHad    int    `json:"old_entries_before_del"`
		LeftAtDel int    `json:"left_after_del"`
		Inherited int    `json:"inherited_by_new_pod"`
	} `json:"reuse"`
	Metrics      string `json:"metrics"`
	AuditIPs     *int   `json:"audit_ips"`
	AuditMissing *int   `json:"audit_missing"`
}

func needDemoHost(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("the demo needs root: BPF maps, network namespaces")
	}
	if _, err := os.Stat("/usr/lib/cni/bridge"); err != nil {
		t.Skip("Debian's containernetworking-plugins not installed: run scripts/setup.sh")
	}
	if _, err := os.Stat("/sys/fs/bpf"); err != nil {
		t.Skip("bpffs not mounted at /sys/fs/bpf: run scripts/setup.sh")
	}
}

var (
	buildOnce sync.Once
	buildDir  string
	buildErr  error
)

// TestMain removes the binaries the tests built.
func TestMain(m *testing.M) {
	code := m.Run()
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
	os.Exit(code)
}

// buildAll builds scrubd, the plugin and the demo once into a temp dir, as
// `make demo` does into bin/.
func buildAll(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		goBin, err := exec.LookPath("go")
		if err != nil {
			goBin = filepath.Join(runtime.GOROOT(), "bin", "go")
		}
		if buildDir, buildErr = os.MkdirTemp("", "ctscrub-demo-bin-"); buildErr != nil {
			return
		}
		for name, pkg := range map[string]string{"scrubd": "../../scrubd", "ctscrub": "../../plugin", "ctscrub-demo": "."} {
			cmd := exec.Command(goBin, "build", "-o", filepath.Join(buildDir, name), pkg)
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
			if out, err := cmd.CombinedOutput(); err != nil {
				buildErr = fmt.Errorf("go build %s: %v\n%s", pkg, err, out)
				return
			}
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return buildDir
}

// output collects the demo's stdout and lets a test wait for a line.
type output struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (o *output) Write(p []byte) (int, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.buf.Write(p)
}

func (o *output) String() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.buf.String()
}

type run struct {
	cmd  *exec.Cmd
	done chan error
}

func startDemo(t *testing.T, bin string) (*run, *output) {
	cmd := exec.Command(filepath.Join(bin, "ctscrub-demo"))
	cmd.Env = append(os.Environ(), "DEMO_SHORT=1", "DEMO_BIN="+bin, "ENTRIES=", "PER_IP=")
	out := &output{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	r := &run{cmd: cmd, done: make(chan error, 1)}
	go func() { r.done <- cmd.Wait() }()
	return r, out
}

func waitExit(t *testing.T, r *run, out *output, limit time.Duration) int {
	t.Helper()
	cmd, done := r.cmd, r.done
	select {
	case err := <-done:
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return ee.ExitCode()
		}
		if err != nil {
			t.Fatal(err)
		}
		return 0
	case <-time.After(limit):
		_ = cmd.Process.Signal(syscall.SIGTERM)
		<-done
		t.Fatalf("demo did not finish within %s; output:\n%s", limit, out)
		return -1
	}
}

func checkNoLeftovers(t *testing.T) {
	t.Helper()
	// Under the demo's lock: internal/netnsnode's tests (run in parallel by
	// go test ./...) create names of the demo while they hold it.
	lk, err := netnsnode.Lock(5*time.Minute, os.Stderr)
	if err != nil {
		t.Fatal(err)
	}
	defer lk.Close()
	if left := netnsnode.Leftovers(); len(left) > 0 {
		t.Errorf("the demo left behind: %v", left)
	}
}

// The short demo runs end to end: every scrub is complete, each reused IP's
// new pod inherits none of the old pod's CT entries (which it had), the full
// walk read at least ENTRIES entries, and nothing is left behind.
func TestDemoShort(t *testing.T) {
	needDemoHost(t)
	bin := buildAll(t)
	cmd, out := startDemo(t, bin)
	code := waitExit(t, cmd, out, 10*time.Minute)
	text := out.String()
	t.Logf("demo output:\n%s", text)
	if code != 0 {
		t.Fatalf("demo exited %d", code)
	}
	var res result
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(nil, 1<<20)
	found := false
	for sc.Scan() {
		if j, ok := strings.CutPrefix(sc.Text(), "RESULT "); ok {
			if err := json.Unmarshal([]byte(j), &res); err != nil {
				t.Fatalf("RESULT line: %v", err)
			}
			found = true
		}
	}
	if !found {
		t.Fatal("no RESULT line in the demo's output")
	}
	if !strings.Contains(text, "\naudit: ") {
		t.Error("no line starting with \"audit:\" in the demo's output")
	}
	if res.AuditMissing == nil || res.AuditIPs == nil || *res.AuditIPs == 0 || *res.AuditMissing != 0 {
		t.Errorf("RESULT audit_ips %v, audit_missing %v: want every pod IP audited and 0 missing", res.AuditIPs, res.AuditMissing)
	}
	if len(res.Scrubs) == 0 {
		t.Fatal("no scrub printed")
	}
	// The walk runs after the first pods' ADD scrubs and before any DEL:
	// it reads the fill less what those scrubs deleted, plus the traffic's.
	sweptBeforeWalk := 0
	for _, s := range res.Scrubs {
		if s.Step == "DEL" {
			break
		}
		sweptBeforeWalk += s.Deleted
	}
	if res.WalkEntries < res.Entries-sweptBeforeWalk || res.NextKeyWalkS <= 0 {
		t.Errorf("full walk read %d entries in %g s; the maps were filled with %d, %d deleted before the walk",
			res.WalkEntries, res.NextKeyWalkS, res.Entries, sweptBeforeWalk)
	}
	methods := map[string]int{}
	for _, s := range res.Scrubs {
		methods[s.Method]++
		if s.Result != "complete" {
			t.Errorf("%s: scrub %s by %s: result %q, want complete", s.Step, s.Reason, s.Method, s.Result)
		}
		if s.Method != "index" && s.Method != "sweep" {
			t.Errorf("%s: scrub method %q", s.Step, s.Method)
		}
		if s.Latency <= 0 {
			t.Errorf("%s: scrub latency %d ns", s.Step, s.Latency)
		}
	}
	// The first ADD of each pre-filled IP deletes its stale entries: by the
	// index once scrubd's bootstrap pass filed every entry already in the
	// maps (docs/design.md, "The bootstrap pass"), by a sweep if it came
	// before the pass ended. The pods' own flows were recorded, so their
	// DEL goes by the index.
	for _, s := range res.Scrubs {
		if s.Step == "DEL" {
			break
		}
		if s.Reason == "add" && s.Deleted == 0 {
			t.Errorf("%s %s: the first ADD of a pre-filled IP deleted nothing (method %s)", s.Step, s.Pod, s.Method)
		}
	}
	if methods["index"] == 0 {
		t.Errorf("scrub methods %v: want index scrubs", methods)
	}
	if len(res.Reuse) == 0 {
		t.Fatal("no IP was reused")
	}
	for _, r := range res.Reuse {
		if r.OldHad == 0 {
			t.Errorf("%s: old pod %s had no CT entries before its DEL: the traffic made none, the check proves nothing", r.IP, r.OldPod)
		}
		if r.LeftAtDel != 0 || r.Inherited != 0 {
			t.Errorf("%s: %d entries left after %s's DEL, %d inherited by %s; want 0 and 0", r.IP, r.LeftAtDel, r.OldPod, r.Inherited, r.NewPod)
		}
	}
	if !strings.Contains(text, "cleanup: done") {
		t.Error("the demo did not report a clean cleanup")
	}
	checkNoLeftovers(t)
}

// SIGINT in the middle of the demo (pods up, traffic running) still removes
// everything it created.
func TestDemoInterrupted(t *testing.T) {
	needDemoHost(t)
	if testing.Short() {
		t.Skip("-short")
	}
	bin := buildAll(t)
	cmd, out := startDemo(t, bin)
	deadline := time.Now().Add(5 * time.Minute)
	for !strings.Contains(out.String(), "== 4.") {
		select {
		case err := <-cmd.done:
			t.Fatalf("the demo ended (%v) before its traffic step; output:\n%s", err, out)
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("the demo never reached its traffic step; output:\n%s", out)
		}
	}
	if err := cmd.cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	code := waitExit(t, cmd, out, 2*time.Minute)
	text := out.String()
	t.Logf("demo output:\n%s", text)
	if code != 130 {
		t.Errorf("interrupted demo exited %d, want 130", code)
	}
	if !strings.Contains(text, "cleanup: done") {
		t.Error("the interrupted demo did not report a clean cleanup")
	}
	checkNoLeftovers(t)
}

// A demo killed with SIGKILL cannot clean up; the next run removes what it
// left (netns, links, the daemon, pins, work dir) before it starts.
func TestDemoAfterKill(t *testing.T) {
	needDemoHost(t)
	if testing.Short() {
		t.Skip("-short")
	}
	bin := buildAll(t)
	first, out := startDemo(t, bin)
	deadline := time.Now().Add(5 * time.Minute)
	for !strings.Contains(out.String(), "== 4.") {
		select {
		case err := <-first.done:
			t.Fatalf("the demo ended (%v) before its traffic step; output:\n%s", err, out)
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("the demo never reached its traffic step; output:\n%s", out)
		}
	}
	_ = first.cmd.Process.Kill()
	<-first.done
	// The killed demo's lock went with it; take it so no test of
	// internal/netnsnode starts between here and the second run.
	lk, err := netnsnode.Lock(5*time.Minute, os.Stderr)
	if err != nil {
		t.Fatal(err)
	}
	left := netnsnode.Leftovers()
	lk.Close()
	if len(left) == 0 {
		t.Fatal("a killed demo left nothing behind: this test would prove nothing")
	}
	second, out2 := startDemo(t, bin)
	code := waitExit(t, second, out2, 10*time.Minute)
	text := out2.String()
	if code != 0 {
		t.Fatalf("demo after a killed one exited %d; output:\n%s", code, text)
	}
	if !strings.Contains(text, "Removed what an interrupted run left behind") || !strings.Contains(text, "scrubd pid") {
		t.Errorf("the second run did not report removing the killed run's leftovers (netns, daemon); output:\n%s", text)
	}
	checkNoLeftovers(t)
}
