package daemon

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/internal/testsupport/netpods"
	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// bootNode is a node of real namespaces with the Cilium stand-in on every
// pod's host-side veth: found is a pod no ctscrub ADD ever attached (it
// started before ctscrub, or while scrubd was down), indexed one that an
// index start attached.
type bootNode struct {
	root           *ctRoot
	node           *netpods.Node
	found, indexed *netpods.Pod
	cfg            Config
}

func newBootNode(t *testing.T) *bootNode {
	root, dp := standinRoot(t, 1<<16)
	node, found := standinNode(t, dp)
	indexed := node.AddPod()
	if err := node.Do(func() error { return dp.AttachHostSide(indexed.HostVeth) }); err != nil {
		t.Fatal(err)
	}
	found.ServeEcho()
	indexed.ServeEcho()
	cfg := podConfig(t, root, node)
	cfg.Bootstrap = "on"
	cfg.DelegateSocket = filepath.Join(t.TempDir(), "delegate", "delegate.sock")
	cfg.CNIConfDir = t.TempDir()
	if err := os.WriteFile(filepath.Join(cfg.CNIConfDir, "05-cilium.conflist"), []byte(chainedConf), 0o644); err != nil {
		t.Fatal(err)
	}
	return &bootNode{root: root, node: node, found: found, indexed: indexed, cfg: cfg}
}

// start runs a daemon whose bootstrap finds pods in the node's namespace;
// walked, when set, holds the pass after its walk.
func (b *bootNode) start(t *testing.T, walked func(), opts podIfOptions) *testDaemon {
	return startDaemonWith(t, b.cfg, func(d *Daemon) {
		d.bs.netns, d.bs.walked, d.bs.ifOpts = b.node.Path, walked, opts
	}, true)
}

func sweeps(td *testDaemon) uint64 {
	return td.Backends()[0].(ciliumBackend).Sweeper().Passes()
}

func waitPass(t *testing.T, td *testDaemon) {
	t.Helper()
	if td.cfg.Bootstrap == "off" {
		return // the daemon as it was before the bootstrap (checks the test fails then)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if st := td.boot.Status(); st != nil && !st.Running {
			if st.Error != "" {
				t.Fatalf("bootstrap pass: %s", st.Error)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the bootstrap pass did not end within 30 s")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// A daemon restarted with pods and flows on the node, after a clean stop
// and without a snapshot (a kill: what the dead process had read is gone),
// answers from the index from the end of its bootstrap pass: the DEL of a
// pod no ADD ever attached (found at start, named by its DEL) and of an
// indexed one, the next ADD of the first's address and a delegate create
// of the second's, and a delegate create of a free address of the node's
// bridge range; none sweeps and nothing of the addresses is left, the
// flow the found pod opened while the pass ran included. Before the
// bootstrap was wired in, every one of them swept.
func TestRestartAnswersFromTheBootstrapPass(t *testing.T) {
	for _, kill := range []bool{false, true} {
		name := "clean"
		if kill {
			name = "kill"
		}
		t.Run(name, func(t *testing.T) {
			b := newBootNode(t)
			ctx := context.Background()
			free := netip.MustParseAddr("10.244.0.50")
			ia := api.Attachment{ContainerID: "indexed", IfName: "eth0"}
			first := b.start(t, nil, podIfOptions{})
			waitPass(t, first)
			if err := first.c.IndexStart(ctx, api.IndexStartRequest{Attachment: ia, Netns: b.indexed.Path,
				IPs: []netip.Addr{b.indexed.Addr4, b.indexed.Addr6}, Network: "pods", Scrub: true}); err != nil {
				t.Fatal(err)
			}
			for _, f := range []func() error{
				func() error { return b.found.TCP(b.node.Remote.Addr4, netpods.EchoPort) },
				func() error { return b.found.TCP(b.indexed.Addr4, netpods.EchoPort) },
				func() error { return b.indexed.UDP(b.node.Remote.Addr6, netpods.EchoPort) },
				func() error { return b.indexed.SendUDP(free, 9) },
			} {
				if err := f(); err != nil {
					t.Fatal(err)
				}
			}
			first.stop()
			if kill {
				if err := os.Remove(first.snapshotPath()); err != nil {
					t.Fatal(err)
				}
			}

			hold, walked := make(chan struct{}), make(chan struct{})
			second := b.start(t, func() { close(walked); <-hold }, podIfOptions{})
			if b.cfg.Bootstrap == "off" {
				close(walked)
			}
			<-walked
			// During the pass, behind its walk: only the recorder sees it.
			if err := b.found.UDP(b.node.Remote.Addr4, netpods.EchoPort); err != nil {
				t.Fatal(err)
			}
			close(hold)
			waitPass(t, second)
			before := sweeps(second)
			for _, ip := range []netip.Addr{b.found.Addr4, b.indexed.Addr4, free} {
				if st := second.Index().State(ip); !st.Complete {
					t.Errorf("%s after the pass: incomplete (%s)", ip, st.Incomplete)
				}
			}

			fa := api.Attachment{ContainerID: "found-pod", IfName: "eth0"}
			for _, del := range []struct {
				a     api.Attachment
				netns string
				ip    netip.Addr
			}{{fa, b.found.Path, b.found.Addr4}, {ia, b.indexed.Path, b.indexed.Addr4}} {
				resp, err := second.c.Del(ctx, api.IndexStopRequest{Attachment: del.a, Netns: del.netns,
					Del: &api.CNIDel{IPs: []netip.Addr{del.ip}, Scrub: true}})
				if err != nil {
					t.Fatalf("DEL of %s: %v", del.a.ContainerID, err)
				}
				if !resp.Known || len(resp.Results) == 0 || resp.Results[0].Method != scrub.MethodIndex {
					t.Errorf("DEL of %s: %+v, want a known attachment scrubbed by the index", del.a.ContainerID, resp)
				}
				if left := b.root.entriesOf(t, del.ip); left != 0 {
					t.Errorf("DEL of %s: %d entries of %s left", del.a.ContainerID, left, del.ip)
				}
			}
			if err := second.c.IndexStart(ctx, api.IndexStartRequest{Attachment: api.Attachment{ContainerID: "next", IfName: "eth0"},
				Netns: b.found.Path, IPs: []netip.Addr{b.found.Addr4}, Network: "pods", Scrub: true}); err != nil {
				t.Fatal(err)
			}
			for _, ip := range []netip.Addr{b.indexed.Addr4, free} {
				if a := delegateAsk(t, b.cfg.DelegateSocket, api.DelegateEventCreate, ip); !a.Complete {
					t.Errorf("delegate create of %s: %+v, want complete", ip, a)
				}
				if left := b.root.entriesOf(t, ip); left != 0 {
					t.Errorf("delegate create of %s: %d entries left", ip, left)
				}
			}
			if n := sweeps(second) - before; n != 0 {
				t.Errorf("%d sweeps after the pass ended, want 0", n)
			}
		})
	}
}

// A pod the find at start misses (its namespace has no path the daemon
// can open) is not recorded: its address is not vouched for and its scrub
// sweeps; nor is any free address (the missed pod may have sent towards
// it), nor a found pod's (the rule is blind: the missed pod may send
// towards it once that pod is dead and its DEL still to come). Once the
// find can open it (refind), the rule sees again.
func TestBootstrapMissedPodSweeps(t *testing.T) {
	b := newBootNode(t)
	ctx := context.Background()
	free := netip.MustParseAddr("10.244.0.50")
	if err := b.found.TCP(b.indexed.Addr4, netpods.EchoPort); err != nil {
		t.Fatal(err)
	}
	if err := b.indexed.TCP(b.node.Remote.Addr4, netpods.EchoPort); err != nil {
		t.Fatal(err)
	}
	// Only the found pod's namespace is visible to the find.
	dir := t.TempDir()
	if err := os.Symlink(b.found.Path, filepath.Join(dir, "found")); err != nil {
		t.Fatal(err)
	}
	td := b.start(t, nil, podIfOptions{NetnsDirs: []string{dir}, Proc: t.TempDir()})
	waitPass(t, td)
	if !td.Daemon.own.Blind() {
		t.Error("not blind after a find that missed a pod")
	}
	for _, ip := range []netip.Addr{b.indexed.Addr4, free, b.found.Addr4} {
		if st := td.Index().State(ip); st.Complete {
			t.Errorf("%s complete after a pass whose find missed a pod", ip)
		}
	}
	res, err := td.c.Scrub(ctx, api.ScrubRequest{IPs: []netip.Addr{b.indexed.Addr4}, Reason: scrub.ReasonDel})
	if err != nil {
		t.Fatal(err)
	}
	if r := res.Results[0]; r.Method != scrub.MethodSweep {
		t.Errorf("scrub of the missed pod's %s: %s, want a sweep", b.indexed.Addr4, r.Method)
	}
	if left := b.root.entriesOf(t, b.indexed.Addr4); left != 0 {
		t.Errorf("%d entries of %s left", left, b.indexed.Addr4)
	}
	// The missed pod's namespace, and the uplink's (the remote host's: no
	// pod, but a veth the find must follow), become visible.
	for name, path := range map[string]string{"indexed": b.indexed.Path, "remote": b.node.Remote.Path} {
		if err := os.Symlink(path, filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	if !td.Daemon.refind() || td.Daemon.own.Blind() {
		t.Error("blind after a find that followed every pod")
	}
}
