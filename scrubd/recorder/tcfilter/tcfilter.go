// Package tcfilter knows the recorder's tc filters by what the kernel reports
// about them, and removes them: what `ctscrub uninstall` needs without the
// recorder's BPF loader (the plugin binary imports this, not the recorder).
package tcfilter

import (
	"errors"
	"fmt"
	"os"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// The recorder's filters: one direct-action cls_bpf filter on each hook of a
// clsact qdisc, at Priority with Handle, created with the filter name Name
// (cls_bpf reports it back as TCA_BPF_NAME). Priority 1 runs first among tc
// filters, so no other filter drops or redirects a packet before it is
// recorded; the handle and the name tell ctscrub's filters from others (see
// docs/recorder.md, "Where it runs").
const (
	Priority = 1
	Handle   = 0xc75c
	Name     = "ctscrub_recorder"
)

// Ours reports whether f is one of the recorder's filters: cls_bpf at
// Priority with Handle and named Name. A filter missing any of the three is
// someone else's.
func Ours(f netlink.Filter) bool {
	bf, ok := f.(*netlink.BpfFilter)
	return ok && bf.Priority == Priority && bf.Handle == Handle && bf.Name == Name
}

// Removed is one interface the recorder's filters were taken off.
type Removed struct {
	Ifname string
	Hooks  []string // "ingress", "egress"
}

// RemoveIn removes the recorder's filters from every interface of the
// network namespace at netnsPath and reports the interfaces it removed them
// from. A namespace, interface or filter that is gone (or goes meanwhile)
// is not an error: there is nothing left to remove. The clsact qdiscs stay
// (other programs may use them).
func RemoveIn(netnsPath string) ([]Removed, error) {
	ns, err := netns.GetFromPath(netnsPath)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, nil
		}
		return nil, fmt.Errorf("open netns %s: %w", netnsPath, err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		// A bind-mount point whose namespace was unmounted is an empty
		// file: setns refuses it.
		if errors.Is(err, unix.EINVAL) {
			return nil, nil
		}
		return nil, fmt.Errorf("netlink in netns %s: %w", netnsPath, err)
	}
	defer h.Close()
	links, err := h.LinkList()
	if err != nil {
		return nil, fmt.Errorf("list interfaces in netns %s: %w", netnsPath, err)
	}
	var removed []Removed
	var errs []error
	for _, l := range links {
		r := Removed{Ifname: l.Attrs().Name}
		for _, hook := range []struct {
			name   string
			parent uint32
		}{{"ingress", netlink.HANDLE_MIN_INGRESS}, {"egress", netlink.HANDLE_MIN_EGRESS}} {
			fs, err := h.FilterList(l, hook.parent)
			if err != nil {
				// No clsact qdisc (EINVAL), or the interface went.
				if !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENODEV) && !errors.Is(err, unix.ENOENT) {
					errs = append(errs, fmt.Errorf("list %s filters of %s in netns %s: %w", hook.name, r.Ifname, netnsPath, err))
				}
				continue
			}
			for _, f := range fs {
				if !Ours(f) {
					continue
				}
				f.(*netlink.BpfFilter).Fd = -1
				if err := h.FilterDel(f); err != nil {
					if !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.ENODEV) && !errors.Is(err, unix.EINVAL) {
						errs = append(errs, fmt.Errorf("delete %s filter of %s in netns %s: %w", hook.name, r.Ifname, netnsPath, err))
					}
					continue
				}
				r.Hooks = append(r.Hooks, hook.name)
			}
		}
		if len(r.Hooks) > 0 {
			removed = append(removed, r)
		}
	}
	return removed, errors.Join(errs...)
}
