package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/internal/ciliumwalk"
	"github.com/ctscrub/ctscrub/internal/netnsnode"
	"github.com/ctscrub/ctscrub/internal/testsupport/standin"
	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/cilium"
	"github.com/ctscrub/ctscrub/scrubd/client"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// FaultResult is one injected fault and what the node did.
type FaultResult struct {
	Name    string  `json:"name"`
	Cycle   int     `json:"cycle"`
	Outcome string  `json:"outcome"`
	OK      bool    `json:"ok"`
	Skipped bool    `json:"skipped,omitempty"` // not caused in this run (the outcome says why)
	WindowS float64 `json:"window_s"`          // how long CNI calls could fail because of it
	// scrubd's RSS right before and right after the fault: which fault a
	// step in rss_start -> rss_end comes from.
	RSSBefore int64 `json:"rss_before_bytes,omitempty"`
	RSSAfter  int64 `json:"rss_after_bytes,omitempty"`
}

// SoakResult is the last line.
type SoakResult struct {
	Cycles           int           `json:"cycles"`
	Entries          int           `json:"entries"`
	StaleEntriesLeft int           `json:"stale_entries_left"`
	WrongDeletions   int           `json:"wrong_deletions"`
	FailedAdds       int           `json:"failed_adds"`
	FailedDels       int           `json:"failed_dels"`
	FailedAddsInWin  int           `json:"failed_adds_in_fault_windows"`
	FailedDelsInWin  int           `json:"failed_dels_in_fault_windows"`
	CRICycles        int           `json:"cri_cycles"`            // cycles whose pod went through containerd's CRI
	CRISkipped       string        `json:"cri_skipped,omitempty"` // why no pod did
	AddP99S          float64       `json:"add_p99_s"`
	AddP50S          float64       `json:"add_p50_s"`
	Faults           []FaultResult `json:"faults"`
	// RSS: the median of one reading per cycle over the first tenth of
	// the cycles (after the warm-up, before the first fault) and over the
	// last tenth (after the last fault). One reading at each end lands
	// anywhere on the GC's sawtooth (a few MiB here), the medians compare
	// like with like.
	RSSStart int64 `json:"rss_start_bytes"`
	RSSEnd   int64 `json:"rss_end_bytes"`
	// The heap the last GC found live (go_gc_heap_live_bytes) at the end
	// of the first tenth and at the end: a leak grows it, the GC's
	// sawtooth does not.
	HeapLiveStart int64 `json:"heap_live_start_bytes"`
	HeapLiveEnd   int64 `json:"heap_live_end_bytes"`
	// The same medians of RssAnon alone: scrubd's own memory (heap,
	// stacks, runtime). VmRSS also counts pages mapped from elsewhere:
	// the binary's code as more of it runs, and the ring buffer's pages,
	// which the kernel allocated when it created the map and which count
	// once the reader has reached them (twice: the ring is mapped twice).
	RSSAnonStart int64 `json:"rss_anon_start_bytes"`
	RSSAnonEnd   int64 `json:"rss_anon_end_bytes"`
	// RssFile and RssShmem at the end (the code pages and the ring's).
	RSSFileEnd  int64 `json:"rss_file_end_bytes"`
	RSSShmemEnd int64 `json:"rss_shmem_end_bytes"`
	// Keys in scrubd's index at the end of the first tenth and at the
	// end: the long-lived pods' flows are indexed for as long as their CT
	// entries live, so the index (and the heap) follows the CT table.
	// The warm-up before the first cycle (warmUp): how long it ran, and
	// scrubd's RSS and index keys when it began (scrubd just started) and
	// when it ended. Nothing of the run is hidden by it: the cycles' first
	// tenth starts where it ends.
	WarmupS            float64 `json:"warmup_s"`
	RSSWarmupStart     int64   `json:"rss_warmup_start_bytes"`
	RSSWarmupEnd       int64   `json:"rss_warmup_end_bytes"`
	IndexKeysWarmupEnd int64   `json:"index_keys_warmup_end"`
	IndexKeysStart     int64   `json:"index_keys_start"`
	IndexKeysEnd       int64   `json:"index_keys_end"`
	FDsStart           int     `json:"fds_start"`
	FDsEnd             int     `json:"fds_end"`
	GoroutinesStart    int     `json:"goroutines_start"`
	GoroutinesEnd      int     `json:"goroutines_end"`
	DurationS          float64 `json:"duration_s"`
	Pass               bool    `json:"pass"`
}

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

// snapshotKeep reads the long-lived pods' entries with none of their
// connections open. A TCP entry read while its connection is open has the
// lifetime of an open connection; the close then shortens it to Cilium's
// close timeout and the expiry pass deletes it, which the final check
// counted as a wrong deletion (2 in a run of 2026-12-01: one pod-to-pod
// connection, its OUT and IN entries).
func (s *soak) snapshotKeep(ips []netip.Addr) (map[anyKey]uint32, error) {
	s.bgMu.Lock()
	defer s.bgMu.Unlock()
	time.Sleep(300 * time.Millisecond) // the last round's FIN exchanges
	return keysOf(s.maps, ips)
}

// setChecker makes the soak's own count pass over the CT maps pinned now.
func (s *soak) setChecker(ctRoot string) error {
	cm, err := ctmap.Open(ctRoot)
	if err != nil {
		return err
	}
	cb, err := cilium.New(cm, index.New(index.Config{}), cilium.Options{})
	if err != nil {
		cm.Close()
		return err
	}
	s.cleanup.Push("close the check's sweep programs", func() error { cb.Close(); cm.Close(); return nil })
	s.checker = cb.Sweeper()
	return nil
}

// add creates a pod through the chain and puts the Cilium stand-in on its
// host-side veth, so its traffic makes CT entries.
func (s *soak) add(ctx context.Context, name string) (*netnsnode.Pod, error) {
	p, err := s.ch.Add(ctx, s.cleanup, name)
	if err != nil {
		return p, err
	}
	if err := netnsnode.InNetns(s.node, func() error { return s.dp.Attach(p.HostVeth) }); err != nil {
		return p, fmt.Errorf("attach the datapath stand-in to %s: %w", p.HostVeth, err)
	}
	return p, nil
}

// leftOf counts the entries of ips left in the kernel's CT maps: an
// in-kernel pass over every map (ctscrub's own sweep program, count only,
// through a private index-less backend of this process), so the check does
// not depend on scrubd or its index.
func (s *soak) leftOf(ctx context.Context, ips []netip.Addr) (int, error) {
	r, err := s.checker.Sweep(ctx, ips, true)
	if err != nil {
		return 0, err
	}
	if !r.Complete {
		return 0, errors.New("check pass did not complete")
	}
	n := 0
	for _, c := range r.Deleted {
		n += c
	}
	return n, nil
}

// delAndCount DELs p through libcni and counts its IPs' entries left
// once scrubd's late DEL scrub of them ran (docs/daemon.md, "The DEL
// window"), as every cycle does.
func (s *soak) delAndCount(ctx context.Context, p *netnsnode.Pod) (left int, delErr, countErr error) {
	lateBefore := s.metric("ctscrub_del_late_total")
	if _, delErr = s.ch.Del(ctx, p); delErr == nil {
		s.waitLate(lateBefore, len(p.IPs()))
	}
	left, countErr = s.leftOf(ctx, p.IPs())
	return left, delErr, countErr
}

func (s *soak) daemon() *netnsnode.Daemon {
	s.dmu.Lock()
	defer s.dmu.Unlock()
	return s.d
}

func (s *soak) logf(format string, a ...any) {
	fmt.Fprintf(s.w, "[%s] "+format+"\n", append([]any{time.Now().UTC().Format("15:04:05")}, a...)...)
}

func runSoak(ctx context.Context, cfg SoakConfig, cleanup *netnsnode.Cleanup, w io.Writer) (*SoakResult, error) {
	start := time.Now()
	s := &soak{cfg: cfg, w: w, cleanup: cleanup, spare: netip.MustParseAddr("10.199.1.200")}
	s.res.Cycles, s.res.Entries = cfg.Cycles, cfg.Entries
	if err := netnsnode.RemoveLeftovers(w); err != nil {
		return nil, err
	}
	for _, d := range []string{netnsnode.WorkDir, netnsnode.BPFDir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, err
		}
		cleanup.Push("remove "+d, func() error { return os.RemoveAll(d) })
	}
	// Maps sized for twice ENTRIES: the bursts of the ring-buffer fault and
	// the pods' flows must never make the LRU evict the background's
	// entries, which are counted at the end.
	ctRoot := filepath.Join(netnsnode.BPFDir, "globals")
	maps, err := netnsnode.CreateCTMaps(ctRoot, 2*cfg.Entries)
	if err != nil {
		return nil, err
	}
	s.maps = maps
	cleanup.Push("unpin CT maps", maps.Close)
	nbg := min(max(64, cfg.Entries/256), 16384)
	nbg -= nbg % 4
	s.plan = netnsnode.FillPlan{Entries: cfg.Entries, Background: netnsnode.BackgroundPods(netnsnode.BGPods4, netnsnode.BGPods6, nbg)}
	put, took, err := netnsnode.Fill(ctx, maps, s.plan)
	if err != nil {
		return nil, err
	}
	s.logf("filled %d entries (%d synthetic pods) in %s", put, nbg, took.Round(time.Millisecond))
	if s.bgBefore, err = countRange(maps, netnsnode.BGPods4, netnsnode.BGPods6); err != nil {
		return nil, err
	}
	if err := s.setChecker(ctRoot); err != nil {
		return nil, err
	}
	dp, err := netnsnode.NewDatapath(maps, soakLifetimes)
	if err != nil {
		return nil, err
	}
	cleanup.Push("unload the datapath stand-in", dp.Close)
	s.dp = dp
	s.dcfg = netnsnode.DaemonConfig{Bin: filepath.Join(cfg.BinDir, "scrubd"), WorkDir: netnsnode.WorkDir, PinDir: filepath.Join(netnsnode.BPFDir, "scrubd"),
		CTRoot: ctRoot, PodCIDRs: []netip.Prefix{netnsnode.PodCIDR4, netnsnode.PodCIDR6}, RingBytes: soakRingBytes}
	if s.d, err = netnsnode.StartDaemon(ctx, cleanup, s.dcfg); err != nil {
		return nil, err
	}
	node, err := netnsnode.AddNode(cleanup, netnsnode.NodeNS)
	if err != nil {
		return nil, err
	}
	s.node = node
	if _, err := netnsnode.AddOutside(cleanup); err != nil {
		return nil, err
	}
	out, err := netnsnode.StartServer(netnsnode.NetnsPath(netnsnode.OutsideNS))
	if err != nil {
		return nil, err
	}
	cleanup.Push("stop the outside host's servers", func() error { out.Close(); return nil })
	// Two long-lived pods, then two addresses for the cycling pods: every new
	// pod gets the address the pod before it released.
	const longLived, slots = 2, 2
	s.ch, err = netnsnode.NewChain(netnsnode.ChainConfig{Node: node, WorkDir: netnsnode.WorkDir, RefPlugins: cfg.RefPlugins,
		Plugin: filepath.Join(cfg.BinDir, "ctscrub"), Socket: s.d.Socket, RangeSize: longLived + slots})
	if err != nil {
		return nil, err
	}
	var others []*netnsnode.Pod
	for i := range longLived {
		p, err := s.add(ctx, fmt.Sprintf("keep-%d", i))
		if err != nil {
			return nil, err
		}
		srv, err := netnsnode.StartServer(p.Netns)
		if err != nil {
			return nil, err
		}
		cleanup.Push("stop a pod's servers", func() error { srv.Close(); return nil })
		others = append(others, p)
	}
	if err := netnsnode.WaitDAD(ctx, netnsnode.BridgeName); err != nil {
		return nil, err
	}
	skip, err := s.setupCRI(ctx)
	if err != nil {
		return nil, fmt.Errorf("containerd for the CRI part: %w", err)
	}
	if skip != "" {
		s.res.CRISkipped = skip
		s.logf("CRI part skipped: %s", skip)
	} else {
		s.logf("containerd (CRI) running in the node netns: every %d. cycle's pod is a pod sandbox", s.cfg.CRIEvery)
	}
	// Background traffic: the long-lived pods keep making new flows.
	bgCtx, stopBG := context.WithCancel(ctx)
	var bgWG sync.WaitGroup
	var bgFlows atomic.Int64
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
	defer func() { stopBG(); bgWG.Wait() }()
	s.others = others
	time.Sleep(time.Second)
	if err := s.warmUp(ctx); err != nil {
		return nil, err
	}
	if s.keep, err = s.snapshotKeep(append(others[0].IPs(), others[1].IPs()...)); err != nil {
		return nil, err
	}
	s.logf("long-lived pods %s, %s: %d CT entries so far; cycles start", others[0].V4, others[1].V4, len(s.keep))

	faults := s.schedule()
	tenth := max(1, cfg.Cycles/10)
	var rssFirst, rssLast, anonFirst, anonLast []int64 // per cycle, first and last tenth
	firstPid := 0
	for i := 0; i < cfg.Cycles; i++ {
		if ctx.Err() != nil {
			return &s.res, ctx.Err()
		}
		if f := faults[i]; f != nil {
			before, _, _ := s.procFigures()
			fr := f(ctx, i)
			fr.Cycle = i
			fr.RSSBefore = before
			fr.RSSAfter, _, _ = s.procFigures()
			s.res.Faults = append(s.res.Faults, fr)
			s.logf("fault %s at cycle %d: %s (ok %v)", fr.Name, i, fr.Outcome, fr.OK)
		}
		if err := s.cycle(ctx, i, others); err != nil {
			return &s.res, err
		}
		switch m := s.memory(); {
		case i < tenth:
			if pid := s.daemon().Pid(); pid != firstPid {
				firstPid, rssFirst, anonFirst = pid, nil, nil // a restarted scrubd starts over
			}
			rssFirst, anonFirst = append(rssFirst, m["VmRSS"]), append(anonFirst, m["RssAnon"])
		case i >= cfg.Cycles-tenth:
			rssLast, anonLast = append(rssLast, m["VmRSS"]), append(anonLast, m["RssAnon"])
		}
		if i == tenth-1 {
			_, s.res.FDsStart, s.res.GoroutinesStart = s.procFigures()
			s.res.HeapLiveStart = int64(s.metric("go_gc_heap_live_bytes"))
			s.res.IndexKeysStart = int64(s.metric("ctscrub_index_keys"))
		}
		if i%max(1, cfg.Cycles/20) == 0 {
			s.logf("cycle %d/%d: stale %d, CRI cycles %d, failed adds %d (in fault windows %d), failed dels %d (%d), background flows %d",
				i, cfg.Cycles, s.res.StaleEntriesLeft, s.res.CRICycles, s.res.FailedAdds, s.res.FailedAddsInWin, s.res.FailedDels, s.res.FailedDelsInWin, bgFlows.Load())
		}
	}
	_, s.res.FDsEnd, s.res.GoroutinesEnd = s.procFigures()
	s.res.HeapLiveEnd = int64(s.metric("go_gc_heap_live_bytes"))
	s.res.IndexKeysEnd = int64(s.metric("ctscrub_index_keys"))
	s.res.RSSStart, s.res.RSSEnd = netnsnode.Median(rssFirst), netnsnode.Median(rssLast)
	s.res.RSSAnonStart, s.res.RSSAnonEnd = netnsnode.Median(anonFirst), netnsnode.Median(anonLast)
	m := s.memory()
	s.res.RSSFileEnd, s.res.RSSShmemEnd = m["RssFile"], m["RssShmem"]
	stopBG()
	bgWG.Wait()

	// Every other pod's entries are intact: the synthetic pods' entries all
	// there, and every entry the long-lived pods had before the cycles
	// either there or expired by its own lifetime.
	bgAfter, err := countRange(maps, netnsnode.BGPods4, netnsnode.BGPods6)
	if err != nil {
		return &s.res, err
	}
	s.res.WrongDeletions = max(0, s.bgBefore-bgAfter)
	now := netnsnode.MonotonicSeconds()
	for k, lt := range s.keep {
		if !present(maps, k) && lt >= now {
			s.res.WrongDeletions++
			if s.res.WrongDeletions <= 10 {
				s.logf("wrong deletion: %s entry %s gone, its lifetime at the snapshot %d s, now %d s", k.kind.Name(), k, lt, now)
			}
		}
	}
	s.res.AddP50S, s.res.AddP99S = pct(s.addLat, 50), pct(s.addLat, 99)
	s.res.DurationS = time.Since(start).Seconds()
	flat := func(a, b int64) bool { return a > 0 && float64(b) <= float64(a)*1.1 && float64(b) >= float64(a)*0.9 }
	s.res.Pass = s.res.StaleEntriesLeft == 0 && s.res.WrongDeletions == 0 &&
		s.res.FailedAdds == s.res.FailedAddsInWin && s.res.FailedDels == s.res.FailedDelsInWin &&
		flat(s.res.RSSStart, s.res.RSSEnd) && flat(int64(s.res.FDsStart), int64(s.res.FDsEnd))
	for _, f := range s.res.Faults {
		s.res.Pass = s.res.Pass && (f.OK || f.Skipped)
	}
	s.logf("background: %d entries before, %d after; long-lived pods' entries checked: %d", s.bgBefore, bgAfter, len(s.keep))
	return &s.res, nil
}

// cycle creates a pod (ADD through the chain, or every CRI_EVERY-th through
// containerd's CRI), makes flows to and from it, deletes it (DEL) and walks
// the maps for its IPs.
func (s *soak) cycle(ctx context.Context, i int, others []*netnsnode.Pod) error {
	add := func(attempt int) (*netnsnode.Pod, error) { return s.add(ctx, fmt.Sprintf("c%d-%d", i, attempt)) }
	del := func(p *netnsnode.Pod) error { _, err := s.ch.Del(ctx, p); return err }
	// The runtime's cleanup of a failed ADD: DEL, then retry.
	undo := func(p *netnsnode.Pod, attempt int) {
		if p != nil {
			_, _ = s.ch.Del(ctx, p)
		} else {
			_ = netnsnode.DelNetns(netnsnode.NamePrefix + "-" + fmt.Sprintf("c%d-%d", i, attempt))
		}
	}
	via := "libcni"
	if s.cri != nil && s.cfg.CRIEvery > 0 && i%s.cfg.CRIEvery == s.cfg.CRIEvery-1 {
		via = "CRI"
		s.res.CRICycles++
		// containerd cleans up a RunPodSandbox that failed; a sandbox that
		// ran but could not be read is removed as a kubelet would.
		add = func(attempt int) (*netnsnode.Pod, error) { return s.criAdd(ctx, fmt.Sprintf("c%d", i), attempt) }
		del = func(p *netnsnode.Pod) error { return s.criDel(ctx, p) }
		undo = func(p *netnsnode.Pod, _ int) {
			if p != nil && p.ContainerID != "" {
				_ = s.criDel(ctx, p)
			}
		}
	}
	var p *netnsnode.Pod
	var err error
	for attempt := 0; ; attempt++ {
		t0 := time.Now()
		p, err = add(attempt)
		if err == nil {
			s.addLat = append(s.addLat, time.Since(t0))
			break
		}
		s.res.FailedAdds++
		if s.inWindow() {
			s.res.FailedAddsInWin++
		} else {
			s.logf("cycle %d: ADD (%s) failed outside any fault window: %v", i, via, err)
		}
		undo(p, attempt)
		if attempt >= 60 {
			return fmt.Errorf("cycle %d: ADD (%s) failed 60 times: %v", i, via, err)
		}
		time.Sleep(500 * time.Millisecond)
	}
	// Flows out (to the outside host and a long-lived pod) and in.
	_, _ = netnsnode.SendTraffic(ctx, p.Netns, netnsnode.OutsideAddr[0].Addr(), netnsnode.TrafficCounts{TCP: 2, UDP: 2, Ping: 1})
	_, _ = netnsnode.SendTraffic(ctx, p.Netns, netnsnode.OutsideAddr[1].Addr(), netnsnode.TrafficCounts{TCP: 1, UDP: 1})
	_, _ = netnsnode.SendTraffic(ctx, p.Netns, others[0].V4, netnsnode.TrafficCounts{TCP: 1, UDP: 1})
	_, _ = netnsnode.SendTraffic(ctx, netnsnode.NetnsPath(netnsnode.OutsideNS), p.V4, netnsnode.TrafficCounts{TCP: 1})
	lateBefore := s.metric("ctscrub_del_late_total")
	for attempt := 0; ; attempt++ {
		err = del(p)
		if err == nil {
			break
		}
		s.res.FailedDels++
		if s.inWindow() {
			s.res.FailedDelsInWin++
		} else {
			s.logf("cycle %d: DEL (%s) failed outside any fault window: %v", i, via, err)
		}
		if attempt >= 60 {
			return fmt.Errorf("cycle %d: DEL (%s) failed 60 times: %v", i, via, err)
		}
		time.Sleep(500 * time.Millisecond)
	}
	// scrubd's late scrub of what the DEL window recorded, once the veth
	// is gone (docs/daemon.md, "The DEL window").
	s.waitLate(lateBefore, len(p.IPs()))
	// A full walk of the kernel's maps: no entry of the deleted IPs left.
	// (The next pod with the address would also clean them at its ADD; this
	// checks the DEL alone.)
	left, err := s.leftOf(ctx, p.IPs())
	if err != nil {
		return err
	}
	if left > 0 {
		s.res.StaleEntriesLeft += left
		s.logf("cycle %d: %d entries of %v (%s) left after DEL", i, left, p.IPs(), via)
	}
	return nil
}

func (s *soak) inWindow() bool { return s.window.Load() > 0 }

// openWindow marks a fault window: CNI calls may fail until it closes, and
// the time it stayed open is the fault's window.
func (s *soak) openWindow() func() float64 {
	s.window.Add(1)
	t := time.Now()
	return func() float64 {
		// A grace for the call that was in flight when the fault ended.
		time.Sleep(200 * time.Millisecond)
		s.window.Add(-1)
		return time.Since(t).Seconds()
	}
}

type faultFn func(ctx context.Context, cycle int) FaultResult

// schedule spreads the faults over the middle of the run, from 15 % to
// 75 %: the first tenth of the cycles is the node at its steady state before
// any fault (the baseline of rss_start), the last tenth the node at least
// 15 % of the run after the last one (rss_end). The SIGKILL comes first, so
// the restarted scrubd has most of the run to fill its index again.
func (s *soak) schedule() map[int]faultFn {
	n := s.cfg.Cycles
	at := func(frac float64) int { return min(n-1, max(1, int(float64(n)*frac))) }
	m := map[int]faultFn{
		at(0.15): s.faultKill,
		at(0.25): s.faultDeadline,
		at(0.35): s.faultRingOverrun,
		at(0.45): s.faultPinsRemoved,
		at(0.50): s.faultSocketRemoved,
		at(0.65): s.faultCTMapsRecreated,
		at(0.75): s.faultContainerdRestart,
	}
	if s.cfg.Starve > 0 {
		m[at(0.55)] = s.faultStarve
	}
	return m
}

// warmUpMin is the shortest warm-up: one lifetime of the background's UDP
// entries (the stand-in's non-TCP lifetime, 60 s) and one expiry interval
// (60 s), after which the long-lived pods' CT entries, and so their index
// keys, are as many as they will be.
const warmUpMin = 2 * time.Minute

// warmUp lets the background traffic run, before the first cycle, until
// scrubd is at the steady state of that load: neither its RSS (by more than
// 1 %) nor its index's key count (by more than 2 %) has set a new high for
// 60 s, and at least warmUpMin has passed; at most cfg.WarmupMax. The index
// keeps an IP's stale keys until its set has doubled (then prunes it), so
// its key count rises for a few minutes after the CT entries have levelled
// off, and scrubd's heap with it. Without the warm-up the first tenth of a
// 500-cycle run (about a minute) caught scrubd mid-fill and rss_end was 13-19
// % above rss_start with no leak behind it (docs/soak.md).
func (s *soak) warmUp(ctx context.Context) error {
	start := time.Now()
	rss := func() int64 { return s.memory()["VmRSS"] }
	s.res.RSSWarmupStart = rss()
	defer func() {
		s.res.WarmupS = time.Since(start).Seconds()
		s.res.RSSWarmupEnd = rss()
		s.res.IndexKeysWarmupEnd = int64(s.metric("ctscrub_index_keys"))
		s.logf("warm-up: %.0f s; scrubd RSS %.1f -> %.1f MiB, index %d keys", s.res.WarmupS,
			float64(s.res.RSSWarmupStart)/(1<<20), float64(s.res.RSSWarmupEnd)/(1<<20), s.res.IndexKeysWarmupEnd)
	}()
	if s.cfg.WarmupMax <= 0 {
		return nil
	}
	var highRSS, highKeys float64
	lastHigh := start
	for {
		now := time.Now()
		if r, k := float64(rss()), s.metric("ctscrub_index_keys"); r > highRSS*1.01 || k > highKeys*1.02 {
			highRSS, highKeys, lastHigh = max(highRSS, r), max(highKeys, k), now
		}
		switch {
		case now.Sub(start) >= s.cfg.WarmupMax:
			return nil
		case now.Sub(start) >= warmUpMin && now.Sub(lastHigh) >= time.Minute:
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(5 * time.Second):
		}
	}
}

// faultKill: scrubd is SIGKILLed while a sweep runs in the kernel (a scrub
// of an address no pod has, which sweeps the whole maps), then restarted.
func (s *soak) faultKill(ctx context.Context, _ int) FaultResult {
	r := FaultResult{Name: "scrubd SIGKILLed mid-scrub, restarted"}
	closeWin := s.openWindow()
	d := s.daemon()
	done := make(chan error, 1)
	go func() {
		_, err := d.Client.Scrub(ctx, api.ScrubRequest{IPs: []netip.Addr{s.spare}, Reason: scrub.ReasonDel})
		done <- err
	}()
	// 30 ms into a sweep of 4 M entries; at the development size the
	// whole sweep takes less than that on a quiet machine (the scrub
	// answered before the kill), so the delay shrinks with ENTRIES.
	time.Sleep(time.Duration(min(30, max(3, 30*s.cfg.Entries/(1<<22)))) * time.Millisecond)
	_ = d.Signal(syscall.SIGKILL)
	<-d.Exited()
	err := <-done
	nd, serr := netnsnode.StartDaemon(ctx, s.cleanup, s.dcfg)
	r.WindowS = closeWin()
	if serr != nil {
		r.Outcome = "restart failed: " + serr.Error()
		return r
	}
	s.dmu.Lock()
	s.d = nd
	s.dmu.Unlock()
	r.OK = err != nil
	r.Outcome = fmt.Sprintf("the scrub in flight got %v; restarted in %.2fs, serving", errString(err), r.WindowS)
	return r
}

// faultDeadline: a sweep whose caller's deadline passes mid-pass answers
// cancelled; the retry completes.
func (s *soak) faultDeadline(ctx context.Context, _ int) FaultResult {
	r := FaultResult{Name: "sweep cancelled by its caller's deadline"}
	c := s.daemon().Client
	cctx, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	_, err := c.Scrub(cctx, api.ScrubRequest{IPs: []netip.Addr{s.spare}, Reason: scrub.ReasonDel})
	cancel()
	e, isAPI := client.APIError(err)
	cancelled := (isAPI && e.Code == api.CodeCancelled) || errors.Is(err, context.DeadlineExceeded)
	resp, rerr := c.Scrub(ctx, api.ScrubRequest{IPs: []netip.Addr{s.spare}, Reason: scrub.ReasonDel})
	r.OK = cancelled && rerr == nil && resp.Results[0].Outcome == scrub.Complete
	r.Outcome = fmt.Sprintf("first answer: %s; retry: %s", errString(err), outcomeOf(resp, rerr))
	return r
}

// soakRingBytes is the recorder's ring buffer in the soak: 1 MiB, about
// 18,700 records, so the ring-buffer fault's burst (tens of thousands of new
// flows) overruns it for certain at every ENTRIES, while the cycles' and the
// background's few flows a second never come near it.
const soakRingBytes = 1 << 20

// faultRingOverrun: scrubd is stopped (SIGSTOP) so its reader drains
// nothing, a pod makes more new flows than the ring buffer holds, scrubd is
// continued. The kernel must count the records lost, scrubd must show them
// (ctscrub_index_lost_total) and mark the pod's IP incomplete, and its DEL
// must leave nothing (it sweeps).
func (s *soak) faultRingOverrun(ctx context.Context, cycle int) FaultResult {
	r := FaultResult{Name: "ring buffer overrun by a burst of new flows"}
	closeWin := s.openWindow()
	p, err := s.add(ctx, fmt.Sprintf("burst-%d", cycle))
	if err != nil {
		r.WindowS = closeWin()
		r.Outcome = "ADD of the burst pod failed: " + err.Error()
		return r
	}
	d := s.daemon()
	lostBefore := s.metric("ctscrub_index_lost_total")
	_ = d.Signal(syscall.SIGSTOP)
	// Four times the ring's records, within what the maps have room for.
	flows := min(4*soakRingBytes/56, s.cfg.Entries/2)
	sent, berr := burst(p.Netns, netnsnode.OutsideAddr[0].Addr(), flows)
	_ = d.Signal(syscall.SIGCONT)
	// scrubd polls the kernel's lost counters every second.
	var lost float64
	var st *api.IPState
	t0 := time.Now()
	for time.Since(t0) < 15*time.Second {
		lost = s.metric("ctscrub_index_lost_total") - lostBefore
		st, _ = d.Client.IndexIP(ctx, p.V4)
		if lost > 0 && st != nil && st.Incomplete != "" {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	keys := 0
	incomplete := ""
	if st != nil {
		keys, incomplete = st.Keys, st.Incomplete
	}
	left, derr, werr := s.delAndCount(ctx, p)
	// The next pod gets the address again: its ADD scrub is the safety net
	// for what the DEL missed.
	inherited := -1
	if np, err := s.add(ctx, fmt.Sprintf("burst-%d-next", cycle)); err == nil {
		if slices.Contains(np.IPs(), p.V4) {
			inherited, _ = s.leftOf(ctx, []netip.Addr{p.V4})
		}
		_, _ = s.ch.Del(ctx, np)
	}
	r.WindowS = closeWin()
	s.res.StaleEntriesLeft += left
	r.OK = berr == nil && derr == nil && werr == nil && left == 0 && lost > 0 && incomplete != ""
	r.Outcome = fmt.Sprintf("%d flows sent while scrubd was stopped (ring %d KiB); records lost %.0f; index then held %d keys of the pod, incomplete %q; DEL %s; entries left after the DEL %d; left after the next pod's ADD on the same address %d (-1: other address)",
		sent, soakRingBytes>>10, lost, keys, incomplete, errString(derr), left, inherited)
	if lost == 0 {
		r.Outcome += " (no record lost: the ring was not overrun)"
	}
	return r
}

// faultPinsRemoved: every pin of the recorder (maps and tcx links) is
// removed from bpffs under the running daemon.
func (s *soak) faultPinsRemoved(ctx context.Context, cycle int) FaultResult {
	r := FaultResult{Name: "bpffs pins of the recorder removed"}
	closeWin := s.openWindow()
	ents, _ := os.ReadDir(s.dcfg.PinDir)
	n := 0
	_ = filepath.WalkDir(s.dcfg.PinDir, func(path string, de os.DirEntry, err error) error {
		if err == nil && !de.IsDir() && os.Remove(path) == nil {
			n++
		}
		return nil
	})
	// The next pods must still be scrubbed clean: run two cycles' worth of
	// ADD, traffic, DEL and walk right here.
	left := 0
	var errs []string
	for j := range 2 {
		p, err := s.add(ctx, fmt.Sprintf("pins-%d-%d", cycle, j))
		if err != nil {
			errs = append(errs, err.Error())
			continue
		}
		_, _ = netnsnode.SendTraffic(ctx, p.Netns, netnsnode.OutsideAddr[0].Addr(), netnsnode.TrafficCounts{TCP: 2, UDP: 2})
		n, err, _ := s.delAndCount(ctx, p)
		if err != nil {
			errs = append(errs, err.Error())
		}
		left += n
	}
	s.res.StaleEntriesLeft += left
	r.WindowS = closeWin()
	r.OK = left == 0 && len(errs) == 0
	r.Outcome = fmt.Sprintf("%d pins removed (%d entries in the pin dir); 2 pods after it: %d entries left, errors %v", n, len(ents), left, errs)
	return r
}

// faultSocketRemoved: the API socket's file is removed under the running
// daemon; CNI calls fail until scrubd notices and listens again.
func (s *soak) faultSocketRemoved(ctx context.Context, _ int) FaultResult {
	r := FaultResult{Name: "API socket removed"}
	closeWin := s.openWindow()
	d := s.daemon()
	err := os.Remove(d.Socket)
	t0 := time.Now()
	back := false
	for time.Since(t0) < 30*time.Second {
		sctx, cancel := context.WithTimeout(ctx, time.Second)
		st, serr := d.Client.Status(sctx)
		cancel()
		if serr == nil && st.Ready {
			back = true
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	r.WindowS = closeWin()
	r.OK = err == nil && back
	r.Outcome = fmt.Sprintf("removed (%s); serving again after %.2fs: %v", errString(err), time.Since(t0).Seconds(), back)
	return r
}

// faultCTMapsRecreated: Cilium's CT maps are unpinned and re-created empty
// under the daemon, as an agent restart that re-creates its maps does: the
// datapath stand-in is detached, the maps replaced, the stand-in loaded
// again on the new maps and re-attached to the long-lived pods. scrubd must
// notice on its own (ctscrub_ct_maps_reopened_total), mark the indexed IPs
// incomplete (ctscrub_index_marked_incomplete_total), and scrub the new maps: a
// pod made after it is scrubbed clean. The background's entries went with
// the old maps; they are written again into the new ones, and the count of
// "other pods' entries" checked at the end restarts from there.
func (s *soak) faultCTMapsRecreated(ctx context.Context, cycle int) FaultResult {
	r := FaultResult{Name: "Cilium's CT maps unpinned and re-created"}
	closeWin := s.openWindow()
	fail := func(what string, err error) FaultResult {
		r.WindowS = closeWin()
		r.Outcome = what + ": " + err.Error()
		return r
	}
	reopened := s.metric("ctscrub_ct_maps_reopened_total")
	marked := s.metric("ctscrub_index_marked_incomplete_total")
	if err := s.dp.Close(); err != nil {
		return fail("detach the datapath stand-in", err)
	}
	t0 := time.Now()
	if err := s.maps.Recreate(2 * s.cfg.Entries); err != nil {
		return fail("re-create the CT maps", err)
	}
	dp, err := netnsnode.LoadDatapath(s.maps, soakLifetimes)
	if err != nil {
		return fail("reload the datapath stand-in", err)
	}
	s.cleanup.Push("unload the datapath stand-in", dp.Close)
	s.dp = dp
	for _, p := range s.others {
		if err := netnsnode.InNetns(s.node, func() error { return s.dp.Attach(p.HostVeth) }); err != nil {
			return fail("re-attach the datapath stand-in", err)
		}
	}
	if err := s.setChecker(s.maps.Dir()); err != nil {
		return fail("the soak's count pass on the new maps", err)
	}
	noticed := false
	for time.Since(t0) < 30*time.Second {
		if s.metric("ctscrub_ct_maps_reopened_total") > reopened {
			noticed = true
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	took := time.Since(t0)
	nMarked := s.metric("ctscrub_index_marked_incomplete_total") - marked
	st, _ := s.daemon().Client.IndexIP(ctx, s.others[0].V4)
	why := ""
	if st != nil {
		why = st.Incomplete
	}
	// The other pods' entries, again: the synthetic ones written into the
	// new maps, the long-lived pods' after a second of their traffic.
	put, ftook, err := netnsnode.Fill(ctx, s.maps, s.plan)
	if err != nil {
		return fail("refill the new maps", err)
	}
	if s.bgBefore, err = countRange(s.maps, netnsnode.BGPods4, netnsnode.BGPods6); err != nil {
		return fail("count the refilled maps", err)
	}
	time.Sleep(time.Second)
	ips := append(s.others[0].IPs(), s.others[1].IPs()...)
	if s.keep, err = s.snapshotKeep(ips); err != nil {
		return fail("read the long-lived pods' entries", err)
	}
	// Two pods through the whole cycle on the new maps.
	left := 0
	var errs []string
	for j := range 2 {
		p, err := s.add(ctx, fmt.Sprintf("ctmaps-%d-%d", cycle, j))
		if err != nil {
			errs = append(errs, err.Error())
			continue
		}
		_, _ = netnsnode.SendTraffic(ctx, p.Netns, netnsnode.OutsideAddr[0].Addr(), netnsnode.TrafficCounts{TCP: 2, UDP: 2, Ping: 1})
		_, _ = netnsnode.SendTraffic(ctx, netnsnode.NetnsPath(netnsnode.OutsideNS), p.V4, netnsnode.TrafficCounts{TCP: 1})
		n, derr, err := s.delAndCount(ctx, p)
		for _, e := range []error{derr, err} {
			if e != nil {
				errs = append(errs, e.Error())
			}
		}
		left += n
	}
	s.res.StaleEntriesLeft += left
	r.WindowS = closeWin()
	// An IP keeps the first reason it was marked for (the SIGKILL fault's
	// restart may have marked the long-lived pods before): incomplete is
	// what counts, and the marks of this fault are in nMarked.
	r.OK = noticed && nMarked > 0 && why != "" && left == 0 && len(errs) == 0
	r.Outcome = fmt.Sprintf("re-created; scrubd re-opened them: %v after %.2fs; IPs marked incomplete %.0f (long-lived pod %s: %q); refilled %d entries in %s, long-lived pods' entries now %d; 2 pods after it: %d entries left, errors %v",
		noticed, took.Seconds(), nMarked, s.others[0].V4, why, put, ftook.Round(time.Millisecond), len(s.keep), left, errs)
	return r
}

// faultStarve: both CPUs busy for STARVE_S while cycles go on.
func (s *soak) faultStarve(ctx context.Context, cycle int) FaultResult {
	r := FaultResult{Name: fmt.Sprintf("both CPUs starved by a busy loop for %s", s.cfg.Starve)}
	closeWin := s.openWindow()
	// One busy shell loop per CPU, at normal priority: they compete with
	// scrubd, the plugins and this process alike.
	var hogs []*exec.Cmd
	for range runtime.NumCPU() {
		c := exec.Command("sh", "-c", "while :; do :; done")
		if err := c.Start(); err == nil {
			hogs = append(hogs, c)
		}
	}
	stopHogs := func() {
		for _, c := range hogs {
			_ = c.Process.Kill()
			_ = c.Wait()
		}
	}
	defer stopHogs()
	t0 := time.Now()
	var lat []time.Duration
	var left, failed int
	for j := 0; time.Since(t0) < s.cfg.Starve; j++ {
		a := time.Now()
		p, err := s.add(ctx, fmt.Sprintf("starve-%d-%d", cycle, j))
		if err != nil {
			failed++
			continue
		}
		lat = append(lat, time.Since(a))
		_, _ = netnsnode.SendTraffic(ctx, p.Netns, netnsnode.OutsideAddr[0].Addr(), netnsnode.TrafficCounts{TCP: 1, UDP: 1})
		n, err, _ := s.delAndCount(ctx, p)
		if err != nil {
			failed++
		}
		left += n
	}
	stopHogs()
	s.res.StaleEntriesLeft += left
	r.WindowS = closeWin()
	r.OK = left == 0 && failed == 0
	r.Outcome = fmt.Sprintf("%d busy loops; %d pods created and deleted while starved: ADD p50 %.2fs max %.2fs; %d failed; %d entries left",
		len(hogs), len(lat), pct(lat, 50), pct(lat, 100), failed, left)
	return r
}

// burst sends one UDP datagram to each of n distinct destination ports from
// the netns at from: n new flows, answered or not.
func burst(from string, dst netip.Addr, n int) (int, error) {
	sent := 0
	err := netnsnode.InNetns(from, func() error {
		c, err := net.ListenPacket("udp", ":0")
		if err != nil {
			return err
		}
		defer c.Close()
		for i := range n {
			// 50,000 ports per address: distinct flows up to 100,000.
			port := 10000 + i%50000
			ip := dst
			if i/50000%2 == 1 {
				ip = netnsnode.OutsideAddr[1].Addr()
			}
			if _, err := c.WriteTo([]byte("x"), net.UDPAddrFromAddrPort(netip.AddrPortFrom(ip, uint16(port)))); err == nil {
				sent++
			}
		}
		return nil
	})
	return sent, err
}

// memory reads scrubd's VmRSS, RssAnon, RssFile and RssShmem in bytes.
func (s *soak) memory() map[string]int64 {
	m := map[string]int64{}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", s.daemon().Pid()))
	if err != nil {
		return m
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && strings.HasSuffix(f[0], ":") {
			if kb, err := strconv.ParseInt(f[1], 10, 64); err == nil {
				m[strings.TrimSuffix(f[0], ":")] = kb * 1024
			}
		}
	}
	return m
}

// procFigures reads scrubd's resident memory, open fds and goroutines.
func (s *soak) procFigures() (rss int64, fds, goroutines int) {
	rss = s.memory()["VmRSS"]
	if ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", s.daemon().Pid())); err == nil {
		fds = len(ents)
	}
	goroutines = int(s.metric("go_goroutines"))
	return rss, fds, goroutines
}

// metric reads one unlabelled (or summed) series from scrubd's /metrics.
func (s *soak) metric(name string) float64 {
	resp, err := http.Get("http://" + s.daemon().Metrics + "/metrics")
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	sum := 0.0
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, name+" ") || strings.HasPrefix(l, name+"{") {
			f := strings.Fields(l)
			v, _ := strconv.ParseFloat(f[len(f)-1], 64)
			sum += v
		}
	}
	return sum
}

// countRange counts the entries holding an address of either prefix.
func countRange(m *netnsnode.CTMaps, p4, p6 netip.Prefix) (int, error) {
	st, err := ciliumwalk.Batch(m.All(), func(kind ctmap.Kind, key []byte, _ *ctmap.Entry) bool {
		if kind.IPv6() {
			c := ctmap.CTKey6(key)
			return p6.Contains(c.DAddr()) || p6.Contains(c.SAddr())
		}
		c := ctmap.CTKey4(key)
		return p4.Contains(c.DAddr()) || p4.Contains(c.SAddr())
	}, ciliumwalk.Options{CountOnly: true})
	return st.Matched, err
}

type anyKey struct {
	kind ctmap.Kind
	key  string
}

// String is the key's tuple.
func (k anyKey) String() string {
	if k.kind.IPv6() {
		return ctmap.CTKey6([]byte(k.key)).String()
	}
	return ctmap.CTKey4([]byte(k.key)).String()
}

// keysOf returns the keys of ips's entries with their lifetimes.
func keysOf(m *netnsnode.CTMaps, ips []netip.Addr) (map[anyKey]uint32, error) {
	out := map[anyKey]uint32{}
	has := ciliumwalk.HasIP(ips...)
	for _, k := range ctmap.Kinds {
		var v ctmap.Entry
		it := m.Map(k).Iterate()
		if k.IPv6() {
			var key ctmap.CTKey6
			for it.Next(&key, &v) {
				if has(k, key[:], nil) {
					out[anyKey{k, string(key[:])}] = v.Lifetime()
				}
			}
		} else {
			var key ctmap.CTKey4
			for it.Next(&key, &v) {
				if has(k, key[:], nil) {
					out[anyKey{k, string(key[:])}] = v.Lifetime()
				}
			}
		}
		if err := it.Err(); err != nil {
			return nil, err
		}
	}
	return out, nil
}

func present(m *netnsnode.CTMaps, k anyKey) bool {
	var v ctmap.Entry
	return !errors.Is(m.Map(k.kind).Lookup([]byte(k.key), &v), ebpf.ErrKeyNotExist)
}

func pct(d []time.Duration, p int) float64 {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	i := min(len(s)-1, (len(s)*p+99)/100-1)
	return s[max(0, i)].Seconds()
}

func errString(err error) string {
	if err == nil {
		return "ok"
	}
	return err.Error()
}

func outcomeOf(resp *api.ScrubResponse, err error) string {
	if err != nil {
		return err.Error()
	}
	if len(resp.Results) == 0 {
		return "no result"
	}
	return fmt.Sprintf("%s via %s, %d deleted", resp.Results[0].Outcome, resp.Results[0].Method, resp.Results[0].Total)
}
