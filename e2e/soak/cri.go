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
	"strings"

	"github.com/vishvananda/netlink"

	"github.com/ctscrub/ctscrub/internal/netnsnode"
	"github.com/ctscrub/ctscrub/internal/testsupport/crirt"
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
