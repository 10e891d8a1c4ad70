package recorder

import (
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"sync/atomic"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
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
// address is one of ips, in in-kernel passes over the caches (SEC("syscall")
// program forget_ips, run with BPF_PROG_TEST_RUN; one pass per cache covers
// eight IPs). Their next packets are recorded again. Attach calls it for a
// new pod's addresses, and Run's Tracked hook for an IP declared complete.
//
// Callers arriving while passes run share the next passes: 50 pods
// attached together cost about 50/8 passes, not 50. deleted counts every
// flow the shared passes dropped.
func (r *Recorder) ForgetIPs(ips ...netip.Addr) (deleted int, err error) {
	w := &forgetWaiter{done: make(chan struct{})}
	for _, ip := range ips {
		if ip = ip.Unmap(); ip.IsValid() {
			w.ips = append(w.ips, ip)
		}
	}
	if len(w.ips) == 0 {
		return 0, nil
	}
	q := &r.forgetQ
	q.mu.Lock()
	q.waiting = append(q.waiting, w)
	if !q.leading {
		// Lead: run passes until nobody waits, then hand over.
		q.leading = true
		for len(q.waiting) > 0 {
			batch := q.waiting
			q.waiting = nil
			q.mu.Unlock()
			r.forgetBatch(batch)
			q.mu.Lock()
		}
		q.leading = false
	}
	q.mu.Unlock()
	<-w.done
	return w.deleted, w.err
}

// forgetQueue coalesces concurrent ForgetIPs calls.
type forgetQueue struct {
	mu      sync.Mutex
	waiting []*forgetWaiter
	leading bool
	passes  atomic.Int64 // BPF_PROG_TEST_RUN calls made (tests)
}

type forgetWaiter struct {
	ips     []netip.Addr
	deleted int
	err     error
	done    chan struct{}
}

// forgetBatch forgets the IPs of every waiter in batch and releases them.
func (r *Recorder) forgetBatch(batch []*forgetWaiter) {
	var v4, v6 []netip.Addr
	seen := make(map[netip.Addr]bool)
	for _, w := range batch {
		for _, ip := range w.ips {
			if seen[ip] {
				continue
			}
			seen[ip] = true
			if ip.Is4() {
				v4 = append(v4, ip)
			} else {
				v6 = append(v6, ip)
			}
		}
	}
	var deleted int
	var err error
	for (len(v4) > 0 || len(v6) > 0) && err == nil {
		var a forgetArgs
		for ; len(v4) > 0 && a.N4 < forgetMaxIPs; v4 = v4[1:] {
			a.IPs4[a.N4] = v4[0].As4()
			a.N4++
		}
		for ; len(v6) > 0 && a.N6 < forgetMaxIPs; v6 = v6[1:] {
			a.IPs6[a.N6] = v6[0].As16()
			a.N6++
		}
		var out forgetArgs
		r.forgetQ.passes.Add(1)
		if _, rerr := r.objs.ForgetIps.Run(&ebpf.RunOptions{Context: a, ContextOut: &out}); rerr != nil {
			err = fmt.Errorf("recorder: forget the flows of %d IPs: %w", a.N4+a.N6, rerr)
		}
		deleted += int(out.Deleted)
	}
	for _, w := range batch {
		w.deleted, w.err = deleted, err
		close(w.done)
	}
}

// ForgetKeys drops the flows of CT keys from the seen caches: for each key
// the pod side that recorded it (the initiator, daddr, for an OUT key; the
// responder, saddr, for an IN or SERVICE key). Related keys are skipped
// (their flow's own key carries them). A scrub must forget the keys it is
// about to delete before it deletes them, or an entry re-created by a
// flow's next packet would never be recorded: Run arranges that through the
// index's Taken hook.
func (r *Recorder) ForgetKeys(k4 []ctmap.CTKey4, k6 []ctmap.CTKey6) error {
	var s4 []seenKey4
	for _, k := range k4 {
		if k.Flags()&ctmap.FlagRelated != 0 {
			continue
		}
		d, s, dport, sport := k[0:4], k[4:8], k[8:10], k[10:12]
		if k.Flags()&(ctmap.FlagIn|ctmap.FlagService) != 0 {
			s4 = append(s4, newSeenKey4(s, d, dport, sport, k.NextHdr()))
		} else {
			s4 = append(s4, newSeenKey4(d, s, sport, dport, k.NextHdr()))
		}
	}
	var s6 []seenKey6
	for _, k := range k6 {
		if k.Flags()&ctmap.FlagRelated != 0 {
			continue
		}
		d, s, dport, sport := k[0:16], k[16:32], k[32:34], k[34:36]
		if k.Flags()&(ctmap.FlagIn|ctmap.FlagService) != 0 {
			s6 = append(s6, newSeenKey6(s, d, dport, sport, k.NextHdr()))
		} else {
			s6 = append(s6, newSeenKey6(d, s, sport, dport, k.NextHdr()))
		}
	}
	if err := deleteBatch(r.objs.RecSeen4, s4); err != nil {
		return err
	}
	return deleteBatch(r.objs.RecSeen6, s6)
}

// deleteBatch deletes keys with BPF_MAP_DELETE_BATCH. The kernel stops a
// batch at the first key that is not there (evicted, or a flow recorded
// twice); it is skipped and the batch goes on after it.
func deleteBatch[K any](m *ebpf.Map, keys []K) error {
	for len(keys) > 0 {
		n, err := m.BatchDelete(keys, nil)
		switch {
		case err == nil:
			return nil
		case errors.Is(err, ebpf.ErrKeyNotExist):
			keys = keys[min(n+1, len(keys)):]
		default:
			return fmt.Errorf("recorder: forget flows: %w", err)
		}
	}
	return nil
}

// hooks keeps the seen caches in step with the index (see index.Hooks):
// keys a scrub takes are forgotten before it deletes their entries, and an
// IP declared complete (a sweep is about to remove all its entries, or a
// fresh pod) has all its flows forgotten, so every entry created from then
// on is recorded, including flows to service VIPs that mark it incomplete
// again.
func (r *Recorder) hooks() *index.Hooks {
	return &index.Hooks{
		Taken: func(ip netip.Addr, k4 []ctmap.CTKey4, k6 []ctmap.CTKey6) {
			if err := r.ForgetKeys(k4, k6); err != nil {
				r.opts.Log.Warn("recorder: forget the flows of taken keys", "ip", ip, "err", err)
			}
		},
		Tracked: func(ips []netip.Addr) {
			if _, err := r.ForgetIPs(ips...); err != nil {
				r.opts.Log.Warn("recorder: forget the flows of tracked IPs", "ips", ips, "err", err)
			}
		},
	}
}
