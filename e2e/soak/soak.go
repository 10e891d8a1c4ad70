package main

import (
	"context"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ctscrub/ctscrub/internal/netnsnode"
	"github.com/ctscrub/ctscrub/internal/testsupport/standin"
	"github.com/ctscrub/ctscrub/scrubd/cilium"
)

// soakLifetimes: the stand-in closes TCP entries as Cilium does (its
// CT_CLOSE_TIMEOUT, 10 s after a FIN or an RST). Without it every closed
// connection of the long-lived pods kept TCP's 6 h lifetime, the CT table
// and the index grew for the whole run, and scrubd's memory with them.
var soakLifetimes = &standin.Lifetimes{Close: 10}

type soak struct {
	cfg     SoakConfig
	w       io.Writer
	cleanup *netnsnode.Cleanup
	ch      *netnsnode.Chain
	burstCh *netnsnode.Chain // a second network for the start-burst faults (burst.go)
	maps    *netnsnode.CTMaps
	dcfg    netnsnode.DaemonConfig
	d       *netnsnode.Daemon
	dmu     sync.Mutex // guards d across restarts
	res     SoakResult
	addLat  []time.Duration
	window  atomic.Int64 // >0 while a fault may make CNI calls fail
	winFrom time.Time
	spare   netip.Addr // a pod-CIDR address no pod has: sweeps of it delete nothing
	checker *cilium.Sweeper
	node    string
	dp      netnsnode.Datapath
	others  []*netnsnode.Pod // the long-lived pods
	cri     *criRuntime      // nil: the CRI part is skipped (res.CRISkipped says why)

	// The other pods' entries whose survival is checked at the end (reset
	// when the CT maps are re-created).
	plan     netnsnode.FillPlan
	bgBefore int
	keep     map[anyKey]uint32
	// bgMu is held by the long-lived pods' traffic for each round of
	// connections, and by the keep snapshot (snapshotKeep).
	bgMu sync.Mutex
}

// add creates a pod through the chain and puts the Cilium stand-in on its
// host-side veth, so its traffic makes CT entries.
func (s *soak) add(ctx context.Context, name string) (*netnsnode.Pod, error) {
	return s.addVia(ctx, s.ch, name)
}

// addVia is add through the chain ch.
func (s *soak) addVia(ctx context.Context, ch *netnsnode.Chain, name string) (*netnsnode.Pod, error) {
	p, err := ch.Add(ctx, s.cleanup, name)
	if err != nil {
		return p, err
	}
	if err := netnsnode.InNetns(s.node, func() error { return s.dp.Attach(p.HostVeth) }); err != nil {
		return p, fmt.Errorf("attach the datapath stand-in to %s: %w", p.HostVeth, err)
	}
	return p, nil
}

func (s *soak) daemon() *netnsnode.Daemon {
	s.dmu.Lock()
	defer s.dmu.Unlock()
	return s.d
}

func (s *soak) logf(format string, a ...any) {
	fmt.Fprintf(s.w, "[%s] "+format+"\n", append([]any{time.Now().UTC().Format("15:04:05")}, a...)...)
}

// runSoak is the soak: the node set up, the long-lived pods' traffic, the
// warm-up, the cycles with their faults, then the checks of what the node
// kept.
func runSoak(ctx context.Context, cfg SoakConfig, cleanup *netnsnode.Cleanup, w io.Writer) (*SoakResult, error) {
	start := time.Now()
	s := &soak{cfg: cfg, w: w, cleanup: cleanup, spare: netip.MustParseAddr("10.199.1.200")}
	s.res.Cycles, s.res.Entries = cfg.Cycles, cfg.Entries
	if err := s.setUpMaps(ctx); err != nil {
		return nil, err
	}
	if err := s.setUpNode(ctx); err != nil {
		return nil, err
	}
	bgFlows, stopBG := s.background(ctx)
	defer stopBG()
	time.Sleep(time.Second)
	if err := s.warmUp(ctx); err != nil {
		return nil, err
	}
	var err error
	if s.keep, err = s.snapshotKeep(append(s.others[0].IPs(), s.others[1].IPs()...)); err != nil {
		return nil, err
	}
	s.logf("long-lived pods %s, %s: %d CT entries so far; cycles start", s.others[0].V4, s.others[1].V4, len(s.keep))
	if err := s.runCycles(ctx, bgFlows); err != nil {
		return &s.res, err
	}
	stopBG()
	if err := s.checkOthers(); err != nil {
		return &s.res, err
	}
	s.res.AddP50S, s.res.AddP99S = pct(s.addLat, 50), pct(s.addLat, 99)
	s.res.DurationS = time.Since(start).Seconds()
	s.res.Pass = s.res.passed()
	return &s.res, nil
}

// setUpMaps removes what an interrupted run left, then creates the CT maps,
// fills them with the synthetic pods' flows, and loads the soak's count
// pass and the datapath stand-in over them.
func (s *soak) setUpMaps(ctx context.Context) error {
	if err := netnsnode.RemoveLeftovers(s.w); err != nil {
		return err
	}
	for _, d := range []string{netnsnode.WorkDir, netnsnode.BPFDir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return err
		}
		s.cleanup.Push("remove "+d, func() error { return os.RemoveAll(d) })
	}
	// Maps sized for twice ENTRIES: the bursts of the ring-buffer fault and
	// the pods' flows must never make the LRU evict the background's
	// entries, which are counted at the end.
	ctRoot := filepath.Join(netnsnode.BPFDir, "globals")
	maps, err := netnsnode.CreateCTMaps(ctRoot, 2*s.cfg.Entries)
	if err != nil {
		return err
	}
	s.maps = maps
	s.cleanup.Push("unpin CT maps", maps.Close)
	nbg := netnsnode.BackgroundPodCount(s.cfg.Entries)
	s.plan = netnsnode.FillPlan{Entries: s.cfg.Entries, Background: netnsnode.BackgroundPods(netnsnode.BGPods4, netnsnode.BGPods6, nbg)}
	put, took, err := netnsnode.Fill(ctx, maps, s.plan)
	if err != nil {
		return err
	}
	s.logf("filled %d entries (%d synthetic pods) in %s", put, nbg, took.Round(time.Millisecond))
	if s.bgBefore, err = countRange(maps, netnsnode.BGPods4, netnsnode.BGPods6); err != nil {
		return err
	}
	if err := s.setChecker(ctRoot); err != nil {
		return err
	}
	dp, err := netnsnode.NewDatapath(maps, soakLifetimes)
	if err != nil {
		return err
	}
	s.cleanup.Push("unload the datapath stand-in", dp.Close)
	s.dp = dp
	return nil
}

// setUpNode starts scrubd on the maps, creates the node and the outside
// host, the chain, the two long-lived pods, and containerd for the CRI
// part (unless it is skipped: res.CRISkipped says why).
func (s *soak) setUpNode(ctx context.Context) error {
	cfg := s.cfg
	var err error
	s.dcfg = netnsnode.NodeDaemonConfig(cfg.BinDir, s.maps.Dir())
	s.dcfg.RingBytes = soakRingBytes
	if s.d, err = netnsnode.StartDaemon(ctx, s.cleanup, s.dcfg); err != nil {
		return err
	}
	node, err := netnsnode.AddNode(s.cleanup, netnsnode.NodeNS)
	if err != nil {
		return err
	}
	s.node = node
	if _, err := netnsnode.AddOutside(s.cleanup); err != nil {
		return err
	}
	out, err := netnsnode.StartServer(netnsnode.NetnsPath(netnsnode.OutsideNS))
	if err != nil {
		return err
	}
	s.cleanup.Push("stop the outside host's servers", func() error { out.Close(); return nil })
	// Two long-lived pods, then two addresses for the cycling pods: every new
	// pod gets the address the pod before it released.
	const longLived, slots = 2, 2
	s.ch, err = netnsnode.NewChain(netnsnode.ChainConfig{Node: node, WorkDir: netnsnode.WorkDir, RefPlugins: cfg.RefPlugins,
		Plugin: filepath.Join(cfg.BinDir, "ctscrub"), Socket: s.d.Socket, RangeSize: longLived + slots})
	if err != nil {
		return err
	}
	// The start bursts' pods get addresses of their own: many at once would
	// not fit in the cycles' two.
	s.burstCh, err = netnsnode.NewChain(netnsnode.ChainConfig{Node: node, WorkDir: filepath.Join(netnsnode.WorkDir, "burst"), RefPlugins: cfg.RefPlugins,
		Plugin: filepath.Join(cfg.BinDir, "ctscrub"), Socket: s.d.Socket, Name: netnsnode.NetName + "-burst", RangeFrom: burstRangeFrom, RangeSize: burstRangeSize})
	if err != nil {
		return err
	}
	for i := range longLived {
		p, err := s.add(ctx, fmt.Sprintf("keep-%d", i))
		if err != nil {
			return err
		}
		srv, err := netnsnode.StartServer(p.Netns)
		if err != nil {
			return err
		}
		s.cleanup.Push("stop a pod's servers", func() error { srv.Close(); return nil })
		s.others = append(s.others, p)
	}
	if err := netnsnode.WaitDAD(ctx, netnsnode.BridgeName); err != nil {
		return err
	}
	skip, err := s.setupCRI(ctx)
	if err != nil {
		return fmt.Errorf("containerd for the CRI part: %w", err)
	}
	if skip != "" {
		s.res.CRISkipped = skip
		s.logf("CRI part skipped: %s", skip)
	} else {
		s.logf("containerd (CRI) running in the node netns: every %d. cycle's pod is a pod sandbox", s.cfg.CRIEvery)
	}
	return nil
}

// background starts the long-lived pods' traffic: new flows to each other
// and to the outside host every 200 ms. It returns the count of flows
// answered and the function that stops it and waits for it.
func (s *soak) background(ctx context.Context) (*atomic.Int64, func()) {
	bgCtx, stopBG := context.WithCancel(ctx)
	var bgWG sync.WaitGroup
	var bgFlows atomic.Int64
	others := s.others
	bgWG.Go(func() {
		for bgCtx.Err() == nil {
			s.bgMu.Lock()
			for i, p := range others {
				peer := others[(i+1)%len(others)]
				for _, dst := range []netip.Addr{netnsnode.OutsideAddr[0].Addr(), peer.V4, netnsnode.OutsideAddr[1].Addr()} {
					n, _ := netnsnode.SendTraffic(bgCtx, p.Netns, dst, netnsnode.TrafficCounts{TCP: 2, UDP: 2})
					bgFlows.Add(int64(n))
				}
			}
			s.bgMu.Unlock()
			select {
			case <-bgCtx.Done():
			case <-time.After(200 * time.Millisecond):
			}
		}
	})
	return &bgFlows, func() { stopBG(); bgWG.Wait() }
}
