package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/ctscrub/ctscrub/scrubd/api"
)

// The test binary doubles as the plugin binary so the tests can go through
// skel (environment, stdin, exit code, error JSON) without a separate build.
func TestMain(m *testing.M) {
	if os.Getenv("CTSCRUB_TEST_AS_PLUGIN") == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

var allVersions = []string{"0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"}

// prevResult is what bridge + host-local hand to the next plugin: a bridge, a
// host-side veth and the container's eth0, with IPv4 and IPv6 on eth0.
func prevResult(ver string) map[string]any {
	ip := func(addr, gw string) map[string]any {
		m := map[string]any{"address": addr, "gateway": gw, "interface": 2}
		if !strings.HasPrefix(ver, "1.") {
			if strings.Contains(addr, ":") {
				m["version"] = "6"
			} else {
				m["version"] = "4"
			}
		}
		return m
	}
	return map[string]any{
		"cniVersion": ver,
		"interfaces": []any{
			map[string]any{"name": "cni0", "mac": "aa:bb:cc:00:00:01"},
			map[string]any{"name": "veth1234", "mac": "aa:bb:cc:00:00:02"},
			map[string]any{"name": "eth0", "mac": "aa:bb:cc:00:00:03", "sandbox": "/var/run/netns/pod1"},
		},
		"ips": []any{ip("10.22.0.5/24", "10.22.0.1"), ip("fd22::5/64", "fd22::1")},
		"dns": map[string]any{},
	}
}

func stdin(t *testing.T, ver string, fields map[string]any, prev map[string]any) []byte {
	t.Helper()
	m := map[string]any{"cniVersion": ver, "name": "pods", "type": "ctscrub"}
	for k, v := range fields {
		m[k] = v
	}
	if prev != nil {
		m["prevResult"] = prev
	}
	b, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func cmdArgs(data []byte) *skel.CmdArgs {
	return &skel.CmdArgs{ContainerID: "c0ffee", Netns: "/var/run/netns/pod1", IfName: "eth0", Path: "/opt/cni/bin", StdinData: data}
}

// run calls one of the plugin's commands and returns what it printed.
func run(t *testing.T, cmd func(*skel.CmdArgs) error, args *skel.CmdArgs) (string, string, error) {
	t.Helper()
	var out, errOut bytes.Buffer
	stdout, stderr = &out, &errOut
	defer func() { stdout, stderr = os.Stdout, os.Stderr }()
	err := cmd(args)
	return out.String(), errOut.String(), err
}

func missingSocket(t *testing.T) string { return filepath.Join(t.TempDir(), "scrubd.sock") }

func TestAddWithoutPrevResult(t *testing.T) {
	for _, ver := range allVersions {
		out, _, err := run(t, cmdAdd, cmdArgs(stdin(t, ver, nil, nil)))
		e := mustCNIError(t, err, types.ErrInvalidNetworkConfig)
		if !strings.Contains(e.Msg, "chained plugin") || !strings.Contains(e.Msg, "assigns the pod's IPs") {
			t.Errorf("%s: message %q does not say ctscrub must be chained after an IP-assigning plugin", ver, e.Msg)
		}
		if out != "" {
			t.Errorf("%s: printed %q on failure", ver, out)
		}
	}
}

func TestAddPrevResultWithoutIPs(t *testing.T) {
	for _, ver := range allVersions {
		prev := prevResult(ver)
		delete(prev, "ips")
		_, _, err := run(t, cmdAdd, cmdArgs(stdin(t, ver, map[string]any{"socket": missingSocket(t)}, prev)))
		e := mustCNIError(t, err, types.ErrInvalidNetworkConfig)
		if !strings.Contains(e.Msg, "no IPs") {
			t.Errorf("%s: message %q does not say prevResult has no IPs", ver, e.Msg)
		}
	}
}

func TestAddBadConfig(t *testing.T) {
	for name, fields := range map[string]map[string]any{
		"unknown field":     {"scrubOnAdds": true},
		"bad failurePolicy": {"failurePolicy": "Ignore"},
	} {
		for _, cmd := range []func(*skel.CmdArgs) error{cmdAdd, cmdDel} {
			_, _, err := run(t, cmd, cmdArgs(stdin(t, "1.0.0", fields, prevResult("1.0.0"))))
			e := mustCNIError(t, err, types.ErrInvalidNetworkConfig)
			if !strings.Contains(e.Msg, "invalid config") {
				t.Errorf("%s: message %q", name, e.Msg)
			}
		}
	}
}

// Without scrubd, policy fail stops every command with 50 and names the
// socket; policy ignore passes prevResult through unchanged and logs why.
func TestDaemonSocketMissing(t *testing.T) {
	for _, ver := range allVersions {
		sock := missingSocket(t)
		fail := map[string]any{"socket": sock, "failurePolicy": "fail"}
		ignore := map[string]any{"socket": sock, "failurePolicy": "ignore"}

		out, _, err := run(t, cmdAdd, cmdArgs(stdin(t, ver, fail, prevResult(ver))))
		e := mustCNIError(t, err, types.ErrPluginNotAvailable)
		if !strings.Contains(e.Msg, sock) || !strings.Contains(e.Details, "start scrubd") || out != "" {
			t.Errorf("%s ADD fail: %q / %q, stdout %q", ver, e.Msg, e.Details, out)
		}
		_, _, err = run(t, cmdDel, cmdArgs(stdin(t, ver, fail, prevResult(ver))))
		mustCNIError(t, err, types.ErrPluginNotAvailable)
		// DEL without prevResult: from 0.4.0 on, the runtime has no
		// successful ADD on record (the cleanup of a failed ADD), so the pod
		// never ran and DEL lets the chain release the IP. Below 0.4.0 DEL
		// never gets prevResult, so nothing can be concluded: it fails.
		_, logged, err := run(t, cmdDel, cmdArgs(stdin(t, ver, fail, nil)))
		if ver >= "0.4.0" {
			if err != nil || !strings.Contains(logged, "the pod never ran") {
				t.Errorf("%s DEL without prevResult, no scrubd: %v, stderr %q", ver, err, logged)
			}
		} else {
			mustCNIError(t, err, types.ErrPluginNotAvailable)
		}

		out, logged, err = run(t, cmdAdd, cmdArgs(stdin(t, ver, ignore, prevResult(ver))))
		if err != nil {
			t.Fatalf("%s ADD ignore: %v", ver, err)
		}
		mustEqualResult(t, ver, out, prevResult(ver))
		if !strings.Contains(logged, "failurePolicy is \"ignore\"") || !strings.Contains(logged, sock) {
			t.Errorf("%s ADD ignore: stderr %q does not explain", ver, logged)
		}
		if _, _, err := run(t, cmdDel, cmdArgs(stdin(t, ver, ignore, nil))); err != nil {
			t.Errorf("%s DEL ignore: %v", ver, err)
		}

		if ver >= "0.4.0" {
			_, _, err = run(t, cmdCheck, cmdArgs(stdin(t, ver, fail, prevResult(ver))))
			mustCNIError(t, err, types.ErrPluginNotAvailable)
		}
		if ver == "1.1.0" {
			_, _, err = run(t, cmdStatus, cmdArgs(stdin(t, ver, fail, nil)))
			mustCNIError(t, err, types.ErrPluginNotAvailable)
			if _, _, err := run(t, cmdStatus, cmdArgs(stdin(t, ver, ignore, nil))); err != nil {
				t.Errorf("STATUS ignore: %v", err)
			}
			gc := map[string]any{"socket": sock, "cni.dev/valid-attachments": []any{map[string]any{"containerID": "a", "ifname": "eth0"}}}
			_, _, err = run(t, cmdGC, cmdArgs(stdin(t, ver, gc, nil)))
			mustCNIError(t, err, types.ErrPluginNotAvailable)
		}
	}
}

// mustEqualResult checks that the plugin printed prev unchanged at ver.
func mustEqualResult(t *testing.T, ver, out string, prev map[string]any) {
	t.Helper()
	var got, want any
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("%s: printed %q: %v", ver, out, err)
	}
	b, _ := json.Marshal(prev)
	if prev["cniVersion"] == ver {
		// At the config's version the plugin passes it on byte for byte.
		if err := json.Unmarshal(b, &want); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("%s: printed\n%s\nwant prevResult unchanged\n%s", ver, out, b)
		}
		return
	}
	// Converted by the CNI library: through its types once, so empty fields
	// drop out the same way on both sides.
	res, err := current.NewResultFromResult(mustCreate(t, ver, b))
	if err != nil {
		t.Fatal(err)
	}
	r, err := res.GetAsVersion(ver)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if err := r.PrintTo(&buf); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(buf.Bytes(), &want); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("%s: printed\n%s\nwant prevResult unchanged\n%s", ver, out, buf.String())
	}
	if !strings.Contains(out, `"cniVersion": "`+ver+`"`) && !strings.Contains(out, `"cniVersion":"`+ver+`"`) {
		t.Fatalf("%s: result not at the config's cniVersion: %s", ver, out)
	}
}

func mustCreate(t *testing.T, ver string, b []byte) types.Result {
	t.Helper()
	// The CNI library's own reading, independent of the plugin's.
	nc := types.NetConf{CNIVersion: ver}
	if err := json.Unmarshal(b, &nc.RawPrevResult); err != nil {
		t.Fatal(err)
	}
	if err := version.ParsePrevResult(&nc); err != nil {
		t.Fatal(err)
	}
	return nc.PrevResult
}

// faultDaemon serves scrubd's socket with a handler the test controls. It is
// a fault injection: a real scrubd that is this slow or refuses this way
// cannot be produced on demand; e2e/cni runs the real one.
type faultDaemon struct {
	mu        sync.Mutex
	deadlines []string // X-Ctscrub-Deadline of each request
	paths     []string
}

func startFaultDaemon(t *testing.T, h func(w http.ResponseWriter, r *http.Request)) (string, *faultDaemon) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "scrubd.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	d := &faultDaemon{}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		d.mu.Lock()
		d.deadlines = append(d.deadlines, r.Header.Get(api.DeadlineHeader))
		d.paths = append(d.paths, r.URL.Path)
		d.mu.Unlock()
		h(w, r)
	})}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	return sock, d
}

// A daemon slower than the plugin's timeout: the plugin gives up at its own
// deadline with "try again later" (11), and tells the daemon that deadline.
func TestDaemonSlowerThanTimeout(t *testing.T) {
	const slow = 3 * time.Second
	sock, d := startFaultDaemon(t, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-time.After(slow):
		case <-r.Context().Done():
		}
		w.Write([]byte(`{"results":[]}`))
	})
	for _, policy := range []string{"fail", "ignore"} {
		fields := map[string]any{"socket": sock, "timeout": "300ms", "failurePolicy": policy}
		start := time.Now()
		out, logged, err := run(t, cmdAdd, cmdArgs(stdin(t, "1.0.0", fields, prevResult("1.0.0"))))
		took := time.Since(start)
		if took >= slow {
			t.Errorf("%s: ADD took %s: it waited for the slow daemon instead of its 300ms timeout", policy, took)
		}
		switch policy {
		case "fail":
			e := mustCNIError(t, err, types.ErrTryAgainLater)
			if !strings.Contains(e.Msg, "timeout 300ms") || out != "" {
				t.Errorf("fail: %q, stdout %q", e.Msg, out)
			}
		case "ignore":
			if err != nil {
				t.Fatalf("ignore: %v", err)
			}
			mustEqualResult(t, "1.0.0", out, prevResult("1.0.0"))
			if !strings.Contains(logged, "timeout 300ms") {
				t.Errorf("ignore: stderr %q does not name the timeout", logged)
			}
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if len(d.deadlines) == 0 || d.paths[0] != api.PathIndexStart {
		t.Fatalf("daemon saw %v", d.paths)
	}
	for _, dl := range d.deadlines {
		if _, err := time.Parse(time.RFC3339Nano, dl); err != nil {
			t.Errorf("deadline header %q: %v", dl, err)
		}
	}
}

// A daemon that refuses for load answers try_again; the runtime must be told
// to try again later (11), and DEL must fail so the IP stays held.
func TestDaemonRefusesForLoad(t *testing.T) {
	sock, _ := startFaultDaemon(t, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
		json.NewEncoder(w).Encode(api.Error{Code: api.CodeTryAgain, Message: "64 scrubs in flight, queue limit 64"})
	})
	fields := map[string]any{"socket": sock}
	for _, cmd := range []func(*skel.CmdArgs) error{cmdAdd, cmdDel} {
		_, _, err := run(t, cmd, cmdArgs(stdin(t, "1.0.0", fields, prevResult("1.0.0"))))
		e := mustCNIError(t, err, types.ErrTryAgainLater)
		if !strings.Contains(e.Msg, "refused for load") || !strings.Contains(e.Msg, "queue limit 64") {
			t.Errorf("message %q", e.Msg)
		}
	}
}

func TestGCWithoutValidAttachments(t *testing.T) {
	_, _, err := run(t, cmdGC, cmdArgs(stdin(t, "1.1.0", map[string]any{"socket": missingSocket(t)}, nil)))
	e := mustCNIError(t, err, types.ErrInvalidNetworkConfig)
	if !strings.Contains(e.Msg, "cni.dev/valid-attachments") {
		t.Fatalf("message %q", e.Msg)
	}
}

// An empty valid list is not sent: scrubd refuses a GC that would drop every
// pod of the network, and the runtime sends one only when the network has no
// pod on the node. The plugin succeeds without asking scrubd (its socket
// here does not even exist) and says so.
func TestGCWithEmptyValidAttachments(t *testing.T) {
	_, errOut, err := run(t, cmdGC, cmdArgs(stdin(t, "1.1.0", map[string]any{"socket": missingSocket(t), "cni.dev/valid-attachments": []any{}}, nil)))
	if err != nil {
		t.Fatalf("GC with an empty list: %v", err)
	}
	if !strings.Contains(errOut, "no valid attachment listed") {
		t.Errorf("stderr %q does not say why nothing was done", errOut)
	}
}

func TestPodAddrs(t *testing.T) {
	prev := `{"cniVersion":"1.0.0","interfaces":[{"name":"cni0"},{"name":"vethx"},{"name":"eth0","sandbox":"/var/run/netns/p"}],
		"ips":[{"interface":2,"address":"10.0.0.5/24"},
		       {"interface":1,"address":"10.0.0.1/24"},
		       {"interface":2,"address":"fd00::5/64"},
		       {"address":"10.0.0.5/24"}]}`
	conf, err := parseConfig([]byte(`{"cniVersion":"1.0.0","name":"pods","type":"ctscrub","prevResult":` + prev + `}`))
	if err != nil {
		t.Fatal(err)
	}
	// The host side's 10.0.0.1 is not the pod's; the repeated 10.0.0.5 counts once.
	ips, ifname, _ := prevResultAddrs(conf, "eth0")
	want := []netip.Addr{netip.MustParseAddr("10.0.0.5"), netip.MustParseAddr("fd00::5")}
	if !reflect.DeepEqual(ips, want) || ifname != "eth0" {
		t.Fatalf("got %v %q, want %v eth0", ips, ifname, want)
	}
	// No interface with sandbox set: the runtime's CNI_IFNAME is the pod's.
	conf, err = parseConfig([]byte(`{"cniVersion":"1.0.0","name":"pods","type":"ctscrub","prevResult":{"cniVersion":"1.0.0","ips":[{"address":"10.0.0.5/24"}]}}`))
	if err != nil {
		t.Fatal(err)
	}
	ips, ifname, _ = prevResultAddrs(conf, "net1")
	if len(ips) != 1 || ifname != "net1" {
		t.Fatalf("got %v %q", ips, ifname)
	}
}

func mustIPNet(t *testing.T, s string) net.IPNet {
	t.Helper()
	ip, n, err := net.ParseCIDR(s)
	if err != nil {
		t.Fatal(err)
	}
	n.IP = ip
	return *n
}

// The binary through skel: the environment, the error JSON on stdout and the
// exit code are what a runtime sees.
func TestBinaryThroughSkel(t *testing.T) {
	exe := func(env []string, in []byte) (string, int) { return runAsPlugin(t, env, in) }

	out, code := exe([]string{"CNI_COMMAND=VERSION"}, nil)
	var vi struct{ SupportedVersions []string }
	if json.Unmarshal([]byte(out), &vi); code != 0 || !reflect.DeepEqual(vi.SupportedVersions, allVersions) {
		t.Fatalf("VERSION: exit %d, %s", code, out)
	}

	out, code = exe([]string{"CNI_COMMAND=ADD", "CNI_NETNS=/var/run/netns/none"}, stdin(t, "1.0.0", nil, nil))
	var e types.Error
	if json.Unmarshal([]byte(out), &e); code != 1 || e.Code != types.ErrInvalidNetworkConfig || !strings.Contains(e.Msg, "chained") {
		t.Fatalf("ADD without prevResult: exit %d, %s", code, out)
	}

	// DEL with an empty CNI_NETNS (containerd's second DEL) and no daemon,
	// under policy ignore: succeeds and prints nothing.
	out, code = exe([]string{"CNI_COMMAND=DEL"}, stdin(t, "1.0.0", map[string]any{"socket": missingSocket(t), "failurePolicy": "ignore"}, nil))
	if code != 0 || out != "" {
		t.Fatalf("DEL ignore: exit %d, %s", code, out)
	}

	// STATUS below 1.1.0 is refused by skel, not by ctscrub.
	out, code = exe([]string{"CNI_COMMAND=STATUS"}, stdin(t, "1.0.0", nil, nil))
	if code != 1 || !strings.Contains(out, "does not allow STATUS") {
		t.Fatalf("STATUS at 1.0.0: exit %d, %s", code, out)
	}
}

// runAsPlugin runs the test binary as the plugin, through skel, with env
// added to a runtime's usual variables; it returns stdout and the exit code.
func runAsPlugin(t *testing.T, env []string, in []byte) (string, int) {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := exec.CommandContext(ctx, self)
	c.Env = append([]string{"CTSCRUB_TEST_AS_PLUGIN=1", "CNI_PATH=/opt/cni/bin", "CNI_CONTAINERID=c0ffee", "CNI_IFNAME=eth0"}, env...)
	c.Stdin = bytes.NewReader(in)
	out, err := c.Output()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return string(out), ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return string(out), 0
}

// CNI_NETNS naming the plugin's own network namespace (plugin/netns.go):
// an ADD is refused with skel's error before it asks scrubd anything; a
// DEL does its work first, as skel had it; a runtime's CNI_NETNS_OVERRIDE
// lets both through.
func TestOwnNetnsRefused(t *testing.T) {
	own := fmt.Sprintf("/proc/%d/ns/net", os.Getpid()) // the child's too
	noDaemon := map[string]any{"socket": missingSocket(t)}
	decode := func(out string) types.Error {
		var e types.Error
		json.Unmarshal([]byte(out), &e)
		return e
	}

	out, code := runAsPlugin(t, []string{"CNI_COMMAND=ADD", "CNI_NETNS=" + own}, stdin(t, "1.0.0", noDaemon, prevResult("1.0.0")))
	if e := decode(out); code != 1 || e.Code != types.ErrInvalidNetNS || strings.Contains(out, "unavailable") {
		t.Fatalf("ADD in the plugin's own netns: exit %d, %s; want error %d before scrubd is asked", code, out, types.ErrInvalidNetNS)
	}
	out, code = runAsPlugin(t, []string{"CNI_COMMAND=ADD", "CNI_NETNS=" + own, "CNI_NETNS_OVERRIDE=true"}, stdin(t, "1.0.0", noDaemon, prevResult("1.0.0")))
	if e := decode(out); code != 1 || e.Code == types.ErrInvalidNetNS || !strings.Contains(out, "unavailable") {
		t.Fatalf("ADD in the plugin's own netns with CNI_NETNS_OVERRIDE: exit %d, %s; want it to go on to scrubd (unavailable)", code, out)
	}
	ignore := map[string]any{"socket": missingSocket(t), "failurePolicy": "ignore"}
	out, code = runAsPlugin(t, []string{"CNI_COMMAND=DEL", "CNI_NETNS=" + own}, stdin(t, "1.0.0", ignore, prevResult("1.0.0")))
	if e := decode(out); code != 1 || e.Code != types.ErrInvalidNetNS {
		t.Fatalf("DEL in the plugin's own netns: exit %d, %s; want error %d after the DEL", code, out, types.ErrInvalidNetNS)
	}
	out, code = runAsPlugin(t, []string{"CNI_COMMAND=DEL", "CNI_NETNS=" + own, "CNI_NETNS_OVERRIDE=1"}, stdin(t, "1.0.0", ignore, prevResult("1.0.0")))
	if code != 0 || out != "" {
		t.Fatalf("DEL in the plugin's own netns with CNI_NETNS_OVERRIDE, policy ignore: exit %d, %s; want success", code, out)
	}
}
