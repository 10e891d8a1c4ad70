package main

// The fault of the CRI part: containerd restarted while a RunPodSandbox's
// CNI ADD is in flight, and what a lost sandbox leaves behind.

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/ctscrub/ctscrub/internal/netnsnode"
	"github.com/ctscrub/ctscrub/scrubd/api"
)

// faultContainerdRestart: containerd is SIGKILLed while a RunPodSandbox's
// CNI ADD is in flight and started again. To be sure the ADD is in flight
// when the kill comes, scrubd is stopped (SIGSTOP) first: the chain's ADD
// then waits in ctscrub, after bridge made the veth and host-local reserved
// the address (the point where a lost sandbox leaks the most); the kill
// comes once that plugin process runs, scrubd is continued right after.
// Then, as a kubelet: the sandbox is asked for again (a new attempt), and
// what the lost sandbox left is looked for: an address host-local keeps
// for a container no runtime has, scrubd attachments of such containers,
// CT entries of such addresses. What containerd leaves is recorded; a
// runtime's cleanup (a CNI DEL of the lost attachment, as CNI GC or a
// runtime that finds the leftover netns does) is then run and must leave
// nothing.
func (s *soak) faultContainerdRestart(ctx context.Context, cycle int) FaultResult {
	r := FaultResult{Name: "containerd restarted during an ADD"}
	if s.cri == nil {
		r.Skipped = true
		r.Outcome = "CRI part not running: " + s.res.CRISkipped
		return r
	}
	closeWin := s.openWindow()
	fail := func(what string, err error) FaultResult {
		r.WindowS = closeWin()
		r.Outcome += what + ": " + errString(err)
		return r
	}
	name := fmt.Sprintf("crikill-%d", cycle)
	conf, err := s.cri.criPodConfig(name, 0)
	if err != nil {
		return fail("pod config", err)
	}
	d := s.daemon()
	cdPid := s.cri.cd.Pid()
	_ = d.Signal(syscall.SIGSTOP)
	type answer struct {
		out string
		err error
	}
	first := make(chan answer, 1)
	go func() {
		out, err := s.cri.cd.CrictlContext(ctx, "runp", conf)
		first <- answer{out, err}
	}()
	pid, lost, inflight := s.pluginInFlight(ctx, cdPid, 30*time.Second)
	t0 := time.Now()
	s.cri.cd.Kill()
	alive := func() bool {
		st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		return err == nil && !strings.Contains(string(st), ") Z ")
	}
	aliveAfterKill := pid != 0 && alive()
	_ = d.Signal(syscall.SIGCONT)
	// The plugin finishes its ADD (scrubd answers) with nobody to read it.
	for pid != 0 && time.Since(t0) < 20*time.Second && alive() {
		time.Sleep(20 * time.Millisecond)
	}
	pluginEnd := time.Since(t0)
	serr := s.cri.cd.Start()
	restart := time.Since(t0)
	a := <-first
	if id := strings.TrimSpace(a.out); a.err == nil && id != "" {
		s.cri.sandboxes[id] = true
	}
	if serr != nil {
		return fail("restart containerd", serr)
	}
	if a.err != nil {
		s.res.FailedAdds++
		s.res.FailedAddsInWin++
	}
	r.Outcome = fmt.Sprintf("plugin in flight at the kill: %v (sandbox %.12s), alive after it %v, gone %.2fs after it; RunPodSandbox answered %s; containerd serving again after %.2fs; ",
		inflight, lost, aliveAfterKill, pluginEnd.Seconds(), firstLine(errString(a.err)), restart.Seconds())
	// The lost sandbox as the restarted containerd, host-local and scrubd see it.
	known, _ := s.cri.cd.CrictlContext(ctx, "pods", "-q", "--no-trunc")
	var reservedIP []netip.Addr
	for ip, id := range s.reservations() {
		if id == lost && lost != "" {
			reservedIP = append(reservedIP, ip)
		}
	}
	_, attErr := d.Client.IndexPod(ctx, api.Attachment{ContainerID: lost, IfName: "eth0"})
	r.Outcome += fmt.Sprintf("the lost sandbox: known to containerd %v, address reserved %v, scrubd attachment %v; ",
		lost != "" && strings.Contains(known, lost), reservedIP, attErr == nil)

	// The kubelet's retry: a new attempt of the same pod.
	var p *netnsnode.Pod
	var rerr error
	for attempt := 1; attempt <= 5; attempt++ {
		if p, rerr = s.criAdd(ctx, name, attempt); rerr == nil {
			break
		}
		s.res.FailedAdds++
		s.res.FailedAddsInWin++
		time.Sleep(time.Second)
	}
	if rerr != nil {
		return fail("retried RunPodSandbox", rerr)
	}
	r.Outcome += fmt.Sprintf("retried RunPodSandbox ok (%s); ", p.V4)
	// The kubelet then stops and removes the pod's older sandboxes
	// (StopPodSandbox runs the CNI DEL: without a cached result, the chain
	// releases by container ID, ctscrub finds scrubd's record if any).
	olds, err := s.cri.cd.CrictlContext(ctx, "pods", "--name", name, "-q", "--no-trunc")
	if err != nil {
		return fail("list the pod's sandboxes", err)
	}
	nOld := 0
	for _, id := range strings.Fields(olds) {
		if id == p.ContainerID {
			continue
		}
		nOld++
		if err := s.criDel(ctx, &netnsnode.Pod{Name: name, ContainerID: id}); err != nil {
			r.Outcome += fmt.Sprintf("stop/remove of the old sandbox %.12s: %v; ", id, err)
		}
	}
	r.Outcome += fmt.Sprintf("%d old sandbox(es) stopped and removed; ", nOld)

	// What the lost sandbox left.
	live, err := s.liveOwners(ctx, s.others...)
	if err != nil {
		return fail("list sandboxes", err)
	}
	type orphan struct {
		ip netip.Addr
		id string
	}
	var orphans []orphan
	for ip, id := range s.reservations() {
		if !live[id] {
			orphans = append(orphans, orphan{ip, id})
		}
	}
	leakedAtt := 0
	if l, err := d.Client.IndexList(ctx); err == nil {
		for _, a := range l.Pods {
			if !live[a.ContainerID] {
				leakedAtt++
			}
		}
	}
	r.Outcome += fmt.Sprintf("then left: %d address(es) reserved for a container no runtime has, %d scrubd attachment(s) of one; ", len(orphans), leakedAtt)

	// Any such leftover (a sandbox containerd lost entirely) is a leak of
	// the runtime's: the CNI DEL a runtime's CNI GC would run, through the
	// chain (with the netns scrubd recorded, if the ADD got that far).
	var orphanIPs []netip.Addr
	lateOrphans := s.metric("ctscrub_del_late_total")
	for _, o := range orphans {
		orphanIPs = append(orphanIPs, o.ip)
		rt := &libcni.RuntimeConf{ContainerID: o.id, IfName: "eth0"}
		if rec, err := d.Client.IndexPod(ctx, api.Attachment{ContainerID: o.id, IfName: "eth0"}); err == nil {
			rt.NetNS = rec.Netns
		}
		derr := netnsnode.InNetns(s.node, func() error { return s.ch.CNI.DelNetworkList(ctx, s.ch.List, rt) })
		if derr != nil {
			r.Outcome += fmt.Sprintf("DEL of %s: %v; ", o.id[:min(12, len(o.id))], derr)
		}
		if strings.HasPrefix(rt.NetNS, "/var/run/netns/") || strings.HasPrefix(rt.NetNS, netnsnode.NetnsDir+"/") {
			_ = syscall.Unmount(rt.NetNS, syscall.MNT_DETACH)
			_ = os.Remove(rt.NetNS)
		}
	}
	// Checked again: nothing reserved for a pod that does not exist, no
	// attachment of one in scrubd, no CT entry of its addresses.
	live, err = s.liveOwners(ctx, s.others...)
	if err != nil {
		return fail("list sandboxes", err)
	}
	stillReserved := 0
	for _, id := range s.reservations() {
		if !live[id] {
			stillReserved++
		}
	}
	stillAtt := 0
	if l, err := d.Client.IndexList(ctx); err == nil {
		for _, a := range l.Pods {
			if !live[a.ContainerID] {
				stillAtt++
			}
		}
	}
	// No CT entry of the lost sandbox's addresses or of any leftover's.
	orphanIPs = append(orphanIPs, reservedIP...)
	left := 0
	if len(orphanIPs) > 0 {
		s.waitLate(lateOrphans, len(orphanIPs))
		if left, err = s.leftOf(ctx, orphanIPs); err != nil {
			return fail("count", err)
		}
	}
	// The retried pod through its whole cycle.
	_, _ = netnsnode.SendTraffic(ctx, p.Netns, netnsnode.OutsideAddr[0].Addr(), netnsnode.TrafficCounts{TCP: 2, UDP: 2, Ping: 1})
	_, _ = netnsnode.SendTraffic(ctx, netnsnode.NetnsPath(netnsnode.OutsideNS), p.V4, netnsnode.TrafficCounts{TCP: 1})
	lateBefore := s.metric("ctscrub_del_late_total")
	delErr := s.criDel(ctx, p)
	s.waitLate(lateBefore, len(p.IPs()))
	pleft, err := s.leftOf(ctx, p.IPs())
	if err != nil {
		return fail("count", err)
	}
	left += pleft
	s.res.StaleEntriesLeft += left
	r.WindowS = closeWin()
	r.OK = inflight && delErr == nil && stillReserved == 0 && stillAtt == 0 && left == 0
	r.Outcome += fmt.Sprintf("in the end: %d address(es) still reserved for no pod, %d scrubd attachment(s) of no pod, %d CT entries left; the retried pod's DEL %s",
		stillReserved, stillAtt, left, errString(delErr))
	return r
}

// pluginInFlight waits until containerd runs the ctscrub plugin (a child
// of containerd whose executable is the plugin): the ADD is in flight.
// It returns the plugin's pid and the CNI_CONTAINERID it runs for.
func (s *soak) pluginInFlight(ctx context.Context, ppid int, within time.Duration) (int, string, bool) {
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		ents, _ := os.ReadDir("/proc")
		for _, e := range ents {
			pid, err := strconv.Atoi(e.Name())
			if err != nil {
				continue
			}
			exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid))
			if err != nil || exe != s.cri.plugin {
				continue
			}
			st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
			if err != nil {
				continue
			}
			// pid (comm) state ppid ...
			if i := strings.LastIndexByte(string(st), ')'); i > 0 {
				f := strings.Fields(string(st)[i+1:])
				if len(f) > 1 && f[1] == strconv.Itoa(ppid) {
					env, _ := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
					for _, kv := range strings.Split(string(env), "\x00") {
						if v, ok := strings.CutPrefix(kv, "CNI_CONTAINERID="); ok {
							return pid, v, true
						}
					}
					return pid, "", true
				}
			}
		}
		time.Sleep(2 * time.Millisecond)
	}
	return 0, "", false
}

// reservations lists host-local's reserved addresses: IP -> container ID.
func (s *soak) reservations() map[netip.Addr]string {
	out := map[netip.Addr]string{}
	files, _ := filepath.Glob(filepath.Join(netnsnode.WorkDir, "ipam", netnsnode.NetName, "*"))
	for _, f := range files {
		a, err := netip.ParseAddr(filepath.Base(f))
		if err != nil {
			continue
		}
		b, _ := os.ReadFile(f)
		out[a] = strings.TrimSpace(strings.SplitN(string(b), "\n", 2)[0])
	}
	return out
}

// liveOwners is every container ID a pod that exists has: the libcni pods
// passed in and the CRI's sandboxes.
func (s *soak) liveOwners(ctx context.Context, libcniPods ...*netnsnode.Pod) (map[string]bool, error) {
	live := map[string]bool{}
	for _, p := range libcniPods {
		live[p.ContainerID] = true
	}
	out, err := s.cri.cd.CrictlContext(ctx, "pods", "-q", "--no-trunc")
	if err != nil {
		return nil, err
	}
	for _, id := range strings.Fields(out) {
		live[id] = true
	}
	return live, nil
}

func firstLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		return s[i+1:] // crictl's last line is its error
	}
	return s
}
