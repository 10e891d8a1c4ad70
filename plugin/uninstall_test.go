package main

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/internal/nsexec"
	"github.com/ctscrub/ctscrub/internal/testsupport/standin"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
	"github.com/ctscrub/ctscrub/scrubd/recorder/tcfilter"
)

// uninstallNode is a node for the uninstall: two pod netns, each with a veth
// (eth0, peer0) that the real recorder is attached to, and filters of
// others' beside ctscrub's.
type uninstallNode struct {
	rec    *recorder.Recorder
	pinDir string
	// nsA is found in the netns dir (and by a process), nsB only in the
	// state file, nsC only by a process.
	nsA, nsB, nsC string
	netnsDir      string
	proc          string
	state         string
	runDir        string
}

func newUninstallNode(t *testing.T) *uninstallNode {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: network namespaces, tc filters, BPF programs")
	}
	n := &uninstallNode{pinDir: filepath.Join(standin.TempDir(t), "ctscrub"), netnsDir: t.TempDir(), runDir: t.TempDir(), proc: t.TempDir()}
	// Container side only: the pods' veths end in their own namespaces
	// (uninstall removes filters; the host-side links go with the pin dir).
	rec, err := recorder.Load(recorder.Options{PinDir: n.pinDir, CTRoot: t.TempDir(), RingBytes: 1 << 16, ContainerSideOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rec.Close() })
	n.rec = rec
	for i, p := range []*string{&n.nsA, &n.nsB, &n.nsC} {
		name := fmt.Sprintf("ctscrub-uninst-%d-%s-%d", os.Getpid(), filepath.Base(n.runDir), i)
		path, err := nsexec.Create(name)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { netns.DeleteNamed(name) })
		*p = path
		if err := nsexec.Do(path, func() error {
			return netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "eth0"}, PeerName: "peer0"})
		}); err != nil {
			t.Fatal(err)
		}
		if _, err := rec.Attach(path, "eth0"); err != nil {
			t.Fatal(err)
		}
	}
	// nsA through a link in the netns dir, beside a file that is no netns
	// (a mount point left empty); nsB only through scrubd's state file, and
	// the journal names a netns that is gone.
	if err := os.Symlink(n.nsA, filepath.Join(n.netnsDir, "cni-a")); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(n.netnsDir, "cni-stale"), nil, 0o644)
	// A /proc of three processes: one in nsC, one in nsA, and "self".
	for pid, ns := range map[string]string{"7": n.nsC, "8": n.nsA, "self": n.nsA} {
		os.MkdirAll(filepath.Join(n.proc, pid, "ns"), 0o755)
		if err := os.Symlink(ns, filepath.Join(n.proc, pid, "ns", "net")); err != nil {
			t.Fatal(err)
		}
	}
	n.state = filepath.Join(n.runDir, "attachments.json")
	os.WriteFile(n.state, []byte(fmt.Sprintf(`{"version":1,"pods":[{"containerID":"b","ifName":"eth0","netns":%q,"ips":[],"ifindex":2}]}`, n.nsB)), 0o600)
	os.WriteFile(n.state+".log", []byte(`{"op":"active","pod":{"containerID":"c","ifName":"eth0","netns":"/var/run/netns/ctscrub-uninst-gone"}}`+"\n"), 0o600)
	return n
}

// foreign is a filter that is not ctscrub's, though it shares some of
// priority, handle and name with it.
type foreign struct {
	ifname string
	parent uint32
	prio   uint16
	handle uint32
	name   string
}

var foreignFilters = []foreign{
	{"eth0", netlink.HANDLE_MIN_INGRESS, 1, 0x1, "other"},                    // same interface, hook and priority
	{"eth0", netlink.HANDLE_MIN_EGRESS, 1, 0x1, "other"},                     //
	{"peer0", netlink.HANDLE_MIN_INGRESS, 1, 0xc75c, "someone_else"},         // same priority and handle
	{"peer0", netlink.HANDLE_MIN_EGRESS, 2, 0xc75c, "ctscrub_recorder_copy"}, // same handle, other priority
	{"peer0", netlink.HANDLE_MIN_EGRESS, 3, 0x7, tcfilter.Name},              // same name
}

func (n *uninstallNode) addForeign(t *testing.T) {
	t.Helper()
	prog, _ := n.rec.Programs()
	if err := nsexec.Do(n.nsA, func() error {
		for _, ifname := range []string{"peer0"} {
			l, err := netlink.LinkByName(ifname)
			if err != nil {
				return err
			}
			qd := &netlink.GenericQdisc{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: l.Attrs().Index, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT}, QdiscType: "clsact"}
			if err := netlink.QdiscAdd(qd); err != nil {
				return err
			}
		}
		for _, f := range foreignFilters {
			l, err := netlink.LinkByName(f.ifname)
			if err != nil {
				return err
			}
			if err := netlink.FilterAdd(&netlink.BpfFilter{
				FilterAttrs: netlink.FilterAttrs{LinkIndex: l.Attrs().Index, Parent: f.parent, Handle: f.handle, Priority: f.prio, Protocol: unix.ETH_P_ALL},
				Fd:          prog.FD(), Name: f.name, DirectAction: true,
			}); err != nil {
				return fmt.Errorf("foreign filter %+v: %w", f, err)
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

// foreignLeft lists the foreign filters still on nsA's interfaces.
func (n *uninstallNode) foreignLeft(t *testing.T) int {
	t.Helper()
	left := 0
	if err := nsexec.Do(n.nsA, func() error {
		for _, f := range foreignFilters {
			l, err := netlink.LinkByName(f.ifname)
			if err != nil {
				return err
			}
			fs, err := netlink.FilterList(l, f.parent)
			if err != nil {
				return err
			}
			for _, g := range fs {
				if bf, ok := g.(*netlink.BpfFilter); ok && bf.Priority == f.prio && bf.Handle == f.handle && bf.Name == f.name {
					left++
				}
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return left
}

func (n *uninstallNode) attached(t *testing.T, path string) bool {
	t.Helper()
	ok, err := recorder.Attached(path, "eth0")
	if err != nil {
		t.Fatal(err)
	}
	return ok
}

func (n *uninstallNode) args(extra ...string) []string {
	return append([]string{"--conf-dir", filepath.Join(n.runDir, "no-conf"), "--netns-dirs", n.netnsDir + ",/nonexistent/netns",
		"--state-file", n.state, "--proc", n.proc, "--run-dir", n.runDir, "--pin-dir", n.pinDir}, extra...)
}

// TestUninstallRemovesRecorders: the real recorder's filters go from every
// pod netns (found by dir and by state file); filters that share only some
// of ctscrub's priority, handle and name stay; a second run removes nothing.
func TestUninstallRemovesRecorders(t *testing.T) {
	n := newUninstallNode(t)
	n.addForeign(t)
	if !n.attached(t, n.nsA) || !n.attached(t, n.nsB) {
		t.Fatal("recorder not attached before the uninstall")
	}
	if got := n.foreignLeft(t); got != len(foreignFilters) {
		t.Fatalf("%d of %d foreign filters before the uninstall", got, len(foreignFilters))
	}

	var out bytes.Buffer
	if err := runSubcommand("uninstall", n.args(), &out); err != nil {
		t.Fatalf("uninstall: %v\n%s", err, out.String())
	}
	want := fmt.Sprintf(`ctscrub uninstall: removed recorder filters (ingress, egress) from eth0 in %s
ctscrub uninstall: removed recorder filters (ingress, egress) from eth0 in %s
ctscrub uninstall: removed recorder filters (ingress, egress) from eth0 in %s
ctscrub uninstall: removed the recorder from 3 interfaces in 3 of 3 network namespaces
`, filepath.Join(n.netnsDir, "cni-a"), n.nsB, filepath.Join(n.proc, "7", "ns", "net"))
	if out.String() != want {
		t.Errorf("output:\n%s\nwant:\n%s", out.String(), want)
	}
	if n.attached(t, n.nsA) || n.attached(t, n.nsB) || n.attached(t, n.nsC) {
		t.Error("recorder filters left after the uninstall")
	}
	if got := n.foreignLeft(t); got != len(foreignFilters) {
		t.Errorf("%d of %d foreign filters left: the uninstall removed someone else's", got, len(foreignFilters))
	}
	if _, err := os.Stat(n.pinDir); err != nil {
		t.Errorf("pin dir gone without --remove-state: %v", err)
	}

	out.Reset()
	if err := runSubcommand("uninstall", n.args(), &out); err != nil {
		t.Fatalf("second uninstall: %v\n%s", err, out.String())
	}
	if want := "ctscrub uninstall: removed the recorder from 0 interfaces in 0 of 3 network namespaces\n"; out.String() != want {
		t.Errorf("second uninstall wrote:\n%s\nwant:\n%s", out.String(), want)
	}
	if got := n.foreignLeft(t); got != len(foreignFilters) {
		t.Errorf("%d of %d foreign filters left after the second run", got, len(foreignFilters))
	}

	// A state file it cannot read is a warning: the netns dirs and the
	// processes are still looked at.
	os.WriteFile(n.state, []byte("{"), 0o600)
	out.Reset()
	if err := runSubcommand("uninstall", n.args(), &out); err != nil {
		t.Fatalf("uninstall with a bad state file: %v\n%s", err, out.String())
	}
	if want := fmt.Sprintf("ctscrub uninstall: warning: read scrubd's state file %s: unexpected end of JSON input (skipped)\n"+
		"ctscrub uninstall: removed the recorder from 0 interfaces in 0 of 2 network namespaces\n", n.state); out.String() != want {
		t.Errorf("uninstall with a bad state file wrote:\n%s\nwant:\n%s", out.String(), want)
	}
}

// TestUninstallRemoveState: --remove-state takes scrubd's pins and run dir;
// --keep-recorders leaves the filters; while scrubd answers on its socket
// neither filters nor state are touched.
func TestUninstallRemoveState(t *testing.T) {
	n := newUninstallNode(t)
	sock := filepath.Join(n.runDir, "scrubd.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	err = runSubcommand("uninstall", n.args("--remove-state"), &out)
	if err == nil || !strings.Contains(err.Error(), "scrubd still answers on "+sock) {
		t.Errorf("uninstall while scrubd answers: error %v, want it to say scrubd still answers", err)
	}
	if !strings.Contains(out.String(), "recorder filters left in place") || !n.attached(t, n.nsA) || !n.attached(t, n.nsB) {
		t.Errorf("recorder filters touched while scrubd answers:\n%s", out.String())
	}
	if _, err := os.Stat(filepath.Join(n.pinDir, "rec_events")); err != nil {
		t.Errorf("pins touched while scrubd answers: %v", err)
	}
	l.Close() // scrubd is gone; its socket file stays, as after a kill

	out.Reset()
	if err := runSubcommand("uninstall", n.args("--keep-recorders", "--remove-state"), &out); err != nil {
		t.Fatalf("uninstall: %v\n%s", err, out.String())
	}
	if want := fmt.Sprintf("ctscrub uninstall: removed %s\nctscrub uninstall: removed %s\n", n.pinDir, n.runDir); out.String() != want {
		t.Errorf("output:\n%s\nwant:\n%s", out.String(), want)
	}
	for _, p := range []string{n.pinDir, n.runDir} {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Errorf("%s left: %v", p, err)
		}
	}
	if !n.attached(t, n.nsA) || !n.attached(t, n.nsB) || !n.attached(t, n.nsC) {
		t.Error("--keep-recorders removed the recorder's filters")
	}

	for _, bad := range [][]string{
		// Paths that do not exist: if the guard were broken the test
		// fails without removing anything.
		{"--run-dir", "/ctscrub-test-none"}, {"--pin-dir", "/ctscrub-test-none"}, {"--run-dir", "relative/none"},
		{"--pin-dir", t.TempDir()}, // exists, not on bpffs
	} {
		err := runSubcommand("uninstall", append(n.args("--keep-recorders", "--remove-state"), bad...), &bytes.Buffer{})
		if err == nil || !strings.Contains(err.Error(), "refusing to remove") {
			t.Errorf("--remove-state %v: error %v, want a refusal", bad, err)
		}
	}
}
