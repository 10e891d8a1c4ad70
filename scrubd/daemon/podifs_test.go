package daemon

import (
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/ctscrub/ctscrub/internal/nsexec"
)

func runIP(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
	}
}

// addNetns makes a named namespace for the test and removes it at the end.
func addNetns(t *testing.T, name string) string {
	t.Helper()
	runIP(t, "netns", "add", name)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	return filepath.Join("/var/run/netns", name)
}

// A node of real network namespaces: a Cilium-like pod (lxc* veth), a
// bridge node's pod (a port of cni0), and a pod whose namespace has no
// bind mount left, only its sandbox process (found through /proc). Beside
// them, devices that are no pod's: the bridge, a veth pair inside the node, a
// namespace with no veth to the node. Each pod is found once, with its
// interface's name and global addresses (not its link-local one), under a
// path that opens its namespace.
func TestFindPodInterfaces(t *testing.T) {
	requireRoot(t)
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("needs ip(8)")
	}
	tag := fmt.Sprintf("ctspi%d", os.Getpid()%100000)
	node := addNetns(t, tag+"-node")
	p1 := addNetns(t, tag+"-p1")
	p2 := addNetns(t, tag+"-p2")
	p3name := tag + "-p3"
	p3 := addNetns(t, p3name)
	other := addNetns(t, tag+"-other")
	n := filepath.Base(node)

	// Cilium: lxc<hash> on the node, eth0 in the pod, /32 and /128.
	runIP(t, "-n", n, "link", "add", "lxc1a2b", "type", "veth", "peer", "name", "eth0", "netns", filepath.Base(p1))
	runIP(t, "-n", filepath.Base(p1), "addr", "add", "10.244.1.5/32", "dev", "eth0")
	runIP(t, "-n", filepath.Base(p1), "addr", "add", "fd00:10:244::5/128", "dev", "eth0", "nodad")
	runIP(t, "-n", filepath.Base(p1), "link", "set", "eth0", "up")
	runIP(t, "-n", n, "link", "set", "lxc1a2b", "up")
	// Bridge node: a port of cni0.
	runIP(t, "-n", n, "link", "add", "cni0", "type", "bridge")
	runIP(t, "-n", n, "addr", "add", "10.244.2.1/24", "dev", "cni0")
	runIP(t, "-n", n, "link", "add", "veth9f8e", "type", "veth", "peer", "name", "eth0", "netns", filepath.Base(p2))
	runIP(t, "-n", n, "link", "set", "veth9f8e", "master", "cni0")
	runIP(t, "-n", filepath.Base(p2), "addr", "add", "10.244.2.7/24", "dev", "eth0")
	// A pod known only by its sandbox process.
	runIP(t, "-n", n, "link", "add", "lxc7777", "type", "veth", "peer", "name", "eth0", "netns", p3name)
	runIP(t, "-n", p3name, "addr", "add", "10.244.3.9/32", "dev", "eth0")
	sandbox := exec.Command("ip", "netns", "exec", p3name, "sleep", "300")
	if err := sandbox.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sandbox.Process.Kill(); sandbox.Wait() })
	sandboxNs := fmt.Sprintf("/proc/%d/ns/net", sandbox.Process.Pid)
	for deadline := time.Now().Add(5 * time.Second); ; {
		// `ip netns exec` enters the namespace, then execs sleep.
		a, _ := os.Readlink(sandboxNs)
		b, _ := os.Readlink(fmt.Sprintf("/proc/%d/ns/net", os.Getpid()))
		if a != "" && a != b {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the sandbox process never entered its namespace")
		}
		time.Sleep(10 * time.Millisecond)
	}
	runIP(t, "netns", "del", p3name) // the bind mount goes, the namespace stays
	if _, err := os.Stat(p3); !os.IsNotExist(err) {
		t.Fatalf("%s still there: %v", p3, err)
	}
	// No pod's: a veth pair within the node (and the bridge itself), a namespace whose
	// veth ends in itself.
	runIP(t, "-n", n, "link", "add", "vh0", "type", "veth", "peer", "name", "vh1")
	runIP(t, "-n", filepath.Base(other), "link", "add", "eth0", "type", "veth", "peer", "name", "eth1")

	var got []PodInterface
	var ranges []netip.Prefix
	start := time.Now()
	err := nsexec.Do(node, func() error {
		var err error
		if got, err = findPodInterfaces(podIfOptions{}); err != nil {
			return err
		}
		ranges, err = bridgeRanges(got)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("found %d pod interfaces in %v", len(got), time.Since(start))
	if want := []netip.Prefix{netip.MustParsePrefix("10.244.2.0/24")}; !slices.Equal(ranges, want) {
		t.Errorf("the bridge's ranges: %v, want %v", ranges, want)
	}
	want := []struct {
		netns, host, kind string
		ips               []netip.Addr
	}{
		{sandboxNs, "lxc7777", "cilium", []netip.Addr{netip.MustParseAddr("10.244.3.9")}},
		{p1, "lxc1a2b", "cilium", []netip.Addr{netip.MustParseAddr("10.244.1.5"), netip.MustParseAddr("fd00:10:244::5")}},
		{p2, "veth9f8e", "bridge:cni0", []netip.Addr{netip.MustParseAddr("10.244.2.7")}},
	}
	if len(got) != len(want) {
		t.Fatalf("found %+v, want %d pod interfaces", got, len(want))
	}
	for i, w := range want {
		g := got[i]
		// The sandbox's namespace may be named through another process
		// in it (ip's own, before it exec'd sleep, is the same one).
		sameNs := g.Netns == w.netns
		if !sameNs && w.netns == sandboxNs {
			a, _ := os.Readlink(g.Netns)
			b, _ := os.Readlink(sandboxNs)
			sameNs = a != "" && a == b
		}
		if !sameNs || g.IfName != "eth0" || g.HostIf != w.host || g.Kind != w.kind || !slices.Equal(g.IPs, w.ips) || g.Ifindex == 0 || g.HostIfindex == 0 {
			t.Errorf("pod interface %d: %+v, want netns %s, eth0, host %s, %s, %v", i, g, w.netns, w.host, w.kind, w.ips)
		}
		// The path opens the pod's namespace: its eth0 is there.
		if err := nsexec.Do(g.Netns, func() error {
			l, err := netlink.LinkByName(g.IfName)
			if err == nil && l.Attrs().Index != g.Ifindex {
				err = fmt.Errorf("ifindex %d, found %d", l.Attrs().Index, g.Ifindex)
			}
			return err
		}); err != nil {
			t.Errorf("%s in %s: %v", g.IfName, g.Netns, err)
		}
	}
}

// Cilium's node range, from the routes it installs on cilium_host (the
// local node route of cluster-pool IPAM): the pass covers the node's free
// addresses from it. The router's own /32 is no range, nor is another
// node's range (it does not hold the router's address); a node without
// cilium_host has none, and that is not an error.
func TestCiliumHostRanges(t *testing.T) {
	requireRoot(t)
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("needs ip(8)")
	}
	tag := fmt.Sprintf("ctsch%d", os.Getpid()%100000)
	node := addNetns(t, tag+"-node")
	bare := addNetns(t, tag+"-bare")
	n := filepath.Base(node)
	runIP(t, "-n", n, "link", "add", "cilium_host", "type", "veth", "peer", "name", "cilium_net") // as Cilium makes it
	runIP(t, "-n", n, "link", "set", "cilium_net", "up")
	runIP(t, "-n", n, "link", "set", "cilium_host", "up")
	runIP(t, "-n", n, "addr", "add", "10.244.7.1/32", "dev", "cilium_host")
	runIP(t, "-n", n, "route", "add", "10.244.7.0/24", "dev", "cilium_host", "src", "10.244.7.1")
	runIP(t, "-n", n, "route", "add", "10.244.7.1/32", "dev", "cilium_host")
	runIP(t, "-n", n, "addr", "add", "fd00:10:244:7::1/128", "dev", "cilium_host", "nodad")
	runIP(t, "-n", n, "-6", "route", "add", "fd00:10:244:7::/64", "dev", "cilium_host")
	// Another node's range, routed through cilium_host in tunnel mode.
	runIP(t, "-n", n, "route", "add", "10.244.9.0/24", "dev", "cilium_host", "src", "10.244.7.1")

	var got []netip.Prefix
	if err := nsexec.Do(node, func() (err error) { got, err = ciliumHostRanges(); return err }); err != nil {
		t.Fatal(err)
	}
	want := []netip.Prefix{netip.MustParsePrefix("10.244.7.0/24"), netip.MustParsePrefix("fd00:10:244:7::/64")}
	if !slices.Equal(got, want) {
		t.Errorf("ciliumHostRanges = %v, want %v", got, want)
	}
	if err := nsexec.Do(bare, func() (err error) { got, err = ciliumHostRanges(); return err }); err != nil || len(got) != 0 {
		t.Errorf("a node without cilium_host: %v, %v; want none and no error", got, err)
	}
}

// A kind node's uplink is a veth whose peer is in the container host's
// namespace, which no path here opens: it carries the node's default route
// and is the node's own, not a pod's host end the find missed. A pod's
// host end whose namespace cannot be opened is still missed.
func TestScanPodInterfacesSkipsUplink(t *testing.T) {
	requireRoot(t)
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("needs ip(8)")
	}
	tag := fmt.Sprintf("ctsup%d", os.Getpid()%100000)
	node := addNetns(t, tag+"-node")
	n := filepath.Base(node)
	// Two namespaces kept alive by a process each, then unnamed: no path
	// in the (empty) dirs the scan is given reaches them.
	hidden := func(name string) {
		addNetns(t, name)
		p := exec.Command("ip", "netns", "exec", name, "sleep", "300")
		if err := p.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { p.Process.Kill(); p.Wait() })
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			a, _ := os.Readlink(fmt.Sprintf("/proc/%d/ns/net", p.Process.Pid))
			b, _ := os.Readlink("/proc/self/ns/net")
			if a != "" && a != b {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("the process never entered its namespace")
			}
		}
	}
	hidden(tag + "-host")
	hidden(tag + "-pod")
	runIP(t, "-n", n, "link", "add", "eth0", "type", "veth", "peer", "name", "vethhost", "netns", tag+"-host")
	runIP(t, "-n", n, "addr", "add", "172.30.0.2/24", "dev", "eth0")
	runIP(t, "-n", n, "link", "set", "eth0", "up")
	runIP(t, "-n", n, "route", "add", "default", "via", "172.30.0.1")
	runIP(t, "-n", n, "link", "add", "lxc9f9f", "type", "veth", "peer", "name", "eth0", "netns", tag+"-pod")
	runIP(t, "netns", "del", tag+"-host")
	runIP(t, "netns", "del", tag+"-pod")

	var missed []string
	err := nsexec.Do(node, func() (err error) {
		_, missed, err = scanPodInterfaces(podIfOptions{NetnsDirs: []string{t.TempDir()}, Proc: t.TempDir()})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(missed, []string{"lxc9f9f"}) {
		t.Errorf("missed %v, want [lxc9f9f]: the uplink (default route) is the node's, the pod's host end is missed", missed)
	}
}
