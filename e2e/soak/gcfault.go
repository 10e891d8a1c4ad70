package main

// The CNI GC during churn (faultGCChurn).

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"

	"github.com/ctscrub/ctscrub/internal/netnsnode"
)

// gcRounds and gcDelays: each round starts the churn's ADDs, then the GC
// after the round's delay. An ADD reaches scrubd after bridge and
// host-local ran (tens of ms), the GC after one exec of the plugin, so
// over the rounds the ADDs' takes land before the GC lists the
// attachments, between its listing and its scrub, and after it.
// (In the first development runs, with delays up to 160 ms, every GC listed
// before the ADDs took their IPs: the ADDs took longer under load.)
var gcDelays = []time.Duration{0, 25 * time.Millisecond, 50 * time.Millisecond, 100 * time.Millisecond,
	150 * time.Millisecond, 250 * time.Millisecond, 400 * time.Millisecond}

// faultGCChurn: a CNI GC, through libcni's GCNetworkList and the ctscrub
// plugin as a runtime calls it, while pods are added and deleted. Each
// round first loses two pods as a runtime that lost their sandboxes and
// their IPAM and libcni state would (host-local's reservations and the
// libcni cache entries removed, the netns deleted, no DEL): scrubd still
// holds them, host-local hands their addresses out again. Then two workers
// each add and delete two pods (UDP and ICMP flows, whose lifetimes do not
// shorten) while the GC runs with the valid attachments: the long-lived
// pods and every pod the churn starts in the round (a runtime lists the
// sandboxes it is creating). OK when every GC worked, no entry of a churn
// pod went between its traffic and its DEL, every IP the GC's answer
// skipped is one a churn ADD took, no IP the GC scrubbed without skipping
// had been taken by an ADD that had finished before the GC started, and
// nothing of the lost or the churn pods is left.
//
// The GC conflist is the soak's network at CNI 1.1.0 with ctscrub alone:
// Debian's bridge and host-local speak up to 1.0.0.
func (s *soak) faultGCChurn(ctx context.Context, cycle int) FaultResult {
	r := FaultResult{Name: "CNI GC during ADD/DEL churn"}
	closeWin := s.openWindow()
	fail := func(what string, err error) FaultResult {
		r.WindowS = closeWin()
		r.Outcome = what + ": " + err.Error()
		return r
	}
	gcList, err := libcni.ConfListFromBytes(fmt.Appendf(nil,
		`{"cniVersion":"1.1.0","name":%q,"plugins":[{"type":"ctscrub","socket":%q,"failurePolicy":"fail"}]}`,
		netnsnode.NetName, s.daemon().Socket))
	if err != nil {
		return fail("the GC conflist", err)
	}
	var (
		gone, left, addFails                  int
		dropped, scrubbed, skipped, displaced int
		errs                                  []string
	)
	for round, delay := range gcDelays {
		rs, err := s.gcRound(ctx, gcList, fmt.Sprintf("gc%d-%d", cycle, round), delay)
		if err != nil {
			errs = append(errs, fmt.Sprintf("round %d: %v", round, err))
		}
		gone += rs.gone
		left += rs.left
		addFails += rs.addFails
		dropped += rs.dropped
		scrubbed += rs.scrubbed
		skipped += rs.skipped
		displaced += rs.displaced
		errs = append(errs, rs.errs...)
	}
	s.res.WrongDeletions += gone
	s.res.StaleEntriesLeft += left
	s.res.FailedAdds += addFails
	s.res.FailedAddsInWin += addFails
	r.WindowS = closeWin()
	r.OK = gone == 0 && left == 0 && len(errs) == 0
	r.Outcome = fmt.Sprintf("%d rounds (GC %v after the churn's first ADDs began): the GCs dropped %d attachments (the lost pods, and the deleted pods scrubd kept as stopped); of the lost pods' IPs, %d taken by an ADD before the GC's listing (displaced, not the GC's), %d scrubbed by the GC, %d skipped (an ADD took them while the GC ran); churn pods' entries gone before their DEL %d; entries left %d; failed ADDs %d; errors %v",
		len(gcDelays), gcDelays, dropped, displaced, scrubbed, skipped, gone, left, addFails, errs)
	return r
}

type gcRoundResult struct {
	gone, left, addFails                  int
	dropped, scrubbed, skipped, displaced int
	errs                                  []string
}

// churnAdd is one ADD of the churn: the IPs it took and when it ended.
type churnAdd struct {
	ips []netip.Addr
	end time.Time
}

func (s *soak) gcRound(ctx context.Context, gcList *libcni.NetworkConfigList, name string, delay time.Duration) (rs gcRoundResult, _ error) {
	// Two pods lost with their state: scrubd holds them, nothing else does.
	var lostIPs []netip.Addr
	for j := range 2 {
		p, err := s.add(ctx, fmt.Sprintf("%s-lost%d", name, j))
		if err != nil {
			return rs, err
		}
		_, _ = netnsnode.SendTraffic(ctx, p.Netns, netnsnode.OutsideAddr[0].Addr(), netnsnode.TrafficCounts{TCP: 1, UDP: 2})
		if err := s.lose(p); err != nil {
			return rs, err
		}
		lostIPs = append(lostIPs, p.IPs()...)
	}
	const workers, perWorker = 2, 2
	valid := []types.GCAttachment{}
	for _, p := range s.others {
		valid = append(valid, types.GCAttachment{ContainerID: p.ContainerID, IfName: p.IfName})
	}
	churnName := func(w, j int) string { return fmt.Sprintf("%s-w%d-%d", name, w, j) }
	for w := range workers {
		for j := range perWorker {
			// Every attempt's name: a retried ADD is a new attempt.
			for a := range 3 {
				valid = append(valid, types.GCAttachment{ContainerID: netnsnode.NamePrefix + "-" + churnName(w, j) + fmt.Sprintf("-a%d", a), IfName: "eth0"})
			}
		}
	}
	logFrom := fileSize(s.daemon().LogPath)
	gcDone := make(chan struct{})
	var gcErr error
	var gcStart time.Time
	var mu sync.Mutex
	// A DEL and the count of what it left hold reuse; ADDs share it. Without
	// it the other worker's next pod could get the address between the two,
	// and its live entries counted as left (5 "stale" entries in the second
	// default run of 2 Dec, round 4: w1's count of .13 after w0's ADD of it).
	var reuse sync.RWMutex
	var adds []churnAdd
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for j := range perWorker {
				var p *netnsnode.Pod
				var err error
				for a := range 3 {
					n := churnName(w, j) + fmt.Sprintf("-a%d", a)
					reuse.RLock()
					p, err = s.add(ctx, n)
					reuse.RUnlock()
					if err == nil {
						break
					}
					mu.Lock()
					rs.addFails++
					mu.Unlock()
					if p == nil {
						ns := netnsnode.NamePrefix + "-" + n
						p = &netnsnode.Pod{Name: n, ContainerID: ns, Netns: netnsnode.NetnsPath(ns), IfName: "eth0"}
					}
					_, _ = s.delRetry(ctx, s.ch, p, 30*time.Second)
					p = nil
				}
				if p == nil {
					mu.Lock()
					rs.errs = append(rs.errs, fmt.Sprintf("churn ADD %s: %v", churnName(w, j), err))
					mu.Unlock()
					continue
				}
				mu.Lock()
				adds = append(adds, churnAdd{ips: p.IPs(), end: time.Now()})
				mu.Unlock()
				_, _ = netnsnode.SendTraffic(ctx, p.Netns, netnsnode.OutsideAddr[0].Addr(), netnsnode.TrafficCounts{UDP: 3, Ping: 1})
				time.Sleep(100 * time.Millisecond)
				n0, err0 := s.leftOf(ctx, p.IPs())
				if j == perWorker-1 {
					<-gcDone
				}
				n1, err1 := s.leftOf(ctx, p.IPs())
				reuse.Lock()
				n, derr, cerr := s.delAndCount(ctx, p)
				reuse.Unlock()
				mu.Lock()
				if err0 == nil && err1 == nil && n1 < n0 {
					rs.gone += n0 - n1
					s.logf("GC fault: %d of churn pod %s's %d entries (%v) gone before its DEL", n0-n1, p.Name, n0, p.IPs())
				}
				rs.left += n
				if n > 0 {
					s.logf("GC fault: %d entries of churn pod %s (%v) left after its DEL", n, p.Name, p.IPs())
				}
				for _, e := range []error{err0, err1, derr, cerr} {
					if e != nil {
						rs.errs = append(rs.errs, e.Error())
					}
				}
				mu.Unlock()
			}
		})
	}
	time.Sleep(delay)
	gcStart = time.Now()
	gcErr = netnsnode.InNetns(s.node, func() error {
		return s.ch.CNI.GCNetworkList(ctx, gcList, &libcni.GCArgs{ValidAttachments: valid})
	})
	close(gcDone)
	wg.Wait()
	if gcErr != nil {
		rs.errs = append(rs.errs, "GC: "+gcErr.Error())
	}
	// The GC's answer, as scrubd logged it: the IPs it set out to scrub and
	// those it skipped (api.GCResponse.Skipped).
	var scrubIPs, skippedIPs []string
	for _, l := range logLines(s.daemon().LogPath, logFrom) {
		switch l["msg"] {
		case "gc":
			scrubIPs = append(scrubIPs, strs(l["scrub_ips"])...)
			if n, ok := l["dropped"].(float64); ok {
				rs.dropped += int(n)
			}
		case "gc: not scrubbing IPs an ADD took while the GC ran":
			skippedIPs = append(skippedIPs, strs(l["ips"])...)
		}
	}
	takenBy := func(ip netip.Addr, before time.Time) bool {
		for _, a := range adds {
			if slices.Contains(a.ips, ip) && (before.IsZero() || a.end.Before(before)) {
				return true
			}
		}
		return false
	}
	for _, ip := range lostIPs {
		switch {
		case slices.Contains(skippedIPs, ip.String()):
			rs.skipped++
			if !takenBy(ip, time.Time{}) {
				rs.errs = append(rs.errs, fmt.Sprintf("the GC skipped %s, which no ADD took", ip))
			}
		case slices.Contains(scrubIPs, ip.String()):
			rs.scrubbed++
			if takenBy(ip, gcStart) {
				rs.errs = append(rs.errs, fmt.Sprintf("the GC scrubbed %s, which an ADD had taken before the GC started", ip))
			}
		default:
			rs.displaced++
		}
	}
	n, err := s.leftOf(ctx, lostIPs)
	if err != nil {
		return rs, err
	}
	if n > 0 {
		s.logf("GC fault: %d entries of the lost pods' IPs %v left", n, lostIPs)
	}
	rs.left += n
	return rs, nil
}

// lose makes p a pod its runtime lost with its CNI state: host-local's
// reservations and libcni's cache entry removed, the netns deleted, no DEL.
func (s *soak) lose(p *netnsnode.Pod) error {
	for _, ip := range p.IPs() {
		if err := os.Remove(filepath.Join(netnsnode.WorkDir, "ipam", netnsnode.NetName, ip.String())); err != nil {
			return fmt.Errorf("lose pod %s: %w", p.Name, err)
		}
	}
	_ = os.Remove(filepath.Join(netnsnode.WorkDir, "cni-cache", "results", fmt.Sprintf("%s-%s-%s", netnsnode.NetName, p.ContainerID, p.IfName)))
	return netnsnode.DelNetns(netnsnode.NamePrefix + "-" + p.Name)
}

func fileSize(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// logLines returns scrubd's JSON log lines from offset on.
func logLines(path string, offset int64) []map[string]any {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	if _, err := f.Seek(offset, 0); err != nil {
		return nil
	}
	var out []map[string]any
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		var m map[string]any
		if json.Unmarshal(sc.Bytes(), &m) == nil {
			out = append(out, m)
		}
	}
	return out
}

func strs(v any) []string {
	l, _ := v.([]any)
	var out []string
	for _, x := range l {
		out = append(out, fmt.Sprint(x))
	}
	return out
}
