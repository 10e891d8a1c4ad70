package recorder

import (
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"
)

// forgetMaxIPs is FORGET_MAX_IPS in bpf/recorder.c.
const forgetMaxIPs = 8

// forgetArgs is struct forget_args in bpf/recorder.c.
type forgetArgs struct {
	N4, N6           uint32
	Visited, Deleted uint64
	IPs4             [forgetMaxIPs][4]byte
	IPs6             [forgetMaxIPs][16]byte
}

// ForgetIPs drops from the seen caches every flow whose local or remote
// address is one of ips, in one in-kernel pass per cache and batch of eight
// IPs (SEC("syscall") program forget_ips, run with BPF_PROG_TEST_RUN). Their
// next packets are recorded again. Attach calls it for a new pod's
// addresses.
func (r *Recorder) ForgetIPs(ips ...netip.Addr) (deleted int, err error) {
	for len(ips) > 0 {
		var a forgetArgs
		for len(ips) > 0 && a.N4 < forgetMaxIPs && a.N6 < forgetMaxIPs {
			ip := ips[0].Unmap()
			ips = ips[1:]
			if ip.Is4() {
				a.IPs4[a.N4] = ip.As4()
				a.N4++
			} else if ip.Is6() {
				a.IPs6[a.N6] = ip.As16()
				a.N6++
			}
		}
		var out forgetArgs
		if _, err := r.objs.ForgetIps.Run(&ebpf.RunOptions{Context: a, ContextOut: &out}); err != nil {
			return deleted, fmt.Errorf("recorder: forget the flows of %d IPs: %w", a.N4+a.N6, err)
		}
		deleted += int(out.Deleted)
	}
	return deleted, nil
}
