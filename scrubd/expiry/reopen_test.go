package expiry

import (
	"context"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// A Reopen that fails leaves the Runner holding nothing of the old maps: the
// daemon closes them (Cilium left them), and a pass fails, saying why,
// instead of walking a table no datapath uses and reporting it (before: the
// pass went on over the old maps, which therefore stayed open for good). The
// next Reopen that works resumes the passes. The failure is real: one of the
// new maps is closed before the programs are loaded on it.
func TestReopenFailureLeavesOldMaps(t *testing.T) {
	needRoot(t)
	var old, good [ctmap.NumKinds]*ebpf.Map
	for _, k := range ctmap.Kinds {
		old[k] = newMap(t, k, 1024)
		good[k] = newMap(t, k, 1024)
	}
	kt, _ := nows(t)
	fill(t, old[ctmap.TCP4], ctmap.TCP4, kt, population{live: 10})
	fill(t, good[ctmap.TCP4], ctmap.TCP4, kt, population{live: 3})
	r := runner(t, old, Config{Mode: ModeReport, Clock: ClockKtime}, nil)
	if _, err := r.Pass(context.Background()); err != nil {
		t.Fatal(err)
	}

	bad := good
	closed, err := ebpf.NewMap(ctmap.Any4.Spec(1024))
	if err != nil {
		t.Fatal(err)
	}
	bad[ctmap.Any4] = closed
	cm, err := ctmap.FromMaps(bad)
	if err != nil {
		t.Fatal(err)
	}
	closed.Close()
	if err := r.Reopen(cm); err == nil {
		t.Fatal("Reopen onto a closed map succeeded")
	}
	for _, m := range old {
		m.Close()
	}
	if rep, err := r.Pass(context.Background()); err == nil {
		t.Errorf("a pass after a failed Reopen walked %d entries of the maps Cilium left", rep.Total().Entries)
	} else {
		t.Logf("pass after the failed Reopen: %v", err)
	}

	cm, err = ctmap.FromMaps(good)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Reopen(cm); err != nil {
		t.Fatal(err)
	}
	rep, err := r.Pass(context.Background())
	if err != nil {
		t.Fatalf("pass after a Reopen that worked: %v", err)
	}
	if n := rep.Total().Entries; n != 3 {
		t.Errorf("pass over the new maps visited %d entries, want 3", n)
	}
}
