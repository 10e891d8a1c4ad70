package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestMain runs main in a child process when asked (TestRunAs): dropping
// the uid in the test's own process would drop it for every test.
func TestMain(m *testing.M) {
	if os.Getenv("FAKEDELEGATE_MAIN") == "1" {
		os.Args = append([]string{"fakedelegate"}, strings.Fields(os.Getenv("FAKEDELEGATE_ARGS"))...)
		main()
		return
	}
	os.Exit(m.Run())
}

// syncBuffer is a log the test reads while the fake writes it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) lines(t *testing.T, msg string) []map[string]any {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []map[string]any
	for _, l := range strings.Split(strings.TrimSpace(s.b.String()), "\n") {
		var m map[string]any
		if l == "" {
			continue
		}
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("log line %q: %v", l, err)
		}
		if m["msg"] == msg {
			out = append(out, m)
		}
	}
	return out
}

// scrubdSocket stands in for scrubd's socket: 0600, listening.
func scrubdSocket(t *testing.T) (string, net.Listener) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "delegate.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	t.Cleanup(func() { ln.Close() })
	if err := os.Chmod(path, 0o600); err != nil {
		t.Fatal(err)
	}
	return path, ln
}

const reqBody = `{"api_version":1,"caller":"cilium-agent","event":"endpoint-create","endpoint_id":77,"ips":["10.244.1.9","fd00::9"],"timeout_ms":1000}`

func post(path string) (*http.Response, error) {
	c := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", path)
	}}, Timeout: 5 * time.Second}
	return c.Post("http://delegate/v1/conntrack/scrub", "application/json", strings.NewReader(reqBody))
}

func checkComplete(t *testing.T, resp *http.Response) {
	t.Helper()
	defer resp.Body.Close()
	var ans struct {
		APIVersion int        `json:"api_version"`
		IPs        []ipAnswer `json:"ips"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&ans); err != nil || resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("answer: status %d, %v", resp.StatusCode, err)
	}
	if ans.APIVersion != 1 || len(ans.IPs) != 2 || ans.IPs[0] != (ipAnswer{IP: "10.244.1.9", Complete: true}) || ans.IPs[1] != (ipAnswer{IP: "fd00::9", Complete: true}) {
		t.Fatalf("answer %+v, want both IPs complete", ans)
	}
}

// TestHangThenAnswer: the fake takes the path over from the socket there
// (same mode), holds a request open without an answer until the client
// closes, and in answer mode answers complete in the API's format.
func TestHangThenAnswer(t *testing.T) {
	path, _ := scrubdSocket(t)
	if err := os.Chmod(path, 0o640); err != nil {
		t.Fatal(err)
	}
	ln, perm, err := listen(path, -1)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	if fi, err := os.Lstat(path); err != nil || perm != 0o640 || fi.Mode().Perm() != 0o640 || fi.Mode().Type() != os.ModeSocket {
		t.Fatalf("socket after the takeover: %v %v, perm %v; want a socket of mode 0640", fi, err, perm)
	}
	if _, err := os.Lstat(path + ".fake"); err == nil {
		t.Errorf("%s.fake left behind", path)
	}
	log := &syncBuffer{}
	go serve(ln, "hang", &logger{w: log})

	conn, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	req, _ := http.NewRequest(http.MethodPost, "http://delegate/v1/conntrack/scrub", strings.NewReader(reqBody))
	req.Header.Set("Content-Type", "application/json")
	if err := req.Write(conn); err != nil {
		t.Fatal(err)
	}
	conn.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if n, err := conn.Read(make([]byte, 1)); n != 0 || !os.IsTimeout(err) {
		t.Fatalf("hang mode answered: %d bytes, %v", n, err)
	}
	conn.Close()
	deadline := time.Now().Add(5 * time.Second)
	var closed []map[string]any
	for len(closed) == 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
		closed = log.lines(t, "closed")
	}
	if len(closed) != 1 {
		t.Fatalf("closed lines %v, want 1", closed)
	}
	c := closed[0]
	if c["request"] != true || c["answered"] != false || c["event"] != "endpoint-create" || c["endpoint_id"] != 77.0 || c["timeout_ms"] != 1000.0 || c["held_s"].(float64) < 0.3 {
		t.Errorf("hang mode's closed line %v", c)
	}

	// Answer mode, taking the path over from the hung fake.
	ln2, _, err := listen(path, -1)
	if err != nil {
		t.Fatal(err)
	}
	defer ln2.Close()
	log2 := &syncBuffer{}
	go serve(ln2, "answer", &logger{w: log2})
	resp, err := post(path)
	if err != nil {
		t.Fatal(err)
	}
	checkComplete(t, resp)
}

// TestRunAs (root): bound as root, listening as uid 65534: the socket file
// is root's, SO_PEERCRED says 65534, and it answers complete.
func TestRunAs(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the fake binds as root and drops to uid 65534")
	}
	path, _ := scrubdSocket(t)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "FAKEDELEGATE_MAIN=1", "FAKEDELEGATE_ARGS=-socket "+path+" -mode answer -run-as 65534")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	first, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatalf("the fake's first line: %v", err)
	}
	var l map[string]any
	if err := json.Unmarshal([]byte(first), &l); err != nil || l["msg"] != "listening" || l["uid"] != 65534.0 || l["euid"] != 65534.0 || l["gid"] != 65534.0 {
		t.Fatalf("the fake's first line %q (%v): want listening as uid and gid 65534", first, err)
	}
	go io.Copy(io.Discard, out)
	fi, err := os.Lstat(path)
	if err != nil {
		t.Fatal(err)
	}
	if st := fi.Sys().(*syscall.Stat_t); st.Uid != 0 || fi.Mode().Perm() != 0o600 {
		t.Errorf("socket owned by uid %d, mode %v: want root's, 0600 (the agent's file checks pass)", st.Uid, fi.Mode().Perm())
	}
	conn, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := conn.(*net.UnixConn).SyscallConn()
	var cred *unix.Ucred
	var credErr error
	raw.Control(func(fd uintptr) { cred, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) })
	conn.Close()
	if credErr != nil || cred.Uid != 65534 || cred.Gid != 65534 {
		t.Fatalf("SO_PEERCRED %+v (%v): want uid and gid 65534", cred, credErr)
	}
	resp, err := post(path)
	if err != nil {
		t.Fatal(err)
	}
	checkComplete(t, resp)
}
