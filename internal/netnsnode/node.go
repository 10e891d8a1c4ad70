// Package netnsnode is one Kubernetes-like node on this machine, built from
// network namespaces: a node netns with pods attached through the real CNI
// chain (libcni; Debian's bridge + host-local, then ctscrub), an "outside"
// host, Cilium-layout CT maps pinned in a private bpffs dir and filled with
// synthetic flows, the Cilium datapath stand-in (test support) turning the
// pods' real traffic into CT entries, and scrubd as a child process. The
// demo (e2e/demo), the soak (e2e/soak) and bench-cni (bench/cni) run on it.
//
// Unlike e2e/internal/node, which gives each test temporary names and undoes
// them with t.Cleanup, a node here lives as long as a program: fixed names
// (UseNames), one run at a time (Lock), every step undone by a Cleanup stack
// on exit or signal, and what a killed run left removed by the next
// (RemoveLeftovers).
package netnsnode

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
)

// Names of everything the demo creates. Fixed, with one prefix, so a later run
// can find and remove what an interrupted run left behind.
//
// The node is a network namespace of its own (like a kind node): the bridge,
// the pods' host-side veths and the route to the outside host live there, so
// the demo changes no link, sysctl (the bridge plugin turns on ip_forward) or
// firewall rule of the machine, and deleting the netns removes them all.
// scrubd runs in the machine's namespace: it reaches pods by netns path.
//
// Variables, not constants, only so that `make soak` can use names of its own
// (useNames) and run beside a demo or a benchmark that uses the demo's.
var (
	NamePrefix = "ctscrub-demo"
	NetName    = "ctscrub-demo" // the CNI network
	NodeNS     = NamePrefix + "-node"
	OutsideNS  = NamePrefix + "-outside"
)

const (
	BridgeName  = "ctsdemo0"    // inside the node netns
	outsideVeth = "ctsdemo-out" // the node's side of the outside host's link
	NetnsDir    = "/run/netns"
)

// Addresses. The pod CIDRs are what scrubd accepts; host-local hands out a
// range of only a few addresses inside them, so a deleted pod's IP is the only
// one free and the next pod gets it again (IP reuse, the case ctscrub is for).
var (
	PodCIDR4    = netip.MustParsePrefix("10.199.0.0/16")
	PodCIDR6    = netip.MustParsePrefix("fd10:199::/48")
	podSubnet4  = netip.MustParsePrefix("10.199.1.0/24")
	podSubnet6  = netip.MustParsePrefix("fd10:199:0:1::/64")
	BGPods4     = netip.MustParsePrefix("10.199.128.0/17") // the node's other pods (synthetic)
	BGPods6     = netip.MustParsePrefix("fd10:199:0:80::/64")
	outsideHost = [2]netip.Prefix{netip.MustParsePrefix("198.18.99.1/24"), netip.MustParsePrefix("fd10:198:99::1/64")}
	OutsideAddr = [2]netip.Prefix{netip.MustParsePrefix("198.18.99.2/24"), netip.MustParsePrefix("fd10:198:99::2/64")}
)

// PodRange returns the first n addresses host-local hands out (from .10).
func PodRange(n int) (v4, v6 []netip.Addr) { return PodRangeFrom(0, n) }

// PodRangeFrom returns n addresses from the from-th one after .10: the range
// of a second network on the same bridge and subnet.
func PodRangeFrom(from, n int) (v4, v6 []netip.Addr) {
	a4 := netip.MustParseAddr("10.199.1.10")
	a6 := netip.MustParseAddr("fd10:199:0:1::10")
	for range from {
		a4, a6 = a4.Next(), a6.Next()
	}
	for i := 0; i < n; i++ {
		v4 = append(v4, a4)
		v6 = append(v6, a6)
		a4, a6 = a4.Next(), a6.Next()
	}
	return v4, v6
}

// RunIP runs the ip(8) command and returns a clear error with its output.
func RunIP(args ...string) error {
	out, err := exec.Command("ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

// NetnsPath is the path of the named netns.
func NetnsPath(name string) string { return filepath.Join(NetnsDir, name) }

// AddNetns creates a named network namespace with its loopback up, as a
// container runtime does before it runs the CNI chain.
func AddNetns(name string) (string, error) {
	if err := RunIP("netns", "add", name); err != nil {
		return "", err
	}
	if err := RunIP("-n", name, "link", "set", "lo", "up"); err != nil {
		_ = RunIP("netns", "del", name)
		return "", err
	}
	return NetnsPath(name), nil
}

// DelNetns deletes the named netns, if it exists.
func DelNetns(name string) error {
	if _, err := os.Stat(NetnsPath(name)); os.IsNotExist(err) {
		return nil
	}
	return RunIP("netns", "del", name)
}

// AddNode creates the node's network namespace (NodeNS; tests use another).
func AddNode(c *Cleanup, name string) (string, error) {
	path, err := AddNetns(name)
	if err != nil {
		return "", err
	}
	// Pushed before any pod: popped after every pod's CNI DEL, which runs in it.
	c.Push("delete netns "+name+" (bridge, veths, routes)", func() error { return DelNetns(name) })
	return path, nil
}

// AddOutside creates the "outside" host: a netns behind a veth from the node,
// outside the pod CIDRs, for pod-to-outside and outside-to-pod traffic.
func AddOutside(c *Cleanup) (string, error) {
	path, err := AddNetns(OutsideNS)
	if err != nil {
		return "", err
	}
	c.Push("delete netns "+OutsideNS, func() error { return DelNetns(OutsideNS) })
	steps := [][]string{
		{"-n", NodeNS, "link", "add", outsideVeth, "type", "veth", "peer", "name", "eth0", "netns", OutsideNS},
		{"-n", NodeNS, "addr", "add", outsideHost[0].String(), "dev", outsideVeth},
		{"-n", NodeNS, "addr", "add", outsideHost[1].String(), "dev", outsideVeth, "nodad"},
		{"-n", NodeNS, "link", "set", outsideVeth, "up"},
		{"-n", OutsideNS, "addr", "add", OutsideAddr[0].String(), "dev", "eth0"},
		{"-n", OutsideNS, "addr", "add", OutsideAddr[1].String(), "dev", "eth0", "nodad"},
		{"-n", OutsideNS, "link", "set", "eth0", "up"},
		{"-n", OutsideNS, "route", "add", "default", "via", outsideHost[0].Addr().String()},
		{"-n", OutsideNS, "-6", "route", "add", "default", "via", outsideHost[1].Addr().String()},
	}
	for _, s := range steps {
		if err := RunIP(s...); err != nil {
			return "", err
		}
	}
	return path, nil
}

// Chain is the CNI network the demo's pods are created through: Debian's
// reference bridge + host-local, then ctscrub, as a runtime would run it.
type Chain struct {
	node      string // the node's netns path: the plugins run in it
	CNI       *libcni.CNIConfig
	List      *libcni.NetworkConfigList
	ConfPath  string
	HasPlugin bool // ctscrub is in the chain
}

// ChainConfig is what NewChain builds the conflist and bin dir from.
type ChainConfig struct {
	Node       string // the node's netns path
	WorkDir    string // bin dir, cache, IPAM state and the conflist go here
	RefPlugins string // Debian's reference plugins (/usr/lib/cni)
	Plugin     string // the ctscrub binary; "" leaves it out of the chain
	Socket     string // scrubd's socket
	RangeSize  int    // addresses host-local may hand out
	// A second network on the same bridge: its name ("": NetName) and
	// where its range starts (addresses after the first of PodRange).
	Name      string
	RangeFrom int
}

// NewChain writes the chain's conflist and its bin dir of symlinks under
// cfg.WorkDir.
func NewChain(cfg ChainConfig) (*Chain, error) {
	binDir := filepath.Join(cfg.WorkDir, "cni-bin")
	if err := os.MkdirAll(binDir, 0o755); err != nil {
		return nil, err
	}
	// One bin dir of symlinks, as containerd takes it.
	for _, p := range []string{"bridge", "host-local", "loopback"} {
		src := filepath.Join(cfg.RefPlugins, p)
		if _, err := os.Stat(src); err != nil {
			return nil, fmt.Errorf("reference CNI plugin %s: %w (install Debian's containernetworking-plugins: scripts/setup.sh)", src, err)
		}
		if err := os.Symlink(src, filepath.Join(binDir, p)); err != nil {
			return nil, err
		}
	}
	if cfg.Plugin != "" {
		abs, err := filepath.Abs(cfg.Plugin)
		if err != nil {
			return nil, err
		}
		if _, err := os.Stat(abs); err != nil {
			return nil, fmt.Errorf("ctscrub CNI plugin %s: %w (run `make build`)", abs, err)
		}
		if err := os.Symlink(abs, filepath.Join(binDir, "ctscrub")); err != nil {
			return nil, err
		}
	}
	v4, v6 := PodRangeFrom(cfg.RangeFrom, cfg.RangeSize)
	plugins := []map[string]any{{
		"type":        "bridge",
		"bridge":      BridgeName,
		"isGateway":   true,
		"ipMasq":      false, // the outside netns routes back to the pod CIDR: no NAT
		"hairpinMode": false,
		"ipam": map[string]any{
			"type":    "host-local",
			"dataDir": filepath.Join(cfg.WorkDir, "ipam"),
			"ranges": [][]map[string]string{
				{{"subnet": podSubnet4.String(), "rangeStart": v4[0].String(), "rangeEnd": v4[len(v4)-1].String()}},
				{{"subnet": podSubnet6.String(), "rangeStart": v6[0].String(), "rangeEnd": v6[len(v6)-1].String()}},
			},
			"routes": []map[string]string{{"dst": "0.0.0.0/0"}, {"dst": "::/0"}},
		},
	}}
	if cfg.Plugin != "" {
		plugins = append(plugins, map[string]any{
			"type":          "ctscrub",
			"socket":        cfg.Socket,
			"failurePolicy": "fail",
		})
	}
	conf := map[string]any{
		// Debian's reference plugins speak CNI up to 1.0.0.
		"cniVersion": "1.0.0",
		"name":       cmp.Or(cfg.Name, NetName),
		"plugins":    plugins,
	}
	data, err := json.MarshalIndent(conf, "", "  ")
	if err != nil {
		return nil, err
	}
	confPath := filepath.Join(cfg.WorkDir, "10-ctscrub-demo.conflist")
	if err := os.WriteFile(confPath, data, 0o644); err != nil {
		return nil, err
	}
	list, err := libcni.ConfListFromBytes(data)
	if err != nil {
		return nil, fmt.Errorf("parse the demo's conflist %s: %w", confPath, err)
	}
	return &Chain{
		node:      cfg.Node,
		CNI:       libcni.NewCNIConfigWithCacheDir([]string{binDir}, filepath.Join(cfg.WorkDir, "cni-cache"), nil),
		List:      list,
		ConfPath:  confPath,
		HasPlugin: cfg.Plugin != "",
	}, nil
}

// Pod is one pod sandbox: a netns attached through the chain.
type Pod struct {
	Name        string
	ContainerID string
	Netns       string // path
	IfName      string
	V4, V6      netip.Addr
	HostVeth    string
	AddTook     time.Duration
}

// IPs is the pod's v4 and v6 address, those it has.
func (p *Pod) IPs() []netip.Addr {
	var out []netip.Addr
	for _, a := range []netip.Addr{p.V4, p.V6} {
		if a.IsValid() {
			out = append(out, a)
		}
	}
	return out
}

func (p *Pod) rt() *libcni.RuntimeConf {
	return &libcni.RuntimeConf{ContainerID: p.ContainerID, NetNS: p.Netns, IfName: p.IfName}
}

// Add creates the pod's netns and runs the chain's ADD.
func (ch *Chain) Add(ctx context.Context, c *Cleanup, name string) (*Pod, error) {
	nsName := NamePrefix + "-" + name
	path, err := AddNetns(nsName)
	if err != nil {
		return nil, err
	}
	p := &Pod{Name: name, ContainerID: nsName, Netns: path, IfName: "eth0"}
	c.Push("delete netns "+nsName, func() error { return DelNetns(nsName) })
	start := time.Now()
	var res types.Result
	// A runtime runs the plugins in the node's namespace; they inherit it
	// from the thread that forks them.
	err = InNetns(ch.node, func() error {
		var err error
		res, err = ch.CNI.AddNetworkList(ctx, ch.List, p.rt())
		return err
	})
	p.AddTook = time.Since(start)
	if err != nil {
		return nil, fmt.Errorf("CNI ADD of pod %s (netns %s) through %s: %w", name, path, ch.ConfPath, err)
	}
	// Run DEL on cleanup too: it is what releases the IP and, with ctscrub in
	// the chain, scrubs it; a pod deleted by the demo itself pushes nothing.
	r, err := current.NewResultFromResult(res)
	if err != nil {
		return nil, fmt.Errorf("CNI ADD of pod %s: result: %w", name, err)
	}
	for _, ipc := range r.IPs {
		a, _ := netip.AddrFromSlice(ipc.Address.IP)
		a = a.Unmap()
		if a.Is4() {
			p.V4 = a
		} else {
			p.V6 = a
		}
	}
	for _, ifc := range r.Interfaces {
		// The bridge plugin reports the bridge, the host-side veth, then the
		// container side (the one with a sandbox).
		if ifc.Sandbox == "" && ifc.Name != BridgeName {
			p.HostVeth = ifc.Name
		}
	}
	if !p.V4.IsValid() {
		return p, fmt.Errorf("CNI ADD of pod %s gave no IPv4 address: %s", name, r)
	}
	if p.HostVeth == "" {
		return p, fmt.Errorf("CNI ADD of pod %s: no host-side veth in the result: %s", name, r)
	}
	return p, nil
}

// Del runs the chain's DEL (with the cached prevResult, as a runtime does) and
// removes the netns.
func (ch *Chain) Del(ctx context.Context, p *Pod) (time.Duration, error) {
	start := time.Now()
	err := InNetns(ch.node, func() error { return ch.CNI.DelNetworkList(ctx, ch.List, p.rt()) })
	took := time.Since(start)
	if err != nil {
		return took, fmt.Errorf("CNI DEL of pod %s (%s): %w", p.Name, p.V4, err)
	}
	return took, DelNetns(NamePrefix + "-" + p.Name)
}

// WaitDAD waits until IPv6 duplicate address detection has finished on the
// bridge (its gateway address answers neighbour solicitations only then):
// the bridge plugin does not wait for it, a pod's first v6 packets to the
// outside would be lost.
func WaitDAD(ctx context.Context, link string) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		out, err := exec.Command("ip", "-n", NodeNS, "-6", "addr", "show", "dev", link, "tentative").CombinedOutput()
		if err != nil {
			return fmt.Errorf("ip -6 addr show dev %s: %v: %s", link, err, bytes.TrimSpace(out))
		}
		if len(bytes.TrimSpace(out)) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("IPv6 addresses of %s still tentative after 10 s: %s", link, bytes.TrimSpace(out))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}
