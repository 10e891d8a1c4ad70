package recorder

import (
	"path/filepath"
	"testing"

	"github.com/ctscrub/ctscrub/internal/testsupport/standin"
)

// A service map re-created under the same pin is noticed, and after
// ReloadPrograms the programs read the map pinned now; a service map that
// appears after Load (Cilium started after scrubd) is noticed too.
func TestServiceMapChangeNoticed(t *testing.T) {
	r, dir := loadOverServiceMaps(t)
	if v4, v6 := r.VIPDetection(); !v4 || !v6 {
		t.Fatalf("VIP detection v4 %v v6 %v with both service maps pinned", v4, v6)
	}
	if r.ServiceMapsChanged() {
		t.Fatal("a change reported with the maps untouched")
	}
	if err := standin.RecreateServiceMap4(dir); err != nil {
		t.Fatal(err)
	}
	if !r.ServiceMapsChanged() {
		t.Fatalf("re-created %s not noticed", ServiceMap4)
	}
	in, _ := r.Programs()
	if err := r.ReloadPrograms(); err != nil {
		t.Fatal(err)
	}
	if r.ServiceMapsChanged() {
		t.Fatal("still changed after ReloadPrograms")
	}
	if in2, _ := r.Programs(); in2 == in {
		t.Fatal("Programs unchanged after ReloadPrograms")
	}

	// Without service maps at Load, then Cilium pins them.
	dir2 := standin.TempDir(t)
	r2, err := Load(Options{PinDir: filepath.Join(dir2, "ctscrub"), CTRoot: dir2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r2.Close() })
	if v4, _ := r2.VIPDetection(); v4 || r2.ServiceMapsChanged() {
		t.Fatal("VIP detection on, or a change, without service maps")
	}
	if err := standin.CreateServiceMaps(dir2); err != nil {
		t.Fatal(err)
	}
	if !r2.ServiceMapsChanged() {
		t.Fatal("service maps pinned after Load not noticed")
	}
	if err := r2.ReloadPrograms(); err != nil {
		t.Fatal(err)
	}
	if v4, v6 := r2.VIPDetection(); !v4 || !v6 || r2.ServiceMapsChanged() {
		t.Fatalf("after ReloadPrograms: VIP detection v4 %v v6 %v, changed %v", v4, v6, r2.ServiceMapsChanged())
	}
}

// Each service-map reload closes the programs of the reload before it (the
// filters that still use them hold their own references): reloads on every
// agent restart must not pile up programs in scrubd.
func TestReloadsDoNotAccumulatePrograms(t *testing.T) {
	r, dir := loadOverServiceMaps(t)
	first, _ := r.Programs()
	var prev [2]int
	for i := range 5 {
		if err := standin.RecreateServiceMap4(dir); err != nil {
			t.Fatal(err)
		}
		if err := r.ReloadPrograms(); err != nil {
			t.Fatal(err)
		}
		in, eg := r.Programs()
		if i > 0 && (prev[0] == in.FD() || prev[1] == eg.FD()) {
			t.Fatalf("reload %d: programs unchanged", i)
		}
		prev = [2]int{in.FD(), eg.FD()}
		if n := r.Reloaded(); n != 3 {
			t.Fatalf("reload %d: %d reloaded programs held open, want 3 (pod ingress, pod egress, host side)", i, n)
		}
	}
	if first.FD() < 0 {
		t.Fatal("Load's own program closed by a reload (Close owns it)")
	}
}

// loadOverServiceMaps loads a recorder over both service maps pinned, as
// Cilium pins them, in a fresh directory that it returns.
func loadOverServiceMaps(t *testing.T) (*Recorder, string) {
	t.Helper()
	requireRoot(t)
	dir := standin.TempDir(t)
	if err := standin.CreateServiceMaps(dir); err != nil {
		t.Fatal(err)
	}
	r, err := Load(Options{PinDir: filepath.Join(dir, "ctscrub"), CTRoot: dir})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r, dir
}
