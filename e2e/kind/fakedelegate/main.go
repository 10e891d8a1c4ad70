// Command fakedelegate takes the conntrack scrub delegate's socket from
// scrubd for the kind e2e's fault test (TestKindDelegateFaults,
// e2e/kind/delegate_faults_test.go): a real process on a real socket in
// front of the real, patched Cilium agent, which must bound what the fault
// costs it (docs/delegate-api.md, "What the caller does with it").
//
// It binds a new socket next to the one at -socket (same directory, the
// mode of the file it replaces, owned by root: it runs as root) and renames
// it over that path, so the agent's next connection reaches it and scrubd's
// own listener, which still holds the old inode, no longer gets any. scrubd
// re-listens only when the path disappears, which the test does after
// killing this process. Modes:
//
//   - hang: accepts every connection, reads the request and never answers,
//     until the agent gives up and closes it (a stuck delegate).
//   - answer: answers every request 200 with every IP complete, in the
//     API's format. With -run-as, it binds as root (the file is root's and
//     passes the agent's owner and mode checks), then drops to that uid and
//     gid before listen(): SO_PEERCRED, the credentials of the process that
//     called listen(), names that uid, so the agent must refuse it
//     (untrusted_peer) before it sends anything.
//
// It logs one JSON line to stdout when it listens ("listening") and two per
// connection ("accepted", then "closed" with what it read and answered and
// how long the connection was held open). Built with CGO_ENABLED=0: it runs
// in the kind node container, which has no Go toolchain.
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

func main() {
	socket := flag.String("socket", "/run/ctscrub-delegate/delegate.sock", "the delegate socket to take over")
	mode := flag.String("mode", "hang", "hang (accept, never answer) or answer (every IP complete)")
	runAs := flag.Int("run-as", -1, "after binding as root, drop to this uid and gid before listen() (-1: stay)")
	flag.Parse()
	if *mode != "hang" && *mode != "answer" {
		fmt.Fprintf(os.Stderr, "fakedelegate: -mode %q: want hang or answer\n", *mode)
		os.Exit(2)
	}
	ln, perm, err := listen(*socket, *runAs)
	if err != nil {
		fmt.Fprintf(os.Stderr, "fakedelegate: %v\n", err)
		os.Exit(1)
	}
	lg := &logger{w: os.Stdout}
	lg.log(map[string]any{"msg": "listening", "socket": *socket, "mode": *mode, "socket_perm": fmt.Sprintf("%04o", perm),
		"uid": os.Getuid(), "euid": os.Geteuid(), "gid": os.Getgid(), "pid": os.Getpid()})
	// SIGTERM: stop accepting; the socket file stays (the test removes it,
	// so that scrubd re-listens only once this process is gone).
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-sig
		os.Exit(0)
	}()
	serve(ln, *mode, lg)
}

// listen binds a unix socket at path+".fake" with the mode of the file at
// path (0600 if there is none), renames it over path, and listens on it;
// with runAs >= 0 it drops to that uid and gid between the bind and the
// listen.
func listen(path string, runAs int) (net.Listener, os.FileMode, error) {
	perm := os.FileMode(0o600)
	if fi, err := os.Lstat(path); err == nil {
		perm = fi.Mode().Perm()
	}
	tmp := path + ".fake"
	if err := os.Remove(tmp); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, 0, err
	}
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, 0, fmt.Errorf("socket: %w", err)
	}
	f := os.NewFile(uintptr(fd), tmp)
	defer f.Close()
	old := syscall.Umask(0o177)
	err = unix.Bind(fd, &unix.SockaddrUnix{Name: tmp})
	syscall.Umask(old)
	if err != nil {
		return nil, 0, fmt.Errorf("bind %s: %w", tmp, err)
	}
	if err := os.Chmod(tmp, perm); err != nil {
		return nil, 0, err
	}
	if runAs < 0 {
		// Listening before the rename: no connection to path is refused.
		if err := unix.Listen(fd, 128); err != nil {
			return nil, 0, fmt.Errorf("listen: %w", err)
		}
	}
	if err := os.Rename(tmp, path); err != nil {
		return nil, 0, err
	}
	if runAs >= 0 {
		// syscall's, not x/sys/unix's: Go applies these to every thread of
		// the process (Linux credentials are per thread).
		if err := syscall.Setgroups(nil); err != nil {
			return nil, 0, fmt.Errorf("setgroups: %w", err)
		}
		if err := syscall.Setresgid(runAs, runAs, runAs); err != nil {
			return nil, 0, fmt.Errorf("setresgid %d: %w", runAs, err)
		}
		if err := syscall.Setresuid(runAs, runAs, runAs); err != nil {
			return nil, 0, fmt.Errorf("setresuid %d: %w", runAs, err)
		}
		if err := unix.Listen(fd, 128); err != nil {
			return nil, 0, fmt.Errorf("listen as uid %d: %w", runAs, err)
		}
	}
	ln, err := net.FileListener(f)
	if err != nil {
		return nil, 0, err
	}
	return ln, perm, nil
}

// logger writes one JSON object per line, whole lines only.
type logger struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *logger) log(m map[string]any) {
	b, _ := json.Marshal(m)
	l.mu.Lock()
	defer l.mu.Unlock()
	l.w.Write(append(b, '\n'))
}

// request is what the fake reads of the agent's request
// (docs/delegate-api.md, "Request").
type request struct {
	Event      string   `json:"event"`
	EndpointID int64    `json:"endpoint_id"`
	IPs        []string `json:"ips"`
	TimeoutMs  int64    `json:"timeout_ms"`
}

type ipAnswer struct {
	IP         string `json:"ip"`
	Complete   bool   `json:"complete"`
	CTDeleted  int    `json:"ct_deleted"`
	NATDeleted int    `json:"nat_deleted"`
	Reason     string `json:"reason"`
}

func serve(ln net.Listener, mode string, lg *logger) {
	var n int64
	for {
		conn, err := ln.Accept()
		if err != nil {
			lg.log(map[string]any{"msg": "accept failed", "error": err.Error()})
			time.Sleep(100 * time.Millisecond)
			continue
		}
		n++
		go handle(conn, n, mode, lg)
	}
}

// handle serves one connection and logs it.
func handle(conn net.Conn, n int64, mode string, lg *logger) {
	defer conn.Close()
	accepted := time.Now()
	lg.log(map[string]any{"msg": "accepted", "conn": n, "at": accepted.Format(time.RFC3339Nano)})
	rec := map[string]any{"msg": "closed", "conn": n, "accepted": accepted.Format(time.RFC3339Nano), "request": false, "answered": false}
	defer func() {
		closed := time.Now()
		rec["at"] = closed.Format(time.RFC3339Nano)
		rec["held_s"] = closed.Sub(accepted).Seconds()
		lg.log(rec)
	}()
	br := bufio.NewReader(conn)
	req, err := http.ReadRequest(br)
	if err != nil {
		// The agent refused the peer and closed before sending.
		rec["read_error"] = err.Error()
		return
	}
	var r request
	body, err := io.ReadAll(io.LimitReader(req.Body, 64<<10))
	if err == nil {
		err = json.Unmarshal(body, &r)
	}
	rec["request"] = true
	rec["method"], rec["path"] = req.Method, req.URL.Path
	rec["event"], rec["endpoint_id"], rec["ips"], rec["timeout_ms"] = r.Event, r.EndpointID, r.IPs, r.TimeoutMs
	if err != nil {
		rec["body_error"] = err.Error()
	}
	if mode == "hang" {
		// Never answer: wait for the agent to close (EOF), or to send
		// anything more, which it does not.
		_, err := io.Copy(io.Discard, br)
		if err != nil {
			rec["read_error"] = err.Error()
		}
		return
	}
	ans := struct {
		APIVersion int        `json:"api_version"`
		IPs        []ipAnswer `json:"ips"`
	}{APIVersion: 1, IPs: []ipAnswer{}}
	for _, ip := range r.IPs {
		ans.IPs = append(ans.IPs, ipAnswer{IP: ip, Complete: true})
	}
	b, _ := json.Marshal(ans)
	resp := &http.Response{
		StatusCode:    http.StatusOK,
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        http.Header{"Content-Type": {"application/json"}},
		ContentLength: int64(len(b)),
		Body:          io.NopCloser(bytes.NewReader(b)),
		Close:         true,
	}
	if err := resp.Write(conn); err != nil {
		rec["write_error"] = err.Error()
		return
	}
	rec["answered"] = true
	rec["answer_bytes"] = len(b)
}
