package main

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/ctscrub/ctscrub/internal/netnsnode"
)

// runCycles runs the cycles, each fault before its cycle (schedule), and
// reads scrubd's memory, fds, goroutines, heap and index over the baseline
// tenth of them and over the last tenth. The baseline is the first tenth;
// after the last fault that restarts scrubd, the soak re-warms the new
// process and the baseline is the tenth after that, so rss_start and
// rss_end are one process's.
func (s *soak) runCycles(ctx context.Context, bgFlows *atomic.Int64) error {
	cfg := s.cfg
	faults, restarting := s.schedule()
	lastRestart := -1
	for c := range restarting {
		if faults[c] != nil {
			lastRestart = max(lastRestart, c)
		}
	}
	tenth := max(1, cfg.Cycles/10)
	var rssFirst, rssLast, anonFirst, anonLast []int64 // per cycle, baseline and last tenth
	base := 0                                          // the baseline's first cycle
	pids := map[int]bool{}
	for i := 0; i < cfg.Cycles; i++ {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if f := faults[i]; f != nil {
			before, _, _ := s.procFigures()
			fr := f(ctx, i)
			fr.Cycle = i
			fr.RSSBefore = before
			fr.RSSAfter, _, _ = s.procFigures()
			s.res.Faults = append(s.res.Faults, fr)
			s.logf("fault %s at cycle %d: %s (ok %v)", fr.Name, i, fr.Outcome, fr.OK)
			if restarting[i] && !fr.Skipped {
				s.res.PlannedRestarts++
			}
			if i == lastRestart && i+tenth <= cfg.Cycles-tenth {
				if err := s.rewarm(ctx); err != nil {
					return err
				}
				if len(rssFirst) > 0 {
					s.res.RSSFirstProcess = netnsnode.Median(rssFirst)
				}
				base, rssFirst, anonFirst = i, nil, nil
			}
		}
		if err := s.cycle(ctx, i, s.others); err != nil {
			return err
		}
		pids[s.daemon().Pid()] = true
		switch m := s.memory(); {
		case i >= base && i < base+tenth:
			rssFirst, anonFirst = append(rssFirst, m["VmRSS"]), append(anonFirst, m["RssAnon"])
		case i >= cfg.Cycles-tenth:
			rssLast, anonLast = append(rssLast, m["VmRSS"]), append(anonLast, m["RssAnon"])
		}
		if i == base+tenth-1 {
			_, s.res.FDsStart, s.res.GoroutinesStart = s.procFigures()
			s.res.HeapLiveStart = int64(s.metric("go_gc_heap_live_bytes"))
			s.res.IndexKeysStart = int64(s.metric("ctscrub_index_keys"))
		}
		if i%max(1, cfg.Cycles/20) == 0 {
			s.logf("cycle %d/%d: stale %d, CRI cycles %d, failed adds %d (in fault windows %d), failed dels %d (%d), background flows %d",
				i, cfg.Cycles, s.res.StaleEntriesLeft, s.res.CRICycles, s.res.FailedAdds, s.res.FailedAddsInWin, s.res.FailedDels, s.res.FailedDelsInWin, bgFlows.Load())
		}
	}
	s.res.BaselineCycle, s.res.ScrubdProcesses = base, len(pids)
	_, s.res.FDsEnd, s.res.GoroutinesEnd = s.procFigures()
	s.res.HeapLiveEnd = int64(s.metric("go_gc_heap_live_bytes"))
	s.res.IndexKeysEnd = int64(s.metric("ctscrub_index_keys"))
	s.res.RSSStart, s.res.RSSEnd = netnsnode.Median(rssFirst), netnsnode.Median(rssLast)
	s.res.RSSAnonStart, s.res.RSSAnonEnd = netnsnode.Median(anonFirst), netnsnode.Median(anonLast)
	m := s.memory()
	s.res.RSSFileEnd, s.res.RSSShmemEnd = m["RssFile"], m["RssShmem"]
	return nil
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
