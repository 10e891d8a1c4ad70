package index

import (
	"errors"
	"fmt"
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

// SnapshotIP is one IP's slot. Its keys are the index's own records
// (keyset.go): RecSize4 (RecSize6) bytes per key, relative to IP, in no
// particular order. AppendRecord4/6 make them from whole keys.
type SnapshotIP struct {
	IP         netip.Addr
	Tracked    bool
	Incomplete string
	Recs4      []byte
	Recs6      []byte
	// Svc is what was learnt of the IP's service flows (SvcState), each
	// under its whole SERVICE key (ctmap.KeySize4 or KeySize6 bytes). A
	// SERVICE key among the records without a state here restores as
	// pending (nothing learnt), as before snapshots kept them.
	Svc []SnapshotSvc
}

// SnapshotSvc is one service flow's state in a snapshot. Backends read and
// not resolved are not kept (the IP is marked instead).
type SnapshotSvc struct {
	Key                      []byte
	ID                       uint32
	Pending, Repick, NoEntry bool
	Since                    int64
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
			if si.Incomplete == "" && e.svcReadLocked() {
				// Backends read but not resolved are not kept: restored,
				// the SERVICE key is only pending, and the OUT entry of
				// such a read could be missed.
				si.Incomplete = ReasonServiceUnresolved
			}
			for id, st := range e.svc {
				if len(st.Read) > 0 {
					continue
				}
				k := id.b[:ctmap.KeySize4]
				if id.v6 {
					k = id.b[:]
				}
				si.Svc = append(si.Svc, SnapshotSvc{Key: append([]byte(nil), k...), ID: st.ID,
					Pending: st.Pending, Repick: st.Repick, NoEntry: st.NoEntry, Since: st.Since})
			}
			if e.keys4.n > 0 {
				si.Recs4 = e.keys4.records(make([]byte, 0, e.keys4.n*RecSize4), RecSize4)
			}
			if e.keys6.n > 0 {
				si.Recs6 = e.keys6.records(make([]byte, 0, e.keys6.n*RecSize6), RecSize6)
			}
			e.mu.Unlock()
			s.IPs = append(s.IPs, si)
		}
		sh.mu.RUnlock()
	}
	return s
}

// AppendRecord4 appends k's record relative to ip to dst (e.g. to read an
// older snapshot that stored whole keys); it fails when k does not contain ip.
func AppendRecord4(dst []byte, ip netip.Addr, k ctmap.CTKey4) ([]byte, error) {
	var rec [RecSize4]byte
	if a := ip.As4(); !ip.Is4() || !pack(rec[:], a[:], k[:], 4) {
		return dst, fmt.Errorf("key %v does not contain %s", k, ip)
	}
	return append(dst, rec[:]...), nil
}

// AppendRecord6 is AppendRecord4 for IPv6 keys.
func AppendRecord6(dst []byte, ip netip.Addr, k ctmap.CTKey6) ([]byte, error) {
	var rec [RecSize6]byte
	if a := ip.As16(); !ip.Is6() || !pack(rec[:], a[:], k[:], 16) {
		return dst, fmt.Errorf("key %v does not contain %s", k, ip)
	}
	return append(dst, rec[:]...), nil
}

// Restore loads a snapshot into an empty index. A malformed snapshot is
// refused as a whole: the index is left empty and the error names the IP.
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
		if err := ix.restoreIP(si); err != nil {
			for _, si := range s.IPs {
				ix.Forget(si.IP)
			}
			return fmt.Errorf("index: restore %s: %w", si.IP, err)
		}
	}
	return nil
}

func (ix *Index) restoreIP(si SnapshotIP) error {
	if !si.IP.IsValid() {
		return errors.New("invalid address")
	}
	if (len(si.Recs4) > 0 && !si.IP.Is4()) || (len(si.Recs6) > 0 && !si.IP.Is6()) {
		return errors.New("keys of the other address family")
	}
	e := ix.entry(si.IP, true)
	e.mu.Lock()
	defer e.mu.Unlock()
	e.tracked = si.Tracked
	if si.Incomplete != "" {
		ix.markLocked(e, si.Incomplete)
	}
	n4, err := e.keys4.restore(si.Recs4, RecSize4)
	ix.keys.Add(int64(n4))
	if err != nil {
		return err
	}
	n6, err := e.keys6.restore(si.Recs6, RecSize6)
	ix.keys.Add(int64(n6))
	if err != nil {
		return err
	}
	e.pruneAt = max(1024, 2*e.size())
	k4, k6 := e.list(nil, nil)
	e.noteServiceKeysLocked(k4, k6)
	for i := range k4 {
		ix.mirror4(e, &k4[i])
	}
	for i := range k6 {
		ix.mirror6(e, &k6[i])
	}
	for _, ss := range si.Svc {
		var id svcID
		switch {
		case si.IP.Is4() && len(ss.Key) == ctmap.KeySize4:
			k := ctmap.CTKey4(ss.Key)
			if k.Flags()&ctmap.FlagService == 0 || k.SAddr() != si.IP {
				return fmt.Errorf("service state under %v, not a SERVICE key of the IP", k)
			}
			id = svcID4(&k)
		case si.IP.Is6() && len(ss.Key) == ctmap.KeySize6:
			k := ctmap.CTKey6(ss.Key)
			if k.Flags()&ctmap.FlagService == 0 || k.SAddr() != si.IP {
				return fmt.Errorf("service state under %v, not a SERVICE key of the IP", k)
			}
			id = svcID6(&k)
		default:
			return fmt.Errorf("service state under a key of %d bytes", len(ss.Key))
		}
		if e.svc == nil {
			e.svc = map[svcID]*SvcState{}
		}
		e.svc[id] = &SvcState{ID: ss.ID, Pending: ss.Pending, Repick: ss.Repick && ss.Pending, NoEntry: ss.NoEntry, Since: ss.Since}
	}
	return nil
}
