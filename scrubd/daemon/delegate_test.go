package daemon

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// delegatePost sends body to the delegate socket and returns the status and
// body of the answer, or the error when there was none.
func delegatePost(sock, body string) (int, []byte, error) {
	hc := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}}
	resp, err := hc.Post("http://scrubd"+api.PathDelegateScrub, "application/json", strings.NewReader(body))
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

func delegateBody(version int, timeoutMS int, ips ...string) string {
	b, _ := json.Marshal(map[string]any{"api_version": version, "caller": "cilium-agent", "event": "endpoint-create",
		"endpoint_id": 1234, "ips": ips, "timeout_ms": timeoutMS, "a_field_from_the_future": true})
	return string(b)
}

// natRoot pins Cilium's IPv4 SNAT map beside root's CT maps.
func natRoot(t *testing.T, root *ctRoot) *ebpf.Map {
	t.Helper()
	m, err := ebpf.NewMap(ctmap.NATSpec(false, 4096))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	if err := m.Pin(filepath.Join(root.dir, ctmap.NATName4)); err != nil {
		t.Fatal(err)
	}
	return m
}

// putSNAT writes, for each OUT key of keys, the forward and reverse SNAT
// mappings Cilium's datapath makes for it, and returns them.
func putSNAT(t *testing.T, nat *ebpf.Map, keys []ctmap.CTKey4) []ctmap.CTKey4 {
	t.Helper()
	node := netip.MustParseAddr("172.18.0.2")
	var out []ctmap.CTKey4
	for i, k := range keys {
		if k.Flags() != ctmap.FlagOut {
			continue
		}
		port := uint16(30000 + i)
		fwd := ctmap.NewKey4(k.SAddr(), k.DAddr(), k.DPort(), k.SPort(), k.NextHdr(), ctmap.FlagOut)
		rev := ctmap.NewKey4(node, k.SAddr(), port, k.DPort(), k.NextHdr(), ctmap.FlagIn)
		v := make([]byte, ctmap.NATEntrySize4)
		a := node.As4()
		copy(v[32:], a[:])
		binary.BigEndian.PutUint16(v[36:], port)
		r := make([]byte, ctmap.NATEntrySize4)
		a = k.DAddr().As4()
		copy(r[32:], a[:])
		binary.BigEndian.PutUint16(r[36:], k.SPort())
		if err := nat.Put(fwd, v); err != nil {
			t.Fatal(err)
		}
		if err := nat.Put(rev, r); err != nil {
			t.Fatal(err)
		}
		out = append(out, fwd, rev)
	}
	return out
}

func startDelegate(t *testing.T, root *ctRoot) (*testDaemon, string) {
	t.Helper()
	cfg := testConfig(t, root)
	cfg.DelegateSocket = filepath.Join(t.TempDir(), "delegate", "delegate.sock")
	cfg.CNIConfDir = chainedConfDir(t)
	td := startDaemon(t, cfg)
	return td, cfg.DelegateSocket
}

// The delegate contract (docs/delegate-api.md), case by case, on a real
// daemon over real CT and SNAT maps.
func TestDelegateContract(t *testing.T) {
	root := newCTRoot(t, 1<<16)
	nat := natRoot(t, root)
	td, sock := startDelegate(t, root)
	pod := mustAddr("10.244.3.7")
	flows := podFlows(pod, 50)
	root.put4(t, flows)
	mappings := putSNAT(t, nat, flows)
	indexFlows(td.Daemon, pod, flows)

	t.Run("other api_version is 400", func(t *testing.T) {
		status, body, err := delegatePost(sock, delegateBody(2, 1000, pod.String()))
		if err != nil || status != http.StatusBadRequest || !strings.Contains(string(body), `"error":"api_version 2`) {
			t.Errorf("api_version 2: %d %s %v", status, body, err)
		}
		if n := root.present4(t, flows); n != len(flows) {
			t.Errorf("a refused request deleted %d entries", len(flows)-n)
		}
	})
	t.Run("malformed is 400", func(t *testing.T) {
		for _, body := range []string{`{`, delegateBody(1, 1000, "not-an-ip"), delegateBody(1, -5, pod.String()), delegateBody(1, 1000)} {
			if status, b, err := delegatePost(sock, body); err != nil || status != http.StatusBadRequest || !strings.Contains(string(b), `"error":`) {
				t.Errorf("%s: %d %s %v", body, status, b, err)
			}
		}
	})
	t.Run("only the delegate path", func(t *testing.T) {
		hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		}}}
		resp, err := hc.Get("http://scrubd" + api.PathStatus)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusNotFound {
			t.Errorf("GET %s on the delegate socket: %d, want 404", api.PathStatus, resp.StatusCode)
		}
	})
	t.Run("complete when CT and SNAT are clean", func(t *testing.T) {
		outside := "192.0.2.99"
		status, body, err := delegatePost(sock, delegateBody(1, 5000, pod.String(), outside))
		if err != nil || status != http.StatusOK {
			t.Fatalf("%d %s %v", status, body, err)
		}
		var resp api.DelegateResponse
		if err := json.Unmarshal(body, &resp); err != nil {
			t.Fatal(err)
		}
		if resp.APIVersion != 1 || len(resp.IPs) != 2 {
			t.Fatalf("answer %s", body)
		}
		got := resp.IPs[0]
		if got.IP != pod.String() || !got.Complete || got.CTDeleted != len(flows) || got.NATDeleted != len(mappings) || got.Reason != "" {
			t.Errorf("pod IP: %+v, want complete with %d CT entries and %d SNAT mappings deleted", got, len(flows), len(mappings))
		}
		if n := root.present4(t, flows); n != 0 {
			t.Errorf("%d CT entries left", n)
		}
		var v [ctmap.NATEntrySize4]byte
		for _, k := range mappings {
			if nat.Lookup(k, &v) == nil {
				t.Errorf("SNAT mapping %s left", k)
			}
		}
		// An IP that is not a pod IP is not scrubbed, and says why.
		if o := resp.IPs[1]; o.IP != outside || o.Complete || !strings.Contains(o.Reason, "outside the pod CIDRs") {
			t.Errorf("non-pod IP: %+v, want complete:false with the reason", o)
		}
		if n := counterValue(t, td, "ctscrub_delegate_requests_total", map[string]string{"caller": "cilium-agent", "event": "endpoint-create", "outcome": "incomplete"}); n != 1 {
			t.Errorf("ctscrub_delegate_requests_total{outcome=incomplete} = %v, want 1", n)
		}
		if n := counterValue(t, td, "ctscrub_scrub_nat_deleted_total", map[string]string{"map": ctmap.NATName4}); n != float64(len(mappings)) {
			t.Errorf("ctscrub_scrub_nat_deleted_total = %v, want %d", n, len(mappings))
		}
	})
}

// A scrub that cannot finish within timeout_ms is answered within it with
// complete:false, or not at all: never late. The IP is not indexed, so its
// scrub sweeps a table too large to sweep in time.
func TestDelegateDeadline(t *testing.T) {
	root := newCTRoot(t, 1<<20)
	root.put4(t, background(1<<20-1<<16))
	_, sock := startDelegate(t, root)
	const timeout = 20 * time.Millisecond
	for range 3 {
		start := time.Now()
		status, body, err := delegatePost(sock, delegateBody(1, int(timeout/time.Millisecond), "10.244.9.9"))
		took := time.Since(start)
		if err != nil {
			t.Logf("no answer after %v (allowed: past the deadline scrubd does not answer): %v", took, err)
			continue
		}
		var resp api.DelegateResponse
		if status != http.StatusOK || json.Unmarshal(body, &resp) != nil || len(resp.IPs) != 1 {
			t.Fatalf("%d %s", status, body)
		}
		if resp.IPs[0].Complete || resp.IPs[0].Reason == "" {
			t.Errorf("a sweep of %d entries reported complete within %v: %+v", 1<<20-1<<16, timeout, resp.IPs[0])
		}
		// The answer left scrubd before the deadline; reading it here may
		// lag on a loaded machine, so the bound checked is generous.
		if took > timeout+200*time.Millisecond {
			t.Errorf("answered after %v, deadline %v", took, timeout)
		}
		t.Logf("answered after %v: %+v", took, resp.IPs[0])
	}
}

const delegatePeerEnv = "CTSCRUB_TEST_DELEGATE_SOCKET"

// TestMain: run as the child TestDelegateRefusesNonRoot starts as nobody
// (delegatePeerEnv set), the test binary calls the delegate socket once and
// exits instead of running the tests; a function of TestMain, not a test
// that skips, so no run reports a skip for it.
func TestMain(m *testing.M) {
	if sock := os.Getenv(delegatePeerEnv); sock != "" {
		status, body, err := delegatePost(sock, delegateBody(1, 1000, "10.244.3.8"))
		fmt.Printf("uid=%d status=%d body=%s err=%v\n", os.Getuid(), status, bytes.TrimSpace(body), err)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// Only root may call the delegate: a caller whose SO_PEERCRED uid is not 0
// is refused (403) even when the socket's modes let it connect. The caller
// is this test binary run as nobody.
func TestDelegateRefusesNonRoot(t *testing.T) {
	root := newCTRoot(t, 1024)
	dir, err := os.MkdirTemp("", "ctscrub-delegate-peer-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(t, root)
	cfg.DelegateSocket = filepath.Join(dir, "delegate", "delegate.sock")
	cfg.CNIConfDir = chainedConfDir(t)
	startDaemon(t, cfg)
	if st, err := os.Stat(cfg.DelegateSocket); err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("delegate socket mode: %v %v, want 0600", st.Mode(), err)
	}
	if err := os.Chmod(filepath.Dir(cfg.DelegateSocket), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(cfg.DelegateSocket, 0o666); err != nil {
		t.Fatal(err)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "daemon.test")
	if err := os.WriteFile(bin, data, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin)
	cmd.Dir = dir
	cmd.Env = []string{delegatePeerEnv + "=" + cfg.DelegateSocket, "PATH=/usr/bin:/bin"}
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child as nobody: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "uid=65534 status=403") || !strings.Contains(string(out), `"code":"forbidden"`) {
		t.Errorf("nobody on the delegate socket: want 403 forbidden, got:\n%s", out)
	}
}

// An SNAT map scrubd cannot use (here: a value layout it does not know)
// means the mappings of the deleted OUT entries may be left: the CT entries
// are scrubbed, but no IP is complete, and the reason names the map.
func TestDelegateIncompleteWhenSNATUnusable(t *testing.T) {
	root := newCTRoot(t, 1<<16)
	bad := ctmap.NATSpec(false, 4096)
	bad.ValueSize = 48
	m, err := ebpf.NewMap(bad)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.Pin(filepath.Join(root.dir, ctmap.NATName4)); err != nil {
		t.Fatal(err)
	}
	td, sock := startDelegate(t, root)
	pod := mustAddr("10.244.3.9")
	flows := podFlows(pod, 10)
	root.put4(t, flows)
	indexFlows(td.Daemon, pod, flows)
	status, body, err := delegatePost(sock, delegateBody(1, 5000, pod.String()))
	if err != nil || status != http.StatusOK {
		t.Fatalf("%d %s %v", status, body, err)
	}
	var resp api.DelegateResponse
	if err := json.Unmarshal(body, &resp); err != nil || len(resp.IPs) != 1 {
		t.Fatalf("answer %s: %v", body, err)
	}
	got := resp.IPs[0]
	if got.Complete || !strings.Contains(got.Reason, ctmap.NATName4) || got.CTDeleted != len(flows) {
		t.Errorf("%+v: want complete:false naming %s, with the %d CT entries deleted", got, ctmap.NATName4, len(flows))
	}
}

// CT maps other than the global ones (here a per-endpoint map,
// cilium_ct4_<endpoint ID, 5 digits>) may hold entries scrubd does not scrub: no IP is
// complete while one is pinned, and Cilium keeps walking.
func TestDelegateIncompleteWithMapsOutsideGlobal(t *testing.T) {
	root := newCTRoot(t, 1<<16)
	local, err := ebpf.NewMap(ctmap.TCP4.Spec(1024))
	if err != nil {
		t.Fatal(err)
	}
	defer local.Close()
	if err := local.Pin(filepath.Join(root.dir, "cilium_ct4_01234")); err != nil {
		t.Fatal(err)
	}
	td, sock := startDelegate(t, root)
	pod := mustAddr("10.244.3.10")
	flows := podFlows(pod, 10)
	root.put4(t, flows)
	indexFlows(td.Daemon, pod, flows)
	status, body, err := delegatePost(sock, delegateBody(1, 5000, pod.String()))
	if err != nil || status != http.StatusOK {
		t.Fatalf("%d %s %v", status, body, err)
	}
	var resp api.DelegateResponse
	if err := json.Unmarshal(body, &resp); err != nil || len(resp.IPs) != 1 {
		t.Fatalf("answer %s: %v", body, err)
	}
	if got := resp.IPs[0]; got.Complete || !strings.Contains(got.Reason, "per-endpoint CT maps") || got.CTDeleted != len(flows) {
		t.Errorf("%+v: want complete:false for the per-endpoint CT maps, with the %d global entries deleted", got, len(flows))
	}
}

// An address a pod scrubd never saw used after its release (the conflist
// not chaining ctscrub for a while): the delegate must not answer complete
// from the index, which lacks that pod's flows. Fails without
// delegateOwnership: the index scrub leaves the unseen pod's entries and
// answers complete.
func TestDelegateDistrustsAnUnseenOwner(t *testing.T) {
	root := newCTRoot(t, 1<<16)
	td, sock := startDelegate(t, root)
	pod := mustAddr("10.244.3.9")
	seen := podFlows(pod, 20)
	root.put4(t, seen)
	indexFlows(td.Daemon, pod, seen)
	releaseIP(td.Daemon, pod) // a DEL scrubd saw let it go
	// Then an owner scrubd never indexed: its flows are in the CT only, and
	// the conflist watch's sign of it ends every release.
	unseen := podFlows(pod, 60)[20:]
	root.put4(t, unseen)
	td.Daemon.unseenOwner("test: the conflist did not chain ctscrub")

	for _, event := range []string{"endpoint-create", "endpoint-delete"} {
		root.put4(t, unseen)
		b, _ := json.Marshal(map[string]any{"api_version": 1, "caller": "cilium-agent", "event": event,
			"endpoint_id": 7, "ips": []string{pod.String()}, "timeout_ms": 5000})
		status, body, err := delegatePost(sock, string(b))
		if err != nil || status != http.StatusOK {
			t.Fatalf("%s: %d %s %v", event, status, body, err)
		}
		var resp api.DelegateResponse
		if err := json.Unmarshal(body, &resp); err != nil || len(resp.IPs) != 1 {
			t.Fatalf("%s: answer %s (%v)", event, body, err)
		}
		left := root.present4(t, unseen)
		if got := resp.IPs[0]; got.Complete && left != 0 {
			t.Errorf("%s: complete with %d entries of the unseen owner left: %+v", event, left, got)
		}
		if left != 0 {
			t.Errorf("%s: %d entries of the unseen owner left", event, left)
		}
	}
}
