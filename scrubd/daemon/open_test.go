package daemon

import (
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestOpenWaitsForCiliumMaps: with backends auto on a node whose CNI config
// runs cilium-cni, scrubd started before Cilium's agent made its CT maps (a
// node restart empties bpffs) waits for them and turns the cilium backend
// on, or fails with the reason; it never settles for nf_conntrack alone.
func TestOpenWaitsForCiliumMaps(t *testing.T) {
	root := newCTRoot(t, 1<<12)
	conf := t.TempDir()
	if err := os.WriteFile(filepath.Join(conf, "05-cilium.conflist"),
		[]byte(`{"cniVersion":"1.0.0","name":"cilium","plugins":[{"type":"cilium-cni"},{"type":"ctscrub"}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	config := func() Config {
		cfg := testConfig(t, root)
		cfg.Backends = "auto"
		cfg.CNIConfDir = conf
		cfg.CTRoot = filepath.Join(t.TempDir(), "globals") // no maps (yet)
		return cfg
	}
	defer func(w time.Duration) { ciliumMapsWait = w }(ciliumMapsWait)

	t.Run("never", func(t *testing.T) {
		ciliumMapsWait = time.Second
		d, err := Open(config(), slog.New(slog.NewJSONHandler(&logBuffer{}, nil)), "test")
		if err == nil {
			d.Close()
			t.Fatal("Open with no Cilium CT maps on a cilium-cni node succeeded, want an error")
		}
		if !strings.Contains(err.Error(), "cilium-cni") || !strings.Contains(err.Error(), "CT maps not found") {
			t.Errorf("error %q: want it to say the CT maps were not found though the config runs cilium-cni", err)
		}
	})
	t.Run("later", func(t *testing.T) {
		ciliumMapsWait = time.Minute
		cfg := config()
		go func() {
			time.Sleep(time.Second)
			os.Symlink(root.dir, cfg.CTRoot) // the agent's maps appear
		}()
		logs := &logBuffer{}
		d, err := Open(cfg, slog.New(slog.NewJSONHandler(logs, nil)), "test")
		if err != nil {
			t.Fatalf("Open: %v", err)
		}
		defer d.Close()
		if d.rec == nil || !strings.Contains(logs.text(), "Cilium's CT maps found") {
			t.Errorf("Open returned once the maps appeared, but without the cilium backend and its recorder:\n%s", logs.text())
		}
	})
	t.Run("not_cilium", func(t *testing.T) {
		if _, ok := conflistRuns(t.TempDir(), "cilium-cni"); ok {
			t.Error("an empty CNI config dir runs cilium-cni")
		}
		bridge := t.TempDir()
		os.WriteFile(filepath.Join(bridge, "10-bridge.conflist"), []byte(`{"plugins":[{"type":"bridge"},{"type":"ctscrub"}]}`), 0o644)
		if _, ok := conflistRuns(bridge, "cilium-cni"); ok {
			t.Error("a bridge conflist runs cilium-cni")
		}
	})
}

func (b *logBuffer) text() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
