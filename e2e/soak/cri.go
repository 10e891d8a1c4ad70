package main

// The CRI share of `make soak`: every CRI_EVERY-th cycle's pod is a pod
// sandbox run through containerd's CRI (crictl runp / stopp / rmp: the
// RunPodSandbox, StopPodSandbox and RemovePodSandbox a kubelet calls), with
// the same conflist, CNI bin dir and host-local state as the libcni pods, so
// the two kinds of pods reuse each other's addresses. containerd runs in the
// node's netns (the CNI plugins it runs create the veths on the node's
// bridge), with its own root, state and socket (internal/testsupport/crirt,
// as e2e/cri runs it), and the locally built pause image.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/vishvananda/netlink"

	"github.com/ctscrub/ctscrub/internal/netnsnode"
	"github.com/ctscrub/ctscrub/internal/testsupport/crirt"
	"github.com/ctscrub/ctscrub/scrubd/api"
)

type criRuntime struct {
	cd        *crirt.Containerd
	dir       string
	plugin    string // the ctscrub plugin's real path (what /proc/PID/exe shows)
	n         int    // pod configs written
	sandboxes map[string]bool
}

// criMissing names the first tool the CRI part needs that is not installed.
func criMissing() string {
	for _, t := range []string{"containerd", "runc", "crictl", "ctr", "nsenter"} {
		if _, err := exec.LookPath(t); err != nil {
			return t
		}
	}
	return ""
}

// setupCRI starts the soak's containerd. A "" skip and a nil error: running.
func (s *soak) setupCRI(ctx context.Context) (skip string, err error) {
	if s.cfg.CRIEvery == 0 {
		return "CRI_EVERY=0", nil
	}
	if t := criMissing(); t != "" {
		return fmt.Sprintf("%s is not installed (scripts/setup.sh installs containerd, runc and crictl)", t), nil
	}
	dir := filepath.Join(netnsnode.WorkDir, "containerd")
	confDir := filepath.Join(dir, "cni-conf")
	if err := os.MkdirAll(confDir, 0o755); err != nil {
		return "", err
	}
	conf, err := os.ReadFile(s.ch.ConfPath)
	if err != nil {
		return "", err
	}
	if err := os.WriteFile(filepath.Join(confDir, filepath.Base(s.ch.ConfPath)), conf, 0o644); err != nil {
		return "", err
	}
	// containerd's stream server listens on 127.0.0.1 in the node's netns.
	if err := netnsnode.RunIP("-n", netnsnode.NodeNS, "link", "set", "lo", "up"); err != nil {
		return "", err
	}
	pause := filepath.Join(s.cfg.BinDir, "pause")
	if _, err := os.Stat(pause); err != nil {
		pause = filepath.Join(dir, "pause")
		b := exec.CommandContext(ctx, "go", "build", "-o", pause, "./e2e/cri/pause")
		b.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := b.CombinedOutput(); err != nil {
			return "", fmt.Errorf("build the pause binary: %v: %s", err, out)
		}
	}
	archive := filepath.Join(dir, "pause.tar")
	if err := crirt.WritePauseImage(pause, archive); err != nil {
		return "", err
	}
	cd, err := crirt.New(dir, filepath.Join(netnsnode.WorkDir, "cni-bin"), confDir, s.node)
	if err != nil {
		return "", err
	}
	plugin, err := filepath.EvalSymlinks(filepath.Join(netnsnode.WorkDir, "cni-bin", "ctscrub"))
	if err != nil {
		return "", err
	}
	s.cri = &criRuntime{cd: cd, dir: dir, plugin: plugin, sandboxes: map[string]bool{}}
	if err := cd.Start(); err != nil {
		return "", err
	}
	// Popped before the node netns goes: the sandboxes' DELs run in it.
	s.cleanup.Push("remove the CRI pods, stop containerd", func() error {
		if out, err := cd.Crictl("pods", "-q", "--no-trunc"); err == nil {
			for _, id := range strings.Fields(out) {
				cd.Crictl("stopp", id)
				cd.Crictl("rmp", "-f", id)
				removeCgroups(id)
			}
		}
		for id := range s.cri.sandboxes {
			removeCgroups(id)
		}
		cd.Stop()
		return nil
	})
	if err := cd.ImportImage(archive); err != nil {
		return "", err
	}
	return "", nil
}

// criPodConfig writes a pod sandbox config (a kubelet's, reduced).
func (c *criRuntime) criPodConfig(name string, attempt int) (string, error) {
	c.n++
	path := filepath.Join(c.dir, fmt.Sprintf("pod-%d.json", c.n))
	b, err := json.Marshal(map[string]any{
		"metadata":      map[string]any{"name": name, "namespace": "ctscrub-soak", "uid": "uid-" + name, "attempt": attempt},
		"log_directory": filepath.Join(c.dir, "pod-logs"),
		"linux":         map[string]any{},
	})
	if err != nil {
		return "", err
	}
	return path, os.WriteFile(path, b, 0o644)
}

// criAdd runs a pod sandbox (RunPodSandbox: the CNI ADD through the chain)
// and puts the Cilium stand-in on its host-side veth.
func (s *soak) criAdd(ctx context.Context, name string, attempt int) (*netnsnode.Pod, error) {
	conf, err := s.cri.criPodConfig(name, attempt)
	if err != nil {
		return nil, err
	}
	out, err := s.cri.cd.CrictlContext(ctx, "runp", conf)
	if err != nil {
		return nil, err
	}
	id := strings.TrimSpace(out)
	s.cri.sandboxes[id] = true
	return s.criPod(ctx, name, id)
}

// criPod reads a running sandbox's IPs and netns and attaches the stand-in.
func (s *soak) criPod(ctx context.Context, name, id string) (*netnsnode.Pod, error) {
	p := &netnsnode.Pod{Name: name, ContainerID: id, IfName: "eth0"}
	out, err := s.cri.cd.CrictlContext(ctx, "inspectp", id)
	if err != nil {
		return p, err
	}
	var in struct {
		Status struct {
			Network struct {
				IP            string `json:"ip"`
				AdditionalIPs []struct {
					IP string `json:"ip"`
				} `json:"additionalIps"`
			} `json:"network"`
		} `json:"status"`
		Info struct {
			RuntimeSpec struct {
				Linux struct {
					Namespaces []struct {
						Type string `json:"type"`
						Path string `json:"path"`
					} `json:"namespaces"`
				} `json:"linux"`
			} `json:"runtimeSpec"`
		} `json:"info"`
	}
	if err := json.Unmarshal([]byte(out), &in); err != nil {
		return p, fmt.Errorf("crictl inspectp %s: %w", id, err)
	}
	ips := []string{in.Status.Network.IP}
	for _, a := range in.Status.Network.AdditionalIPs {
		ips = append(ips, a.IP)
	}
	for _, s := range ips {
		a, err := netip.ParseAddr(s)
		if err != nil {
			continue
		}
		if a.Is4() {
			p.V4 = a
		} else {
			p.V6 = a
		}
	}
	for _, n := range in.Info.RuntimeSpec.Linux.Namespaces {
		if n.Type == "network" {
			p.Netns = n.Path
		}
	}
	if !p.V4.IsValid() || p.Netns == "" {
		return p, fmt.Errorf("sandbox %s: no IPv4 address or netns in crictl inspectp (ip %q, netns %q)", id, in.Status.Network.IP, p.Netns)
	}
	// The host side: the veth in the node netns whose peer is the pod's eth0.
	var peer int
	if err := netnsnode.InNetns(p.Netns, func() error {
		l, err := netlink.LinkByName(p.IfName)
		if err != nil {
			return err
		}
		peer = l.Attrs().ParentIndex
		return nil
	}); err != nil {
		return p, fmt.Errorf("sandbox %s: %s in %s: %w", id, p.IfName, p.Netns, err)
	}
	if err := netnsnode.InNetns(s.node, func() error {
		l, err := netlink.LinkByIndex(peer)
		if err != nil {
			return err
		}
		p.HostVeth = l.Attrs().Name
		return s.dp.Attach(p.HostVeth)
	}); err != nil {
		return p, fmt.Errorf("sandbox %s: attach the datapath stand-in to its host-side veth (ifindex %d): %w", id, peer, err)
	}
	return p, nil
}

// criDel stops and removes a sandbox (StopPodSandbox runs the CNI DEL with
// the cached prevResult, RemovePodSandbox a second DEL).
func (s *soak) criDel(ctx context.Context, p *netnsnode.Pod) error {
	if _, err := s.cri.cd.CrictlContext(ctx, "stopp", p.ContainerID); err != nil {
		return err
	}
	if _, err := s.cri.cd.CrictlContext(ctx, "rmp", p.ContainerID); err != nil {
		return err
	}
	removeCgroups(p.ContainerID)
	delete(s.cri.sandboxes, p.ContainerID)
	return nil
}

// removeCgroups removes the empty cgroup folders runc leaves for a sandbox
// (cgroupfs driver: <controller>/k8s.io/<id>).
func removeCgroups(id string) {
	if id == "" {
		return
	}
	dirs, _ := filepath.Glob("/sys/fs/cgroup/*/k8s.io/" + id)
	dirs2, _ := filepath.Glob("/sys/fs/cgroup/k8s.io/" + id)
	for _, d := range append(dirs, dirs2...) {
		os.Remove(d)
	}
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

func firstLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		return s[i+1:] // crictl's last line is its error
	}
	return s
}
