// Package netpods is TEST SUPPORT ONLY: a node with pods made of real
// network namespaces and veth pairs, for tests that need real traffic.
//
// A Node is a dedicated "node" network namespace (nothing is created in the
// host namespace) with a bridge holding the pods' gateway addresses
// (10.244.0.1/24, fd00:244::1/64) and a "remote" host outside the pod CIDRs
// (192.0.2.2, 2001:db8:2::2) behind a routed veth. Each pod is a network
// namespace whose eth0 is one end of a veth pair; the other end (HostVeth)
// is a bridge port in the node namespace, where a test attaches the Cilium
// stand-in. Everything is removed when the test ends.
//
// Traffic helpers (TCP, UDP, Ping) open real sockets inside a host's
// namespace on a locked OS thread; ServeEcho answers TCP and UDP on EchoPort.
package netpods

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"sync"
	"testing"

	"github.com/ctscrub/ctscrub/internal/nsexec"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Addresses of every Node (each node lives in its own namespaces, so nodes
// of parallel tests do not collide).
var (
	PodCIDR4 = netip.MustParsePrefix("10.244.0.0/24")
	PodCIDR6 = netip.MustParsePrefix("fd00:244::/64")
	Gateway4 = netip.MustParseAddr("10.244.0.1")
	Gateway6 = netip.MustParseAddr("fd00:244::1")

	nodeUplink4 = netip.MustParsePrefix("192.0.2.1/24")
	nodeUplink6 = netip.MustParsePrefix("2001:db8:2::1/64")
	remote4     = netip.MustParsePrefix("192.0.2.2/24")
	remote6     = netip.MustParsePrefix("2001:db8:2::2/64")
)

// EchoPort is where ServeEcho listens (TCP and UDP, both families).
const EchoPort = 7007

// Host is a network namespace with one interface, eth0, and an IPv4 and an
// IPv6 address.
type Host struct {
	Name  string // netns name (under /var/run/netns)
	Path  string // netns path, what a CNI runtime passes as CNI_NETNS
	Addr4 netip.Addr
	Addr6 netip.Addr
	t     testing.TB
}

// Pod is a Host on the node's bridge.
type Pod struct {
	Host
	HostVeth string // host-side veth in the node namespace
}

// Node is the node namespace with its bridge, pods and remote host.
type Node struct {
	Host          // the node namespace itself (Addr4/Addr6: the gateway)
	Bridge string // bridge in the node namespace
	Remote *Host  // a host outside the pod CIDRs, routed through the node

	t      testing.TB
	prefix string
	mu     sync.Mutex
	pods   []*Pod
	gen    int // pods replaced so far
}

// NewNode creates a node namespace, its bridge and the remote host. It
// skips the test when not root.
func NewNode(t testing.TB) *Node {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("netpods: needs root (network namespaces)")
	}
	var rnd [3]byte
	rand.Read(rnd[:])
	prefix := "ctscrub-" + hex.EncodeToString(rnd[:])
	n := &Node{t: t, prefix: prefix, Bridge: "br0"}
	n.Host = *newHost(t, prefix+"-node")
	n.Addr4, n.Addr6 = Gateway4, Gateway6

	err := n.Do(func() error {
		if err := linkUp("lo"); err != nil {
			return err
		}
		br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: n.Bridge}}
		if err := netlink.LinkAdd(br); err != nil {
			return fmt.Errorf("create bridge: %w", err)
		}
		if err := addAddrs(n.Bridge, netip.PrefixFrom(Gateway4, 24), netip.PrefixFrom(Gateway6, 64)); err != nil {
			return err
		}
		if err := linkUp(n.Bridge); err != nil {
			return err
		}
		for _, p := range []string{"/proc/sys/net/ipv4/ip_forward", "/proc/sys/net/ipv6/conf/all/forwarding"} {
			if err := os.WriteFile(p, []byte("1"), 0o644); err != nil {
				return fmt.Errorf("enable forwarding (%s): %w", p, err)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("netpods: set up node %s: %v", n.Name, err)
	}

	// The remote host: a routed veth "uplink" <-> remote eth0.
	r := newHost(t, prefix+"-remote")
	r.Addr4, r.Addr6 = remote4.Addr(), remote6.Addr()
	if err := n.veth("uplink", r, ""); err != nil {
		t.Fatalf("netpods: connect remote host: %v", err)
	}
	err = n.Do(func() error {
		if err := addAddrs("uplink", nodeUplink4, nodeUplink6); err != nil {
			return err
		}
		return linkUp("uplink")
	})
	if err == nil {
		err = r.Do(func() error {
			if err := linkUp("lo"); err != nil {
				return err
			}
			if err := addAddrs("eth0", remote4, remote6); err != nil {
				return err
			}
			if err := linkUp("eth0"); err != nil {
				return err
			}
			if err := addRoute(PodCIDR4, nodeUplink4.Addr()); err != nil {
				return err
			}
			return addRoute(PodCIDR6, nodeUplink6.Addr())
		})
	}
	if err != nil {
		t.Fatalf("netpods: set up remote host: %v", err)
	}
	n.Remote = r
	return n
}

// PodCIDRs are the node's pod CIDRs (index.Config.PodCIDRs).
func (n *Node) PodCIDRs() []netip.Prefix { return []netip.Prefix{PodCIDR4, PodCIDR6} }

// AddPod creates a pod: a namespace with eth0 (addresses 10.244.0.N,
// fd00:244::N, default routes via the bridge) and its host-side veth vethN
// on the bridge.
func (n *Node) AddPod() *Pod {
	n.t.Helper()
	n.mu.Lock()
	i := len(n.pods) + 10
	n.pods = append(n.pods, nil)
	n.mu.Unlock()
	p := n.addPod(i, fmt.Sprintf("%s-pod%d", n.prefix, i))
	n.mu.Lock()
	n.pods[i-10] = p
	n.mu.Unlock()
	return p
}

// ReplacePod deletes p (its host-side veth, which takes eth0 with it, and
// its namespace) and creates a new pod with the same addresses and host-side
// veth name in a new namespace: a pod IP reused on the node.
func (n *Node) ReplacePod(p *Pod) *Pod {
	n.t.Helper()
	err := n.Do(func() error {
		l, err := netlink.LinkByName(p.HostVeth)
		if err != nil {
			return fmt.Errorf("find %s: %w", p.HostVeth, err)
		}
		return netlink.LinkDel(l)
	})
	if err != nil {
		n.t.Fatalf("netpods: delete pod %s: %v", p.Name, err)
	}
	if err := netns.DeleteNamed(p.Name); err != nil {
		n.t.Fatalf("netpods: delete netns %s: %v", p.Name, err)
	}
	var i int
	fmt.Sscanf(p.HostVeth, "veth%d", &i)
	n.mu.Lock()
	n.gen++
	name := fmt.Sprintf("%s-pod%d-%d", n.prefix, i, n.gen)
	n.mu.Unlock()
	np := n.addPod(i, name)
	n.mu.Lock()
	n.pods[i-10] = np
	n.mu.Unlock()
	return np
}

func (n *Node) addPod(i int, name string) *Pod {
	n.t.Helper()
	h := newHost(n.t, name)
	h.Addr4 = netip.AddrFrom4([4]byte{10, 244, 0, byte(i)})
	a6 := Gateway6.As16()
	a6[15] = byte(i)
	h.Addr6 = netip.AddrFrom16(a6)
	p := &Pod{Host: *h, HostVeth: fmt.Sprintf("veth%d", i)}
	if err := n.veth(p.HostVeth, h, n.Bridge); err != nil {
		n.t.Fatalf("netpods: create pod %s: %v", h.Name, err)
	}
	err := n.Do(func() error { return linkUp(p.HostVeth) })
	if err == nil {
		err = h.Do(func() error {
			if err := linkUp("lo"); err != nil {
				return err
			}
			if err := addAddrs("eth0", netip.PrefixFrom(h.Addr4, 24), netip.PrefixFrom(h.Addr6, 64)); err != nil {
				return err
			}
			if err := linkUp("eth0"); err != nil {
				return err
			}
			if err := addRoute(netip.Prefix{}, Gateway4); err != nil {
				return err
			}
			return addRoute(netip.Prefix{}, Gateway6)
		})
	}
	if err != nil {
		n.t.Fatalf("netpods: set up pod %s: %v", h.Name, err)
	}
	return p
}

// veth creates a veth pair: name in the node namespace (a port of master
// when master is set) and eth0 in peer's namespace.
func (n *Node) veth(name string, peer *Host, master string) error {
	return n.Do(func() error {
		peerNS, err := netns.GetFromPath(peer.Path)
		if err != nil {
			return fmt.Errorf("open netns %s: %w", peer.Path, err)
		}
		defer peerNS.Close()
		attrs := netlink.LinkAttrs{Name: name}
		if master != "" {
			br, err := netlink.LinkByName(master)
			if err != nil {
				return fmt.Errorf("find bridge %s: %w", master, err)
			}
			attrs.MasterIndex = br.Attrs().Index
		}
		v := &netlink.Veth{LinkAttrs: attrs, PeerName: "eth0", PeerNamespace: netlink.NsFd(int(peerNS))}
		if err := netlink.LinkAdd(v); err != nil {
			return fmt.Errorf("create veth %s <-> %s/eth0: %w", name, peer.Name, err)
		}
		return nil
	})
}

// newHost creates a named network namespace, removed when the test ends.
func newHost(t testing.TB, name string) *Host {
	t.Helper()
	path, err := nsexec.Create(name)
	if err != nil {
		t.Fatalf("netpods: %v", err)
	}
	t.Cleanup(func() {
		if err := netns.DeleteNamed(name); err != nil && !errors.Is(err, os.ErrNotExist) {
			t.Logf("netpods: delete netns %s: %v", name, err)
		}
	})
	return &Host{Name: name, Path: path, t: t}
}

// Do runs fn on a locked OS thread inside the host's network namespace.
// Sockets opened in fn stay in that namespace after Do returns.
func (h *Host) Do(fn func() error) error { return nsexec.Do(h.Path, fn) }

func linkUp(name string) error {
	l, err := netlink.LinkByName(name)
	if err != nil {
		return fmt.Errorf("find %s: %w", name, err)
	}
	if err := netlink.LinkSetUp(l); err != nil {
		return fmt.Errorf("set %s up: %w", name, err)
	}
	return nil
}

// addAddrs adds addresses without duplicate address detection, so IPv6 is
// usable at once.
func addAddrs(name string, prefixes ...netip.Prefix) error {
	l, err := netlink.LinkByName(name)
	if err != nil {
		return fmt.Errorf("find %s: %w", name, err)
	}
	for _, p := range prefixes {
		a, err := netlink.ParseAddr(p.String())
		if err != nil {
			return err
		}
		if p.Addr().Is6() {
			a.Flags = unix.IFA_F_NODAD
		}
		if err := netlink.AddrAdd(l, a); err != nil {
			return fmt.Errorf("add %s to %s: %w", p, name, err)
		}
	}
	return nil
}

// addRoute adds a route to dst (the default route when dst is the zero
// Prefix) via gw.
func addRoute(dst netip.Prefix, gw netip.Addr) error {
	r := &netlink.Route{Gw: gw.AsSlice()}
	if dst.IsValid() {
		d, err := netlink.ParseIPNet(dst.String())
		if err != nil {
			return err
		}
		r.Dst = d
	} else if gw.Is6() {
		r.Family = netlink.FAMILY_V6
	} else {
		r.Family = netlink.FAMILY_V4
	}
	if err := netlink.RouteAdd(r); err != nil {
		return fmt.Errorf("add route %v via %s: %w", dst, gw, err)
	}
	return nil
}
