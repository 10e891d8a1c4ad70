package client

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/ctscrub/ctscrub/scrubd/api"
)

// A large answer that net/http's server sends chunked (the handler flushes
// before it is done) is read whole, as are the Server-Timing steps, also
// when they are many times the reader's buffer (a scrub of many IPs names
// every IP's steps: bench/core's scrubs of 1,000 IPs sent a 40 KB header).
func TestChunkedAnswerAndTiming(t *testing.T) {
	steps := []string{"decode;dur=0.120"}
	for i := range 2000 {
		steps = append(steps, fmt.Sprintf("ip%04d.take;dur=1.5", i))
	}
	var want api.IndexList
	for i := range 3000 {
		want.Pods = append(want.Pods, api.IndexedPod{
			Attachment: api.Attachment{ContainerID: fmt.Sprintf("c%05d", i), IfName: "eth0"},
			IPs:        []netip.Addr{netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)})},
		})
	}
	c := serve(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set(api.TimingHeader, strings.Join(steps, ", "))
		b, _ := json.Marshal(&want)
		half := len(b) / 2
		w.Write(b[:half])
		w.(http.Flusher).Flush()
		w.Write(b[half:])
	})
	c.Trace = true
	got, err := c.IndexList(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Pods) != len(want.Pods) || got.Pods[2999].ContainerID != "c02999" {
		t.Fatalf("chunked answer: %d pods, want %d", len(got.Pods), len(want.Pods))
	}
	if len(c.Timings) != 1 || len(c.Timings[0].Server) != len(steps) || c.Timings[0].Server[2000].Name != "ip1999.take" {
		t.Errorf("timings: %+v", c.Timings)
	}
}

// Answers that are not HTTP, or that end early, are errors that name what was
// wrong; none is taken for an answer.
func TestMalformedAnswers(t *testing.T) {
	for name, raw := range map[string]string{
		"not HTTP":             "hello\r\n\r\n",
		"no status code":       "HTTP/1.1 OK\r\n\r\n",
		"header without colon": "HTTP/1.1 200 OK\r\nbroken\r\n\r\n{}",
		"short body":           "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}",
		"bad content-length":   "HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n{}",
		"huge content-length":  "HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n{}",
		"bad chunk size":       "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
		"chunk without end":    "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}xx\r\n0\r\n\r\n",
		"cut in the headers":   "HTTP/1.1 200 OK\r\nContent-Type: app",
		"nothing":              "",
		"header over 1 MiB":    "HTTP/1.1 200 OK\r\nServer-Timing: " + strings.Repeat("x", 1<<20) + "\r\n\r\n{}",
	} {
		t.Run(name, func(t *testing.T) {
			c := New(rawServer(t, raw))
			_, err := c.Status(context.Background())
			if err == nil {
				t.Fatalf("answer %q accepted", raw)
			}
			if !IsUnavailable(err) {
				t.Errorf("answer %q: %v, want ErrUnavailable (no usable answer)", raw, err)
			}
		})
	}
	// Without Content-Length the body ends with the connection.
	c := New(rawServer(t, "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{\"version\":\"v9\"}"))
	st, err := c.Status(context.Background())
	if err != nil || st.Version != "v9" {
		t.Errorf("answer ended by the connection: %+v, %v", st, err)
	}
}

// rawServer answers every connection with raw after reading the request.
func rawServer(t *testing.T, raw string) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "raw.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			buf := make([]byte, 4096)
			n, _ := c.Read(buf)
			if !strings.HasSuffix(string(buf[:n]), "\r\n\r\n") {
				t.Errorf("request not read whole in one read: %q", buf[:n])
			}
			c.Write([]byte(raw))
			c.Close()
		}
	}()
	return sock
}

// FuzzReadAnswer: the answer reader never panics, never takes a cut answer
// for a whole one, and where net/http's own reader accepts an answer whole,
// reads the same status and body from it.
func FuzzReadAnswer(f *testing.F) {
	for _, s := range []string{
		"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1;x=y\r\n{\r\n1\r\n}\r\n0\r\nTrailer: z\r\n\r\n",
		"HTTP/1.1 503 Service Unavailable\r\nServer-Timing: a;dur=1, b;dur=2\r\nContent-Length: 0\r\n\r\n",
		"HTTP/1.0 200 OK\r\n\r\nclose-delimited",
		"HTTP/1.1 204 No Content\r\n\r\n",
		"HTTP/1.1 200 OK\nContent-Length: 1\n\nx",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffff0\r\nshort",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		a, err := readAnswer(bufio.NewReaderSize(bytes.NewReader(raw), 8<<10))
		if err != nil {
			return
		}
		// 1xx, 204 and 304 answers have no body whatever their headers say
		// (RFC 9112, 6.3).
		noBody := a.status/100 == 1 || a.status == 204 || a.status == 304
		if cl := a.header["content-length"]; cl != "" && !noBody && !strings.EqualFold(a.header["transfer-encoding"], "chunked") {
			if n, _ := strconv.Atoi(cl); n != len(a.body) {
				t.Fatalf("Content-Length %s, body of %d bytes accepted", cl, len(a.body))
			}
		}
		resp, err := http.ReadResponse(bufio.NewReader(bytes.NewReader(raw)), nil)
		if err != nil {
			return
		}
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			return
		}
		if resp.StatusCode != a.status || !bytes.Equal(body, a.body) {
			t.Fatalf("net/http read status %d, %q; readAnswer %d, %q", resp.StatusCode, body, a.status, a.body)
		}
	})
}
