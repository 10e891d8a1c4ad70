package daemon

import (
	"encoding/gob"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
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
const snapshotVersion = 1

type snapshotFile struct {
	Version int
	MapIDs  map[string]ebpf.MapID // pinned map path -> kernel map ID
	Index   index.Snapshot
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

// writeSnapshot writes the index atomically. Call it only after the API and
// the recorder's reader have stopped.
func (d *Daemon) writeSnapshot() error {
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
	err = gob.NewEncoder(tmp).Encode(snapshotFile{Version: snapshotVersion, MapIDs: ids, Index: d.ix.Snapshot()})
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
	if decErr != nil || s.Version != snapshotVersion {
		d.log.Warn("index snapshot unreadable: dropped, attached IPs will sweep", "path", path, "err", decErr, "version", s.Version)
		return false, nil
	}
	ids, err := d.mapIDs()
	if err != nil || !maps.Equal(ids, s.MapIDs) {
		d.log.Warn("index snapshot made over other maps (recorder pins or Cilium's CT maps re-created): dropped, attached IPs will sweep", "err", err)
		return false, nil
	}
	if err := d.ix.Restore(s.Index); err != nil {
		return false, err
	}
	return true, nil
}
