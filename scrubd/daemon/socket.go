package daemon

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/scrubd/api"
)

// The API deletes flows of any pod on the node: only root may call it. The
// socket is 0600 in a 0700 directory, which is the first guard; the second
// does not depend on file modes (a socket bind-mounted into a container, a
// directory made group-readable by a careless chmod): every connection's peer
// credentials are read from the kernel (SO_PEERCRED, the credentials of the
// process that connected) and a caller whose uid is not 0 gets 403 forbidden
// on every request, health checks included.

type peerKey struct{}

type peer struct {
	cred *unix.Ucred
	err  error
}

// peerCredContext is the API server's ConnContext: it records the
// connection's peer credentials once, at accept.
func peerCredContext(ctx context.Context, c net.Conn) context.Context {
	p := peer{err: fmt.Errorf("not a unix socket connection (%T)", c)}
	if uc, ok := c.(*net.UnixConn); ok {
		raw, err := uc.SyscallConn()
		if err != nil {
			p.err = err
		} else if cerr := raw.Control(func(fd uintptr) {
			p.cred, p.err = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
		}); cerr != nil {
			p.err = cerr
		}
	}
	return context.WithValue(ctx, peerKey{}, p)
}

// directConnContext is peerCredContext and acceptContext for a connection
// of the direct server (direct.go), whose socket is fd.
func directConnContext(ctx context.Context, fd int) context.Context {
	ctx = acceptContext(ctx)
	var p peer
	p.cred, p.err = unix.GetsockoptUcred(fd, unix.SOL_SOCKET, unix.SO_PEERCRED)
	return context.WithValue(ctx, peerKey{}, p)
}

// rootOnly refuses every request from a connection whose peer is not root,
// or whose credentials could not be read.
func (d *Daemon) rootOnly(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p, _ := r.Context().Value(peerKey{}).(peer)
		if p.err == nil && p.cred != nil && p.cred.Uid == 0 {
			next.ServeHTTP(w, r)
			return
		}
		var msg string
		if p.cred != nil {
			msg = fmt.Sprintf("scrubd serves root only: caller uid %d (pid %d) refused", p.cred.Uid, p.cred.Pid)
			d.log.Warn("API caller refused: not root", "uid", p.cred.Uid, "gid", p.cred.Gid, "pid", p.cred.Pid, "path", r.URL.Path)
		} else {
			msg = fmt.Sprintf("scrubd serves root only: caller's credentials unreadable (%v)", p.err)
			d.log.Warn("API caller refused: credentials unreadable", "err", p.err, "path", r.URL.Path)
		}
		d.m.refused.WithLabelValues(api.CodeForbidden).Inc()
		writeError(w, &api.Error{Code: api.CodeForbidden, Message: msg})
	})
}

// socketCheckEvery is how often the daemon checks that its socket file is
// still there.
const socketCheckEvery = time.Second

// watchSocket listens again when the socket's file (path) disappears
// (removed by hand, by a cleanup script, by a tmpfs remount): the old
// listener still serves the clients that connected before, but no new client
// can reach it, and every CNI ADD on the node would fail (or, for the
// delegate socket, Cilium would walk again). A new listener on the same path
// is served by the same server (Shutdown stops both).
func (d *Daemon) watchSocket(ctx context.Context, path string, listen func() (serve func() error, err error)) {
	t := time.NewTicker(socketCheckEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if _, err := os.Lstat(path); !errors.Is(err, os.ErrNotExist) {
			continue
		}
		serve, err := listen()
		if err != nil {
			d.log.Error("API socket removed; listening again failed (retrying)", "socket", path, "err", err)
			continue
		}
		d.log.Warn("API socket removed under the daemon: listening again", "socket", path)
		go func() {
			if err := serve(); err != nil && !errors.Is(err, http.ErrServerClosed) {
				d.log.Error("serve API on the re-created socket", "err", err)
			}
		}()
	}
}
