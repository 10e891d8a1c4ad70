package daemon

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"runtime/debug"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// The API socket is served by directServer, not net/http's server. scrubd's
// clients (the plugin, the CLI) open one connection per request and say
// Connection: close; a plugin is a fresh process per CNI call, so every
// scrub pays its connection's set-up and the daemon's wake-ups in full.
// net/http accepts on one goroutine through the network poller, starts a
// goroutine per connection and another for its background read; on this
// project's VMs each goroutine hand-off that lands on the other, idle CPU
// is a wake-up of tens of µs, and a round trip of a small request through
// net/http took 129-166 µs median against 48-55 µs for the same request
// served with blocking system calls on the thread that accepted it
// (docs/bench.md, "The API socket's round trip").
//
// directServer serves each connection on the goroutine whose blocking
// accept(2) returned it: the kernel wakes that thread, which reads the
// request, runs the handler and writes the answer without another hand-off.
// A few goroutines wait in accept at any time (directSpares); one that
// takes a connection starts another when it was the last waiting, so
// concurrent requests are served in parallel as with net/http, and the
// daemon's own admission (queue_limit) still answers the overflow. A
// goroutine blocked in a system call holds an OS thread: the spares are
// the threads the socket keeps.
//
// What it serves is HTTP/1.1 (and 1.0) as net/http parses it
// (http.ReadRequest), one request per connection: the answer says
// Connection: close and the connection is closed after it. An answer is
// sent with its Content-Length when the handler set one or had finished
// writing when it was flushed, and chunked otherwise.
type directServer struct {
	handler http.Handler
	base    func() context.Context
	// connContext adds a connection's values (accept time, peer) to its
	// requests' context; fd is the connection's socket.
	connContext func(ctx context.Context, fd int) context.Context
	log         *slog.Logger
	maxConns    int // goroutines serving or accepting, per listener

	mu       sync.Mutex
	closed   bool
	lns      map[*directListener]bool
	conns    map[int]context.CancelFunc // in flight: their sockets
	inFlight sync.WaitGroup
	idleCh   chan struct{} // closed when closed and no connection is in flight

	hangups *hangupWatch
}

// directSpares is how many goroutines wait in accept per listener.
const directSpares = 2

// directReadTimeout bounds the read of a request (line, headers and body),
// as net/http's ReadHeaderTimeout did for the headers.
const directReadTimeout = 10 * time.Second

// directWriteTimeout bounds each write of an answer to a client that does
// not read it.
const directWriteTimeout = 30 * time.Second

func newDirectServer(h http.Handler, base func() context.Context, connContext func(context.Context, int) context.Context, log *slog.Logger, maxConns int) *directServer {
	return &directServer{
		handler: h, base: base, connContext: connContext, log: log, maxConns: max(maxConns, directSpares+1),
		lns: map[*directListener]bool{}, conns: map[int]context.CancelFunc{},
	}
}

// directListener is a listening unix socket with blocking accepts.
type directListener struct {
	fd    int
	path  string
	idle  atomic.Int32 // goroutines in (or on their way to) accept
	loops atomic.Int32 // goroutines serving this listener
	once  sync.Once
	done  chan struct{}         // closed when the last loop has returned
	err   atomic.Pointer[error] // an accept's failure that ended the loops
}

// listenDirect listens on path, a unix stream socket with blocking accepts,
// created 0600 (listenUnix's checks are the caller's).
func listenDirect(path string) (*directListener, error) {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, os.NewSyscallError("socket", err)
	}
	old := syscall.Umask(0o177)
	err = unix.Bind(fd, &unix.SockaddrUnix{Name: path})
	syscall.Umask(old)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("listen on %s: %w", path, os.NewSyscallError("bind", err))
	}
	if err := unix.Listen(fd, unix.SOMAXCONN); err != nil {
		unix.Close(fd)
		os.Remove(path)
		return nil, fmt.Errorf("listen on %s: %w", path, os.NewSyscallError("listen", err))
	}
	return &directListener{fd: fd, path: path, done: make(chan struct{})}, nil
}

// close stops the accepts (a shutdown wakes every accept blocked on the
// socket), removes the socket's file and closes it once no loop uses it.
func (l *directListener) close() {
	l.once.Do(func() {
		unix.Shutdown(l.fd, unix.SHUT_RDWR)
		os.Remove(l.path)
		go func() {
			<-l.done
			unix.Close(l.fd)
		}()
	})
}

// discard closes a listener that was never served.
func (l *directListener) discard() {
	l.close()
	close(l.done)
}

// Serve serves l until Shutdown or Close, then returns http.ErrServerClosed.
func (s *directServer) Serve(l *directListener) error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		l.discard()
		return http.ErrServerClosed
	}
	if s.hangups == nil {
		w, err := newHangupWatch()
		if err != nil {
			s.mu.Unlock()
			l.discard()
			return err
		}
		s.hangups = w
	}
	s.lns[l] = true
	s.mu.Unlock()
	var loops sync.WaitGroup
	l.loops.Store(directSpares)
	l.idle.Store(directSpares)
	var spawn func()
	spawn = func() {
		loops.Go(func() { s.acceptLoop(l, spawn) })
	}
	for range directSpares {
		spawn()
	}
	loops.Wait()
	close(l.done)
	if e := l.err.Load(); e != nil && !s.isClosed(l) {
		l.close()
		return fmt.Errorf("socket %s: %w", l.path, *e)
	}
	return http.ErrServerClosed
}

// acceptLoop accepts and serves connections until the listener is closed,
// or until it has served one and enough others wait in accept.
func (s *directServer) acceptLoop(l *directListener, spawn func()) {
	for {
		fd, _, err := unix.Accept4(l.fd, unix.SOCK_CLOEXEC)
		if err != nil {
			switch err {
			case unix.EINTR, unix.ECONNABORTED:
				continue
			case unix.EMFILE, unix.ENFILE, unix.ENOBUFS, unix.ENOMEM:
				s.log.Error("API socket: accept failed, retrying", "socket", l.path, "err", err)
				time.Sleep(10 * time.Millisecond)
				continue
			}
			// EINVAL after the shutdown of close; anything else ends
			// the listener too.
			if !s.isClosed(l) {
				e := error(os.NewSyscallError("accept4", err))
				l.err.CompareAndSwap(nil, &e)
			}
			l.loops.Add(-1)
			l.idle.Add(-1)
			return
		}
		// The last one waiting starts another before serving, so a
		// concurrent request is accepted at once.
		if l.idle.Add(-1) == 0 && int(l.loops.Load()) < s.maxConns {
			l.loops.Add(1)
			l.idle.Add(1)
			spawn()
		}
		s.serveConn(fd)
		if l.idle.Load() >= directSpares || s.isClosed(l) {
			l.loops.Add(-1)
			return
		}
		l.idle.Add(1)
	}
}

func (s *directServer) isClosed(l *directListener) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed || !s.lns[l]
}

// serveConn reads one request from fd, serves it and closes fd.
func (s *directServer) serveConn(fd int) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		unix.Close(fd)
		return
	}
	ctx, cancel := context.WithCancel(s.base())
	s.conns[fd] = cancel
	s.inFlight.Add(1)
	s.mu.Unlock()
	defer func() {
		// As net/http: a handler's panic ends its connection (the caller
		// reads a cut answer), not the daemon.
		if v := recover(); v != nil && v != http.ErrAbortHandler {
			s.log.Error("API handler panicked", "panic", v, "stack", string(debug.Stack()))
		}
		cancel()
		s.mu.Lock()
		delete(s.conns, fd)
		s.mu.Unlock()
		unix.Close(fd)
		s.inFlight.Done()
	}()
	ctx = s.connContext(ctx, fd)
	tv := unix.NsecToTimeval(directReadTimeout.Nanoseconds())
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	tv = unix.NsecToTimeval(directWriteTimeout.Nanoseconds())
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv)
	br := readerPool.Get().(*bufio.Reader)
	br.Reset(fdReader(fd))
	defer readerPool.Put(br)
	req, err := http.ReadRequest(br)
	if err != nil {
		if !errors.Is(err, io.EOF) {
			// As net/http answers a request it cannot parse.
			writeFull(fd, []byte("HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n\r\n400 Bad Request: "+sanitize(err.Error())))
		}
		return
	}
	req.RemoteAddr = "@"
	if req.Header.Get("Expect") == "100-continue" && req.ProtoAtLeast(1, 1) {
		if writeFull(fd, []byte("HTTP/1.1 100 Continue\r\n\r\n")) != nil {
			return
		}
	}
	// A caller that goes away (closes its end) cancels the request, as
	// net/http's background read did, until the answer is on its way.
	id, err := s.hangups.add(fd, cancel)
	watched := err == nil
	w := &directWriter{fd: fd, header: http.Header{}, head: req.Method == http.MethodHead, http10: !req.ProtoAtLeast(1, 1)}
	w.beforeSend = func() {
		if watched {
			s.hangups.remove(fd, id)
			watched = false
		}
	}
	defer w.beforeSend()
	s.handler.ServeHTTP(w, req.WithContext(ctx))
	w.finish()
}

var readerPool = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 4096) }}

// fdReader reads a blocking socket.
type fdReader int

func (r fdReader) Read(b []byte) (int, error) {
	for {
		n, err := unix.Read(int(r), b)
		switch {
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN:
			return 0, os.ErrDeadlineExceeded // SO_RCVTIMEO
		case err != nil:
			return 0, err
		case n == 0 && len(b) > 0:
			return 0, io.EOF
		}
		return n, nil
	}
}

func writeFull(fd int, b []byte) error {
	for len(b) > 0 {
		n, err := unix.Write(fd, b)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		b = b[n:]
	}
	return nil
}

// sanitize keeps an error's text to one printable line.
func sanitize(s string) string {
	b := []byte(s)
	for i, c := range b {
		if c < 0x20 || c > 0x7e {
			b[i] = ' '
		}
	}
	return string(b)
}

// directWriter is an http.ResponseWriter (and http.Flusher) that buffers an
// answer until it is flushed or the handler returns.
type directWriter struct {
	fd         int
	header     http.Header
	status     int
	buf        []byte
	sent       bool // the status line and headers are out
	chunked    bool
	head       bool // a HEAD request: no body
	http10     bool
	err        error
	beforeSend func()
}

func (w *directWriter) Header() http.Header { return w.header }

func (w *directWriter) WriteHeader(code int) {
	if w.status != 0 || code < 200 {
		return
	}
	w.status = code
}

func (w *directWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	if w.err != nil {
		return 0, w.err
	}
	if w.head {
		return len(b), nil
	}
	if !w.sent {
		w.buf = append(w.buf, b...)
		return len(b), nil
	}
	if w.chunked {
		if len(b) == 0 {
			return 0, nil
		}
		w.send([]byte(strconv.FormatInt(int64(len(b)), 16) + "\r\n"))
		w.send(b)
		w.send([]byte("\r\n"))
	} else {
		w.send(b)
	}
	if w.err != nil {
		return 0, w.err
	}
	return len(b), nil
}

// Flush sends what is buffered. Before the handler returns, an answer
// without a Content-Length goes out chunked (close-delimited for HTTP/1.0).
func (w *directWriter) Flush() { w.flush(false) }

func (w *directWriter) flush(final bool) {
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	if w.sent {
		return
	}
	w.beforeSend()
	w.sent = true
	h := w.header
	if h.Get("Content-Length") == "" && !bodyless(w.status) {
		switch {
		case final || w.head:
			if !w.head {
				h.Set("Content-Length", strconv.Itoa(len(w.buf)))
			}
		case !w.http10:
			w.chunked = true
			h.Set("Transfer-Encoding", "chunked")
		}
	}
	h.Set("Connection", "close")
	out := make([]byte, 0, 256+len(w.buf))
	proto := "HTTP/1.1 "
	out = append(out, proto...)
	out = strconv.AppendInt(out, int64(w.status), 10)
	out = append(out, ' ')
	out = append(out, http.StatusText(w.status)...)
	out = append(out, "\r\n"...)
	for k, vs := range h {
		for _, v := range vs {
			out = append(out, k...)
			out = append(out, ": "...)
			out = append(out, sanitize(v)...)
			out = append(out, "\r\n"...)
		}
	}
	out = append(out, "\r\n"...)
	body := w.buf
	w.buf = nil
	if w.chunked && len(body) > 0 {
		out = strconv.AppendInt(out, int64(len(body)), 16)
		out = append(out, "\r\n"...)
		out = append(out, body...)
		out = append(out, "\r\n"...)
	} else if !w.head {
		out = append(out, body...)
	}
	w.send(out)
}

// finish ends the answer once the handler has returned.
func (w *directWriter) finish() {
	w.flush(true)
	if w.chunked {
		w.send([]byte("0\r\n\r\n"))
	}
}

func (w *directWriter) send(b []byte) {
	if w.err == nil {
		w.err = writeFull(w.fd, b)
	}
}

func bodyless(status int) bool {
	return status == http.StatusNoContent || status == http.StatusNotModified
}

// Shutdown stops accepting and waits until the requests in flight have
// answered or ctx ends (then ctx's error).
func (s *directServer) Shutdown(ctx context.Context) error {
	idle := s.stop()
	select {
	case <-idle:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Close stops accepting and cancels the requests in flight: their sockets
// are shut down, which ends a blocked read or write.
func (s *directServer) Close() {
	s.stop()
	s.mu.Lock()
	defer s.mu.Unlock()
	for fd, cancel := range s.conns {
		cancel()
		unix.Shutdown(fd, unix.SHUT_RDWR)
	}
}

// stop closes the listeners once and returns a channel closed when no
// request is in flight.
func (s *directServer) stop() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.closed {
		s.closed = true
		for l := range s.lns {
			l.close()
		}
		s.idleCh = make(chan struct{})
		go func(ch chan struct{}) {
			s.inFlight.Wait()
			if s.hangups != nil {
				s.hangups.close()
			}
			close(ch)
		}(s.idleCh)
	}
	return s.idleCh
}

// hangupWatch cancels a request whose caller closed its end of the
// connection: one epoll instance for every connection in flight, waited
// on by one goroutine (one thread, asleep until a caller goes away). Each
// connection is known by a number of its own, not its descriptor's, which
// the next connection may reuse while an event of the last is handled.
type hangupWatch struct {
	epfd    int
	mu      sync.Mutex
	next    uint64
	cancels map[uint64]context.CancelFunc
	done    chan struct{}
}

func newHangupWatch() (*hangupWatch, error) {
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, os.NewSyscallError("epoll_create1", err)
	}
	w := &hangupWatch{epfd: epfd, cancels: map[uint64]context.CancelFunc{}, done: make(chan struct{})}
	go w.run()
	return w, nil
}

// epollData puts id in an event's 64 bits of user data (Fd and Pad).
func epollData(events uint32, id uint64) unix.EpollEvent {
	return unix.EpollEvent{Events: events, Fd: int32(uint32(id)), Pad: int32(uint32(id >> 32))}
}

func epollID(ev *unix.EpollEvent) uint64 { return uint64(uint32(ev.Fd)) | uint64(uint32(ev.Pad))<<32 }

// add watches fd for its peer's hang-up, which calls cancel.
func (w *hangupWatch) add(fd int, cancel context.CancelFunc) (uint64, error) {
	w.mu.Lock()
	w.next++
	id := w.next
	w.cancels[id] = cancel
	w.mu.Unlock()
	ev := epollData(unix.EPOLLRDHUP|unix.EPOLLONESHOT, id)
	if err := unix.EpollCtl(w.epfd, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
		w.mu.Lock()
		delete(w.cancels, id)
		w.mu.Unlock()
		return 0, err
	}
	return id, nil
}

// remove stops watching fd; called before fd is closed.
func (w *hangupWatch) remove(fd int, id uint64) {
	unix.EpollCtl(w.epfd, unix.EPOLL_CTL_DEL, fd, nil)
	w.mu.Lock()
	delete(w.cancels, id)
	w.mu.Unlock()
}

func (w *hangupWatch) run() {
	defer close(w.done)
	evs := make([]unix.EpollEvent, 64)
	for {
		n, err := unix.EpollWait(w.epfd, evs, -1)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return
		}
		for i := range evs[:n] {
			id := epollID(&evs[i])
			if id == 0 { // close's wake-up
				return
			}
			w.mu.Lock()
			cancel := w.cancels[id]
			w.mu.Unlock()
			if cancel != nil {
				cancel()
			}
		}
	}
}

// close ends the watch: an eventfd made readable (id 0) wakes its wait.
func (w *hangupWatch) close() {
	efd, err := unix.Eventfd(1, unix.EFD_CLOEXEC)
	if err == nil {
		ev := epollData(unix.EPOLLIN, 0)
		if unix.EpollCtl(w.epfd, unix.EPOLL_CTL_ADD, efd, &ev) == nil {
			<-w.done
		}
		unix.Close(efd)
	}
	unix.Close(w.epfd)
}
