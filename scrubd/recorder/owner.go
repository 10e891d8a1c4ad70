package recorder

import (
	"errors"
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/features"
	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/bpf"
)

// Source ownership (rec_owner in bpf/recorder.c): the addresses of each
// attached interface, written at Attach before its filters go live, with the
// interface's ifindex and its network namespace's cookie. A new flow a pod
// sends from an address its interface does not own is recorded as
// RecForeign: nothing is filed under the claimed source, which Apply marks
// incomplete (docs/recorder.md, "Forged source addresses").

// ownerValue is struct owner in bpf/recorder.c.
type ownerValue = bpf.RecorderOwner

// mapped is the v4-mapped 16-byte form the program keys addresses by.
func mapped(ip netip.Addr) [16]byte { return ip.Unmap().As16() }

// netnsCookieInTC reports whether tc programs may call
// bpf_get_netns_cookie on this kernel (a recent addition); without it the
// program checks the ifindex only.
func netnsCookieInTC() bool {
	return features.HaveProgramHelper(ebpf.SchedCLS, asm.FnGetNetnsCookie) == nil
}

// setSourceCheck turns the programs' network namespace comparison on when
// the kernel allows it (owner_netns in bpf/recorder.c).
func setSourceCheck(spec *ebpf.CollectionSpec) error {
	var on uint8
	if netnsCookieInTC() {
		on = 1
	}
	if err := spec.Variables["owner_netns"].Set(on); err != nil {
		return fmt.Errorf("recorder: set owner_netns: %w", err)
	}
	return nil
}

// netnsCookie is the cookie of the calling thread's network namespace, the
// value bpf_get_netns_cookie returns for a socket of that namespace. 0 on a
// kernel without SO_NETNS_COOKIE (before 5.14): its tc programs cannot read
// cookies either, so the programs compare the ifindex only.
func netnsCookie() (uint64, error) {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, fmt.Errorf("socket: %w", err)
	}
	defer unix.Close(fd)
	c, err := unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_NETNS_COOKIE)
	if errors.Is(err, unix.ENOPROTOOPT) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("read the network namespace's cookie (SO_NETNS_COOKIE): %w", err)
	}
	return c, nil
}

// own records addrs as the addresses of interface ifindex in the network
// namespace with cookie netns, whose host-side peer is hostIfindex (0:
// none). A reused address's entry (an earlier pod's) is overwritten.
func (r *Recorder) own(addrs []netip.Addr, netns uint64, ifindex, hostIfindex int) error {
	v := ownerValue{Netns: netns, Ifindex: uint32(ifindex), HostIfindex: uint32(hostIfindex)}
	var errs []error
	for _, ip := range addrs {
		if err := r.objs.RecOwner.Update(mapped(ip), &v, ebpf.UpdateAny); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", ip, err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("record the interface's addresses as its own: %w", err)
	}
	return nil
}

// disown removes addrs' entries that still name this interface (a newer
// owner's entry, written by its Attach, stays).
func (r *Recorder) disown(addrs []netip.Addr, netns uint64, ifindex int) {
	for _, ip := range addrs {
		k := mapped(ip)
		var v ownerValue
		if r.objs.RecOwner.Lookup(k, &v) == nil && v.Netns == netns && v.Ifindex == uint32(ifindex) {
			r.objs.RecOwner.Delete(k)
		}
	}
}

// ForeignSources is the number of new flows pods sent from an address their
// interface does not own, since the maps were created (each recorded as
// RecForeign; metric material).
func (r *Recorder) ForeignSources() uint64 {
	var v uint64
	if err := r.objs.RecForeignTotal.Lookup(uint32(0), &v); err != nil {
		return 0
	}
	return v
}

// SourceCheck names the check the programs make of a sent packet's source
// address: "netns+ifindex", or "ifindex" on a kernel whose tc programs
// cannot read a network namespace's cookie.
func (r *Recorder) SourceCheck() string {
	if r.netnsCheck {
		return "netns+ifindex"
	}
	return "ifindex"
}

// ownTestRunSource records the source address of an egress frame as owned
// by the device BPF_PROG_TEST_RUN runs programs on, so a frame run through
// the programs is a frame its pod sent from its own address.
func ownTestRunSource(m *ebpf.Map, frame []byte) error {
	switch {
	case len(frame) >= 14+20 && frame[12] == 0x08 && frame[13] == 0x00:
		return ownTestRun(m, netip.AddrFrom4([4]byte(frame[26:30])))
	case len(frame) >= 14+40 && frame[12] == 0x86 && frame[13] == 0xdd:
		return ownTestRun(m, netip.AddrFrom16([16]byte(frame[22:38])))
	}
	return nil
}

// ownTestRun records addrs as owned by the device BPF_PROG_TEST_RUN runs
// programs on: the loopback (ifindex 1) of the caller's network namespace,
// with a socket of that namespace, on the pod's side and the host's alike.
func ownTestRun(m *ebpf.Map, addrs ...netip.Addr) error {
	c, err := netnsCookie()
	if err != nil {
		return err
	}
	v := ownerValue{Netns: c, Ifindex: 1, HostIfindex: 1}
	for _, ip := range addrs {
		if err := m.Update(mapped(ip), &v, ebpf.UpdateAny); err != nil {
			return fmt.Errorf("record %s as the test run's own: %w", ip, err)
		}
	}
	return nil
}
