package cri

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ctscrub/ctscrub/e2e/internal/node"
	"github.com/ctscrub/ctscrub/internal/testsupport/crirt"
)

// containerd is a containerd of its own (root, state, socket, config, CNI
// dirs) started and stopped by the test, so it never meets a containerd the
// machine may run: crirt.Containerd (shared with make soak) with the test's
// failures and clean-up.
type containerd struct {
	*crirt.Containerd
	dir string
}

// newContainerd prepares the dirs and config; cniBins maps plugin name to the
// binary the CNI bin dir links to (containerd 1.6 takes one bin dir).
func newContainerd(t *testing.T, cniBins map[string]string, conflist string) *containerd {
	t.Helper()
	for _, tool := range []string{"containerd", "crictl", "ctr", "nsenter"} {
		node.RequireTool(t, tool)
	}
	dir, err := os.MkdirTemp("", "ctscrub-cri-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	binDir, confDir := filepath.Join(dir, "cni-bin"), filepath.Join(dir, "cni-conf")
	for _, d := range []string{binDir, confDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for name, target := range cniBins {
		if err := os.Symlink(target, filepath.Join(binDir, name)); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(confDir, "10-ctscrub-e2e.conflist"), []byte(conflist), 0o644); err != nil {
		t.Fatal(err)
	}
	c, err := crirt.New(dir, binDir, confDir, "")
	if err != nil {
		t.Fatal(err)
	}
	return &containerd{Containerd: c, dir: dir}
}

// start runs containerd and waits for its CRI to answer. Cleanup removes
// every pod sandbox it still has (runc, the shims and the CNI chain clean
// up), then stops it.
func (c *containerd) start(t *testing.T) {
	t.Helper()
	t.Cleanup(func() {
		if out, err := c.Crictl("pods", "-q"); err == nil {
			for _, id := range strings.Fields(out) {
				c.Crictl("stopp", id)
				c.Crictl("rmp", "-f", id)
			}
		}
		c.Stop()
		if t.Failed() {
			b, _ := os.ReadFile(c.LogPath)
			t.Logf("containerd log (last 8 KiB):\n%s", b[max(0, len(b)-8<<10):])
		}
	})
	if err := c.Start(); err != nil {
		b, _ := os.ReadFile(c.LogPath)
		t.Fatalf("%v\n%s", err, b[max(0, len(b)-8<<10):])
	}
}

// crictlRun runs crictl against this containerd and returns its stdout.
func (c *containerd) crictlRun(args ...string) (string, error) { return c.Crictl(args...) }

func (c *containerd) crictl(t *testing.T, args ...string) string {
	t.Helper()
	out, err := c.Crictl(args...)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(out)
}

// importImage imports an OCI archive into the CRI's namespace.
func (c *containerd) importImage(t *testing.T, archive string) {
	t.Helper()
	if err := c.ImportImage(archive); err != nil {
		t.Fatal(err)
	}
}
