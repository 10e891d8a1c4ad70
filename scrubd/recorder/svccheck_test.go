package recorder

import (
	"bytes"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ctscrub/ctscrub/internal/testsupport/standin"
)

// A service map re-created under the same pin (Cilium re-created it) is
// reported: the loaded programs still look at the old one.
func TestServiceMapChangeReported(t *testing.T) {
	requireRoot(t)
	dir := standin.TempDir(t)
	if err := standin.CreateServiceMaps(dir); err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	r, err := Load(Options{PinDir: filepath.Join(dir, "ctscrub"), CTRoot: dir, Log: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	if v4, v6 := r.VIPDetection(); !v4 || !v6 {
		t.Fatalf("VIP detection v4 %v v6 %v with both service maps pinned", v4, v6)
	}
	r.checkServiceMaps()
	if strings.Contains(logs.String(), "changed") {
		t.Fatalf("reported a change with the maps untouched: %s", logs.String())
	}
	// Cilium re-creates its IPv4 service map.
	if err := os.Remove(filepath.Join(dir, ServiceMap4)); err != nil {
		t.Fatal(err)
	}
	sub := filepath.Join(dir, "new")
	if err := os.Mkdir(sub, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := standin.CreateServiceMaps(sub); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(sub, ServiceMap4), filepath.Join(dir, ServiceMap4)); err != nil {
		t.Fatal(err)
	}
	r.checkServiceMaps()
	if !strings.Contains(logs.String(), "service map changed") || !strings.Contains(logs.String(), ServiceMap4) {
		t.Fatalf("re-created %s not reported; log: %s", ServiceMap4, logs.String())
	}
}
