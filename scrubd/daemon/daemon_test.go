package daemon

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/cilium"
	"github.com/ctscrub/ctscrub/scrubd/client"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

const testCIDR = "10.244.0.0/16"

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: BPF maps and programs in a private bpffs dir")
	}
}

// ctRoot is a fake "Cilium root": the four global CT maps with Cilium's
// layout, pinned in a private bpffs dir.
type ctRoot struct {
	dir  string
	maps [ctmap.NumKinds]*ebpf.Map
}

func newCTRoot(t *testing.T, maxEntries uint32) *ctRoot {
	t.Helper()
	requireRoot(t)
	dir, err := os.MkdirTemp("/sys/fs/bpf", "ctscrub-test-")
	if err != nil {
		t.Skipf("no bpffs at /sys/fs/bpf: %v", err)
	}
	r := &ctRoot{dir: dir}
	t.Cleanup(func() {
		for _, m := range r.maps {
			if m != nil {
				m.Close()
			}
		}
		os.RemoveAll(dir)
	})
	for _, k := range ctmap.Kinds {
		m, err := ebpf.NewMap(k.Spec(maxEntries))
		if err != nil {
			t.Fatalf("create %s: %v", k.Name(), err)
		}
		r.maps[k] = m
		if err := m.Pin(filepath.Join(dir, k.Name())); err != nil {
			t.Fatalf("pin %s: %v", k.Name(), err)
		}
	}
	return r
}

// put4 writes v4 keys in batches, each into the map its protocol selects.
func (r *ctRoot) put4(t *testing.T, keys []ctmap.CTKey4) {
	t.Helper()
	byKind := map[ctmap.Kind][]ctmap.CTKey4{}
	for _, k := range keys {
		byKind[k.Kind()] = append(byKind[k.Kind()], k)
	}
	var e ctmap.Entry
	e.SetLifetime(1 << 30)
	for kind, ks := range byKind {
		for len(ks) > 0 {
			n := min(len(ks), 65536)
			vals := make([]ctmap.Entry, n)
			for i := range vals {
				vals[i] = e
			}
			if _, err := r.maps[kind].BatchUpdate(ks[:n], vals, nil); err != nil {
				t.Fatalf("fill %s: %v", kind.Name(), err)
			}
			ks = ks[n:]
		}
	}
}

// present4 counts the keys still in their maps.
func (r *ctRoot) present4(t *testing.T, keys []ctmap.CTKey4) int {
	t.Helper()
	n := 0
	var e ctmap.Entry
	for _, k := range keys {
		err := r.maps[k.Kind()].Lookup(k, &e)
		switch {
		case err == nil:
			n++
		case errors.Is(err, ebpf.ErrKeyNotExist):
		default:
			t.Fatalf("lookup %s: %v", k, err)
		}
	}
	return n
}

// background returns n TCP keys of addresses outside the pod CIDRs: the
// table's bulk, which a walk must visit and no scrub may touch.
func background(n int) []ctmap.CTKey4 {
	out := make([]ctmap.CTKey4, n)
	remote := netip.MustParseAddr("198.18.0.1")
	for i := range out {
		d := netip.AddrFrom4([4]byte{100, byte(64 + i>>24&0x3f), byte(i >> 16), byte(i >> 8)})
		out[i] = ctmap.NewKey4(d, remote, 443, uint16(i), ctmap.ProtoTCP, ctmap.FlagOut)
	}
	return out
}

// podFlows returns n OUT flows of pod ip to remote peers, each with the
// related ICMP key Cilium creates beside it.
func podFlows(ip netip.Addr, n int) []ctmap.CTKey4 {
	out := make([]ctmap.CTKey4, 0, 2*n)
	for i := range n {
		remote := netip.AddrFrom4([4]byte{203, byte(i >> 16), byte(i >> 8), byte(i)})
		k := ctmap.NewKey4(ip, remote, 80, uint16(1024+i), ctmap.ProtoTCP, ctmap.FlagOut)
		out = append(out, k, k.Related())
	}
	return out
}

// indexFlows puts pod flows into the index exactly as the recorder does:
// through recorder.Apply, after declaring the IP tracked (a pod whose every
// flow the recorder saw).
func indexFlows(d *Daemon, ip netip.Addr, keys []ctmap.CTKey4) {
	d.Index().Hold(ip) // a pod of this node holds it, as after its ADD
	d.Index().Track(ip)
	for _, k := range keys {
		if k.Flags()&ctmap.FlagRelated != 0 {
			continue
		}
		r := recorder.Record{Family: 4, Kind: recorder.RecFlow}
		copy(r.Key[:], k[:])
		recorder.Apply(d.Index(), &r)
	}
}

// logBuffer collects the daemon's JSON log lines.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// scrubLines returns the "scrub" log lines.
func (b *logBuffer) scrubLines(t *testing.T) []map[string]any {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []map[string]any
	sc := bufio.NewScanner(bytes.NewReader(b.buf.Bytes()))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("log line is not JSON: %q: %v", sc.Text(), err)
		}
		if m["msg"] == "scrub" {
			out = append(out, m)
		}
	}
	return out
}

type testDaemon struct {
	*Daemon
	c    *client.Client
	logs *logBuffer
	cfg  Config
	// stop ends Run as SIGTERM does and closes the daemon (pins stay); the
	// test's cleanup calls it too.
	stop func()
}

func testConfig(t *testing.T, root *ctRoot) Config {
	cfg := DefaultConfig()
	run := t.TempDir()
	cfg.Socket = filepath.Join(run, "sock", "scrubd.sock")
	cfg.StateFile = filepath.Join(run, "attachments.json")
	cfg.CTRoot = root.dir
	cfg.PinDir = filepath.Join(root.dir, "ctscrub")
	cfg.PodCIDRs = []string{testCIDR}
	cfg.MetricsAddr = "off"
	cfg.Backends = "cilium"
	// The expiry pass has tests of its own; here its walk of the whole map
	// at start would compete for the CPUs with the scrubs under test.
	cfg.Expiry.Mode = "off"
	// The bootstrap finds pods in scrubd's network namespace: the test's is
	// the machine's, whose interfaces are no test's. Tests of it set a
	// node namespace of their own (boot_test.go).
	cfg.Bootstrap = "off"
	return cfg
}

// startDaemon runs a real daemon in-process on a real socket.
func startDaemon(t *testing.T, cfg Config) *testDaemon {
	t.Helper()
	return startDaemonWith(t, cfg, nil, true)
}

// startDaemonWith is startDaemon with prepare run on the opened daemon
// before Run, and, unless ready is set, returning once the socket answers
// (ready or not).
func startDaemonWith(t *testing.T, cfg Config, prepare func(*Daemon), ready bool) *testDaemon {
	t.Helper()
	logs := &logBuffer{}
	d, err := Open(cfg, slog.New(slog.NewJSONHandler(logs, nil)), "test")
	if err != nil {
		t.Fatalf("open daemon: %v", err)
	}
	if prepare != nil {
		prepare(d)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("daemon Run: %v", err)
				}
			case <-time.After(10 * time.Second):
				t.Errorf("daemon did not stop within 10 s of its context's end")
			}
			d.Close()
		})
	}
	t.Cleanup(stop)
	c := client.New(cfg.Socket)
	waitAnswering(t, c, done, ready)
	return &testDaemon{Daemon: d, c: c, logs: logs, cfg: cfg, stop: stop}
}

func waitServing(t *testing.T, c *client.Client, done <-chan error) {
	t.Helper()
	waitAnswering(t, c, done, true)
}

func waitAnswering(t *testing.T, c *client.Client, done <-chan error, ready bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		st, err := c.Status(ctx)
		cancel()
		if err == nil && (st.Ready || !ready) {
			return
		}
		select {
		case err := <-done:
			t.Fatalf("daemon exited before serving: %v", err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("daemon not serving on %s after 10 s: %v", c.Socket, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// waitScrubLines waits for at least n "scrub" log lines and returns them
// all: scrubd writes a scrub's line after its answer has left
// (afterAnswer), so a client may read the answer first.
func (b *logBuffer) waitScrubLines(t *testing.T, n int) []map[string]any {
	t.Helper()
	var lines []map[string]any
	waitFor(t, fmt.Sprintf("%d scrub log lines", n), func() bool {
		lines = b.scrubLines(t)
		return len(lines) >= n
	})
	return lines
}

// waitFor polls cond (a state of the daemon, not a timer) for up to 10 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func mustAddr(s string) netip.Addr { return netip.MustParseAddr(s) }

func TestSocketIsPrivate(t *testing.T) {
	root := newCTRoot(t, 1024)
	td := startDaemon(t, testConfig(t, root))
	fi, err := os.Stat(td.cfg.Socket)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
		t.Errorf("socket %s: mode %s, want a socket with 0600", td.cfg.Socket, fi.Mode())
	}
	di, err := os.Stat(filepath.Dir(td.cfg.Socket))
	if err != nil {
		t.Fatal(err)
	}
	if di.Mode().Perm() != 0o700 {
		t.Errorf("socket dir: mode %s, want 0700", di.Mode().Perm())
	}
	// A second daemon on the same socket must refuse, not steal it.
	if _, err := listenUnix(td.cfg.Socket); err == nil || !strings.Contains(err.Error(), "another scrubd") {
		t.Errorf("second listener on a live socket: err %v, want 'another scrubd'", err)
	}
}

func TestRefusedIPsDeleteNothing(t *testing.T) {
	root := newCTRoot(t, 1<<16)
	td := startDaemon(t, testConfig(t, root))
	pod := mustAddr("10.244.3.7")
	podKeys := podFlows(pod, 100)
	nodeKeys := background(100) // 100.64.x.x: outside the pod CIDRs
	zeroKeys := []ctmap.CTKey4{ctmap.NewKey4(mustAddr("0.0.0.0"), mustAddr("198.18.0.9"), 53, 1000, ctmap.ProtoUDP, ctmap.FlagOut)}
	root.put4(t, podKeys)
	root.put4(t, nodeKeys)
	root.put4(t, zeroKeys)

	for _, tc := range []struct {
		ips  []string
		code string
	}{
		{[]string{"100.64.0.0"}, api.CodeNotPodIP},               // the node's range, outside the pod CIDRs
		{[]string{"0.0.0.0"}, api.CodeNotPodIP},                  // unspecified
		{[]string{"::"}, api.CodeNotPodIP},                       // unspecified v6
		{[]string{"127.0.0.1"}, api.CodeNotPodIP},                // loopback
		{[]string{"10.244.3.7", "100.64.0.0"}, api.CodeNotPodIP}, // one bad IP refuses the whole request
		{[]string{"10.244.3.7", "0.0.0.0"}, api.CodeNotPodIP},
	} {
		var ips []netip.Addr
		for _, s := range tc.ips {
			ips = append(ips, mustAddr(s))
		}
		_, err := td.c.Scrub(context.Background(), api.ScrubRequest{IPs: ips, Reason: scrub.ReasonDel})
		e, ok := client.APIError(err)
		if !ok || e.Code != tc.code {
			t.Errorf("scrub %v: err %v, want code %s", tc.ips, err, tc.code)
			continue
		}
		if !strings.Contains(e.Message, "nothing deleted") {
			t.Errorf("scrub %v: message %q does not say nothing was deleted", tc.ips, e.Message)
		}
	}
	if n := root.present4(t, podKeys); n != len(podKeys) {
		t.Errorf("refused requests deleted %d of the pod's %d entries", len(podKeys)-n, len(podKeys))
	}
	if n := root.present4(t, nodeKeys); n != len(nodeKeys) {
		t.Errorf("refused requests deleted %d node entries", len(nodeKeys)-n)
	}
	if n := root.present4(t, zeroKeys); n != 1 {
		t.Errorf("refused request deleted the 0.0.0.0 entry")
	}
	// The pod IP alone is served, and deletes only its own entries.
	resp, err := td.c.Scrub(context.Background(), api.ScrubRequest{IPs: []netip.Addr{pod}, Reason: scrub.ReasonDel})
	if err != nil {
		t.Fatalf("scrub pod IP: %v", err)
	}
	if got := resp.Results[0].Total; got != len(podKeys) {
		t.Errorf("pod scrub deleted %d, want %d", got, len(podKeys))
	}
	if n := root.present4(t, nodeKeys); n != len(nodeKeys) {
		t.Errorf("pod scrub deleted %d node entries", len(nodeKeys)-n)
	}
}

func TestMalformedRequests(t *testing.T) {
	root := newCTRoot(t, 1024)
	td := startDaemon(t, testConfig(t, root))
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", td.cfg.Socket)
	}}}
	for _, tc := range []struct {
		name, method, path, body string
		header                   map[string]string
		status                   int
		want                     string
	}{
		{"bad JSON", "POST", api.PathScrub, `{"ips": [`, nil, 400, "decode scrub request"},
		{"unknown reason", "POST", api.PathScrub, `{"ips":["10.244.0.5"],"reason":"restart"}`, nil, 400, `reason "restart": want add, del or gc`},
		{"no reason", "POST", api.PathScrub, `{"ips":["10.244.0.5"]}`, nil, 400, `no "reason"`},
		{"not an IP", "POST", api.PathScrub, `{"ips":["pod-a"],"reason":"del"}`, nil, 400, `ParseAddr("pod-a")`},
		{"no IPs", "POST", api.PathScrub, `{"ips":[],"reason":"del"}`, nil, 400, `no "ips"`},
		{"misspelt field", "POST", api.PathScrub, `{"ips":["10.244.0.5"],"reason":"del","dryrun":true}`, nil, 400, `unknown field "dryrun"`},
		{"bad deadline", "POST", api.PathScrub, `{"ips":["10.244.0.5"],"reason":"del"}`, map[string]string{api.DeadlineHeader: "soon"}, 400, api.DeadlineHeader},
		{"wrong method", "GET", api.PathScrub, ``, nil, 400, "no API at GET /v1/scrub"},
		{"unknown path", "GET", "/v2/scrub", ``, nil, 400, "no API at GET /v2/scrub"},
		{"index ip not an IP", "GET", api.PathIndexIP + "?ip=x", ``, nil, 400, `ip "x"`},
		{"index start without netns", "POST", api.PathIndexStart, `{"container_id":"c","ifname":"eth0","ips":["10.244.0.5"]}`, nil, 400, "needs container_id, ifname and netns"},
		{"index pod unknown", "GET", api.PathIndexPod + "?container_id=nope&ifname=eth0", ``, nil, 404, "no attachment nope/eth0"},
	} {
		req, _ := http.NewRequest(tc.method, "http://scrubd"+tc.path, strings.NewReader(tc.body))
		for k, v := range tc.header {
			req.Header.Set(k, v)
		}
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tc.status {
			t.Errorf("%s: status %d, want %d (body %s)", tc.name, resp.StatusCode, tc.status, body)
			continue
		}
		if tc.want == "" {
			continue
		}
		var e api.Error
		if err := json.Unmarshal(body, &e); err != nil || e.Code == "" {
			t.Errorf("%s: body %q is not an api.Error", tc.name, body)
			continue
		}
		if !strings.Contains(e.Message, tc.want) {
			t.Errorf("%s: error %q does not mention %q", tc.name, e.Message, tc.want)
		}
	}
}

// Scrubs of different IPs run at the same time: with a global lock their
// work intervals could not all overlap.
func TestScrubsOfDifferentIPsOverlap(t *testing.T) {
	const pods, flows = 4, 100_000
	root := newCTRoot(t, 1<<20)
	td := startDaemon(t, testConfig(t, root))
	var ips []netip.Addr
	keys := map[netip.Addr][]ctmap.CTKey4{}
	for i := range pods {
		ip := netip.AddrFrom4([4]byte{10, 244, 1, byte(10 + i)})
		ips = append(ips, ip)
		keys[ip] = podFlows(ip, flows)
		root.put4(t, keys[ip])
		indexFlows(td.Daemon, ip, keys[ip])
	}
	var wg sync.WaitGroup
	results := make([]*api.ScrubResponse, pods)
	errs := make([]error, pods)
	for i, ip := range ips {
		wg.Go(func() {
			results[i], errs[i] = td.c.Scrub(context.Background(), api.ScrubRequest{IPs: []netip.Addr{ip}, Reason: scrub.ReasonDel})
		})
	}
	wg.Wait()
	for i, ip := range ips {
		if errs[i] != nil {
			t.Fatalf("scrub %s: %v", ip, errs[i])
		}
		r := results[i].Results[0]
		if r.Method != scrub.MethodIndex || r.Total != 2*flows {
			t.Errorf("scrub %s: %s deleted %d, want index and %d", ip, r.Method, r.Total, 2*flows)
		}
		if n := root.present4(t, keys[ip]); n != 0 {
			t.Errorf("scrub %s left %d entries", ip, n)
		}
	}
	// The work intervals (logged per scrub) all overlap: the latest start
	// comes before the earliest end.
	var latestStart, earliestEnd time.Time
	lines := td.logs.waitScrubLines(t, pods)
	if len(lines) != pods {
		t.Fatalf("%d scrub log lines, want %d", len(lines), pods)
	}
	for _, l := range lines {
		s, err1 := time.Parse(time.RFC3339Nano, fmt.Sprint(l["work_start"]))
		e, err2 := time.Parse(time.RFC3339Nano, fmt.Sprint(l["work_end"]))
		if err1 != nil || err2 != nil {
			t.Fatalf("log line without work interval: %v", l)
		}
		t.Logf("scrub %v: work %s .. %s (%s)", l["ips"], s.Format("15:04:05.000000"), e.Format("15:04:05.000000"), e.Sub(s))
		if s.After(latestStart) {
			latestStart = s
		}
		if earliestEnd.IsZero() || e.Before(earliestEnd) {
			earliestEnd = e
		}
	}
	if !latestStart.Before(earliestEnd) {
		t.Errorf("scrubs of different IPs did not all run at once: last one started %s after the first one ended", latestStart.Sub(earliestEnd))
	}
}

// holdSlot fills the only run slot with a sweep over a big map, so that
// later requests queue deterministically behind it. It returns a channel
// that yields the holder's error.
func holdSlot(t *testing.T, td *testDaemon, root *ctRoot, entries int) <-chan error {
	t.Helper()
	root.put4(t, background(entries))
	holder := mustAddr("10.244.200.1") // not indexed: its scrub sweeps
	done := make(chan error, 1)
	go func() {
		_, err := td.c.Scrub(context.Background(), api.ScrubRequest{IPs: []netip.Addr{holder}, Reason: scrub.ReasonDel})
		done <- err
	}()
	waitFor(t, "the holder's scrub to take the run slot", func() bool { return len(td.slots) == 1 })
	return done
}

func TestSameIPIsShared(t *testing.T) {
	root := newCTRoot(t, 1<<21)
	cfg := testConfig(t, root)
	cfg.MaxInFlight = 1
	td := startDaemon(t, cfg)
	ip := mustAddr("10.244.2.2")
	keys := podFlows(ip, 1000)
	root.put4(t, keys)
	indexFlows(td.Daemon, ip, keys)
	held := holdSlot(t, td, root, 1_500_000)

	// Three requests for one IP while its flight waits for the slot: the
	// first starts it, the others join it; the third goes away early without
	// cancelling the flight the others still wait for.
	type answer struct {
		resp *api.ScrubResponse
		err  error
	}
	a, b, c := make(chan answer, 1), make(chan answer, 1), make(chan answer, 1)
	send := func(ctx context.Context, ch chan answer) {
		// An operator's scrub (no container): an ADD of an IP no DEL
		// released would sweep (ownership.go).
		r, err := td.c.Scrub(ctx, api.ScrubRequest{IPs: []netip.Addr{ip}, Reason: scrub.ReasonDel})
		ch <- answer{r, err}
	}
	go send(context.Background(), a)
	waitFor(t, "the first request's flight", func() bool { return td.flights.running() == 2 })
	go send(context.Background(), b)
	leaving, leave := context.WithCancel(context.Background())
	defer leave()
	go send(leaving, c)
	waitFor(t, "three callers on the flight", func() bool { return waiters(td, ip) == 3 })
	leave() // the third caller goes away while the flight is still queued
	ac := <-c
	if e, ok := client.APIError(ac.err); ok && e.Code == api.CodeCancelled {
		// The daemon answered before the caller hung up.
	} else if !errors.Is(ac.err, context.Canceled) {
		t.Errorf("request whose caller went away: %v, want cancelled", ac.err)
	}
	waitFor(t, "the third caller to leave the flight", func() bool { return waiters(td, ip) == 2 })
	if err := <-held; err != nil {
		t.Fatalf("holder scrub: %v", err)
	}
	aa, ab := <-a, <-b
	if aa.err != nil || ab.err != nil {
		t.Fatalf("shared scrub: %v / %v", aa.err, ab.err)
	}
	ra, rb := aa.resp.Results[0], ab.resp.Results[0]
	if ra.Total != len(keys) || rb.Total != len(keys) {
		t.Errorf("shared scrub answers deleted %d and %d, want %d each (one scrub, one answer)", ra.Total, rb.Total, len(keys))
	}
	if n := root.present4(t, keys); n != 0 {
		t.Errorf("%d entries left", n)
	}
	if got := counterValue(t, td, "ctscrub_scrub_shared_total", nil); got != 2 {
		t.Errorf("ctscrub_scrub_shared_total %v, want 2 (two requests joined the first)", got)
	}
	// Deleted once, not once per caller.
	del := counterValue(t, td, "ctscrub_scrub_deleted_entries_total", map[string]string{"method": "index"})
	if int(del) != len(keys) {
		t.Errorf("deleted-entries counter for the index path: %v, want %d", del, len(keys))
	}
}

// waiters is the number of callers waiting on ip's flight (0: none).
func waiters(td *testDaemon, ip netip.Addr) int {
	td.flights.mu.Lock()
	defer td.flights.mu.Unlock()
	if f := td.flights.m[flightKey{ip: ip}]; f != nil {
		return f.waiters
	}
	return 0
}

func counterValue(t *testing.T, td *testDaemon, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := td.Gatherer().Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			for k, v := range labels {
				found := false
				for _, lp := range m.GetLabel() {
					if lp.GetName() == k && lp.GetValue() == v {
						found = true
					}
				}
				if !found {
					continue next
				}
			}
			if m.Counter != nil {
				sum += m.Counter.GetValue()
			} else if m.Gauge != nil {
				sum += m.Gauge.GetValue()
			} else if m.Histogram != nil {
				sum += float64(m.Histogram.GetSampleCount())
			}
		}
	}
	return sum
}

func TestQueueFullTryAgain(t *testing.T) {
	root := newCTRoot(t, 1<<21)
	cfg := testConfig(t, root)
	cfg.MaxInFlight, cfg.QueueLimit = 1, 1
	td := startDaemon(t, cfg)
	// The test takes the only run slot itself, so the first request stays
	// admitted and queued for as long as the test wants (a slow sweep as
	// the holder raced the second request on a loaded machine).
	td.slots <- struct{}{}
	held := make(chan error, 1)
	go func() {
		_, err := td.c.Scrub(context.Background(), api.ScrubRequest{IPs: []netip.Addr{mustAddr("10.244.200.1")}, Reason: scrub.ReasonDel})
		held <- err
	}()
	waitFor(t, "the first request to be admitted and queued", func() bool { return td.admitted.Load() == 1 })
	start := time.Now()
	// Bounded: a daemon that queued this request instead of refusing it
	// would otherwise hang the test.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := td.c.Scrub(ctx, api.ScrubRequest{IPs: []netip.Addr{mustAddr("10.244.9.9")}, Reason: scrub.ReasonAdd})
	refusedAfter := time.Since(start)
	e, ok := client.APIError(err)
	if !ok || e.Code != api.CodeTryAgain {
		t.Fatalf("request past the queue bound: %v, want %s", err, api.CodeTryAgain)
	}
	<-td.slots
	if err := <-held; err != nil {
		t.Fatalf("holder: %v", err)
	}
	t.Logf("refused after %s while the queue was full", refusedAfter)
	if got := counterValue(t, td, "ctscrub_scrub_refused_total", map[string]string{"code": api.CodeTryAgain}); got != 1 {
		t.Errorf("ctscrub_scrub_refused_total{code=try_again} %v, want 1", got)
	}
	// Once the queue has room again, the same request is served.
	if _, err := td.c.Scrub(context.Background(), api.ScrubRequest{IPs: []netip.Addr{mustAddr("10.244.9.9")}, Reason: scrub.ReasonAdd}); err != nil {
		t.Errorf("retry after the queue drained: %v", err)
	}
}

// A short deadline cancels a slow sweep; the retry completes it.
func TestDeadlineCancelsSweepAndRetryCompletes(t *testing.T) {
	const bulk = 3_000_000
	root := newCTRoot(t, 1<<22)
	td := startDaemon(t, testConfig(t, root))
	root.put4(t, background(bulk))
	ip := mustAddr("10.244.4.4") // never indexed: incomplete, so it sweeps
	keys := podFlows(ip, 1000)
	root.put4(t, keys)

	const budget = 200 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), budget)
	defer cancel()
	dl, _ := ctx.Deadline()
	_, err := td.c.Scrub(ctx, api.ScrubRequest{IPs: []netip.Addr{ip}, Reason: scrub.ReasonDel})
	late := time.Since(dl)
	// The daemon stops the work a little before the deadline so that its
	// answer (cancelled, with partial results) arrives in time. On a loaded
	// machine the answer may still come too late for the caller, which then
	// sees its own deadline error; the daemon's log line tells what it did.
	if e, ok := client.APIError(err); ok {
		if e.Code != api.CodeCancelled {
			t.Fatalf("sweep of %d entries with a %s deadline: %v, want %s", bulk, budget, err, api.CodeCancelled)
		}
		if len(e.Results) != 1 || e.Results[0].Outcome != scrub.Cancelled || e.Results[0].Method != scrub.MethodSweep {
			t.Errorf("cancelled answer carries %+v, want one cancelled sweep result", e.Results)
		}
		t.Logf("answer %s relative to the deadline; partial: %d deleted", late, e.Results[0].Total)
	} else if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("sweep of %d entries with a %s deadline: %v, want cancelled", bulk, budget, err)
	} else {
		t.Logf("the daemon's answer came after the caller's deadline (machine loaded?)")
	}
	// The work itself stopped: the daemon holds no scrub any more.
	waitFor(t, "the cancelled sweep to leave the daemon", func() bool { return td.flights.running() == 0 && td.admitted.Load() == 0 })
	if st := td.Index().State(ip); st.Complete {
		t.Errorf("IP marked complete after a cancelled sweep")
	}
	lines := td.logs.waitScrubLines(t, 1)
	if len(lines) != 1 || lines[0]["result"] != string(scrub.Cancelled) {
		t.Fatalf("scrub log lines %v, want one cancelled scrub", lines)
	}
	ws, _ := time.Parse(time.RFC3339Nano, fmt.Sprint(lines[0]["work_start"]))
	we, _ := time.Parse(time.RFC3339Nano, fmt.Sprint(lines[0]["work_end"]))
	t.Logf("the sweep ran %s of a %s budget and stopped %s after the caller's deadline", we.Sub(ws), budget, we.Sub(dl))
	if n := root.present4(t, keys); n == 0 {
		t.Errorf("a sweep cancelled after %s already deleted every entry of the IP: the test's map is too small to be slow", budget)
	}

	resp, err := td.c.Scrub(context.Background(), api.ScrubRequest{IPs: []netip.Addr{ip}, Reason: scrub.ReasonDel})
	if err != nil {
		t.Fatalf("retry: %v", err)
	}
	if r := resp.Results[0]; r.Outcome != scrub.Complete {
		t.Errorf("retry: %+v", r)
	}
	if n := root.present4(t, keys); n != 0 {
		t.Errorf("retry left %d of the IP's %d entries", n, len(keys))
	}
	if st := td.Index().State(ip); !st.Complete {
		t.Errorf("IP not complete after a full sweep: %s", st.Incomplete)
	}
}

func TestConfigFile(t *testing.T) {
	dir := t.TempDir()
	y := filepath.Join(dir, "c.yaml")
	os.WriteFile(y, []byte("pod_cidrs: [10.0.0.0/16, \"fd00::/104\"]\nshutdown_grace: 2s\nqueue_limit: 10\nmax_in_flight: 5\n"), 0o600)
	cfg := DefaultConfig()
	if err := LoadConfigFile(y, &cfg); err != nil {
		t.Fatal(err)
	}
	cidrs, err := cfg.Validate()
	if err != nil || len(cidrs) != 2 || cfg.ShutdownGrace.Duration != 2*time.Second || cfg.QueueLimit != 10 {
		t.Errorf("yaml config: %+v %v %v", cfg, cidrs, err)
	}
	if cfg.Socket != api.DefaultSocket || cfg.CTRoot != ctmap.DefaultRoot {
		t.Errorf("defaults lost: %+v", cfg)
	}
	j := filepath.Join(dir, "c.json")
	os.WriteFile(j, []byte(`{"pod_cidrs": ["10.1.0.0/16"], "backends": "cilium"}`), 0o600)
	cfg = DefaultConfig()
	if err := LoadConfigFile(j, &cfg); err != nil || cfg.Backends != "cilium" {
		t.Errorf("json config: %+v %v", cfg, err)
	}
	bad := filepath.Join(dir, "bad.yaml")
	os.WriteFile(bad, []byte("pod_cidr: 10.0.0.0/16\n"), 0o600)
	if err := LoadConfigFile(bad, &cfg); err == nil || !strings.Contains(err.Error(), "pod_cidr") {
		t.Errorf("misspelt key: %v, want an error naming it", err)
	}
	for _, tc := range []struct {
		cidrs []string
		want  string
	}{
		{nil, "no pod CIDRs"},
		{[]string{"0.0.0.0/0"}, "covers every address"},
		{[]string{"10.0.0.0/33"}, "pod CIDR"},
	} {
		c := DefaultConfig()
		c.PodCIDRs = tc.cidrs
		if _, err := c.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("cidrs %v: %v, want %q", tc.cidrs, err, tc.want)
		}
	}
	for _, n := range []int{1000, 1 << 10, 3 << 20, -4096} {
		c := DefaultConfig()
		c.PodCIDRs = []string{testCIDR}
		c.RingBytes = n
		if _, err := c.Validate(); err == nil || !strings.Contains(err.Error(), "ring_bytes") {
			t.Errorf("ring_bytes %d: %v, want an error naming it", n, err)
		}
	}
	c := DefaultConfig()
	c.PodCIDRs = []string{testCIDR}
	c.RingBytes = 1 << 20
	if _, err := c.Validate(); err != nil {
		t.Errorf("ring_bytes 1 MiB: %v", err)
	}
}

func httpGet(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// /metrics carries the scrub and CT metrics with their labels; health
// endpoints answer; pprof is off unless asked for.
func TestMetricsEndpoint(t *testing.T) {
	for _, pprofOn := range []bool{false, true} {
		root := newCTRoot(t, 1<<12)
		cfg := testConfig(t, root)
		cfg.MetricsAddr = "127.0.0.1:0"
		cfg.Pprof = pprofOn
		td := startDaemon(t, cfg)
		ip := mustAddr("10.244.8.8")
		keys := podFlows(ip, 10)
		root.put4(t, keys)
		if _, err := td.c.Scrub(context.Background(), api.ScrubRequest{IPs: []netip.Addr{ip}, Reason: scrub.ReasonDel}); err != nil {
			t.Fatal(err)
		}
		if _, err := td.c.CTStats(context.Background()); err != nil {
			t.Fatal(err)
		}
		base := "http://" + td.MetricsAddr()
		code, body := httpGet(t, base+"/metrics")
		if code != 200 {
			t.Fatalf("/metrics: %d", code)
		}
		for _, want := range []string{
			`ctscrub_scrub_duration_seconds_bucket{backend="cilium",method="sweep",reason="del",result="complete",le="0.0001"}`,
			`ctscrub_scrub_duration_seconds_bucket{backend="cilium",method="sweep",reason="del",result="complete",le="100"} 1`,
			`ctscrub_scrub_deleted_entries_total{backend="cilium",map="cilium_ct4_global",method="sweep"} 10`,
			`ctscrub_scrub_deleted_entries_total{backend="cilium",map="cilium_ct_any4_global",method="sweep"} 10`,
			`ctscrub_scrubs_in_flight 0`,
			`ctscrub_ready 1`,
			`ctscrub_index_keys{backend="cilium"} 0`,
			`ctscrub_index_incomplete_ips{backend="cilium"}`,
			`ctscrub_index_lost_total{backend="cilium"} 0`,
			`ctscrub_ct_max_entries{backend="cilium",map="cilium_ct4_global"} 4096`,
			`ctscrub_ct_entries{backend="cilium",map="cilium_ct4_global",state=`,
			"\ngo_gc_heap_live_bytes ", // the soak's leak signal (docs/soak.md)
			"\nprocess_resident_memory_bytes ",
		} {
			if !strings.Contains(body, want) {
				t.Errorf("/metrics lacks %s", want)
			}
		}
		if code, _ := httpGet(t, base+"/healthz"); code != 200 {
			t.Errorf("/healthz: %d", code)
		}
		if code, _ := httpGet(t, base+"/readyz"); code != 200 {
			t.Errorf("/readyz: %d", code)
		}
		code, _ = httpGet(t, base+"/debug/pprof/")
		if pprofOn && code != 200 || !pprofOn && code != 404 {
			t.Errorf("pprof %v: /debug/pprof/ answered %d", pprofOn, code)
		}
	}
}

// SIGTERM (Run's context ending) stops accepting at once, gives in-flight
// scrubs the grace, then cancels them: a sweep longer than the grace answers
// "cancelled" with its partial results, and the IP stays incomplete.
//
// The sweep of 3 M entries takes seconds; when the test goroutine is
// descheduled for longer than that between seeing the sweep in flight and
// stopping the daemon, the sweep ends inside its grace and the attempt
// proves nothing (its log says when the work ended): the test tries again,
// three times at most. A daemon that does not cancel at the grace fails
// every attempt.
func TestShutdownCancelsAfterGrace(t *testing.T) {
	root := newCTRoot(t, 1<<22)
	root.put4(t, background(3_000_000))
	for attempt := 1; !shutdownAfterGrace(t, root, attempt == 3); attempt++ {
		t.Logf("attempt %d: the sweep's work ended inside its grace (the test was descheduled past it); trying again", attempt)
	}
}

// shutdownAfterGrace is one attempt of TestShutdownCancelsAfterGrace; it
// reports false when the sweep ended inside its grace and last is false.
func shutdownAfterGrace(t *testing.T, root *ctRoot, last bool) bool {
	ip := mustAddr("10.244.10.10")
	keys := podFlows(ip, 500)
	root.put4(t, keys)
	cfg := testConfig(t, root)
	cfg.ShutdownGrace.Duration = 100 * time.Millisecond
	logs := &logBuffer{}
	d, err := Open(cfg, slog.New(slog.NewJSONHandler(logs, nil)), "test")
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	c := client.New(cfg.Socket)
	waitServing(t, c, done)

	answer := make(chan error, 1)
	go func() {
		_, err := c.Scrub(context.Background(), api.ScrubRequest{IPs: []netip.Addr{ip}, Reason: scrub.ReasonDel})
		answer <- err
	}()
	waitFor(t, "the sweep to be in flight", func() bool { return d.flights.running() == 1 })
	stopAt := time.Now()
	stop()
	err = <-answer
	took := time.Since(stopAt)
	if err == nil && !last {
		if lines := logs.scrubLines(t); len(lines) == 1 {
			we, perr := time.Parse(time.RFC3339Nano, fmt.Sprint(lines[0]["work_end"]))
			if perr == nil && we.Before(stopAt.Add(cfg.ShutdownGrace.Duration)) {
				stop()
				<-done
				return false
			}
		}
	}
	if e, ok := client.APIError(err); !ok || e.Code != api.CodeCancelled || len(e.Results) != 1 {
		t.Fatalf("in-flight sweep at shutdown: %v, want cancelled with results", err)
	}
	t.Logf("cancelled answer %s after the stop (grace %s)", took, cfg.ShutdownGrace.Duration)
	if lines := logs.scrubLines(t); len(lines) == 1 {
		we, _ := time.Parse(time.RFC3339Nano, fmt.Sprint(lines[0]["work_end"]))
		t.Logf("the sweep's work ended %s after the grace ran out", we.Sub(stopAt.Add(cfg.ShutdownGrace.Duration)))
	}
	if took < cfg.ShutdownGrace.Duration {
		t.Errorf("the scrub was cancelled %s after the stop, before its grace of %s", took, cfg.ShutdownGrace.Duration)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after shutdown")
	}
	if _, err := c.Status(context.Background()); !client.IsUnavailable(err) {
		t.Errorf("status after shutdown: %v, want unavailable", err)
	}
	if st := d.Index().State(ip); st.Complete {
		t.Errorf("IP complete after a cancelled sweep")
	}
	if n := root.present4(t, keys); n == 0 {
		t.Errorf("the sweep finished despite the cancel: map too small to test the grace")
	}
	return true
}

// IPs that need the sweep at the same moment share one pass: eight
// requests arriving while a first sweep runs are all served by the next
// pass, two passes in all.
func TestSweepsShareAPass(t *testing.T) {
	root := newCTRoot(t, 1<<22)
	root.put4(t, background(3_000_000))
	td := startDaemon(t, testConfig(t, root))
	var sw *cilium.Sweeper
	for _, b := range td.Backends() {
		if s, ok := b.(interface{ Sweeper() *cilium.Sweeper }); ok {
			sw = s.Sweeper()
		}
	}
	if sw == nil {
		t.Fatal("no Cilium backend with a Sweeper")
	}
	first := mustAddr("10.244.11.1")
	var ips []netip.Addr
	var keys []ctmap.CTKey4
	for i := range 8 {
		ip := netip.AddrFrom4([4]byte{10, 244, 11, byte(10 + i)})
		ips = append(ips, ip)
		keys = append(keys, podFlows(ip, 100)...)
	}
	root.put4(t, keys)
	before := sw.Passes()
	errs := make(chan error, 9)
	send := func(ip netip.Addr) {
		_, err := td.c.Scrub(context.Background(), api.ScrubRequest{IPs: []netip.Addr{ip}, Reason: scrub.ReasonDel})
		errs <- err
	}
	go send(first)
	waitFor(t, "the first sweep to run", func() bool { _, running := sw.Waiting(); return running == 1 })
	for _, ip := range ips {
		go send(ip)
	}
	waitFor(t, "eight callers to wait for the next pass", func() bool {
		pending, running := sw.Waiting()
		return pending == 8 || running == 0
	})
	if pending, _ := sw.Waiting(); pending != 8 {
		t.Logf("the first pass ended before all eight requests arrived (machine too busy?)")
	}
	for range 9 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if n := sw.Passes() - before; n != 2 {
		t.Errorf("nine sweeping scrubs took %d passes, want 2 (one running, one shared by the eight that arrived during it)", n)
	}
	if n := root.present4(t, keys); n != 0 {
		t.Errorf("%d entries left", n)
	}
}
