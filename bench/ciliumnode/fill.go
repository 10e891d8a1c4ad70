package main

import (
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/bench/internal/ctfill"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// The synthetic part of the node's table: flows of pods that once ran on the
// node (addresses outside the cluster's pod range, so neither Cilium's scrub
// of a new pod nor ctscrub's touches them: they only lengthen every walk),
// each with a peer of its own, bench/core's kind mix, each flow with the
// related ICMP entry Cilium adds.
var (
	oldPodBase = netip.MustParseAddr("10.250.0.0")
	peerBase   = netip.MustParseAddr("11.0.0.0")
)

const oldPods = 4096

// filler writes the synthetic entries: flows 0..flows-1, flow i expired when
// expiredFlow(i). The keys and values are a function of i and the clock
// reading taken once, so a refill restores exactly the same table.
type filler struct {
	maps    *ctmap.Maps
	flows   int
	share   float64
	now     uint32 // Cilium's clock at the first fill
	maxAge  uint32 // expired entries expired up to this many units before now
	liveMin uint32 // live entries expire between now+liveMin and now+liveMin+liveSpan
	liveSpn uint32
}

func (f *filler) expiredFlow(i int) bool {
	// Spread evenly: flow i is expired when the share's running total
	// crosses an integer at i.
	return int(float64(i+1)*f.share) > int(float64(i)*f.share)
}

// expiredEntries is how many of the synthetic entries are expired (two
// per expired flow).
func (f *filler) expiredEntries() int {
	n := 0
	for i := range f.flows {
		if f.expiredFlow(i) {
			n += 2
		}
	}
	return n
}

// lifetime of flow i: expired ones spread over the last maxAge units (a GC
// interval that drifted to hours leaves entries expired that long), live ones
// hours ahead, as established TCP flows are (Cilium's default 6 h timeout).
func (f *filler) lifetime(i int) uint32 {
	h := uint32(i) * 2654435761 // spread without a visible pattern
	if f.expiredFlow(i) {
		return f.now - 1 - h%f.maxAge
	}
	return f.now + f.liveMin + h%f.liveSpn
}

// newFiller plans `entries` synthetic entries (two per flow) with a share
// expired, in a clock whose reading is now with unitsPerSec units a second.
func newFiller(maps *ctmap.Maps, entries int, share float64, now uint32, unitsPerSec float64) (*filler, error) {
	f := &filler{maps: maps, flows: entries / 2, share: share, now: now}
	// Expired up to 6 h ago, but never before the boot (lifetimes are clock
	// readings: the machine may have booted minutes ago).
	f.maxAge = min(uint32(6*3600*unitsPerSec), now-2)
	if f.maxAge == 0 || now < 3 {
		return nil, fmt.Errorf("the BPF clock reads %d: too close to boot to write expired entries", now)
	}
	f.liveMin = uint32(3 * 3600 * unitsPerSec)
	f.liveSpn = max(1, uint32(3*3600*unitsPerSec))
	return f, nil
}

// fill writes every synthetic entry (again), in batches.
func (f *filler) fill() (time.Duration, error) {
	start := time.Now()
	err := f.batches(func(kind ctmap.Kind, keys []ctmap.CTKey4, vals []ctmap.Entry) error {
		if _, err := f.maps.Map(kind).BatchUpdate(keys, vals, nil); err != nil {
			return fmt.Errorf("fill %s: %w", kind.Name(), err)
		}
		return nil
	})
	return time.Since(start), err
}

// clear deletes the synthetic entries still there (a GC or a sweep may
// have taken some), leaving the node's real ones; it returns how many it
// deleted.
func (f *filler) clear() (int, error) {
	deleted := 0
	err := f.batches(func(kind ctmap.Kind, keys []ctmap.CTKey4, _ []ctmap.Entry) error {
		for i := 0; i < len(keys); {
			// A batch delete stops at the first absent key, having
			// deleted the n before it: skip that key, go on.
			n, err := f.maps.Map(kind).BatchDelete(keys[i:], nil)
			deleted += n
			i += n
			switch {
			case errors.Is(err, ebpf.ErrKeyNotExist):
				i++
			case err != nil:
				return fmt.Errorf("clear %s: %w", kind.Name(), err)
			}
		}
		return nil
	})
	return deleted, err
}

// batches hands fn the synthetic entries, a map's batch at a time.
func (f *filler) batches(fn func(kind ctmap.Kind, keys []ctmap.CTKey4, vals []ctmap.Entry) error) error {
	const chunk = 1 << 15
	tcp := make([]ctmap.CTKey4, 0, chunk)
	tcpV := make([]ctmap.Entry, 0, chunk)
	anyK := make([]ctmap.CTKey4, 0, 2*chunk)
	anyV := make([]ctmap.Entry, 0, 2*chunk)
	flush := func() error {
		if len(tcp) > 0 {
			if err := fn(ctmap.TCP4, tcp, tcpV); err != nil {
				return err
			}
		}
		if len(anyK) > 0 {
			if err := fn(ctmap.Any4, anyK, anyV); err != nil {
				return err
			}
		}
		tcp, tcpV, anyK, anyV = tcp[:0], tcpV[:0], anyK[:0], anyV[:0]
		return nil
	}
	for i := 0; i < f.flows; i++ {
		k := ctfill.FlowKey(ctfill.AddrAt(oldPodBase, i%oldPods), ctfill.AddrAt(peerBase, i), i)
		v := ctmap.EncodeEntry(ctmap.EntryFields{Lifetime: f.lifetime(i), Packets: 10, Bytes: 1500})
		if k.Kind() == ctmap.TCP4 {
			tcp, tcpV = append(tcp, k), append(tcpV, v)
		} else {
			anyK, anyV = append(anyK, k), append(anyV, v)
		}
		anyK, anyV = append(anyK, k.Related()), append(anyV, v)
		if len(tcp) == chunk || len(anyK) >= chunk {
			if err := flush(); err != nil {
				return err
			}
		}
	}
	return flush()
}

// capacity checks that the maps hold the plan without LRU eviction: the
// TCP map takes 40% of the entries, the any map 60% (UDP flows and every
// flow's related entry).
func (f *filler) capacity() error {
	tcpNeed := f.flows * 8 / 10
	anyNeed := f.flows + f.flows*2/10
	for _, c := range []struct {
		k    ctmap.Kind
		need int
		helm string
	}{{ctmap.TCP4, tcpNeed, "bpf.ctTcpMax"}, {ctmap.Any4, anyNeed, "bpf.ctAnyMax"}} {
		max := int(f.maps.MaxEntries(c.k))
		if c.need > max*9/10 {
			return fmt.Errorf("%s holds %d entries at most; the fill needs %d there (plus headroom against LRU eviction): size Cilium's maps with the Helm value %s (CT_MAX), or lower ENTRIES", c.k.Name(), max, c.need, c.helm)
		}
	}
	return nil
}
