package main

import (
	"context"
	"net/netip"
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

	// clear takes the synthetic entries out, also when a sweep took most of
	// them first (the batch delete stops at every absent key), and leaves
	// other entries alone.
	other := ctmap.NewKey4(netip.MustParseAddr("10.244.1.5"), netip.MustParseAddr("10.244.1.6"), 80, 40000, ctmap.ProtoTCP, ctmap.FlagOut)
	if err := maps.Map(ctmap.TCP4).Put(other, ctmap.EncodeEntry(ctmap.EntryFields{Lifetime: rep.NowIn(expiry.ClockKtime) + 3600})); err != nil {
		t.Fatal(err)
	}
	if rep, err := sw.Pass(context.Background()); err != nil || rep.Total().Deleted != entries*share {
		t.Fatalf("second sweep deleted %d (%v), want %d", rep.Total().Deleted, err, int(entries*share))
	}
	if n, err := f.clear(); err != nil || n != entries-entries*share {
		t.Fatalf("clear after the sweep: %d deleted (%v), want %d", n, err, int(entries-entries*share))
	}
	if n, err := ctfill.CountAll(maps); err != nil || n != 1 {
		t.Fatalf("after clear: %d entries (%v), want 1 (the other one)", n, err)
	}
	if _, err := f.fill(); err != nil {
		t.Fatal(err)
	}
	if n, err := f.clear(); err != nil || n != entries {
		t.Fatalf("clear after a fill: %d deleted (%v), want %d", n, err, entries)
	}

	// A table too small for the plan is refused before anything is written.
	small, err := newFiller(maps, 1<<17, share, rep.NowIn(expiry.ClockKtime), 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := small.capacity(); err == nil {
		t.Error("a fill of 128 Ki entries into 64 Ki-entry maps was not refused")
	}
}

// EXPIRED=0: a table of live flows only, every one expiring hours ahead.
func TestFillNoneExpired(t *testing.T) {
	const now = 1 << 20
	f, err := newFiller(nil, 10000, 0, now, 1)
	if err != nil {
		t.Fatal(err)
	}
	for i := range f.flows {
		if f.expiredFlow(i) || f.lifetime(i) < now+3*3600 {
			t.Fatalf("flow %d: expired %v, lifetime %d (now %d)", i, f.expiredFlow(i), f.lifetime(i), now)
		}
	}
}

// With Cilium's GC at 60 s the fill may lose its expired share as it is
// written: the check asks for the live part only, in that variant only.
func TestFillWant(t *testing.T) {
	f, err := newFiller(nil, 100000, 0.8, 1<<20, 1)
	if err != nil {
		t.Fatal(err)
	}
	if got := f.expiredEntries(); got != 80000 {
		t.Fatalf("expiredEntries = %d, want 80000", got)
	}
	if got := fillWant("cilium_gc60", 100004, f); got != (100004-80000)*98/100 {
		t.Errorf("cilium_gc60: want %d, got %d", (100004-80000)*98/100, got)
	}
	for _, v := range []string{"cilium_only", "ctscrub", "ctscrub_no_expiry", "ctscrub_delegate"} {
		if got := fillWant(v, 100004, f); got != 100004*98/100 {
			t.Errorf("%s: want %d, got %d", v, 100004*98/100, got)
		}
	}
}
