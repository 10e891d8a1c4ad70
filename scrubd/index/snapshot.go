package index

import (
	"errors"
	"net/netip"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// Snapshot is the index's content at one moment. scrubd writes one on a clean
// stop, after the recorder's reader has applied every record it read, and
// restores it on the next start only when the recorder's pinned maps are the
// same ones (records made meanwhile then wait in the pinned ring buffer).
type Snapshot struct {
	IPs []SnapshotIP
}

// SnapshotIP is one IP's slot.
type SnapshotIP struct {
	IP         netip.Addr
	Tracked    bool
	Incomplete string
	Keys4      []ctmap.CTKey4
	Keys6      []ctmap.CTKey6
}

// Snapshot copies the index. The caller makes sure nothing changes it
// meanwhile (no reader, no scrub); each IP is copied under its own lock.
func (ix *Index) Snapshot() Snapshot {
	var s Snapshot
	for i := range ix.shards {
		sh := &ix.shards[i]
		sh.mu.RLock()
		for _, e := range sh.ips {
			e.mu.Lock()
			si := SnapshotIP{IP: e.ip, Tracked: e.tracked, Incomplete: e.incomplete}
			for k := range e.keys4 {
				si.Keys4 = append(si.Keys4, k)
			}
			for k := range e.keys6 {
				si.Keys6 = append(si.Keys6, k)
			}
			e.mu.Unlock()
			s.IPs = append(s.IPs, si)
		}
		sh.mu.RUnlock()
	}
	return s
}

// Restore loads a snapshot into an empty index.
func (ix *Index) Restore(s Snapshot) error {
	for i := range ix.shards {
		ix.shards[i].mu.RLock()
		n := len(ix.shards[i].ips)
		ix.shards[i].mu.RUnlock()
		if n > 0 {
			return errors.New("index: restore into a non-empty index")
		}
	}
	for _, si := range s.IPs {
		e := ix.entry(si.IP, true)
		e.mu.Lock()
		e.tracked = si.Tracked
		if si.Incomplete != "" {
			ix.markLocked(e, si.Incomplete)
		}
		if len(si.Keys4) > 0 {
			e.keys4 = make(map[ctmap.CTKey4]struct{}, len(si.Keys4))
			for _, k := range si.Keys4 {
				e.keys4[k] = struct{}{}
			}
		}
		if len(si.Keys6) > 0 {
			e.keys6 = make(map[ctmap.CTKey6]struct{}, len(si.Keys6))
			for _, k := range si.Keys6 {
				e.keys6[k] = struct{}{}
			}
		}
		n := len(e.keys4) + len(e.keys6)
		e.pruneAt = max(1024, 2*n)
		ix.keys.Add(int64(n))
		e.mu.Unlock()
	}
	return nil
}
