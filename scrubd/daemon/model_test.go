package daemon

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/ctscrub/ctscrub/internal/testsupport/ownermodel"
	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// The ownership model's walk (internal/testsupport/ownermodel) over the
// real daemon: real CT maps, the real API and delegate sockets, the real
// conflist watch, restarts with and without the snapshot. The recorder's
// records are applied to the index as the recorder applies them
// (recorder.Apply) for the flows the model says a recorder saw; the pods'
// network namespaces are files that exist while the pod lives (what
// restore, the GC's detach and the late DEL look at). The same walk runs
// over the rule alone in scrubd/owner, with many more steps.

var (
	daemonModelSteps = flag.Int("model.daemon.steps", ownermodel.EnvInt("CTSCRUB_MODEL_DAEMON_STEPS", 150), "steps per seed of the ownership walk over the daemon")
	daemonModelSeeds = flag.Int("model.daemon.seeds", ownermodel.EnvInt("CTSCRUB_MODEL_DAEMON_SEEDS", 8), "seeds of the ownership walk over the daemon")
	daemonModelSeed  = flag.Uint64("model.daemon.seed", 0, "run only this seed (0: 1..model.daemon.seeds)")
)

type daemonSystem struct {
	t     *testing.T
	root  *ctRoot
	cfg   Config
	td    *testDaemon
	netns string // the pods' network namespace files
	conf  string // the CNI config file the watch reads

	// The bootstrap: the node's pods as its find sees them (their netns
	// files, less hidden ones), and the pass held after its walk until
	// PassEnd (or the daemon's stop).
	mu     sync.Mutex
	ips    map[api.Attachment]netip.Addr
	hidden map[api.Attachment]bool
	missed bool
	hold   chan struct{}
}

const (
	chainedConf   = `{"cniVersion":"1.0.0","name":"pods","plugins":[{"type":"cilium-cni"},{"type":"ctscrub"}]}`
	unchainedConf = `{"cniVersion":"1.0.0","name":"pods","plugins":[{"type":"cilium-cni"}]}`
)

func newDaemonSystem(t *testing.T) ownermodel.System {
	root := newCTRoot(t, 1<<12)
	cfg := testConfig(t, root)
	cfg.DelegateSocket = filepath.Join(t.TempDir(), "delegate", "delegate.sock")
	cfg.CNIConfDir = t.TempDir()
	cfg.Bootstrap = "on"
	s := &daemonSystem{t: t, root: root, cfg: cfg, netns: t.TempDir(), conf: filepath.Join(cfg.CNIConfDir, "05-cilium.conflist"),
		ips: map[api.Attachment]netip.Addr{}, hidden: map[api.Attachment]bool{}}
	if err := os.WriteFile(s.conf, []byte(chainedConf), 0o644); err != nil {
		t.Fatal(err)
	}
	s.start(nil)
	waitPass(t, s.td)
	return s
}

// start runs the daemon, its bootstrap's find on the model's pods.
func (s *daemonSystem) start(walked func()) {
	s.td = startDaemonWith(s.t, s.cfg, func(d *Daemon) {
		d.bs.scan, d.bs.walked = s.scan, walked
		d.bs.noSightLoop = true                                 // the walk's Refind steps run the find
		d.bs.attach = func(string, string) error { return nil } // recorded: the model applies the records
		d.bs.cover = []netip.Prefix{netip.MustParsePrefix("10.244.0.8/29")}
	}, true)
	// Before the daemon's stop (cleanups run last first): a held pass
	// would keep it from stopping.
	s.t.Cleanup(func() {
		if s.hold != nil {
			close(s.hold)
			s.hold = nil
		}
	})
	s.waitChained(counterValueChained(s))
}

// scan is the node's pods as the bootstrap's find sees them.
func (s *daemonSystem) scan() ([]PodInterface, []string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []PodInterface
	for a, ip := range s.ips {
		if _, err := os.Stat(s.netnsOf(a)); err != nil || s.hidden[a] {
			continue
		}
		out = append(out, PodInterface{Netns: s.netnsOf(a), IfName: a.IfName, IPs: []netip.Addr{ip}})
	}
	var missed []string
	if s.missed {
		missed = []string{"hidden"}
	}
	return out, missed, nil
}

func (s *daemonSystem) Born(a api.Attachment, ip netip.Addr) {
	s.mu.Lock()
	s.ips[a] = ip
	s.mu.Unlock()
	if err := os.WriteFile(s.netnsOf(a), nil, 0o644); err != nil {
		s.t.Fatal(err)
	}
}

func (s *daemonSystem) PassEnd() {
	if s.hold == nil {
		return
	}
	close(s.hold)
	s.hold = nil
	waitPass(s.t, s.td)
}

// Refind is the daemon's find after a sign (refind.go), run now.
func (s *daemonSystem) Refind() { s.td.Daemon.refind() }

func (s *daemonSystem) waitChained(chained bool) {
	want := 0.0
	if chained {
		want = 1
	}
	waitFor(s.t, "the conflist watch", func() bool { return counterValue(s.t, s.td, "ctscrub_cni_chained", nil) == want })
}

func (s *daemonSystem) netnsOf(a api.Attachment) string {
	return filepath.Join(s.netns, a.ContainerID)
}

func (s *daemonSystem) Delegate(event string, ip netip.Addr) bool {
	return delegateAsk(s.t, s.cfg.DelegateSocket, event, ip).Complete
}

// Add is the index start with its scrub, as handleIndexStart runs it (its
// netns check aside: the namespaces here are files).
func (s *daemonSystem) Add(a api.Attachment, ip netip.Addr, fail bool) bool {
	d := s.td.Daemon
	d.ix.Hold(ip)
	res, err := s.td.c.Scrub(context.Background(), api.ScrubRequest{IPs: []netip.Addr{ip}, Reason: scrub.ReasonAdd, ContainerID: a.ContainerID, IfName: a.IfName})
	complete := err == nil && completed(res.Results)
	if fail || !complete {
		d.releaseUnheld([]netip.Addr{ip})
		return complete
	}
	d.ix.Recorded(ip)
	if _, err := d.startPod(api.IndexedPod{Attachment: a, Netns: s.netnsOf(a), IPs: []netip.Addr{ip}, Network: "pods"}); err != nil {
		s.t.Fatal(err)
	}
	return true
}

func (s *daemonSystem) Del(a api.Attachment, ip netip.Addr) bool {
	resp, err := s.td.c.Del(context.Background(), api.IndexStopRequest{Attachment: a, Netns: s.netnsOf(a), Del: &api.CNIDel{IPs: []netip.Addr{ip}, Scrub: true}})
	if err != nil {
		return false
	}
	for _, sk := range resp.Skipped {
		if sk.IP == ip {
			return false
		}
	}
	return len(resp.Results) > 0 && completed(resp.Results)
}

func (s *daemonSystem) GC(valid []api.Attachment) {
	if _, err := s.td.c.GC(context.Background(), "pods", valid); err != nil {
		s.t.Fatalf("GC: %v", err)
	}
}

func (s *daemonSystem) SetChained(chained bool) {
	conf := unchainedConf
	if chained {
		conf = chainedConf
	}
	if err := os.WriteFile(s.conf, []byte(conf), 0o644); err != nil {
		s.t.Fatal(err)
	}
	s.waitChained(chained)
}

func (s *daemonSystem) Restart(kill bool, gone, hidden []api.Attachment, missed bool) {
	if s.hold != nil {
		close(s.hold) // the pass held by the last restart: the stop cancels it
		s.hold = nil
	}
	s.td.stop()
	if kill {
		// No consistent snapshot: what the dead process had read is gone.
		if err := os.Remove(s.td.snapshotPath()); err != nil && !errors.Is(err, os.ErrNotExist) {
			s.t.Fatal(err)
		}
	}
	s.mu.Lock()
	s.hidden, s.missed = map[api.Attachment]bool{}, missed
	for _, a := range hidden {
		s.hidden[a] = true
	}
	s.mu.Unlock()
	hold := make(chan struct{})
	s.hold = hold
	s.start(func() { <-hold })
}

// counterValueChained is what the conflist file says now.
func counterValueChained(s *daemonSystem) bool {
	b, err := os.ReadFile(s.conf)
	if err != nil {
		s.t.Fatal(err)
	}
	return string(b) == chainedConf
}

func (s *daemonSystem) Gone(a api.Attachment) {
	if err := os.Remove(s.netnsOf(a)); err != nil && !errors.Is(err, os.ErrNotExist) {
		s.t.Fatal(err)
	}
}

// keys are e's CT entries as Cilium makes them: a pod's flow to a remote
// address (OUT and its related key), or a local peer's flow towards the pod
// (both directions, each with its related key).
func (s *daemonSystem) keys(e ownermodel.Entry) []ctmap.CTKey4 {
	if !e.Peer.IsValid() {
		remote := netip.AddrFrom4([4]byte{198, 51, 100, byte(e.ID % 250)})
		k := ctmap.NewKey4(e.IP, remote, 443, uint16(1024+e.ID%60000), ctmap.ProtoTCP, ctmap.FlagOut)
		return []ctmap.CTKey4{k, k.Related()}
	}
	k := ctmap.NewKey4(e.Peer, e.IP, 8080, uint16(1024+e.ID%60000), ctmap.ProtoTCP, ctmap.FlagOut)
	t := k.WithFlags(k.Flags() ^ ctmap.FlagIn)
	return []ctmap.CTKey4{k, k.Related(), t, t.Related()}
}

func (s *daemonSystem) Flow(e ownermodel.Entry) {
	keys := s.keys(e)
	s.root.put4(s.t, keys)
	if e.Indexed {
		r := recorder.Record{Family: 4, Kind: recorder.RecFlow}
		copy(r.Key[:], keys[0][:])
		recorder.Apply(s.td.Index(), &r)
	}
}

func (s *daemonSystem) Present(e ownermodel.Entry) bool {
	return s.root.present4(s.t, s.keys(e)) > 0
}

// TestOwnershipModelDaemon walks the ownership model over the real daemon.
func TestOwnershipModelDaemon(t *testing.T) {
	for _, seed := range ownermodel.Seeds(*daemonModelSeed, *daemonModelSeeds) {
		t.Run(fmt.Sprintf("seed%d", seed), func(t *testing.T) {
			reports := ownermodel.Check(func() ownermodel.System { return newDaemonSystem(t) }, []uint64{seed}, *daemonModelSteps, false)
			for _, r := range reports {
				t.Errorf("%s\nrerun: go test ./scrubd/daemon -run TestOwnershipModelDaemon -model.daemon.seed %d -model.daemon.steps %d", r, r.Seed, *daemonModelSteps)
			}
		})
	}
}
