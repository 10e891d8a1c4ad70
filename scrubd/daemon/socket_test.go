package daemon

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/api"
)

const peerCredSocketEnv = "CTSCRUB_TEST_PEERCRED_SOCKET"

// TestPeerCredChild is the child TestSocketRefusesNonRoot runs as another
// user: it asks for the status and prints what it got. It does nothing in a
// normal run.
func TestPeerCredChild(t *testing.T) {
	sock := os.Getenv(peerCredSocketEnv)
	if sock == "" {
		t.Skip("child of TestSocketRefusesNonRoot only")
	}
	hc := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}}
	for _, path := range []string{api.PathStatus, "/healthz"} {
		resp, err := hc.Get("http://scrubd" + path)
		if err != nil {
			fmt.Printf("uid=%d %s: error: %v\n", os.Getuid(), path, err)
			continue
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Printf("uid=%d %s: status=%d body=%s\n", os.Getuid(), path, resp.StatusCode, strings.TrimSpace(string(body)))
	}
}

// The socket refuses non-root callers twice over: its file modes (0700
// directory, 0600 socket) keep another user from connecting at all, and when
// the modes are opened (a careless chmod, a bind mount), SO_PEERCRED still
// refuses every request with 403 forbidden. The caller is this test binary
// run as nobody (uid 65534) in a child process.
func TestSocketRefusesNonRoot(t *testing.T) {
	root := newCTRoot(t, 1024)
	// A directory another user can traverse, for the socket and for a copy
	// of this test binary it can execute.
	dir, err := os.MkdirTemp("", "ctscrub-peercred-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(t, root)
	cfg.Socket = filepath.Join(dir, "sock", "scrubd.sock")
	td := startDaemon(t, cfg)

	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "daemon.test")
	data, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, data, 0o755); err != nil {
		t.Fatal(err)
	}
	asNobody := func() string {
		cmd := exec.Command(bin, "-test.run", "^TestPeerCredChild$", "-test.v")
		cmd.Dir = dir
		cmd.Env = []string{peerCredSocketEnv + "=" + cfg.Socket, "PATH=/usr/bin:/bin"}
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("child as nobody: %v\n%s", err, out)
		}
		return string(out)
	}

	out := asNobody()
	if !strings.Contains(out, "uid=65534 "+api.PathStatus+": error:") || !strings.Contains(out, "permission denied") {
		t.Errorf("nobody, default modes: want permission denied on connect, got:\n%s", out)
	}

	if err := os.Chmod(filepath.Dir(cfg.Socket), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(cfg.Socket, 0o666); err != nil {
		t.Fatal(err)
	}
	out = asNobody()
	for _, path := range []string{api.PathStatus, "/healthz"} {
		if !strings.Contains(out, "uid=65534 "+path+": status=403") || !strings.Contains(out, `"code":"forbidden"`) {
			t.Errorf("nobody, socket opened to all: want 403 forbidden on %s, got:\n%s", path, out)
		}
	}
	if !strings.Contains(td.logs.buf.String(), `"msg":"API caller refused: not root","uid":65534`) {
		t.Errorf("refusal not logged with the caller's uid")
	}
	// Root is still served on the same socket.
	if st, err := td.c.Status(context.Background()); err != nil || !st.Ready {
		t.Errorf("root's status after the refusals: %+v, %v", st, err)
	}
}

// A socket file removed under the daemon is created again: CNI calls fail
// only until the next check (socketCheckEvery), not until a restart.
func TestRemovedSocketIsRecreated(t *testing.T) {
	root := newCTRoot(t, 1024)
	td := startDaemon(t, testConfig(t, root))
	if err := os.Remove(td.cfg.Socket); err != nil {
		t.Fatal(err)
	}
	if _, err := td.c.Status(context.Background()); err == nil {
		t.Fatal("status answered on a removed socket")
	}
	waitFor(t, "the daemon to listen again", func() bool {
		st, err := td.c.Status(context.Background())
		return err == nil && st.Ready
	})
	if fi, err := os.Stat(td.cfg.Socket); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("re-created socket: %v, %v; want mode 0600", fi, err)
	}
	if !strings.Contains(td.logs.buf.String(), "API socket removed under the daemon") {
		t.Error("re-creation not logged")
	}
}
