package cri

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/e2e/internal/node"
	"github.com/ctscrub/ctscrub/internal/testsupport/crirt"
)

// containerd is a containerd of its own (root, state, socket, config, CNI
// dirs) started and stopped by the test, so it never meets a containerd the
// machine may run.
type containerd struct {
	dir       string
	sock      string
	binDir    string // one CNI bin dir: containerd 1.6 takes only one
	confDir   string
	crictlBin string
	ctr       string
	logPath   string
}

// newContainerd prepares the dirs and config; cniBins maps plugin name to the
// binary the CNI bin dir links to.
func newContainerd(t *testing.T, cniBins map[string]string, conflist string) *containerd {
	t.Helper()
	dir, err := os.MkdirTemp("", "ctscrub-cri-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	c := &containerd{
		dir:       dir,
		sock:      filepath.Join(dir, "containerd.sock"),
		binDir:    filepath.Join(dir, "cni-bin"),
		confDir:   filepath.Join(dir, "cni-conf"),
		crictlBin: node.RequireTool(t, "crictl"),
		ctr:       node.RequireTool(t, "ctr"),
		logPath:   filepath.Join(dir, "containerd.log"),
	}
	for _, d := range []string{c.binDir, c.confDir, filepath.Join(dir, "pod-logs")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for name, target := range cniBins {
		if err := os.Symlink(target, filepath.Join(c.binDir, name)); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(c.confDir, "10-ctscrub-e2e.conflist"), []byte(conflist), 0o644); err != nil {
		t.Fatal(err)
	}
	config := crirt.Config(dir, c.sock, c.binDir, c.confDir)
	if err := os.WriteFile(filepath.Join(dir, "config.toml"), []byte(config), 0o644); err != nil {
		t.Fatal(err)
	}
	crictlConf := fmt.Sprintf("runtime-endpoint: unix://%s\nimage-endpoint: unix://%s\ntimeout: 60\n", c.sock, c.sock)
	if err := os.WriteFile(filepath.Join(dir, "crictl.yaml"), []byte(crictlConf), 0o644); err != nil {
		t.Fatal(err)
	}
	return c
}

// start runs containerd and waits for its CRI to answer. Cleanup removes
// every pod sandbox it still has, then stops it.
func (c *containerd) start(t *testing.T) {
	t.Helper()
	bin := node.RequireTool(t, "containerd")
	logf, err := os.Create(c.logPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "--config", filepath.Join(c.dir, "config.toml"))
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		// Pods left by a failed test: stop and remove them through the CRI
		// so runc, the shims and the CNI chain clean up.
		if out, err := c.crictlRun("pods", "-q"); err == nil {
			for _, id := range strings.Fields(out) {
				c.crictlRun("stopp", id)
				c.crictlRun("rmp", "-f", id)
			}
		}
		cmd.Process.Signal(os.Interrupt)
		select {
		case <-exited:
		case <-time.After(15 * time.Second):
			cmd.Process.Kill()
			<-exited
		}
		if t.Failed() {
			b, _ := os.ReadFile(c.logPath)
			t.Logf("containerd log (last 8 KiB):\n%s", tail(b, 8<<10))
		}
		logf.Close()
	})
	deadline := time.Now().Add(60 * time.Second)
	for {
		out, err := c.crictlRun("info")
		if err == nil {
			return
		}
		select {
		case err := <-exited:
			b, _ := os.ReadFile(c.logPath)
			t.Fatalf("containerd exited: %v\n%s", err, tail(b, 8<<10))
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("containerd's CRI not answering after 60s: %v\n%s", err, out)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func tail(b []byte, n int) []byte {
	if len(b) > n {
		return b[len(b)-n:]
	}
	return b
}

// crictlRun runs crictl against this containerd and returns its stdout
// (crictl warns on stderr).
func (c *containerd) crictlRun(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	all := append([]string{"--config", filepath.Join(c.dir, "crictl.yaml"), "--timeout", "60s"}, args...)
	cmd := exec.CommandContext(ctx, c.crictlBin, all...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return string(out), fmt.Errorf("crictl %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return string(out), nil
}

func (c *containerd) crictl(t *testing.T, args ...string) string {
	t.Helper()
	out, err := c.crictlRun(args...)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(out)
}

// importImage imports an OCI archive into the CRI's namespace.
func (c *containerd) importImage(t *testing.T, archive string) {
	t.Helper()
	out, err := exec.Command(c.ctr, "--address", c.sock, "-n", "k8s.io", "images", "import", "--snapshotter", "native", archive).CombinedOutput()
	if err != nil {
		t.Fatalf("ctr images import: %v\n%s", err, out)
	}
}
