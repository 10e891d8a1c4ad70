package main

// The start-burst faults: many pods starting at once (a second network on
// the node's bridge, burstCh), while scrubd is killed or its ring buffer
// overruns. They drive the windows in which the index cannot be trusted
// (docs/design.md, "The completeness contract").

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"sync"
	"syscall"
	"time"

	"github.com/ctscrub/ctscrub/internal/netnsnode"
	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/client"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// The burst network's addresses: .110 on, clear of the cycles' (.10-.13)
// and of s.spare (.200).
const burstRangeFrom, burstRangeSize = 100, 24

// burstPod starts one pod of a burst as a runtime does: a failed ADD is
// undone with DEL (retried until it works: scrubd may be down) and tried
// again under a new attempt's name, for at most a minute. fails counts the
// ADDs that failed.
func (s *soak) burstPod(ctx context.Context, name string, fails *int) (*netnsnode.Pod, error) {
	var lastErr error
	t0 := time.Now()
	for attempt := 0; time.Since(t0) < time.Minute && ctx.Err() == nil; attempt++ {
		n := fmt.Sprintf("%s-a%d", name, attempt)
		p, err := s.addVia(ctx, s.burstCh, n)
		if err == nil {
			return p, nil
		}
		*fails++
		lastErr = err
		if p == nil {
			ns := netnsnode.NamePrefix + "-" + n
			p = &netnsnode.Pod{Name: n, ContainerID: ns, Netns: netnsnode.NetnsPath(ns), IfName: "eth0"}
		}
		s.delRetry(ctx, s.burstCh, p, time.Minute)
		time.Sleep(200 * time.Millisecond)
	}
	return nil, fmt.Errorf("burst pod %s: no ADD worked in a minute: %v", name, lastErr)
}

// delRetry runs p's DEL until it works or for at most max, as a runtime
// retries a DEL; it returns the failed attempts and the last error.
func (s *soak) delRetry(ctx context.Context, ch *netnsnode.Chain, p *netnsnode.Pod, max time.Duration) (fails int, err error) {
	t0 := time.Now()
	for {
		if _, err = ch.Del(ctx, p); err == nil || time.Since(t0) > max || ctx.Err() != nil {
			return fails, err
		}
		fails++
		time.Sleep(100 * time.Millisecond)
	}
}

// delAllAndCount DELs pods at once, waits for scrubd's late DEL scrubs of
// all their IPs, and counts their entries left.
func (s *soak) delAllAndCount(ctx context.Context, ch *netnsnode.Chain, pods []*netnsnode.Pod) (left, delFails int, errs []string) {
	lateBefore := s.metric("ctscrub_del_late_total")
	var mu sync.Mutex
	var wg sync.WaitGroup
	var ips []netip.Addr
	for _, p := range pods {
		ips = append(ips, p.IPs()...)
		wg.Go(func() {
			f, err := s.delRetry(ctx, ch, p, time.Minute)
			mu.Lock()
			defer mu.Unlock()
			delFails += f
			if err != nil {
				errs = append(errs, err.Error())
			}
		})
	}
	wg.Wait()
	s.waitLate(lateBefore, len(ips))
	left, err := s.leftOf(ctx, ips)
	if err != nil {
		errs = append(errs, "count: "+err.Error())
	}
	return left, delFails, errs
}

// firstFlows: a new pod's first flows, as a starting workload opens them:
// a few connections and a few hundred new UDP flows.
func firstFlows(ctx context.Context, p *netnsnode.Pod) {
	_, _ = netnsnode.SendTraffic(ctx, p.Netns, netnsnode.OutsideAddr[0].Addr(), netnsnode.TrafficCounts{TCP: 1, UDP: 2})
	_, _ = burst(p.Netns, netnsnode.OutsideAddr[1].Addr(), 300)
}

// liveEntries counts, of a snapshot of live pods' entries, those gone
// before their own lifetime: a scrub deleted a live pod's entries.
func (s *soak) liveEntriesGone(keep map[anyKey]uint32) int {
	now := netnsnode.MonotonicSeconds()
	gone := 0
	for k, lt := range keep {
		if !present(s.maps, k) && lt >= now {
			gone++
			if gone <= 5 {
				s.logf("wrong deletion (a live burst pod's entry): %s entry %s gone, its lifetime at the snapshot %d s, now %d s", k.kind.Name(), k, lt, now)
			}
		}
	}
	return gone
}

// scrubAnswer is one scrub the soak sent while scrubd came back.
type scrubAnswer struct {
	beforeReady bool // a status answer after it still said not ready
	refused     bool // scrubd answered with an API error (fails closed)
	swept       bool // every IP swept
	// afterPass: a status read just before it, or right after it, said
	// the new scrubd's bootstrap pass had ended: the pass read the maps,
	// the entries made while scrubd was dead included, so an answer by the
	// index is sound. After it counts too: the pass declares its addresses
	// complete before its status says done, so a scrub may use them first
	// (the in-kernel pass, about a second at 4 M entries, often ends
	// between the two reads).
	afterPass bool
	why       []string
	err       error
}

// faultRecorderKilled: the recorder runs inside scrubd, so killing it is
// SIGKILL of scrubd, here during a start burst: pods start at once and open
// new flows, scrubd is killed, the burst goes on (four more pods start and
// their ADDs fail and are retried, the running pods keep opening flows, the
// two pods being deleted open 300 more each, records nobody reads, and
// their DELs are retried), and scrubd is started again as faultKill does.
// From the kill on the soak scrubs the deleted pods' IPs every 10 ms, so the
// first scrubs land as scrubd serves again. OK when the first scrub answered
// swept every IP (and every scrub answered while scrubd said not ready),
// nothing of the deleted pods is left, and no entry of the pods that ran
// through it was deleted.
func (s *soak) faultRecorderKilled(ctx context.Context, cycle int) FaultResult {
	r := FaultResult{Name: "recorder killed (scrubd SIGKILLed) during a start burst"}
	closeWin := s.openWindow()
	var fails int
	var mu sync.Mutex
	start := func(names []string) (up chan *netnsnode.Pod, wait func() []string) {
		up = make(chan *netnsnode.Pod, len(names))
		var wg sync.WaitGroup
		var errs []string
		for _, n := range names {
			wg.Go(func() {
				f := 0
				p, err := s.burstPod(ctx, n, &f)
				mu.Lock()
				fails += f
				if err != nil {
					errs = append(errs, err.Error())
				}
				mu.Unlock()
				if err == nil {
					firstFlows(ctx, p)
					up <- p
				}
			})
		}
		return up, func() []string { wg.Wait(); close(up); return errs }
	}
	names := func(prefix string, n int) (out []string) {
		for i := range n {
			out = append(out, fmt.Sprintf("rk%d-%s%d", cycle, prefix, i))
		}
		return out
	}
	// Four pods that run through the fault: their entries must all stay.
	upA, waitA := start(names("live", 4))
	errs := waitA()
	var live []*netnsnode.Pod
	for p := range upA {
		live = append(live, p)
	}
	time.Sleep(300 * time.Millisecond) // their connections' last FIN exchanges
	var liveIPs []netip.Addr
	for _, p := range live {
		liveIPs = append(liveIPs, p.IPs()...)
	}
	keep, err := keysOf(s.maps, liveIPs)
	if err != nil {
		r.WindowS = closeWin()
		r.Outcome = "read the live pods' entries: " + err.Error()
		return r
	}
	// The running pods keep opening flows through the whole fault.
	stopFlows := make(chan struct{})
	var flowsWG sync.WaitGroup
	for _, p := range live {
		flowsWG.Go(func() {
			for {
				select {
				case <-stopFlows:
					return
				case <-time.After(100 * time.Millisecond):
				}
				_, _ = burst(p.Netns, netnsnode.OutsideAddr[1].Addr(), 200)
			}
		})
	}
	// The burst: six pods at once; the first two up are the pods deleted
	// right as scrubd comes back, the kill comes as they are up.
	upB, waitB := start(names("b", 6))
	var victims []*netnsnode.Pod
	timeout := time.After(time.Minute)
wait:
	for len(victims) < 2 {
		select {
		case p := <-upB:
			victims = append(victims, p)
		case <-timeout:
			break wait
		case <-ctx.Done():
			break wait
		}
	}
	d := s.daemon()
	killedAt := time.Now()
	_ = d.Signal(syscall.SIGKILL)
	<-d.Exited()
	// The burst goes on: four more pods start while scrubd is dead (their
	// ADDs fail and are retried; at a quiet moment the first six were all
	// up before the kill).
	upC, waitC := start(names("c", 4))
	// The victims' DELs, retried as a runtime retries them.
	var victimWG sync.WaitGroup
	var victimIPs []netip.Addr
	victimDelFails := 0
	for _, p := range victims {
		victimIPs = append(victimIPs, p.IPs()...)
		victimWG.Go(func() {
			// New flows while scrubd is dead: their records wait in the
			// ring (or are lost) when it comes back.
			_, _ = burst(p.Netns, netnsnode.OutsideAddr[0].Addr(), 300)
			f, err := s.delRetry(ctx, s.burstCh, p, time.Minute)
			mu.Lock()
			victimDelFails += f
			if err != nil {
				errs = append(errs, err.Error())
			}
			mu.Unlock()
		})
	}
	// The soak's own scrubs of the victims' IPs, from the kill on: each
	// followed by a status, which tells whether scrubd was ready after it.
	var answers []scrubAnswer
	pollDone := make(chan struct{})
	go func() {
		defer close(pollDone)
		c := client.New(d.Socket)
		var firstAnswer time.Time
		for time.Since(killedAt) < time.Minute && ctx.Err() == nil {
			if !firstAnswer.IsZero() && time.Since(firstAnswer) > 2*time.Second {
				return
			}
			pctx, pcancel := context.WithTimeout(ctx, 2*time.Second)
			pst, perr := c.Status(pctx)
			pcancel()
			afterPass := perr == nil && passEnded(pst)
			sctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			resp, err := c.Scrub(sctx, api.ScrubRequest{IPs: victimIPs, Reason: scrub.ReasonDel})
			cancel()
			_, refused := client.APIError(err)
			if err != nil && !refused && firstAnswer.IsZero() {
				time.Sleep(10 * time.Millisecond)
				continue // not serving yet
			}
			if firstAnswer.IsZero() {
				firstAnswer = time.Now()
			}
			a := scrubAnswer{refused: refused, swept: err == nil, afterPass: afterPass}
			if !refused {
				a.err = err
			}
			if err == nil {
				for _, res := range resp.Results {
					for _, ip := range victimIPs {
						m := res.PerIP[ip.String()]
						if m == "" {
							m = res.Method
						}
						a.swept = a.swept && m == scrub.MethodSweep && res.Outcome == scrub.Complete
						if w := res.SweptWhy[ip.String()]; w != "" && !slices.Contains(a.why, w) {
							a.why = append(a.why, w)
						}
					}
				}
			}
			stctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			st, serr := c.Status(stctx)
			cancel()
			a.beforeReady = serr != nil || !st.Ready
			a.afterPass = a.afterPass || (serr == nil && passEnded(st))
			answers = append(answers, a)
			time.Sleep(10 * time.Millisecond)
		}
	}()
	time.Sleep(300 * time.Millisecond) // down: the burst goes on
	nd, serr := netnsnode.StartDaemon(ctx, s.cleanup, s.dcfg)
	if serr == nil {
		s.dmu.Lock()
		s.d = nd
		s.dmu.Unlock()
	}
	restartS := time.Since(killedAt).Seconds()
	<-pollDone
	victimWG.Wait()
	errs = append(errs, waitB()...)
	errs = append(errs, waitC()...)
	close(stopFlows)
	flowsWG.Wait()
	var rest []*netnsnode.Pod
	for p := range upB {
		rest = append(rest, p)
	}
	for p := range upC {
		rest = append(rest, p)
	}
	if serr != nil {
		r.WindowS = closeWin()
		r.Outcome = "restart failed: " + serr.Error()
		return r
	}
	gone := s.liveEntriesGone(keep)
	s.res.WrongDeletions += gone
	victimLeft, err := s.leftOf(ctx, victimIPs)
	if err != nil {
		errs = append(errs, "count: "+err.Error())
	}
	left, delFails, derrs := s.delAllAndCount(ctx, s.burstCh, append(live, rest...))
	errs = append(errs, derrs...)
	left += victimLeft
	s.res.StaleEntriesLeft += left
	s.res.FailedAdds += fails
	s.res.FailedAddsInWin += fails
	s.res.FailedDels += victimDelFails + delFails
	s.res.FailedDelsInWin += victimDelFails + delFails
	r.WindowS = closeWin()
	before, beforeSwept, after, afterSwept, failed, refused := 0, 0, 0, 0, 0, 0
	var whys []string
	for _, a := range answers {
		switch {
		case a.err != nil:
			failed++
		case a.refused:
			refused++
		case a.beforeReady:
			before++
			if a.swept {
				beforeSwept++
			}
		default:
			after++
			if a.swept {
				afterSwept++
			}
		}
		for _, w := range a.why {
			if !slices.Contains(whys, w) {
				whys = append(whys, w)
			}
		}
	}
	sort.Strings(whys)
	// The first scrub answered after the restart must sweep, whatever the
	// reason: the deleted pods' flows made while scrubd was dead are in
	// the ring unread, or lost. Unless the new scrubd's bootstrap pass had
	// ended before it (issue 36): the pass read those entries from the
	// maps. Either way nothing of the pods may be left (left, below).
	firstSwept, firstAfterPass := false, false
	for _, a := range answers {
		if !a.refused {
			firstSwept, firstAfterPass = a.err == nil && a.swept, a.err == nil && a.afterPass
			break
		}
	}
	r.OK = (firstSwept || firstAfterPass) && beforeSwept == before && failed == 0 && left == 0 && gone == 0 && len(errs) == 0
	r.Outcome = fmt.Sprintf("%d pods running, 6 starting, 4 more from the kill on (%d failed ADDs, retried); scrubd killed with 2 of the 6 up, which then opened 300 new flows each and were deleted; serving again after %.2fs; scrubs of the 2 deleted pods' IPs from then: the first answered swept every IP: %v (after the bootstrap pass ended: %v); %d answered before scrubd said ready (%d swept every IP), %d after (%d swept), %d refused, %d failed; swept_why %q; %d of the running pods' %d entries gone before their lifetime; entries left of the deleted pods %d (%d DEL attempts failed, retried); errors %v",
		len(live), fails, restartS, firstSwept, firstAfterPass, before, beforeSwept, after, afterSwept, refused, failed, whys, gone, len(keep), left, victimDelFails+delFails, errs)
	return r
}

// faultRingBurst: the ring buffer overrun during a start burst. Twenty pods
// start at once; once half of them run, their first flows overrun the ring
// (overrun: scrubd stopped, four rings' worth of new flows) while the other
// half's ADDs wait for scrubd, then go on. Then every pod is deleted right
// away. OK when the kernel counted lost records, nothing of the pods is left
// and no DEL failed for good; the outcome says how many pods scrubd had
// marked incomplete and for what, and how many DEL scrubs swept.
func (s *soak) faultRingBurst(ctx context.Context, cycle int) FaultResult {
	r := FaultResult{Name: "ring buffer overrun during a start burst of 20 pods"}
	closeWin := s.openWindow()
	const n = 20
	lostBefore := s.metric("ctscrub_index_lost_total")
	var mu sync.Mutex
	var wg sync.WaitGroup
	var pods []*netnsnode.Pod
	var errs []string
	fails := 0
	up := make(chan *netnsnode.Pod, n)
	for i := range n {
		wg.Go(func() {
			f := 0
			p, err := s.burstPod(ctx, fmt.Sprintf("rb%d-%d", cycle, i), &f)
			mu.Lock()
			fails += f
			if err != nil {
				errs = append(errs, err.Error())
			} else {
				pods = append(pods, p)
			}
			mu.Unlock()
			if err == nil {
				_, _ = netnsnode.SendTraffic(ctx, p.Netns, netnsnode.OutsideAddr[0].Addr(), netnsnode.TrafficCounts{TCP: 1, UDP: 2})
				up <- p
			}
		})
	}
	var first []*netnsnode.Pod
	timeout := time.After(time.Minute)
wait:
	for len(first) < n/2 {
		select {
		case p := <-up:
			first = append(first, p)
		case <-timeout:
			break wait
		case <-ctx.Done():
			break wait
		}
	}
	var sent int
	var berr error
	if len(first) > 0 {
		sent, berr = s.overrun(first)
	}
	wg.Wait()
	// scrubd reads the kernel's lost counters at every Sync and every
	// second: wait until it shows them.
	var lost float64
	for t0 := time.Now(); time.Since(t0) < 15*time.Second; time.Sleep(100 * time.Millisecond) {
		if lost = s.metric("ctscrub_index_lost_total") - lostBefore; lost > 0 {
			break
		}
	}
	reasons := map[string]int{}
	var ips []string
	for _, p := range pods {
		ips = append(ips, p.V4.String(), p.V6.String())
		st, err := s.daemon().Client.IndexIP(ctx, p.V4)
		switch {
		case err != nil:
			reasons["("+err.Error()+")"]++
		case st.Incomplete != "":
			reasons[st.Incomplete]++
		default:
			reasons["complete"]++
		}
	}
	_ = s.daemon().NewScrubs() // only the DELs' scrubs below
	left, delFails, derrs := s.delAllAndCount(ctx, s.burstCh, pods)
	errs = append(errs, derrs...)
	methods := map[string]int{}
	for _, l := range s.daemon().NewScrubs() {
		if l.Reason == string(scrub.ReasonDel) && slices.ContainsFunc(l.IPs, func(ip string) bool { return slices.Contains(ips, ip) }) {
			methods[l.Method]++
		}
	}
	s.res.StaleEntriesLeft += left
	s.res.FailedAdds += fails
	s.res.FailedAddsInWin += fails
	s.res.FailedDels += delFails
	s.res.FailedDelsInWin += delFails
	r.WindowS = closeWin()
	r.OK = berr == nil && lost > 0 && left == 0 && len(errs) == 0 && len(pods) == n
	r.Outcome = fmt.Sprintf("%d of %d pods started (%d failed ADDs, retried); %d flows sent by %d of them while scrubd was stopped (ring %d KiB); records lost %.0f; the pods' v4 IPs before their DEL: %v; DEL scrubs by method %v; entries left %d; %d DELs failed (retried); errors %v",
		len(pods), n, fails, sent, len(first), soakRingBytes>>10, lost, reasons, methods, left, delFails, errs)
	if lost == 0 {
		r.Outcome += " (no record lost: the ring was not overrun)"
	}
	return r
}

// passEnded reports whether a status says scrubd's bootstrap pass ended
// without an error.
func passEnded(st *api.Status) bool {
	return st != nil && st.Bootstrap != nil && !st.Bootstrap.Running && st.Bootstrap.Error == "" && st.Bootstrap.Passes > 0
}
