package main

// The faults the soak causes, on a schedule, while the cycles go on; each
// returns a FaultResult. (containerd's restart is in crifault.go.)

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/ctscrub/ctscrub/internal/netnsnode"
	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/client"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

type faultFn func(ctx context.Context, cycle int) FaultResult

// schedule spreads the faults over the middle of the run, from 15 % to
// 75 %: the first tenth of the cycles is the node at its steady state
// before any fault, the last tenth the node at least 15 % of the run after
// the last one (rss_end). The two faults that kill scrubd come first (the
// SIGKILL, then the recorder killed during a start burst); after the
// second the soak re-warms the restarted scrubd (rewarm) and takes the RSS
// baseline (rss_start) over the tenth of cycles after it, which no fault
// falls in (the next comes at 30 %). The ring overrun during a start burst
// follows the plain ring overrun, and the GC during churn comes before the
// CT maps are re-created (which marks every IP incomplete and would make
// every scrub sweep). restarting lists the cycles whose fault restarts
// scrubd.
func (s *soak) schedule() (faults map[int]faultFn, restarting map[int]bool) {
	n := s.cfg.Cycles
	at := func(frac float64) int { return min(n-1, max(1, int(float64(n)*frac))) }
	m := map[int]faultFn{
		at(0.15): s.faultKill,
		at(0.20): s.faultRecorderKilled,
		at(0.30): s.faultDeadline,
		at(0.35): s.faultRingOverrun,
		at(0.40): s.faultRingBurst,
		at(0.45): s.faultPinsRemoved,
		at(0.50): s.faultSocketRemoved,
		at(0.60): s.faultGCChurn,
		at(0.65): s.faultCTMapsRecreated,
		at(0.75): s.faultContainerdRestart,
	}
	if s.cfg.Starve > 0 {
		m[at(0.55)] = s.faultStarve
	}
	return m, map[int]bool{at(0.15): true, at(0.20): true}
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
	sent, berr := s.overrun([]*netnsnode.Pod{p})
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

// overrun stops scrubd (SIGSTOP: its reader drains nothing), has pods send
// four times the ring's records of new flows between them, at once, and
// continues it: the kernel must drop records. The flows stay within what the
// maps have room for (ENTRIES/2).
func (s *soak) overrun(pods []*netnsnode.Pod) (sent int, err error) {
	d := s.daemon()
	_ = d.Signal(syscall.SIGSTOP)
	defer func() { _ = d.Signal(syscall.SIGCONT) }()
	flows := min(4*soakRingBytes/56, s.cfg.Entries/2)
	per := (flows + len(pods) - 1) / len(pods)
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, p := range pods {
		wg.Go(func() {
			n, berr := burst(p.Netns, netnsnode.OutsideAddr[0].Addr(), per)
			mu.Lock()
			sent += n
			err = cmp.Or(err, berr)
			mu.Unlock()
		})
	}
	wg.Wait()
	return sent, err
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
