package client

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// The client speaks HTTP/1.1 to scrubd itself instead of through net/http:
// one request per connection, written and read on the caller's goroutine.
// net/http (with crypto/tls and the x509 and FIPS packages it links) is about
// half of the plugin's binary and most of its package initialisation, which
// every pod's ADD and DEL paid at start-up for a request on a local socket
// (docs/bench.md, "make bench-cni"). scrubd's server is net/http; what it
// sends is a status line, headers and a body sized by Content-Length or sent
// chunked, then it closes the connection (the request says Connection: close).

// maxAnswer bounds an answer's body (an index listing of every pod is the
// largest, far below this).
const maxAnswer = 256 << 20

// answer is what scrubd sent back.
type answer struct {
	status int
	text   string            // the status line's text after the code
	header map[string]string // lower-case names; repeated headers joined by ", "
	body   []byte
}

// writeRequest writes a whole request with a body (nil for none) in one write.
func writeRequest(w io.Writer, method, path string, header [][2]string, body []byte) error {
	var b bytes.Buffer
	b.Grow(256 + len(body))
	fmt.Fprintf(&b, "%s %s HTTP/1.1\r\nHost: scrubd\r\nConnection: close\r\n", method, path)
	for _, h := range header {
		b.WriteString(h[0])
		b.WriteString(": ")
		b.WriteString(h[1])
		b.WriteString("\r\n")
	}
	if body != nil || method == "POST" {
		b.WriteString("Content-Length: ")
		b.WriteString(strconv.Itoa(len(body)))
		b.WriteString("\r\n")
	}
	b.WriteString("\r\n")
	b.Write(body)
	_, err := w.Write(b.Bytes())
	return err
}

var errMalformed = errors.New("malformed HTTP answer")

// readAnswer reads one answer to a request that asked for the connection to
// be closed after it.
func readAnswer(r *bufio.Reader) (*answer, error) {
	line, err := readLine(r)
	if err != nil {
		return nil, err
	}
	proto, rest, _ := strings.Cut(line, " ")
	code, text, _ := strings.Cut(rest, " ")
	if !strings.HasPrefix(proto, "HTTP/1.") || len(code) != 3 {
		return nil, fmt.Errorf("%w: status line %q", errMalformed, line)
	}
	a := &answer{text: text, header: map[string]string{}}
	if a.status, err = strconv.Atoi(code); err != nil || a.status < 100 {
		return nil, fmt.Errorf("%w: status line %q", errMalformed, line)
	}
	for {
		line, err := readLine(r)
		if err != nil {
			return nil, err
		}
		if line == "" {
			break
		}
		name, value, ok := strings.Cut(line, ":")
		if !ok {
			return nil, fmt.Errorf("%w: header line %q", errMalformed, line)
		}
		name, value = strings.ToLower(strings.TrimSpace(name)), strings.TrimSpace(value)
		if old, ok := a.header[name]; ok {
			value = old + ", " + value
		}
		a.header[name] = value
	}
	if a.header["transfer-encoding"] != "" && proto != "HTTP/1.1" {
		// net/http ignores it there; scrubd always answers HTTP/1.1.
		return nil, fmt.Errorf("%w: Transfer-Encoding in an %s answer", errMalformed, proto)
	}
	switch {
	case a.status/100 == 1 || a.status == 204 || a.status == 304: // no body, whatever the headers say
	case strings.EqualFold(a.header["transfer-encoding"], "chunked"):
		a.body, err = readChunked(r)
	case a.header["content-length"] != "":
		n, perr := strconv.ParseInt(a.header["content-length"], 10, 64)
		if perr != nil || n < 0 || n > maxAnswer {
			return nil, fmt.Errorf("%w: content-length %q", errMalformed, a.header["content-length"])
		}
		a.body, err = readN(r, nil, n)
	default: // the body ends where the connection does
		a.body, err = io.ReadAll(io.LimitReader(r, maxAnswer+1))
		if err == nil && len(a.body) > maxAnswer {
			err = fmt.Errorf("%w: answer over %d bytes", errMalformed, maxAnswer)
		}
	}
	if err != nil {
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return nil, err
	}
	return a, nil
}

// maxLine bounds one status, header or chunk-size line. scrubd's
// Server-Timing header names every step of every IP of a scrub, so a scrub
// of many IPs sends a line far longer than the reader's buffer; net/http's
// client allowed 10 MB of header, 1 MiB per line is ample here.
const maxLine = 1 << 20

// readLine reads one CRLF- (or LF-) terminated line without its end.
func readLine(r *bufio.Reader) (string, error) {
	line, err := r.ReadSlice('\n')
	if err == nil {
		return string(bytes.TrimRight(line, "\r\n")), nil
	}
	var long []byte
	for errors.Is(err, bufio.ErrBufferFull) {
		long = append(long, line...)
		if len(long) > maxLine {
			return "", fmt.Errorf("%w: line over %d bytes", errMalformed, maxLine)
		}
		line, err = r.ReadSlice('\n')
	}
	if err != nil {
		if errors.Is(err, io.EOF) {
			return "", io.ErrUnexpectedEOF
		}
		return "", err
	}
	long = append(long, line...)
	if len(long) > maxLine+2 {
		return "", fmt.Errorf("%w: line over %d bytes", errMalformed, maxLine)
	}
	return string(bytes.TrimRight(long, "\r\n")), nil
}

// readN appends n bytes read from r to b. The buffer grows with what
// arrives, not with what a header or chunk size announces: a short answer
// that claims 200 MB allocates what it sends.
func readN(r io.Reader, b []byte, n int64) ([]byte, error) {
	buf := bytes.NewBuffer(b)
	if n < 64<<10 {
		buf.Grow(int(n))
	}
	got, err := io.CopyN(buf, r, n)
	if err == nil && got != n {
		err = io.ErrUnexpectedEOF
	}
	return buf.Bytes(), err
}

// readChunked reads a chunked body and its trailer.
func readChunked(r *bufio.Reader) ([]byte, error) {
	var body []byte
	for {
		line, err := readLine(r)
		if err != nil {
			return nil, err
		}
		size, _, _ := strings.Cut(line, ";")
		n, err := strconv.ParseInt(strings.TrimSpace(size), 16, 64)
		if err != nil || n < 0 || int64(len(body))+n > maxAnswer {
			return nil, fmt.Errorf("%w: chunk size %q", errMalformed, line)
		}
		if n == 0 {
			for { // trailer, up to its empty line
				if line, err = readLine(r); err != nil || line == "" {
					return body, err
				}
			}
		}
		if body, err = readN(r, body, n); err != nil {
			return nil, err
		}
		if line, err := readLine(r); err != nil || line != "" {
			if err == nil {
				err = fmt.Errorf("%w: no line end after a chunk", errMalformed)
			}
			return nil, err
		}
	}
}

// roundTrip makes one request on a connection of its own. The end of ctx
// (deadline or cancel) unblocks the connection's reads and writes, and the
// caller then sees ctx's error. dial is the time the connect took.
//
// The socket is a plain blocking one, read and written by the calling
// goroutine's thread, not through Go's network poller: a short-lived
// plugin then neither sets the poller up nor takes its extra wake-up per
// read (docs/bench.md, "make bench-cni"). The end of ctx shuts the socket
// down, which ends a blocked read or write.
func roundTrip(ctx context.Context, socket, method, path string, header [][2]string, body []byte) (a *answer, dial time.Duration, err error) {
	start := time.Now()
	f, err := dialUnix(ctx, socket)
	dial = time.Since(start)
	if err != nil {
		return nil, dial, err
	}
	defer f.Close()
	stop := context.AfterFunc(ctx, func() {
		if rc, err := f.SyscallConn(); err == nil {
			rc.Control(func(fd uintptr) { unix.Shutdown(int(fd), unix.SHUT_RDWR) })
		}
	})
	defer stop()
	if err := writeRequest(f, method, path, header, body); err != nil {
		return nil, dial, fmt.Errorf("%s %s: write request: %w", method, path, ctxErr(ctx, err))
	}
	a, err = readAnswer(bufio.NewReaderSize(f, 8<<10))
	if err != nil {
		return nil, dial, fmt.Errorf("%s %s: read answer: %w", method, path, ctxErr(ctx, err))
	}
	return a, dial, nil
}

// dialUnix connects a blocking stream socket to path. A connect waits while
// the listener's backlog is full, at most until ctx's deadline (30 s
// without one).
func dialUnix(ctx context.Context, path string) (*os.File, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, &os.SyscallError{Syscall: "socket", Err: err}
	}
	wait := 30 * time.Second
	if dl, ok := ctx.Deadline(); ok {
		wait = max(time.Until(dl), time.Millisecond)
	}
	tv := unix.NsecToTimeval(wait.Nanoseconds())
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv)
	for {
		err = unix.Connect(fd, &unix.SockaddrUnix{Name: path})
		if err != unix.EINTR {
			break
		}
	}
	if err != nil {
		unix.Close(fd)
		if err == unix.EAGAIN && ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, &net.OpError{Op: "dial", Net: "unix", Addr: &net.UnixAddr{Name: path, Net: "unix"}, Err: &os.SyscallError{Syscall: "connect", Err: err}}
	}
	// Writes are bounded by the shutdown at ctx's end, not by a timeout.
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &unix.Timeval{})
	return os.NewFile(uintptr(fd), path), nil
}

// ctxErr prefers the context's error to the connection's after the context
// ended (the connection failed because of it).
func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}
