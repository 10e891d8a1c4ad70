package daemon

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	dto "github.com/prometheus/client_model/go"
	"github.com/vishvananda/netlink"

	"github.com/ctscrub/ctscrub/internal/testsupport/netpods"
	"github.com/ctscrub/ctscrub/internal/testsupport/standin"
	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/client"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// standinPod is standinRoot with standinNode: the set-up of every test that
// makes real flows of a pod.
func standinPod(t *testing.T, entries uint32) (*ctRoot, *netpods.Node, *netpods.Pod) {
	t.Helper()
	root, dp := standinRoot(t, entries)
	node, pod := standinNode(t, dp)
	return root, node, pod
}

// standinNode is a node of network namespaces, the remote host answering
// echo, and one pod whose host-side veth carries the stand-in dp.
func standinNode(t *testing.T, dp *standin.Datapath) (*netpods.Node, *netpods.Pod) {
	t.Helper()
	node := netpods.NewNode(t)
	node.Remote.ServeEcho()
	pod := node.AddPod()
	if err := node.Do(func() error { return dp.AttachHostSide(pod.HostVeth) }); err != nil {
		t.Fatal(err)
	}
	return node, pod
}

// standinRoot makes a fake Cilium root with the CT and service maps and the
// Cilium datapath stand-in's programs over them.
func standinRoot(t *testing.T, entries uint32) (*ctRoot, *standin.Datapath) {
	t.Helper()
	requireRoot(t)
	dir := standin.TempDir(t)
	if err := standin.CreateMaps(dir, entries); err != nil {
		t.Fatal(err)
	}
	dp, err := standin.Load(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dp.Close() })
	r := &ctRoot{dir: dir}
	for _, k := range ctmap.Kinds {
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, k.Name()), nil)
		if err != nil {
			t.Fatal(err)
		}
		r.maps[k] = m
		t.Cleanup(func() { m.Close() })
	}
	return r, dp
}

// entriesOf walks every CT map and counts the entries holding ip.
func (r *ctRoot) entriesOf(t *testing.T, ip netip.Addr) int {
	t.Helper()
	n := 0
	for _, k := range ctmap.Kinds {
		var v ctmap.Entry
		if k.IPv6() {
			var key ctmap.CTKey6
			it := r.maps[k].Iterate()
			for it.Next(&key, &v) {
				if key.Has(ip) {
					n++
				}
			}
			if err := it.Err(); err != nil {
				t.Fatal(err)
			}
		} else {
			var key ctmap.CTKey4
			it := r.maps[k].Iterate()
			for it.Next(&key, &v) {
				if key.Has(ip) {
					n++
				}
			}
			if err := it.Err(); err != nil {
				t.Fatal(err)
			}
		}
	}
	return n
}

// podConfig is testConfig for pods of node (nil: pods whose veths' other
// ends are in scrubd's own namespace), where the recorder puts its
// host-side links.
func podConfig(t *testing.T, root *ctRoot, node *netpods.Node) Config {
	cfg := testConfig(t, root)
	if node != nil {
		cfg.NodeNetns = node.Path
	}
	cfg.PodCIDRs = []string{netpods.PodCIDR4.String(), netpods.PodCIDR6.String()}
	return cfg
}

// The whole chain on a real pod: index start attaches the recorder in the
// pod's netns, the ADD scrub sweeps and makes the IPs tracked, real traffic
// (through the Cilium stand-in) creates CT entries the recorder indexes, and
// the DEL scrub deletes every one of them through the index.
func TestIndexedPodEndToEnd(t *testing.T) {
	root, node, pod := standinPod(t, 1<<16)
	pod.ServeEcho()
	cfg := podConfig(t, root, node)
	td := startDaemon(t, cfg)
	ctx := context.Background()
	a := api.Attachment{ContainerID: "c0ffee", IfName: "eth0"}
	ips := []netip.Addr{pod.Addr4, pod.Addr6}

	if err := td.c.IndexStart(ctx, api.IndexStartRequest{Attachment: a, Netns: pod.Path, IPs: ips, Network: "pods"}); err != nil {
		t.Fatalf("index start: %v", err)
	}
	if err := td.c.IndexStart(ctx, api.IndexStartRequest{Attachment: api.Attachment{ContainerID: "x", IfName: "eth0"}, Netns: pod.Path, IPs: []netip.Addr{netip.MustParseAddr("192.0.2.2")}}); err == nil {
		t.Errorf("index start with a non-pod IP accepted")
	}
	add, err := td.c.Scrub(ctx, api.ScrubRequest{IPs: ips, Reason: scrub.ReasonAdd, ContainerID: a.ContainerID})
	if err != nil {
		t.Fatalf("ADD scrub: %v", err)
	}
	if m := add.Results[0].Method; m != scrub.MethodSweep {
		t.Errorf("ADD scrub of never-seen IPs used %s, want sweep", m)
	}
	for _, ip := range ips {
		if st := td.Index().State(ip); !st.Complete {
			t.Fatalf("%s incomplete after the ADD sweep: %s", ip, st.Incomplete)
		}
	}

	// Traffic in and out, both families.
	for _, f := range []func() error{
		func() error { return pod.TCP(node.Remote.Addr4, netpods.EchoPort) },
		func() error { return pod.UDP(node.Remote.Addr6, netpods.EchoPort) },
		func() error { return node.Remote.TCP(pod.Addr4, netpods.EchoPort) },
		func() error { return node.Remote.TCP(pod.Addr6, netpods.EchoPort) },
	} {
		if err := f(); err != nil {
			t.Fatalf("traffic: %v", err)
		}
	}
	before := root.entriesOf(t, pod.Addr4) + root.entriesOf(t, pod.Addr6)
	if before == 0 {
		t.Fatal("the stand-in made no CT entries for the pod's traffic")
	}
	waitFor(t, "the recorder to index the pod's flows", func() bool {
		s4, err4 := td.c.IndexIP(ctx, pod.Addr4)
		s6, err6 := td.c.IndexIP(ctx, pod.Addr6)
		return err4 == nil && err6 == nil && s4.Keys >= 4 && s6.Keys >= 4 && s4.Complete && s6.Complete
	})
	st, _ := td.c.IndexIP(ctx, pod.Addr4)
	if st.Owner == nil || *st.Owner != a {
		t.Errorf("index ip owner: %+v", st.Owner)
	}

	del, err := td.c.Scrub(ctx, api.ScrubRequest{IPs: ips, Reason: scrub.ReasonDel, ContainerID: a.ContainerID})
	if err != nil {
		t.Fatalf("DEL scrub: %v", err)
	}
	r := del.Results[0]
	if r.Method != scrub.MethodIndex || r.Total != before {
		t.Errorf("DEL scrub: %s deleted %d, want index and %d", r.Method, r.Total, before)
	}
	if left := root.entriesOf(t, pod.Addr4) + root.entriesOf(t, pod.Addr6); left != 0 {
		t.Errorf("%d CT entries of the pod left after its DEL scrub", left)
	}

	if err := td.c.IndexStop(ctx, api.IndexStopRequest{Attachment: a, Netns: pod.Path}); err != nil {
		t.Fatalf("index stop: %v", err)
	}
	// containerd's second DEL: no netns, already stopped.
	if err := td.c.IndexStop(ctx, api.IndexStopRequest{Attachment: a}); err != nil {
		t.Errorf("second index stop: %v", err)
	}
	// A DEL without prevResult learns the IPs of the stopped attachment.
	got, err := td.c.IndexPod(ctx, a)
	if err != nil || len(got.IPs) != 2 || got.Stopped.IsZero() {
		t.Errorf("index pod after stop: %+v, %v", got, err)
	}
	data, err := os.ReadFile(cfg.StateFile + ".log") // the journal; the file itself is rewritten less often
	if err != nil || !strings.Contains(string(data), "c0ffee") {
		t.Errorf("state file: %q, %v", data, err)
	}
	gc, err := td.c.GC(ctx, "pods", []api.Attachment{{ContainerID: "still-running", IfName: "eth0"}})
	if err != nil || len(gc.Dropped) != 1 {
		t.Errorf("gc: %+v, %v", gc, err)
	}
	if _, err := td.c.IndexPod(ctx, a); err == nil {
		t.Errorf("attachment still known after gc")
	} else if e, ok := client.APIError(err); !ok || e.Code != api.CodeNotFound {
		t.Errorf("index pod after gc: %v, want not_found", err)
	}
}

// buildScrubd builds the daemon binary for subprocess tests.
func buildScrubd(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "scrubd")
	cmd := exec.Command("go", "build", "-o", bin, "github.com/ctscrub/ctscrub/scrubd")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build scrubd: %v\n%s", err, out)
	}
	return bin
}

// daemonProcess is scrubd running as a subprocess; done yields Wait's error.
type daemonProcess struct {
	cmd  *exec.Cmd
	done chan error
}

func startProcess(t *testing.T, bin string, cfg Config, logName string) *daemonProcess {
	t.Helper()
	logf, err := os.Create(filepath.Join(filepath.Dir(cfg.StateFile), logName))
	if err != nil {
		t.Fatal(err)
	}
	args := []string{"run", "--socket", cfg.Socket, "--ct-root", cfg.CTRoot, "--pin-dir", cfg.PinDir,
		"--state-file", cfg.StateFile, "--metrics-addr", "off", "--backends", "cilium", "--shutdown-grace", "2s",
		"--expiry-mode", "off", "--bootstrap", cfg.Bootstrap}
	for _, c := range cfg.PodCIDRs {
		args = append(args, "--pod-cidr", c)
	}
	if cfg.NodeNetns != "" {
		args = append(args, "--node-netns", cfg.NodeNetns)
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &daemonProcess{cmd: cmd, done: make(chan error, 1)}
	exited := make(chan error, 1)
	go func() { err := cmd.Wait(); logf.Close(); exited <- err; p.done <- err }()
	t.Cleanup(func() {
		cmd.Process.Kill() // no-op when it already exited
		<-exited
	})
	waitServing(t, client.New(cfg.Socket), exited)
	return p
}

// wait waits up to 10 s for the process to exit and returns Wait's error.
func (p *daemonProcess) wait(t *testing.T) error {
	t.Helper()
	select {
	case err := <-p.done:
		return err
	case <-time.After(10 * time.Second):
		t.Fatalf("scrubd (pid %d) did not exit within 10 s", p.cmd.Process.Pid)
		return nil
	}
}

// A daemon killed with SIGKILL in the middle of a scrub, then restarted,
// leaves nothing behind after the next scrub; its attachments come back
// marked incomplete (their next scrub sweeps), and SIGTERM leaves pins alone.
func TestKilledDaemonRestarts(t *testing.T) {
	const bulk = 2_000_000
	root, dp := standinRoot(t, 1<<22)
	node := netpods.NewNode(t)
	pod := node.AddPod()
	if err := node.Do(func() error { return dp.AttachHostSide(pod.HostVeth) }); err != nil {
		t.Fatal(err)
	}
	root.put4(t, background(bulk))
	target := netip.MustParseAddr("10.244.0.200") // entries but never indexed: sweeps
	keys := podFlows(target, 1000)
	root.put4(t, keys)
	cfg := podConfig(t, root, node)
	bin := buildScrubd(t)
	c := client.New(cfg.Socket)
	ctx := context.Background()

	first := startProcess(t, bin, cfg, "first.log")
	a := api.Attachment{ContainerID: "k1ll", IfName: "eth0"}
	if err := c.IndexStart(ctx, api.IndexStartRequest{Attachment: a, Netns: pod.Path, IPs: []netip.Addr{pod.Addr4}}); err != nil {
		t.Fatalf("index start: %v", err)
	}
	scrubErr := make(chan error, 1)
	go func() {
		_, err := c.Scrub(ctx, api.ScrubRequest{IPs: []netip.Addr{target}, Reason: scrub.ReasonDel})
		scrubErr <- err
	}()
	waitFor(t, "the scrub to be in flight", func() bool {
		st, err := c.Status(ctx)
		return err == nil && st.InFlight == 1
	})
	if err := first.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if err := <-scrubErr; err == nil {
		t.Logf("the scrub finished before SIGKILL landed")
	} else {
		t.Logf("scrub interrupted by SIGKILL: %v", err)
	}
	first.wait(t)
	if ok, err := recorder.Attached(pod.Path, "eth0"); !ok {
		t.Errorf("recorder filters gone from the pod after SIGKILL: %v", err)
	}
	// Lose the filters too (someone deleted the clsact qdisc): the restart
	// must attach the recorder again from the state file.
	if err := pod.Do(func() error {
		l, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		return netlink.QdiscDel(&netlink.GenericQdisc{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: l.Attrs().Index, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT}, QdiscType: "clsact"})
	}); err != nil {
		t.Fatal(err)
	}
	if ok, _ := recorder.Attached(pod.Path, "eth0"); ok {
		t.Fatal("filters still there after the qdisc was deleted")
	}
	leftAfterKill := root.present4(t, keys)
	t.Logf("%d of the target's %d entries left after the kill", leftAfterKill, len(keys))

	second := startProcess(t, bin, cfg, "second.log")
	list, err := c.IndexList(ctx)
	if err != nil || len(list.Pods) != 1 || list.Pods[0].Attachment != a {
		t.Fatalf("attachments after restart: %+v, %v", list, err)
	}
	if ok, err := recorder.Attached(pod.Path, "eth0"); !ok {
		t.Errorf("the restarted daemon did not attach the recorder to the restored pod again: %v", err)
	}
	st, err := c.IndexIP(ctx, pod.Addr4)
	if err != nil || st.Complete || st.Incomplete != index.ReasonRestart {
		t.Errorf("pod IP after restart: %+v, %v; want incomplete (%s)", st, err, index.ReasonRestart)
	}
	resp, err := c.Scrub(ctx, api.ScrubRequest{IPs: []netip.Addr{target}, Reason: scrub.ReasonDel})
	if err != nil {
		t.Fatalf("scrub after restart: %v", err)
	}
	if n := root.present4(t, keys); n != 0 || resp.Results[0].Total != leftAfterKill {
		t.Errorf("after restart the scrub deleted %d and left %d entries; want %d and 0", resp.Results[0].Total, n, leftAfterKill)
	}
	resp, err = c.Scrub(ctx, api.ScrubRequest{IPs: []netip.Addr{pod.Addr4}, Reason: scrub.ReasonDel})
	if err != nil || resp.Results[0].Method != scrub.MethodSweep {
		t.Errorf("first scrub of a restored pod IP: %+v, %v; want a sweep", resp, err)
	}

	if err := second.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := second.wait(t); err != nil {
		t.Errorf("daemon exit after SIGTERM: %v", err)
	}
	if _, err := os.Stat(cfg.Socket); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket left after a clean stop: %v", err)
	}
	if ok, err := recorder.Attached(pod.Path, "eth0"); !ok {
		t.Errorf("SIGTERM removed the recorder's filters: %v", err)
	}
}

// The CLI subcommands of the scrubd binary, against a real daemon.
func TestCLI(t *testing.T) {
	root := newCTRoot(t, 1<<16)
	td := startDaemon(t, testConfig(t, root))
	bin := buildScrubd(t)
	ip := netip.MustParseAddr("10.244.6.6")
	keys := podFlows(ip, 50)
	root.put4(t, keys)
	cli := func(args ...string) (string, error) {
		out, err := exec.Command(bin, append(args, "--socket", td.cfg.Socket)...).CombinedOutput()
		return string(out), err
	}
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"status"}, []string{"ready", "true", "cilium", testCIDR}},
		{[]string{"scrub", "--ip", ip.String(), "--dry-run"}, []string{"cilium: would delete 100 entries by sweep"}},
		{[]string{"scrub", "--ip", ip.String()}, []string{"cilium: deleted 100 entries by sweep", "(complete)"}},
		{[]string{"index", "--ip", ip.String()}, []string{ip.String() + ": 0 keys, complete"}},
		{[]string{"index"}, []string{"CONTAINER", "IFNAME"}},
		{[]string{"ct", "stats"}, []string{"cilium_ct4_global", "65536"}},
		{[]string{"status", "--json"}, []string{`"ready": true`}},
	} {
		out, err := cli(tc.args...)
		if err != nil {
			t.Errorf("scrubd %s: %v\n%s", strings.Join(tc.args, " "), err, out)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(out, w) {
				t.Errorf("scrubd %s: output does not contain %q:\n%s", strings.Join(tc.args, " "), w, out)
			}
		}
	}
	if n := root.present4(t, keys); n != 0 {
		t.Errorf("CLI scrub left %d entries", n)
	}
	out, err := cli("scrub", "--ip", "192.168.7.7")
	if err == nil || !strings.Contains(out, "outside the pod CIDRs") {
		t.Errorf("CLI scrub of a non-pod IP: %v\n%s", err, out)
	}
	out, err = cli("scrub", "--ip", "nonsense")
	if err == nil || !strings.Contains(out, `--ip "nonsense"`) {
		t.Errorf("CLI scrub of a malformed IP: %v\n%s", err, out)
	}
}

// An IP has one owner: indexing a new attachment with an IP that an older,
// never stopped attachment holds stops the older one.
func TestIndexStartDisplacesStaleOwner(t *testing.T) {
	root, _ := standinRoot(t, 1<<12)
	node := netpods.NewNode(t)
	oldPod, newPod := node.AddPod(), node.AddPod()
	td := startDaemon(t, podConfig(t, root, node))
	ctx := context.Background()
	ip := newPod.Addr4 // the new pod got the IP the old one had
	old := api.Attachment{ContainerID: "old", IfName: "eth0"}
	cur := api.Attachment{ContainerID: "new", IfName: "eth0"}
	if err := td.c.IndexStart(ctx, api.IndexStartRequest{Attachment: old, Netns: oldPod.Path, IPs: []netip.Addr{ip}}); err != nil {
		t.Fatal(err)
	}
	if err := td.c.IndexStart(ctx, api.IndexStartRequest{Attachment: cur, Netns: newPod.Path, IPs: []netip.Addr{ip}}); err != nil {
		t.Fatal(err)
	}
	st, err := td.c.IndexIP(ctx, ip)
	if err != nil || st.Owner == nil || *st.Owner != cur {
		t.Errorf("owner of %s: %+v, %v; want the new attachment", ip, st.Owner, err)
	}
	got, err := td.c.IndexPod(ctx, old)
	if err != nil || got.Stopped.IsZero() {
		t.Errorf("displaced attachment: %+v, %v; want it stopped", got, err)
	}
	list, err := td.c.IndexList(ctx)
	if err != nil || len(list.Pods) != 1 || list.Pods[0].Attachment != cur {
		t.Errorf("active attachments: %+v, %v", list, err)
	}
}

// A clean stop keeps the index: the next start restores it from the
// snapshot, applies the records made while no daemon ran (pinned ring
// buffer), and the DEL scrub takes the index path and leaves nothing. A
// snapshot over other maps (the recorder's pins re-created) is dropped.
func TestCleanRestartKeepsIndex(t *testing.T) {
	root, node, pod := standinPod(t, 1<<16)
	cfg := podConfig(t, root, node)
	ctx := context.Background()
	ip := pod.Addr4
	a := api.Attachment{ContainerID: "clean", IfName: "eth0"}

	first := startDaemon(t, cfg)
	if err := first.c.IndexStart(ctx, api.IndexStartRequest{Attachment: a, Netns: pod.Path, IPs: []netip.Addr{ip}}); err != nil {
		t.Fatal(err)
	}
	if _, err := first.c.Scrub(ctx, api.ScrubRequest{IPs: []netip.Addr{ip}, Reason: scrub.ReasonAdd}); err != nil {
		t.Fatal(err)
	}
	if err := pod.TCP(node.Remote.Addr4, netpods.EchoPort); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the first flow to be indexed", func() bool { return first.Index().State(ip).Keys > 0 })
	keysBefore := first.Index().State(ip).Keys
	first.stop()
	snap := filepath.Join(filepath.Dir(cfg.StateFile), "index.snapshot")
	if _, err := os.Stat(snap); err != nil {
		t.Fatalf("no snapshot after a clean stop: %v", err)
	}

	// A flow while no daemon runs: recorded into the pinned ring buffer.
	if err := pod.UDP(node.Remote.Addr4, netpods.EchoPort); err != nil {
		t.Fatal(err)
	}
	entries := root.entriesOf(t, ip)

	second := startDaemon(t, cfg)
	if _, err := os.Stat(snap); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("snapshot not consumed at start: %v", err)
	}
	waitFor(t, "the flow made while scrubd was down to be indexed", func() bool {
		st := second.Index().State(ip)
		return st.Keys > keysBefore
	})
	if st := second.Index().State(ip); !st.Complete {
		t.Fatalf("%s after a clean restart: incomplete (%s), want complete", ip, st.Incomplete)
	}
	resp, err := second.c.Scrub(ctx, api.ScrubRequest{IPs: []netip.Addr{ip}, Reason: scrub.ReasonDel})
	if err != nil {
		t.Fatal(err)
	}
	if r := resp.Results[0]; r.Method != scrub.MethodIndex || r.Total != entries {
		t.Errorf("DEL scrub after a clean restart: %s deleted %d, want index and %d", r.Method, r.Total, entries)
	}
	if left := root.entriesOf(t, ip); left != 0 {
		t.Errorf("%d entries of %s left", left, ip)
	}
	second.stop()

	// The recorder's maps re-created (pins removed): the snapshot no longer
	// matches them and must not be used.
	ents, _ := os.ReadDir(cfg.PinDir)
	for _, e := range ents {
		if !e.IsDir() {
			os.Remove(filepath.Join(cfg.PinDir, e.Name()))
		}
	}
	third := startDaemon(t, cfg)
	if st := third.Index().State(ip); st.Complete || st.Incomplete != index.ReasonRestart {
		t.Errorf("%s after a restart over new recorder maps: %+v, want incomplete (%s)", ip, st, index.ReasonRestart)
	}
}

// The DEL window: the CNI DEL reaches ctscrub before the runtime removes the
// pod's interface and before cilium-cni removes the endpoint, so the pod's
// flows may still create entries after the DEL scrub. The recorder keeps
// recording until the interface goes (before: index stop detached it, and
// those entries were never indexed while the IP stayed complete); the next
// scrub of the IP leaves nothing.
func TestDelKeepsRecordingUntilInterfaceGoes(t *testing.T) {
	root, node, pod := standinPod(t, 1<<16)
	td := startDaemon(t, podConfig(t, root, node))
	ctx := context.Background()
	a := api.Attachment{ContainerID: "de1", IfName: "eth0"}
	ips := []netip.Addr{pod.Addr4}
	if err := td.c.IndexStart(ctx, api.IndexStartRequest{Attachment: a, Netns: pod.Path, IPs: ips}); err != nil {
		t.Fatalf("index start: %v", err)
	}
	if _, err := td.c.Scrub(ctx, api.ScrubRequest{IPs: ips, Reason: scrub.ReasonAdd, ContainerID: a.ContainerID}); err != nil {
		t.Fatalf("ADD scrub: %v", err)
	}
	// DEL: scrub, then index stop, as the plugin does.
	if _, err := td.c.Scrub(ctx, api.ScrubRequest{IPs: ips, Reason: scrub.ReasonDel, ContainerID: a.ContainerID}); err != nil {
		t.Fatalf("DEL scrub: %v", err)
	}
	if err := td.c.IndexStop(ctx, api.IndexStopRequest{Attachment: a, Netns: pod.Path}); err != nil {
		t.Fatalf("index stop: %v", err)
	}
	// The window: the pod still talks.
	if err := pod.TCP(node.Remote.Addr4, netpods.EchoPort); err != nil {
		t.Fatal(err)
	}
	if n := root.entriesOf(t, pod.Addr4); n == 0 {
		t.Fatal("the stand-in made no CT entries in the DEL window")
	}
	waitFor(t, "the recorder to index the window's flow", func() bool {
		st, err := td.c.IndexIP(ctx, pod.Addr4)
		return err == nil && st.Keys >= 2
	})
	// An operator's scrub (no container): a DEL scrub naming the stopped
	// attachment would sweep (no stopped attachment vouches: scrubd/owner).
	res, err := td.c.Scrub(ctx, api.ScrubRequest{IPs: ips, Reason: scrub.ReasonDel})
	if err != nil {
		t.Fatalf("second scrub: %v", err)
	}
	if m := res.Results[0].Method; m != scrub.MethodIndex {
		t.Errorf("second scrub used %s, want index", m)
	}
	if left := root.entriesOf(t, pod.Addr4); left != 0 {
		t.Errorf("%d CT entries of the pod left after a complete scrub", left)
	}
}

// delWindow runs a pod through ADD and DEL (one index stop with Del, as the
// plugin does) with traffic before the DEL, then makes a flow in the DEL
// window (after the DEL scrub, the interface still there) and waits until
// the recorder indexed it. It returns the pod and the window's entries.
func delWindow(t *testing.T) (*netpods.Node, *netpods.Pod, *ctRoot, *testDaemon, int) {
	t.Helper()
	root, node, pod := standinPod(t, 1<<16)
	td := startDaemon(t, podConfig(t, root, node))
	ctx := context.Background()
	a := api.Attachment{ContainerID: "late1", IfName: "eth0"}
	ips := []netip.Addr{pod.Addr4}
	if err := td.c.IndexStart(ctx, api.IndexStartRequest{Attachment: a, Netns: pod.Path, IPs: ips, Scrub: true}); err != nil {
		t.Fatalf("index start (ADD): %v", err)
	}
	if err := pod.TCP(node.Remote.Addr4, netpods.EchoPort); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the recorder to index the pod's flow", func() bool {
		st, err := td.c.IndexIP(ctx, pod.Addr4)
		return err == nil && st.Keys >= 2
	})
	resp, err := td.c.Del(ctx, api.IndexStopRequest{Attachment: a, Netns: pod.Path, Del: &api.CNIDel{IPs: ips, Scrub: true}})
	if err != nil || len(resp.Results) == 0 || resp.Results[0].Total == 0 {
		t.Fatalf("DEL: %+v, %v; want a scrub that deleted the pod's entries", resp, err)
	}
	if left := root.entriesOf(t, pod.Addr4); left != 0 {
		t.Fatalf("%d entries left right after the DEL scrub", left)
	}
	// The window: the pod still talks through its interface.
	if err := pod.TCP(node.Remote.Addr4, netpods.EchoPort); err != nil {
		t.Fatal(err)
	}
	n := root.entriesOf(t, pod.Addr4)
	if n == 0 {
		t.Fatal("the stand-in made no CT entries in the DEL window")
	}
	waitFor(t, "the recorder to index the window's flow", func() bool {
		st, err := td.c.IndexIP(ctx, pod.Addr4)
		return err == nil && st.Keys >= 2
	})
	return node, pod, root, td, n
}

// removeInterface deletes the pod's veth pair, as the IP-assigning plugin's
// DEL does after ctscrub's.
func removeInterface(t *testing.T, node *netpods.Node, pod *netpods.Pod) {
	t.Helper()
	if err := node.Do(func() error {
		l, err := netlink.LinkByName(pod.HostVeth)
		if err != nil {
			return err
		}
		return netlink.LinkDel(l)
	}); err != nil {
		t.Fatalf("remove the pod's veth: %v", err)
	}
}

// lateCount reads ctscrub_del_late_total{result}.
func lateCount(td *testDaemon, result string) float64 {
	var m dto.Metric
	if err := td.m.late.WithLabelValues(result).Write(&m); err != nil {
		return -1
	}
	return m.GetCounter().GetValue()
}

// TestDelLateScrubsWindowFlows: entries made by packets crossing the pod's
// interface after the DEL scrub (the DEL window) are deleted once the
// interface is gone, with no new ADD of the address (late.go). Before the
// late scrub they stayed until the next scrub of the address.
func TestDelLateScrubsWindowFlows(t *testing.T) {
	node, pod, root, td, n := delWindow(t)
	removeInterface(t, node, pod)
	waitFor(t, "the late DEL scrub to delete the window's entries", func() bool { return root.entriesOf(t, pod.Addr4) == 0 })
	waitFor(t, "the late scrub to be counted", func() bool {
		return lateCount(td, lateScrubbed) == 1
	})
	if got := lateCount(td, lateNewOwner); got != 0 {
		t.Errorf("late scrubs skipped for a new owner: %v, want 0", got)
	}
	found := false
	for _, l := range td.logs.scrubLines(t) {
		if l["reason"] == "del-late" && l["method"] == "index" && l["deleted"] == float64(n) && l["interface_gone"] == true {
			found = true
		}
	}
	if !found {
		t.Errorf("no scrub log line with reason del-late, method index, %d deleted, interface gone: %v", n, td.logs.scrubLines(t))
	}
	t.Logf("%d window entries deleted by the late scrub", n)
}

// TestDelLateLeavesNewOwnerAlone: an ADD of the address between the DEL and
// the interface's removal (the new owner's ADD scrub ran, its entries are
// live) stops the late scrub: the entries made after that ADD stay.
func TestDelLateLeavesNewOwnerAlone(t *testing.T) {
	node, pod, root, td, _ := delWindow(t)
	ctx := context.Background()
	// The new owner's ADD: its scrub deletes what the old pod left.
	if _, err := td.c.Scrub(ctx, api.ScrubRequest{IPs: []netip.Addr{pod.Addr4}, Reason: scrub.ReasonAdd, ContainerID: "late2"}); err != nil {
		t.Fatalf("new owner's ADD scrub: %v", err)
	}
	// The new owner's live flow (made from the same address, after its ADD).
	if err := pod.TCP(node.Remote.Addr4, netpods.EchoPort); err != nil {
		t.Fatal(err)
	}
	live := root.entriesOf(t, pod.Addr4)
	if live == 0 {
		t.Fatal("no entries of the new owner's flow")
	}
	waitFor(t, "the recorder to index the new owner's flow", func() bool {
		st, err := td.c.IndexIP(ctx, pod.Addr4)
		return err == nil && st.Keys >= 2
	})
	removeInterface(t, node, pod)
	waitFor(t, "the late scrub to decide", func() bool {
		return lateCount(td, lateNewOwner)+lateCount(td, lateScrubbed) >= 1
	})
	if got := lateCount(td, lateScrubbed); got != 0 {
		t.Errorf("the late scrub ran on an address a new pod owns (%v)", got)
	}
	if left := root.entriesOf(t, pod.Addr4); left != live {
		t.Errorf("the new owner's entries: %d before the old interface went, %d after", live, left)
	}
}

// An index start whose netns is scrubd's own (the node's, with hostNetwork)
// is refused before anything is attached: the recorder would otherwise put
// its filters on the node's interface of that name. The plugin makes the
// same check before it calls scrubd (plugin/netns.go).
func TestIndexStartRefusesOwnNetns(t *testing.T) {
	root, _ := standinRoot(t, 1<<12)
	td := startDaemon(t, podConfig(t, root, nil))
	// An Ethernet interface of this process's (so scrubd's) namespace that
	// the attach would take without the check.
	la := netlink.NewLinkAttrs()
	la.Name = "ctsown0"
	veth := &netlink.Veth{LinkAttrs: la, PeerName: "ctsown1"}
	if err := netlink.LinkAdd(veth); err != nil {
		t.Fatalf("add a veth pair: %v", err)
	}
	t.Cleanup(func() { netlink.LinkDel(veth) })
	ctx := context.Background()
	own := fmt.Sprintf("/proc/%d/ns/net", os.Getpid())
	ip := netpods.PodCIDR4.Addr().Next().Next()
	err := td.c.IndexStart(ctx, api.IndexStartRequest{Attachment: api.Attachment{ContainerID: "c1", IfName: la.Name}, Netns: own, IPs: []netip.Addr{ip}})
	e, ok := client.APIError(err)
	if !ok || e.Code != api.CodeBadRequest || !strings.Contains(e.Message, "scrubd's own network namespace") {
		t.Fatalf("index start in scrubd's own netns: %v, want %s naming the namespace", err, api.CodeBadRequest)
	}
	if on, err := recorder.Attached(own, la.Name); err != nil || on {
		t.Errorf("recorder on %s of scrubd's netns: %v, %v; want not attached", la.Name, on, err)
	}
	if list, err := td.c.IndexList(ctx); err != nil || len(list.Pods) != 0 {
		t.Errorf("attachments after the refusal: %+v, %v; want none", list, err)
	}
	// A pod's own namespace still attaches.
	node := netpods.NewNode(t)
	pod := node.AddPod()
	if err := td.c.IndexStart(ctx, api.IndexStartRequest{Attachment: api.Attachment{ContainerID: "c2", IfName: "eth0"}, Netns: pod.Path, IPs: []netip.Addr{pod.Addr4}}); err != nil {
		t.Fatalf("index start in the pod's netns: %v", err)
	}
}
