package main

import (
	"context"
	"os"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/bench/internal/ctfill"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/expiry"
)

// The fill writes the planned number of entries with exactly the planned
// share expired, judged by ctscrub's own pass in the clock it detects; a
// refill restores the table after a sweep.
func TestFillExpiredShare(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates BPF maps and runs the expiry pass")
	}
	var ms [ctmap.NumKinds]*ebpf.Map
	for _, k := range []ctmap.Kind{ctmap.TCP4, ctmap.Any4} {
		m, err := ebpf.NewMap(k.Spec(1 << 16))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		ms[k] = m
	}
	maps, err := ctmap.FromMaps(ms)
	if err != nil {
		t.Fatal(err)
	}
	// The clock reading the way the benchmark takes it: a report pass.
	r, err := expiry.New(maps, expiry.Config{Mode: expiry.ModeReport, Clock: expiry.ClockKtime}, expiry.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	rep, err := r.Pass(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	const entries, share = 40000, 0.8
	f, err := newFiller(maps, entries, share, rep.NowIn(expiry.ClockKtime), 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.capacity(); err != nil {
		t.Fatal(err)
	}
	if _, err := f.fill(); err != nil {
		t.Fatal(err)
	}
	check := func(when string) {
		t.Helper()
		n, err := ctfill.CountAll(maps)
		if err != nil {
			t.Fatal(err)
		}
		if n != entries {
			t.Fatalf("%s: %d entries, want %d", when, n, entries)
		}
		// ctscrub's detection must confirm ktime from these entries alone.
		auto, err := expiry.New(maps, expiry.Config{Mode: expiry.ModeReport, Clock: expiry.ClockAuto}, expiry.Options{})
		if err != nil {
			t.Fatal(err)
		}
		defer auto.Close()
		rep, err := auto.Pass(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if !rep.Decision.Confirmed || rep.Decision.Clock != expiry.ClockKtime {
			t.Fatalf("%s: clock decision %+v, want ktime confirmed", when, rep.Decision)
		}
		if got := rep.Total().Expired; got != entries*share {
			t.Errorf("%s: %d expired, want %d", when, got, int(entries*share))
		}
		if n := maps.Map(ctmap.TCP4).MaxEntries(); n == 0 {
			t.Fatal("no TCP map")
		}
	}
	check("after the fill")

	sw, err := expiry.New(maps, expiry.Config{Mode: expiry.ModeSweep, Clock: expiry.ClockKtime}, expiry.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer sw.Close()
	if rep, err := sw.Pass(context.Background()); err != nil || rep.Total().Deleted != entries*share {
		t.Fatalf("sweep deleted %d (%v), want %d", rep.Total().Deleted, err, int(entries*share))
	}
	if _, err := f.fill(); err != nil {
		t.Fatal(err)
	}
	check("after the refill")

	// A table too small for the plan is refused before anything is written.
	small, err := newFiller(maps, 1<<17, share, rep.NowIn(expiry.ClockKtime), 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := small.capacity(); err == nil {
		t.Error("a fill of 128 Ki entries into 64 Ki-entry maps was not refused")
	}
}
