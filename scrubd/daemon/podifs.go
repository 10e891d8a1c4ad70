package daemon

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/internal/netnsid"
)

// PodInterface is one pod network interface found on the node: the
// container side of a veth whose host side lives in scrubd's namespace
// (the node's, with hostNetwork). What the recorder attaches to, and what
// the ownership rule needs after a restart (which pod holds which address
// now), without any history.
type PodInterface struct {
	// Netns is a path that opens the pod's network namespace: its bind
	// mount under /var/run/netns (/run/netns) when the runtime made one
	// (containerd, CRI-O, cilium-cni's tests), else /proc/PID/ns/net of a
	// process in it (the sandbox's pause process), which lasts as long as
	// that process.
	Netns string
	// IfName and Ifindex are the interface inside the pod (eth0).
	IfName  string
	Ifindex int
	// IPs are the interface's addresses, read in the pod's namespace:
	// global scope only (no link-local fe80::/10, no host scope).
	IPs []netip.Addr
	// HostIf and HostIfindex are the veth's host side (lxc... on a
	// Cilium node, veth... on a bridge node).
	HostIf      string
	HostIfindex int
	// Kind is how the host side was recognised: "cilium" (an lxc*
	// veth), "bridge:<name>" (a port of that bridge), or "veth" (any
	// other veth whose peer is in another namespace).
	Kind string
}

// podIfOptions say where findPodInterfaces looks; the zero value is the
// node's defaults.
type podIfOptions struct {
	// NetnsDirs hold the runtimes' netns bind mounts (default
	// /var/run/netns and /run/netns: the same directory on most nodes,
	// read once).
	NetnsDirs []string
	// Proc is procfs's mount point (default /proc).
	Proc string
}

// findPodInterfaces finds every pod network interface of the node, whether
// or not scrubd's CNI state lists it (pods started before ctscrub was
// installed, or while it was down). It must run in the node's network
// namespace (scrubd's, hostNetwork).
//
// How, on every kind of node: each pod's interface is one end of a veth
// pair whose other end is in the node's namespace. On a Cilium node that
// end is an lxc* device (cilium-cni names it lxc + a hash; lxc_health is
// Cilium's health endpoint, whose address is a pod address too); on a
// bridge or kube-proxy node (bridge, flannel, kindnet, ...) it is a port
// of the bridge (cni0, cbr0) or a routed veth (ptp). So: every veth in
// the node's namespace whose peer lives in another namespace
// (IFLA_LINK_NETNSID set), its peer's ifindex (IFLA_LINK) and the
// namespace's ID as the node's namespace knows it. That ID names no path:
// the candidate paths are the bind mounts under /var/run/netns and
// /proc/*/ns/net of every process (a runtime without bind mounts keeps
// the pause process), asked for their ID with RTM_GETNSID, one open and
// one request per distinct namespace (processes sharing one are read once,
// by inode). In the pod's namespace the peer is read by its ifindex: its
// name and its addresses.
//
// A veth whose peer's namespace has no path (its last process gone, bind
// mount removed: a sandbox being torn down) is skipped; so are the node's
// other devices. The result is sorted by netns path and interface name.
func findPodInterfaces(opts podIfOptions) ([]PodInterface, error) {
	pods, _, err := scanPodInterfaces(opts)
	return pods, err
}

// scanPodInterfaces is findPodInterfaces that also names the host ends it
// could not follow (missed): veths whose peer's namespace has no path it
// can open. Each may be a pod whose addresses nobody can read: a sandbox
// being torn down, or one of a runtime that keeps no bind mount while
// scrubd cannot see its processes (hostPID off).
func scanPodInterfaces(opts podIfOptions) (pods []PodInterface, missed []string, err error) {
	if len(opts.NetnsDirs) == 0 {
		opts.NetnsDirs = []string{"/var/run/netns", "/run/netns"}
	}
	if opts.Proc == "" {
		opts.Proc = "/proc"
	}
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, nil, fmt.Errorf("find pod interfaces: netlink: %w", err)
	}
	defer h.Close()
	links, err := h.LinkList()
	if err != nil {
		return nil, nil, fmt.Errorf("find pod interfaces: list the node's links: %w", err)
	}
	bridges := map[int]string{}
	for _, l := range links {
		if l.Type() == "bridge" {
			bridges[l.Attrs().Index] = l.Attrs().Name
		}
	}
	// The node's uplink may be a veth too (a kind node's eth0, whose peer is
	// in the container host's namespace): the device of a default route is
	// the node's own, not a pod's host end (no CNI gives a pod's host end
	// the node's default route).
	uplinks := map[int]bool{}
	for _, family := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		routes, err := h.RouteListFiltered(family, &netlink.Route{Table: unix.RT_TABLE_MAIN}, netlink.RT_FILTER_TABLE)
		if err != nil {
			return nil, nil, fmt.Errorf("find pod interfaces: list the node's routes: %w", err)
		}
		for _, r := range routes {
			if r.Dst == nil || r.Dst.IP.IsUnspecified() && isZeroMask(r.Dst.Mask) {
				uplinks[r.LinkIndex] = true
			}
		}
	}
	byNsid := map[int][]hostEnd{}
	for _, l := range links {
		a := l.Attrs()
		if (l.Type() != "veth" && l.Type() != "netkit") || a.NetNsID < 0 || a.ParentIndex == 0 {
			continue // not a pair device, or its peer is in this namespace
		}
		if uplinks[a.Index] {
			continue // the node's uplink
		}
		kind := "veth"
		switch {
		case strings.HasPrefix(a.Name, "lxc"):
			kind = "cilium"
		case bridges[a.MasterIndex] != "":
			kind = "bridge:" + bridges[a.MasterIndex]
		}
		byNsid[a.NetNsID] = append(byNsid[a.NetNsID], hostEnd{l, kind})
	}
	if len(byNsid) == 0 {
		return nil, nil, nil
	}

	paths, err := netnsPaths(opts)
	if err != nil {
		return nil, nil, err
	}
	// The calling thread's namespace (the node's): not a pod's.
	self, _ := netnsid.Of("/proc/thread-self/ns/net")
	seen := map[netnsid.ID]bool{self: true}
	var out []PodInterface
	var errs []error
	denied := 0 // namespace files the kernel's ptrace check refused
	for _, p := range paths {
		id, err := netnsid.Of(p)
		if errors.Is(err, os.ErrPermission) {
			denied++
			continue
		}
		if err != nil || seen[id] {
			continue // gone meanwhile, or read already
		}
		seen[id] = true
		ns, err := netns.GetFromPath(p)
		if err != nil {
			continue // gone meanwhile
		}
		nsid, err := h.GetNetNsIdByFd(int(ns))
		if err != nil || nsid < 0 || len(byNsid[nsid]) == 0 {
			ns.Close()
			continue // no veth of this namespace ends in the node's
		}
		ends := byNsid[nsid]
		delete(byNsid, nsid)
		found, err := readPeers(ns, p, ends)
		ns.Close()
		if err != nil {
			errs = append(errs, err)
		}
		for _, e := range ends {
			if !slices.ContainsFunc(found, func(f PodInterface) bool { return f.HostIfindex == e.link.Attrs().Index }) {
				missed = append(missed, e.link.Attrs().Name) // its peer could not be read
			}
		}
		out = append(out, found...)
		if len(byNsid) == 0 {
			break
		}
	}
	why := ""
	if denied > 0 {
		// Named with each miss: the fix is the DaemonSet's, not the pod's.
		why = fmt.Sprintf(" (%d processes' namespace files refused: permission denied; scrubd needs CAP_SYS_PTRACE to open those of processes with capabilities it lacks)", denied)
	}
	for _, ends := range byNsid {
		for _, e := range ends {
			missed = append(missed, e.link.Attrs().Name+why)
		}
	}
	slices.Sort(missed)
	slices.SortFunc(out, func(a, b PodInterface) int {
		if c := strings.Compare(a.Netns, b.Netns); c != 0 {
			return c
		}
		return strings.Compare(a.IfName, b.IfName)
	})
	return out, missed, errors.Join(errs...)
}

// netnsPaths lists the candidate paths: bind mounts first (they outlast any
// one process, so a pod found both ways is named by its mount), then every
// process's namespace.
func netnsPaths(opts podIfOptions) ([]string, error) {
	var paths []string
	for _, dir := range opts.NetnsDirs {
		ents, err := os.ReadDir(dir)
		if err != nil {
			continue // no such directory on this node
		}
		for _, e := range ents {
			paths = append(paths, filepath.Join(dir, e.Name()))
		}
	}
	ents, err := os.ReadDir(opts.Proc)
	if err != nil {
		return nil, fmt.Errorf("find pod interfaces: read %s: %w", opts.Proc, err)
	}
	for _, e := range ents {
		if _, err := strconv.Atoi(e.Name()); err == nil {
			paths = append(paths, filepath.Join(opts.Proc, e.Name(), "ns", "net"))
		}
	}
	return paths, nil
}

// hostEnd is a veth's end in the node's namespace, and how it was
// recognised (PodInterface.Kind).
type hostEnd struct {
	link netlink.Link
	kind string
}

// readPeers reads, in the namespace ns (at path), the peer of each host end.
func readPeers(ns netns.NsHandle, path string, ends []hostEnd) ([]PodInterface, error) {
	ph, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("find pod interfaces: netlink in %s: %w", path, err)
	}
	defer ph.Close()
	var out []PodInterface
	var errs []error
	for _, e := range ends {
		a, kind := e.link.Attrs(), e.kind
		peer, err := ph.LinkByIndex(a.ParentIndex)
		if err != nil {
			errs = append(errs, fmt.Errorf("find pod interfaces: %s's peer (ifindex %d) in %s: %w", a.Name, a.ParentIndex, path, err))
			continue
		}
		pi := PodInterface{Netns: path, IfName: peer.Attrs().Name, Ifindex: peer.Attrs().Index,
			HostIf: a.Name, HostIfindex: a.Index, Kind: kind}
		addrs, err := ph.AddrList(peer, netlink.FAMILY_ALL)
		if err != nil {
			errs = append(errs, fmt.Errorf("find pod interfaces: addresses of %s in %s: %w", pi.IfName, path, err))
			continue
		}
		for _, ad := range addrs {
			ip, ok := netip.AddrFromSlice(ad.IP)
			if !ok || ad.Scope != unix.RT_SCOPE_UNIVERSE || ip.IsLinkLocalUnicast() {
				continue
			}
			pi.IPs = append(pi.IPs, ip.Unmap())
		}
		slices.SortFunc(pi.IPs, func(x, y netip.Addr) int { return x.Compare(y) })
		out = append(out, pi)
	}
	return out, errors.Join(errs...)
}

// bridgeRanges returns the subnets of the node's bridges that pods are
// ports of (cni0, cbr0 on a bridge or kube-proxy node: the bridge holds
// the gateway address of the node's pod range, e.g. 10.244.1.1/24), for
// the bootstrap pass's Cover (scrubd/bootstrap Options.Cover), so the
// range's free addresses are vouched for too. A Cilium node has no such
// bridge (its range is in the CiliumNode resource). Global-scope
// addresses only; it must run in the node's network namespace.
func bridgeRanges(pods []PodInterface) ([]netip.Prefix, error) {
	names := map[string]bool{}
	for _, p := range pods {
		if b, ok := strings.CutPrefix(p.Kind, "bridge:"); ok {
			names[b] = true
		}
	}
	var out []netip.Prefix
	for name := range names {
		l, err := netlink.LinkByName(name)
		if err != nil {
			return nil, fmt.Errorf("bridge %s: %w", name, err)
		}
		addrs, err := netlink.AddrList(l, netlink.FAMILY_ALL)
		if err != nil {
			return nil, fmt.Errorf("addresses of bridge %s: %w", name, err)
		}
		for _, a := range addrs {
			ip, ok := netip.AddrFromSlice(a.IP)
			if !ok || a.Scope != unix.RT_SCOPE_UNIVERSE || ip.IsLinkLocalUnicast() {
				continue
			}
			ones, _ := a.Mask.Size()
			if ip.Is4In6() {
				ip = ip.Unmap()
			}
			out = append(out, netip.PrefixFrom(ip, ones).Masked())
		}
	}
	slices.SortFunc(out, func(a, b netip.Prefix) int {
		if c := a.Addr().Compare(b.Addr()); c != 0 {
			return c
		}
		return a.Bits() - b.Bits()
	})
	return slices.Compact(out), nil
}

// ciliumHostRanges is the node's own pod range on a Cilium node: the
// prefixes of the routes Cilium installs on its cilium_host device for
// the node's allocation CIDRs (`enable-local-node-route`, on by default;
// e.g. 10.244.1.0/24 via 10.244.1.1 dev cilium_host). A node without
// cilium_host (no Cilium), or whose IPAM installs no such route (ENI,
// Azure), has none: the pass then covers no free address there. Host
// routes (/32, /128: the router's own address) are not ranges, and a
// range that does not hold the router's address is another node's (tunnel
// mode routes every node's range through cilium_host).
func ciliumHostRanges() ([]netip.Prefix, error) {
	l, err := netlink.LinkByName("cilium_host")
	if err != nil {
		var notFound netlink.LinkNotFoundError
		if errors.As(err, &notFound) {
			return nil, nil
		}
		return nil, fmt.Errorf("cilium_host: %w", err)
	}
	routes, err := netlink.RouteList(l, netlink.FAMILY_ALL)
	if err != nil {
		return nil, fmt.Errorf("routes of cilium_host: %w", err)
	}
	// In tunnel mode the other nodes' ranges are routed through cilium_host
	// too; the node's own range is the one that holds the router's address
	// (cilium_host's, allocated from it).
	addrs, err := netlink.AddrList(l, netlink.FAMILY_ALL)
	if err != nil {
		return nil, fmt.Errorf("addresses of cilium_host: %w", err)
	}
	var router []netip.Addr
	for _, a := range addrs {
		if ip, ok := netip.AddrFromSlice(a.IP); ok {
			router = append(router, ip.Unmap())
		}
	}
	var out []netip.Prefix
	for _, r := range routes {
		if r.Dst == nil {
			continue
		}
		ip, ok := netip.AddrFromSlice(r.Dst.IP)
		if !ok {
			continue
		}
		ip = ip.Unmap()
		ones, _ := r.Dst.Mask.Size()
		if ones >= ip.BitLen() || ip.IsLinkLocalUnicast() || ip.IsMulticast() {
			continue
		}
		pfx := netip.PrefixFrom(ip, ones).Masked()
		if !slices.ContainsFunc(router, pfx.Contains) {
			continue // another node's range
		}
		out = append(out, pfx)
	}
	slices.SortFunc(out, func(a, b netip.Prefix) int {
		if c := a.Addr().Compare(b.Addr()); c != 0 {
			return c
		}
		return a.Bits() - b.Bits()
	})
	return slices.Compact(out), nil
}

func isZeroMask(m net.IPMask) bool {
	ones, _ := m.Size()
	return ones == 0
}
