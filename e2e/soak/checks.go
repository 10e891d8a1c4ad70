package main

// The soak's own checks of the kernel's CT maps: what a DEL left, and
// whether any other pod's entry went.

import (
	"context"
	"errors"
	"net/netip"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/internal/ciliumwalk"
	"github.com/ctscrub/ctscrub/internal/netnsnode"
	"github.com/ctscrub/ctscrub/scrubd/cilium"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// leftOf counts the entries of ips left in the kernel's CT maps: an
// in-kernel pass over every map (ctscrub's own sweep program, count only,
// through a private index-less backend of this process), so the check does
// not depend on scrubd or its index.
func (s *soak) leftOf(ctx context.Context, ips []netip.Addr) (int, error) {
	r, err := s.checker.Sweep(ctx, ips, true)
	if err != nil {
		return 0, err
	}
	if !r.Complete {
		return 0, errors.New("check pass did not complete")
	}
	n := 0
	for _, c := range r.Deleted {
		n += c
	}
	return n, nil
}

// delAndCount DELs p through libcni and counts its IPs' entries left
// once scrubd's late DEL scrub of them ran (docs/daemon.md, "The DEL
// window"), as every cycle does.
func (s *soak) delAndCount(ctx context.Context, p *netnsnode.Pod) (left int, delErr, countErr error) {
	lateBefore := s.metric("ctscrub_del_late_total")
	if _, delErr = s.ch.Del(ctx, p); delErr == nil {
		s.waitLate(lateBefore, len(p.IPs()))
	}
	left, countErr = s.leftOf(ctx, p.IPs())
	return left, delErr, countErr
}

// setChecker makes the soak's own count pass over the CT maps pinned now.
func (s *soak) setChecker(ctRoot string) error {
	cm, err := ctmap.Open(ctRoot)
	if err != nil {
		return err
	}
	cb, err := cilium.New(cm, index.New(index.Config{}), cilium.Options{})
	if err != nil {
		cm.Close()
		return err
	}
	s.cleanup.Push("close the check's sweep programs", func() error { cb.Close(); cm.Close(); return nil })
	s.checker = cb.Sweeper()
	return nil
}

// snapshotKeep reads the long-lived pods' entries with none of their
// connections open. A TCP entry read while its connection is open has the
// lifetime of an open connection; the close then shortens it to Cilium's
// close timeout and the expiry pass deletes it, which the final check
// counted as a wrong deletion (2 in a run of 2026-12-01: one pod-to-pod
// connection, its OUT and IN entries).
func (s *soak) snapshotKeep(ips []netip.Addr) (map[anyKey]uint32, error) {
	s.bgMu.Lock()
	defer s.bgMu.Unlock()
	time.Sleep(300 * time.Millisecond) // the last round's FIN exchanges
	return keysOf(s.maps, ips)
}

// countRange counts the entries holding an address of either prefix.
func countRange(m *netnsnode.CTMaps, p4, p6 netip.Prefix) (int, error) {
	st, err := ciliumwalk.Batch(m.All(), func(kind ctmap.Kind, key []byte, _ *ctmap.Entry) bool {
		if kind.IPv6() {
			c := ctmap.CTKey6(key)
			return p6.Contains(c.DAddr()) || p6.Contains(c.SAddr())
		}
		c := ctmap.CTKey4(key)
		return p4.Contains(c.DAddr()) || p4.Contains(c.SAddr())
	}, ciliumwalk.Options{CountOnly: true})
	return st.Matched, err
}

type anyKey struct {
	kind ctmap.Kind
	key  string
}

// String is the key's tuple.
func (k anyKey) String() string {
	if k.kind.IPv6() {
		return ctmap.CTKey6([]byte(k.key)).String()
	}
	return ctmap.CTKey4([]byte(k.key)).String()
}

// keysOf returns the keys of ips's entries with their lifetimes.
func keysOf(m *netnsnode.CTMaps, ips []netip.Addr) (map[anyKey]uint32, error) {
	out := map[anyKey]uint32{}
	has := ciliumwalk.HasIP(ips...)
	for _, k := range ctmap.Kinds {
		var v ctmap.Entry
		it := m.Map(k).Iterate()
		if k.IPv6() {
			var key ctmap.CTKey6
			for it.Next(&key, &v) {
				if has(k, key[:], nil) {
					out[anyKey{k, string(key[:])}] = v.Lifetime()
				}
			}
		} else {
			var key ctmap.CTKey4
			for it.Next(&key, &v) {
				if has(k, key[:], nil) {
					out[anyKey{k, string(key[:])}] = v.Lifetime()
				}
			}
		}
		if err := it.Err(); err != nil {
			return nil, err
		}
	}
	return out, nil
}

func present(m *netnsnode.CTMaps, k anyKey) bool {
	var v ctmap.Entry
	return !errors.Is(m.Map(k.kind).Lookup([]byte(k.key), &v), ebpf.ErrKeyNotExist)
}

// waitLate waits (at most 10 s: the CPUs may be starved) until scrubd
// counted late DEL scrubs of ips more IPs than before
// (ctscrub_del_late_total, read before the DEL): the
// DEL window's entries are then gone, and the count after it checks the
// DEL with its late scrub.
func (s *soak) waitLate(before float64, ips int) {
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) && s.metric("ctscrub_del_late_total") < before+float64(ips) {
		time.Sleep(20 * time.Millisecond)
	}
}

// checkOthers counts wrong deletions: every other pod's entries must be
// intact, the synthetic pods' all there, and every entry the long-lived
// pods had before the cycles either there or expired by its own lifetime.
func (s *soak) checkOthers() error {
	bgAfter, err := countRange(s.maps, netnsnode.BGPods4, netnsnode.BGPods6)
	if err != nil {
		return err
	}
	// Added to what the faults counted of their live pods' entries.
	s.res.WrongDeletions += max(0, s.bgBefore-bgAfter)
	now := netnsnode.MonotonicSeconds()
	for k, lt := range s.keep {
		if !present(s.maps, k) && lt >= now {
			s.res.WrongDeletions++
			if s.res.WrongDeletions <= 10 {
				s.logf("wrong deletion: %s entry %s gone, its lifetime at the snapshot %d s, now %d s", k.kind.Name(), k, lt, now)
			}
		}
	}
	s.logf("background: %d entries before, %d after; long-lived pods' entries checked: %d", s.bgBefore, bgAfter, len(s.keep))
	return nil
}
