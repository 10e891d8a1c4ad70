package recorder

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
)

// The host-side recorder (docs/recorder.md, "Host-side recording"): a tcx
// link at the head of the pod's host-side veth's ingress, ahead of Cilium's
// cil_from_container, running recorder_host over the same flow caches as the
// container-side filters. It sees what the pod sends, including frames a
// packet socket sends with PACKET_QDISC_BYPASS, which skip the pod's tc
// egress. Cilium attaches its own tcx links at the tail and replaces their
// programs in place, so the head stays ahead of it.
//
// The link is pinned under PinDir/host (a tcx link lives as long as a
// reference to it): it keeps recording while scrubd is down, and Attach finds
// it again and swaps its program in place.

// ErrHostSide is wrapped by Attach's error when the container-side filters
// are on but the host-side link is not: the pod's PACKET_QDISC_BYPASS
// frames are not recorded, so its IPs must not be vouched for while it lives
// (ReasonHostSide).
var ErrHostSide = errors.New("host-side recorder not attached")

// ReasonHostSide is why the IPs of a pod without its host-side link stay
// incomplete.
const ReasonHostSide = "recorder not on the pod's host-side veth: frames it sends with PACKET_QDISC_BYPASS skip the container-side filters, and Cilium makes their entries"

// hostLinkDir holds the host-side links' pins, under PinDir.
const hostLinkDir = "host"

// hostPeer finds the host-side peer of the pod's interface l (read with h
// in the pod's namespace): its ifindex in the node's namespace. The peer
// must be a veth's other end in the node's namespace (Options.NodeNetns):
// the one the tcx link goes on.
func (r *Recorder) hostPeer(h *netlink.Handle, l netlink.Link) (int, error) {
	if l.Type() != "veth" {
		return 0, fmt.Errorf("%w: %s is a %s, not a veth", ErrHostSide, l.Attrs().Name, l.Type())
	}
	peer := l.Attrs().ParentIndex
	if peer == 0 || l.Attrs().NetNsID < 0 {
		return 0, fmt.Errorf("%w: the peer of %s is not in another namespace (IFLA_LINK %d, netnsid %d)", ErrHostSide, l.Attrs().Name, peer, l.Attrs().NetNsID)
	}
	ns, err := r.nodeNSFile()
	if err != nil {
		return 0, fmt.Errorf("%w: %w", ErrHostSide, err)
	}
	node, err := h.GetNetNsIdByFd(int(ns.Fd()))
	if err != nil {
		return 0, fmt.Errorf("%w: the node's namespace id in the pod's: %w", ErrHostSide, err)
	}
	if node != l.Attrs().NetNsID {
		return 0, fmt.Errorf("%w: the peer of %s is not in the node's namespace %s (netnsid %d, the node's %d; set node_netns?)",
			ErrHostSide, l.Attrs().Name, r.nodeNSPath(), l.Attrs().NetNsID, node)
	}
	return peer, nil
}

func (r *Recorder) nodeNSPath() string {
	if r.opts.NodeNetns != "" {
		return r.opts.NodeNetns
	}
	return "(scrubd's own)"
}

// inNodeNS runs fn in the node's namespace: on the calling thread when it is
// scrubd's own (no switch), else on a locked thread moved there.
func (r *Recorder) inNodeNS(fn func() error) error {
	if r.opts.NodeNetns == "" {
		return fn()
	}
	return InNetns(r.opts.NodeNetns, fn)
}

// hostLinkPin is the pin of the host-side link of one pod interface.
func (r *Recorder) hostLinkPin(netnsPath, ifname string) string {
	sum := sha256.Sum256([]byte(netnsPath + "\x00" + ifname))
	base := strings.NewReplacer("/", "_", ".", "_").Replace(filepath.Base(netnsPath))
	return filepath.Join(r.opts.PinDir, hostLinkDir, fmt.Sprintf("%s_%s_%s", base, ifname, hex.EncodeToString(sum[:6])))
}

// attachHost puts the host-side program on hostIfindex's tcx ingress at the
// head, or, when the pinned link of this interface is there already on that
// device, swaps its program in place (a restart, an upgrade, ReloadPrograms):
// no gap, and the link keeps its place ahead of Cilium's.
func (r *Recorder) attachHost(netnsPath, ifname string, hostIfindex int) error {
	r.progMu.RLock()
	defer r.progMu.RUnlock()
	prog := r.prog[2]
	pin := r.hostLinkPin(netnsPath, ifname)
	if l, err := link.LoadPinnedLink(pin, nil); err == nil {
		if tcxOn(l, hostIfindex) {
			err := l.Update(prog)
			l.Close()
			if err != nil {
				return fmt.Errorf("%w: swap the program of the tcx link on ifindex %d: %w", ErrHostSide, hostIfindex, err)
			}
			return nil
		}
		// Its device went (an earlier pod's) or it is on another one.
		l.Unpin()
		l.Close()
	} else if !errors.Is(err, os.ErrNotExist) {
		os.Remove(pin)
	}
	if err := os.MkdirAll(filepath.Dir(pin), 0o700); err != nil {
		return fmt.Errorf("%w: %w", ErrHostSide, err)
	}
	var l link.Link
	err := r.inNodeNS(func() error {
		var err error
		l, err = link.AttachTCX(link.TCXOptions{Interface: hostIfindex, Program: prog, Attach: ebpf.AttachTCXIngress, Anchor: link.Head()})
		return err
	})
	if err != nil {
		return fmt.Errorf("%w: tcx link on ifindex %d in %s: %w", ErrHostSide, hostIfindex, r.nodeNSPath(), err)
	}
	defer l.Close()
	if err := l.Pin(pin); err != nil {
		return fmt.Errorf("%w: pin the tcx link at %s: %w", ErrHostSide, pin, err)
	}
	return nil
}

// tcxOn reports whether l is a live tcx ingress link on ifindex (a link
// whose device went reports ifindex 0).
func tcxOn(l link.Link, ifindex int) bool {
	info, err := l.Info()
	if err != nil {
		return false
	}
	t := info.TCX()
	return t != nil && t.Ifindex == uint32(ifindex) && ebpf.AttachType(t.AttachType) == ebpf.AttachTCXIngress
}

// detachHost removes the interface's host-side link: it goes with its pin.
func (r *Recorder) detachHost(netnsPath, ifname string) {
	pin := r.hostLinkPin(netnsPath, ifname)
	if l, err := link.LoadPinnedLink(pin, nil); err == nil {
		l.Unpin()
		l.Close()
	}
	os.Remove(pin)
}

// HostAttached reports whether the interface's host-side link is pinned and
// on a device.
func (r *Recorder) HostAttached(netnsPath, ifname string) bool {
	l, err := link.LoadPinnedLink(r.hostLinkPin(netnsPath, ifname), nil)
	if err != nil {
		return false
	}
	defer l.Close()
	info, err := l.Info()
	return err == nil && info.TCX() != nil && info.TCX().Ifindex != 0
}

// PruneHostLinks removes the pins of host-side links whose device is gone
// (the pod was deleted: scrubd does not detach at DEL, the interface goes
// after it): each holds a program until its pin goes. It returns how many.
func (r *Recorder) PruneHostLinks() int {
	dir := filepath.Join(r.opts.PinDir, hostLinkDir)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return 0
	}
	n := 0
	for _, e := range ents {
		pin := filepath.Join(dir, e.Name())
		l, err := link.LoadPinnedLink(pin, nil)
		if err != nil {
			continue
		}
		info, err := l.Info()
		if err == nil && info.TCX() != nil && info.TCX().Ifindex == 0 {
			l.Unpin()
			n++
		}
		l.Close()
	}
	return n
}

// openNodeNS opens the namespace the pods' host-side interfaces live in:
// path, or the process's own when path is "".
func openNodeNS(path string) (*os.File, error) {
	if path == "" {
		path = "/proc/self/ns/net"
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("recorder: open the node's network namespace %s: %w", path, err)
	}
	return f, nil
}

// nodeNSFile is the node's namespace, opened at the first call that finds
// it (Options.NodeNetns may name a namespace made after Load).
func (r *Recorder) nodeNSFile() (*os.File, error) {
	r.nodeNSMu.Lock()
	defer r.nodeNSMu.Unlock()
	if r.nodeNS == nil {
		f, err := openNodeNS(r.opts.NodeNetns)
		if err != nil {
			return nil, err
		}
		r.nodeNS = f
	}
	return r.nodeNS, nil
}

func (r *Recorder) closeNodeNS() {
	r.nodeNSMu.Lock()
	defer r.nodeNSMu.Unlock()
	if r.nodeNS != nil {
		r.nodeNS.Close()
		r.nodeNS = nil
	}
}

// HostProgram is the program Attach puts on host-side veths now.
func (r *Recorder) HostProgram() *ebpf.Program {
	r.progMu.RLock()
	defer r.progMu.RUnlock()
	return r.prog[2]
}
