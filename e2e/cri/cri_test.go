// Package cri tests ctscrub under a real container runtime: Debian's
// containerd with its CRI plugin runs pod sandboxes through the CNI chain
// bridge + host-local + ctscrub, driven with crictl, with a real scrubd.
package cri

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/ctscrub/ctscrub/e2e/internal/node"
	"github.com/ctscrub/ctscrub/internal/testsupport/standin"
	"github.com/ctscrub/ctscrub/scrubd/api"
)

func TestMain(m *testing.M) {
	code := m.Run()
	node.CleanupBuilds()
	os.Exit(code)
}

const debianCNI = "/usr/lib/cni"

// TestPodSandboxLifecycle: `crictl runp` runs ADD through ctscrub (scrub of the
// new IP, indexing of eth0); `stopp` runs DEL with the cached prevResult
// (scrub, stop indexing); `rmp` runs DEL again with an empty CNI_NETNS and no
// prevResult, which must succeed and do no second scrub.
func TestPodSandboxLifecycle(t *testing.T) {
	node.RequireRoot(t)
	node.RequireTool(t, "containerd")
	node.RequireTool(t, "runc")
	for _, p := range []string{"bridge", "host-local", "loopback"} {
		if _, err := os.Stat(filepath.Join(debianCNI, p)); err != nil {
			t.Skipf("reference CNI plugin %s missing in %s (apt install containernetworking-plugins)", p, debianCNI)
		}
	}

	sfx := node.Suffix()
	subnet := netip.MustParsePrefix(fmt.Sprintf("10.%d.%d.0/24", 160+rand.IntN(30), rand.IntN(250)))
	bridge := "cri" + sfx

	// Cilium's CT maps in a private bpffs dir, filled from real packets by
	// the Cilium datapath stand-in on the pod's host-side veth.
	ctRoot := standin.TempDir(t)
	if err := standin.CreateMaps(ctRoot, 65536); err != nil {
		t.Fatal(err)
	}
	dp, err := standin.Load(ctRoot, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dp.Close() })
	maps, err := dp.Maps()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { maps.Close() })
	scrubd := node.StartScrubd(t, node.Options{CTRoot: ctRoot, PodCIDRs: []string{subnet.String()}})

	// Reference plugins support up to CNI 1.0.0 (Debian's 1.1.1), and at
	// 1.0.0 containerd 1.6 hands the cached prevResult to DEL.
	conflist := fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": "ctscrub-e2e-%[1]s",
  "plugins": [
    {"type": "bridge", "bridge": %[2]q, "isGateway": false, "ipMasq": false,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": %[3]q}]], "dataDir": %[4]q}},
    {"type": "ctscrub", "socket": %[5]q, "timeout": "20s", "failurePolicy": "fail"}
  ]
}`, sfx, bridge, subnet.String(), filepath.Join(t.TempDir(), "ipam"), scrubd.Socket)

	bins := map[string]string{"ctscrub": node.Build(t, "./plugin", "ctscrub")}
	for _, p := range []string{"bridge", "host-local", "loopback"} {
		bins[p] = filepath.Join(debianCNI, p)
	}
	cd := newContainerd(t, bins, conflist)
	nodeBridge(t, bridge, subnet)

	pause := node.Build(t, "./e2e/cri/pause", "pause")
	archive := filepath.Join(cd.dir, "pause.tar")
	writePauseImage(t, pause, archive)
	cd.start(t)
	cd.importImage(t, archive)

	podConf := filepath.Join(cd.dir, "pod.json")
	writeJSON(t, podConf, map[string]any{
		"metadata":      map[string]any{"name": "e2e-" + sfx, "namespace": "ctscrub-e2e", "uid": "uid-" + sfx, "attempt": 0},
		"log_directory": filepath.Join(cd.dir, "pod-logs"),
		"linux":         map[string]any{},
	})

	addsBefore := scrubd.Metric(t, "ctscrub_scrub_duration_seconds_count", map[string]string{"reason": "add"})
	start := time.Now()
	podID := cd.crictl(t, "runp", podConf)
	t.Logf("crictl runp: %s (pod %s)", time.Since(start).Round(time.Millisecond), podID)
	t.Cleanup(func() { removeCgroups(podID) })

	var inspect struct {
		Status struct {
			Network struct {
				IP string `json:"ip"`
			} `json:"network"`
		} `json:"status"`
	}
	if err := json.Unmarshal([]byte(cd.crictl(t, "inspectp", podID)), &inspect); err != nil {
		t.Fatal(err)
	}
	podIP, err := netip.ParseAddr(inspect.Status.Network.IP)
	if err != nil || !subnet.Contains(podIP) {
		t.Fatalf("pod IP %q not from the chain's subnet %s", inspect.Status.Network.IP, subnet)
	}

	// ADD went through ctscrub: the pod's IP was scrubbed (reason add) and its
	// eth0 is indexed with that IP.
	ctx := context.Background()
	me := api.Attachment{ContainerID: podID, IfName: "eth0"}
	rec, err := scrubd.Client.IndexPod(ctx, me)
	if err != nil {
		t.Fatalf("scrubd has no record of pod %s eth0 after runp: %v", podID, err)
	}
	if !rec.Stopped.IsZero() || len(rec.IPs) != 1 || rec.IPs[0] != podIP || !strings.HasPrefix(rec.Netns, "/var/run/netns/") {
		t.Fatalf("record after runp: %+v, want live, IP %s, netns /var/run/netns/...", rec, podIP)
	}
	if got := scrubd.Metric(t, "ctscrub_scrub_duration_seconds_count", map[string]string{"reason": "add"}); got <= addsBefore {
		t.Fatalf("no scrub with reason add counted after runp (%v before, %v after)", addsBefore, got)
	}
	st, err := scrubd.Client.Status(ctx)
	if err != nil || st.IndexedPods != 1 {
		t.Fatalf("status after runp: %+v, %v; want 1 indexed pod", st, err)
	}

	// Real traffic from the node to the pod (the pause process listens on
	// nothing: the pod's kernel answers TCP with a reset and UDP with an ICMP
	// error) makes CT entries of the pod's IP, and the recorder in the pod's
	// netns indexes them.
	veth := hostVeth(t, bridge)
	if err := dp.AttachHostSide(veth); err != nil {
		t.Fatal(err)
	}
	for _, port := range []int{80, 8080} {
		if c, err := net.DialTimeout("tcp4", netip.AddrPortFrom(podIP, uint16(port)).String(), 2*time.Second); err == nil {
			c.Close()
		}
		if c, err := net.Dial("udp4", netip.AddrPortFrom(podIP, uint16(port)).String()); err == nil {
			c.Write([]byte("ctscrub"))
			c.Close()
		}
	}
	entries := node.CountEntries(t, maps, podIP)
	if entries == 0 {
		t.Fatalf("no CT entries of pod %s after traffic through %s", podIP, veth)
	}
	scrubd.WaitIndexed(t, podIP, entries)

	// stopp: DEL with prevResult scrubs (reason del) through the index and
	// stops indexing.
	delsBefore := scrubd.Metric(t, "ctscrub_scrub_duration_seconds_count", map[string]string{"reason": "del"})
	indexDels := scrubd.Metric(t, "ctscrub_scrub_duration_seconds_count", map[string]string{"reason": "del", "method": "index"})
	cd.crictl(t, "stopp", podID)
	if left := node.CountEntries(t, maps, podIP); left != 0 {
		t.Fatalf("%d of the pod's %d CT entries left after stopp", left, entries)
	}
	if got := scrubd.Metric(t, "ctscrub_scrub_duration_seconds_count", map[string]string{"reason": "del", "method": "index"}); got != indexDels+1 {
		t.Fatalf("stopp's scrub did not go through the index: %v -> %v", indexDels, got)
	}
	t.Logf("pod %s: %d CT entries from real traffic, all indexed, none left after stopp", podIP, entries)
	rec, err = scrubd.Client.IndexPod(ctx, me)
	if err != nil || rec.Stopped.IsZero() {
		t.Fatalf("record after stopp: %+v, %v; want stopped", rec, err)
	}
	delsAfterStop := scrubd.Metric(t, "ctscrub_scrub_duration_seconds_count", map[string]string{"reason": "del"})
	if delsAfterStop <= delsBefore {
		t.Fatalf("no scrub with reason del counted after stopp (%v before, %v after)", delsBefore, delsAfterStop)
	}

	// rmp: the second DEL, with an empty CNI_NETNS and no prevResult, finds
	// the stopped record and does nothing more.
	cd.crictl(t, "rmp", podID)
	if out := cd.crictl(t, "pods", "-q"); out != "" {
		t.Fatalf("pods left after rmp: %s", out)
	}
	if got := scrubd.Metric(t, "ctscrub_scrub_duration_seconds_count", map[string]string{"reason": "del"}); got != delsAfterStop {
		t.Fatalf("rmp's DEL scrubbed again: del scrubs %v after stopp, %v after rmp", delsAfterStop, got)
	}
	if st, err := scrubd.Client.Status(ctx); err != nil || st.IndexedPods != 0 {
		t.Fatalf("status after rmp: %+v, %v; want 0 indexed pods", st, err)
	}
	if strings.Contains(scrubd.Log(t), `"level":"ERROR"`) {
		t.Fatalf("scrubd logged errors:\n%s", scrubd.Log(t))
	}
}

// TestRunpFailsWithoutScrubd: with failurePolicy fail and scrubd gone, the
// runtime cannot start the pod, and the error it reports names the cause and
// the fix.
func TestRunpFailsWithoutScrubd(t *testing.T) {
	node.RequireRoot(t)
	node.RequireTool(t, "containerd")
	node.RequireTool(t, "runc")
	sfx := node.Suffix()
	subnet := netip.MustParsePrefix(fmt.Sprintf("10.%d.%d.0/24", 160+rand.IntN(30), rand.IntN(250)))
	bridge := "cri" + sfx
	sock := filepath.Join(t.TempDir(), "nobody.sock")
	ipamDir := filepath.Join(t.TempDir(), "ipam")
	// containerd cleans up the failed ADD with a DEL that has no prevResult
	// (nothing was cached): ctscrub lets that DEL through, so the bridge and
	// host-local DELs run and neither the netns nor the IP leak.
	conflist := fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": "ctscrub-e2e-%[1]s",
  "plugins": [
    {"type": "bridge", "bridge": %[2]q, "isGateway": false, "ipMasq": false,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": %[3]q}]], "dataDir": %[4]q}},
    {"type": "ctscrub", "socket": %[5]q, "timeout": "5s"}
  ]
}`, sfx, bridge, subnet.String(), ipamDir, sock)
	bins := map[string]string{"ctscrub": node.Build(t, "./plugin", "ctscrub")}
	for _, p := range []string{"bridge", "host-local", "loopback"} {
		bins[p] = filepath.Join(debianCNI, p)
	}
	cd := newContainerd(t, bins, conflist)
	nodeBridge(t, bridge, subnet)
	pause := node.Build(t, "./e2e/cri/pause", "pause")
	archive := filepath.Join(cd.dir, "pause.tar")
	writePauseImage(t, pause, archive)
	cd.start(t)
	cd.importImage(t, archive)

	podConf := filepath.Join(cd.dir, "pod.json")
	writeJSON(t, podConf, map[string]any{
		"metadata":      map[string]any{"name": "e2e-" + sfx, "namespace": "ctscrub-e2e", "uid": "uid-" + sfx, "attempt": 0},
		"log_directory": filepath.Join(cd.dir, "pod-logs"),
		"linux":         map[string]any{},
	})
	out, err := cd.crictlRun("runp", podConf)
	if err == nil {
		t.Fatalf("runp succeeded without scrubd: %s", out)
	}
	for _, want := range []string{"scrubd is unavailable", sock, "start scrubd"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("runp error does not say %q:\n%v", want, err)
		}
	}
	if ids, err := cd.crictlRun("pods", "-q"); err != nil || strings.TrimSpace(ids) != "" {
		t.Errorf("sandboxes left after the failed runp: %q, %v", ids, err)
	}
	// host-local keeps one file per reserved IP, named by the IP.
	files, _ := filepath.Glob(filepath.Join(ipamDir, "*", "*"))
	for _, f := range files {
		if _, err := netip.ParseAddr(filepath.Base(f)); err == nil {
			t.Errorf("IP %s still reserved after the failed runp: the cleanup DEL did not reach host-local", filepath.Base(f))
		}
	}
}

func writeJSON(t *testing.T, path string, v any) {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// nodeBridge creates the bridge the chain's bridge plugin uses, with the
// node's address .1 on it, so the node reaches its pods directly. The plugin
// then runs with isGateway false and leaves the host's ip_forward alone, which
// other tests running at the same time may depend on.
func nodeBridge(t *testing.T, name string, subnet netip.Prefix) {
	t.Helper()
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: name}}
	if err := netlink.LinkAdd(br); err != nil {
		t.Fatalf("create bridge %s: %v", name, err)
	}
	t.Cleanup(func() { netlink.LinkDel(br) })
	gw := subnet.Addr().Next()
	addr, _ := netlink.ParseAddr(netip.PrefixFrom(gw, subnet.Bits()).String())
	if err := netlink.AddrAdd(br, addr); err != nil {
		t.Fatalf("address %s on %s: %v", addr, name, err)
	}
	if err := netlink.LinkSetUp(br); err != nil {
		t.Fatal(err)
	}
}

// removeCgroups removes the empty cgroup folders runc leaves for a sandbox
// (cgroup v1, cgroupfs driver: <controller>/k8s.io/<id>), and k8s.io itself
// when nothing else is in it.
func removeCgroups(id string) {
	if id == "" {
		return
	}
	dirs, _ := filepath.Glob("/sys/fs/cgroup/*/k8s.io/" + id)
	for _, d := range dirs {
		os.Remove(d)
	}
	// rmdir of a cgroup fails unless it is empty: a k8s.io in use stays.
	parents, _ := filepath.Glob("/sys/fs/cgroup/*/k8s.io")
	for _, d := range parents {
		os.Remove(d)
	}
}

// hostVeth returns the one veth enslaved to bridge: the pod's host side.
func hostVeth(t *testing.T, bridge string) string {
	t.Helper()
	br, err := netlink.LinkByName(bridge)
	if err != nil {
		t.Fatalf("bridge %s: %v", bridge, err)
	}
	links, err := netlink.LinkList()
	if err != nil {
		t.Fatal(err)
	}
	var found []string
	for _, l := range links {
		if l.Attrs().MasterIndex == br.Attrs().Index && l.Type() == "veth" {
			found = append(found, l.Attrs().Name)
		}
	}
	if len(found) != 1 {
		t.Fatalf("veths on %s: %v, want the pod's one", bridge, found)
	}
	return found[0]
}
