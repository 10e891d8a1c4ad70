package daemon

import (
	"encoding/gob"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/owner"
)

// A clean stop (SIGTERM) writes the index to a snapshot beside the state
// file, so that the next start keeps every IP's completeness instead of
// sweeping them all. It is only sound under these conditions, each checked:
//   - it is written after the API stopped (no scrub runs) and after the
//     recorder's reader returned (every record it read is in the index);
//     records made later wait in the pinned ring buffer and are applied by
//     the next reader; records lost meanwhile are counted per IP by the
//     kernel, and the recorder marks those IPs incomplete at start;
//   - it is read only if the recorder's pinned maps and Cilium's CT maps are
//     the very maps (same kernel map IDs) they were at the stop: new maps mean
//     lost records or lost entries, and the snapshot is dropped;
//   - it is consumed: removed as soon as it is read, so that a later crash
//     (SIGKILL, no snapshot written) never restarts from a stale one.
//
// Version 2 stores each IP's keys as the index's own records (11 bytes per
// IPv4 key, 23 per IPv6 key, relative to the IP; index.RecSize4/6). Version 1
// stored whole keys (14 and 38 bytes); it is still read, so an upgrade keeps
// the index. Any other version is dropped with a warning naming it.
const snapshotVersion = 2

type snapshotFile struct {
	Version int
	MapIDs  map[string]ebpf.MapID // pinned map path -> kernel map ID
	IPs     []snapshotIP
	// Rule (added within version 2, as snapshotIP.Svc was: gob skips a
	// field its reader does not know, so an earlier scrubd reads the file
	// without it, and this one reads an earlier file with it nil, no
	// release kept: both sweep where they know nothing): the ownership
	// rule's releases and creates at the stop, in a format of its own.
	Rule *snapshotRule
}

// ruleStateVersion is snapshotRule's format. A reader that does not know
// a file's version keeps no release from it.
const ruleStateVersion = 1

// snapshotRule is owner.State on disk.
type snapshotRule struct {
	Version           int
	Released, Created []netip.Addr
}

func encodeRule(st owner.State) *snapshotRule {
	return &snapshotRule{Version: ruleStateVersion, Released: st.Released, Created: st.Created}
}

// decodeRule is the rule's state kept in a snapshot, nil when it holds
// none this scrubd can read.
func decodeRule(r *snapshotRule) *owner.State {
	if r == nil || r.Version != ruleStateVersion {
		return nil
	}
	return &owner.State{Released: r.Released, Created: r.Created}
}

// snapshotIP stores an IP's keys as flat bytes: gob writes a []byte as is,
// but an array element by element.
type snapshotIP struct {
	IP         netip.Addr
	Tracked    bool
	Incomplete string
	Recs4      []byte // version 2: index.RecSize4 bytes per key
	Recs6      []byte // version 2: index.RecSize6 bytes per key
	Keys4      []byte // version 1: ctmap.KeySize4 bytes per key
	Keys6      []byte // version 1: ctmap.KeySize6 bytes per key
	// Svc (added within version 2: gob leaves a field the reader does not
	// know, so an earlier scrubd reads the file and restores the SERVICE
	// keys as pending, as it always did): what was learnt of the IP's
	// service flows (index.SnapshotSvc).
	Svc []snapshotSvc
}

type snapshotSvc struct {
	Key                      []byte
	ID                       uint32
	Pending, Repick, NoEntry bool
	Since                    int64
}

func encodeIndex(s index.Snapshot) []snapshotIP {
	out := make([]snapshotIP, len(s.IPs))
	for i, ip := range s.IPs {
		out[i] = snapshotIP{IP: ip.IP, Tracked: ip.Tracked, Incomplete: ip.Incomplete, Recs4: ip.Recs4, Recs6: ip.Recs6}
		for _, ss := range ip.Svc {
			out[i].Svc = append(out[i].Svc, snapshotSvc(ss))
		}
	}
	return out
}

func decodeIndex(version int, ips []snapshotIP) (index.Snapshot, error) {
	var s index.Snapshot
	for _, o := range ips {
		ip := index.SnapshotIP{IP: o.IP, Tracked: o.Tracked, Incomplete: o.Incomplete, Recs4: o.Recs4, Recs6: o.Recs6}
		for _, ss := range o.Svc {
			ip.Svc = append(ip.Svc, index.SnapshotSvc(ss))
		}
		if version == 1 {
			if len(o.Keys4)%ctmap.KeySize4 != 0 || len(o.Keys6)%ctmap.KeySize6 != 0 {
				return s, fmt.Errorf("keys of %s: truncated", o.IP)
			}
			ip.Recs4, ip.Recs6 = nil, nil
			var err error
			for b := o.Keys4; len(b) > 0 && err == nil; b = b[ctmap.KeySize4:] {
				ip.Recs4, err = index.AppendRecord4(ip.Recs4, o.IP, ctmap.CTKey4(b[:ctmap.KeySize4]))
			}
			for b := o.Keys6; len(b) > 0 && err == nil; b = b[ctmap.KeySize6:] {
				ip.Recs6, err = index.AppendRecord6(ip.Recs6, o.IP, ctmap.CTKey6(b[:ctmap.KeySize6]))
			}
			if err != nil {
				return s, err
			}
		} else if len(o.Recs4)%index.RecSize4 != 0 || len(o.Recs6)%index.RecSize6 != 0 {
			return s, fmt.Errorf("keys of %s: truncated", o.IP)
		}
		s.IPs = append(s.IPs, ip)
	}
	return s, nil
}

func (d *Daemon) snapshotPath() string {
	if d.cfg.StateFile == "" || d.rec == nil {
		return ""
	}
	return filepath.Join(filepath.Dir(d.cfg.StateFile), "index.snapshot")
}

// mapIDs identifies the maps the snapshot depends on: every map pinned in the
// pin dir (the recorder's) and Cilium's CT maps.
func (d *Daemon) mapIDs() (map[string]ebpf.MapID, error) {
	var paths []string
	ents, err := os.ReadDir(d.cfg.PinDir)
	if err != nil {
		return nil, err
	}
	for _, e := range ents {
		if !e.IsDir() {
			paths = append(paths, filepath.Join(d.cfg.PinDir, e.Name()))
		}
	}
	for _, k := range ctmap.Kinds {
		p := filepath.Join(d.cfg.CTRoot, k.Name())
		if _, err := os.Stat(p); err == nil {
			paths = append(paths, p)
		}
	}
	ids := make(map[string]ebpf.MapID, len(paths))
	for _, p := range paths {
		m, err := ebpf.LoadPinnedMap(p, &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			return nil, fmt.Errorf("open %s: %w", p, err)
		}
		info, err := m.Info()
		m.Close()
		if err != nil {
			return nil, fmt.Errorf("info of %s: %w", p, err)
		}
		id, ok := info.ID()
		if !ok {
			return nil, fmt.Errorf("no map ID for %s", p)
		}
		ids[p] = id
	}
	return ids, nil
}

// writeSnapshotMarking writes the index atomically, with the IPs in
// incomplete marked incomplete (their scrubs had not returned; see
// snapshotAtStop). Call it only after the API and the recorder's reader have
// stopped.
func (d *Daemon) writeSnapshotMarking(incomplete []netip.Addr) error {
	path := d.snapshotPath()
	if path == "" {
		return nil
	}
	ids, err := d.mapIDs()
	if err != nil {
		return fmt.Errorf("index snapshot: %w", err)
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".index-*.snapshot")
	if err != nil {
		return fmt.Errorf("index snapshot: %w", err)
	}
	defer os.Remove(tmp.Name())
	snap := d.ix.Snapshot()
	markIncomplete(&snap, incomplete, reasonStillRunning)
	err = gob.NewEncoder(tmp).Encode(snapshotFile{Version: snapshotVersion, MapIDs: ids, IPs: encodeIndex(snap), Rule: encodeRule(d.own.State())})
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	if err != nil {
		return fmt.Errorf("index snapshot: %w", err)
	}
	return nil
}

// loadSnapshot consumes the snapshot: it removes the file, then restores the
// index from it when its maps are still the same. It reports whether the
// index was restored; every other outcome leaves the index empty.
func (d *Daemon) loadSnapshot() (bool, error) {
	path := d.snapshotPath()
	if path == "" {
		return false, nil
	}
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	var s snapshotFile
	decErr := gob.NewDecoder(f).Decode(&s)
	f.Close()
	if err := os.Remove(path); err != nil {
		return false, fmt.Errorf("consume index snapshot %s: %w (remove it by hand)", path, err)
	}
	if decErr != nil {
		d.log.Warn("index snapshot unreadable: dropped, attached IPs will sweep", "path", path, "err", decErr)
		return false, nil
	}
	if s.Version != 1 && s.Version != snapshotVersion {
		d.log.Warn("index snapshot of an unknown format version: dropped, attached IPs will sweep",
			"path", path, "version", s.Version, "readable", []int{1, snapshotVersion})
		return false, nil
	}
	ids, err := d.mapIDs()
	if err != nil || !maps.Equal(ids, s.MapIDs) {
		d.log.Warn("index snapshot made over other maps (recorder pins or Cilium's CT maps re-created): dropped, attached IPs will sweep", "err", err)
		return false, nil
	}
	snap, err := decodeIndex(s.Version, s.IPs)
	if err != nil {
		d.log.Warn("index snapshot unreadable: dropped, attached IPs will sweep", "path", path, "err", err)
		return false, nil
	}
	if err := d.ix.Restore(snap); err != nil {
		d.log.Warn("index snapshot unreadable: dropped, attached IPs will sweep", "path", path, "err", err)
		return false, nil
	}
	// Used only once the attach step has found no pod that ran unseen
	// while scrubd was down (owner.Rule.BeginBoot).
	d.bs.kept = decodeRule(s.Rule)
	return true, nil
}
