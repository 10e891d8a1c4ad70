package client

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"time"
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
	if a.status, err = strconv.Atoi(code); err != nil {
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
	switch {
	case strings.EqualFold(a.header["transfer-encoding"], "chunked"):
		a.body, err = readChunked(r)
	case a.header["content-length"] != "":
		n, perr := strconv.ParseInt(a.header["content-length"], 10, 64)
		if perr != nil || n < 0 || n > maxAnswer {
			return nil, fmt.Errorf("%w: content-length %q", errMalformed, a.header["content-length"])
		}
		a.body = make([]byte, n)
		_, err = io.ReadFull(r, a.body)
	case a.status/100 == 1 || a.status == 204 || a.status == 304:
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

// readLine reads one CRLF- (or LF-) terminated line without its end.
func readLine(r *bufio.Reader) (string, error) {
	line, err := r.ReadSlice('\n')
	if err != nil {
		if errors.Is(err, io.EOF) {
			return "", io.ErrUnexpectedEOF
		}
		if errors.Is(err, bufio.ErrBufferFull) {
			return "", fmt.Errorf("%w: header line over %d bytes", errMalformed, r.Size())
		}
		return "", err
	}
	return string(bytes.TrimRight(line, "\r\n")), nil
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
		start := len(body)
		body = append(body, make([]byte, n)...)
		if _, err := io.ReadFull(r, body[start:]); err != nil {
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
func roundTrip(ctx context.Context, socket, method, path string, header [][2]string, body []byte) (a *answer, dial time.Duration, err error) {
	start := time.Now()
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", socket)
	dial = time.Since(start)
	if err != nil {
		return nil, dial, err
	}
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	if err := writeRequest(conn, method, path, header, body); err != nil {
		return nil, dial, fmt.Errorf("%s %s: write request: %w", method, path, ctxErr(ctx, err))
	}
	a, err = readAnswer(bufio.NewReaderSize(conn, 8<<10))
	if err != nil {
		return nil, dial, fmt.Errorf("%s %s: read answer: %w", method, path, ctxErr(ctx, err))
	}
	return a, dial, nil
}

// ctxErr prefers the context's error to the connection's after the context
// ended (the connection failed because of it).
func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}
