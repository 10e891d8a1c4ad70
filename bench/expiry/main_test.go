package main

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/expiry"
)

// The steady-state check must hold however long the machine took between
// the fill and the pass. At 16 M entries on a loaded machine the old check
// failed ("deleted 240744, want 167770 written expired plus 73038..75369 live
// ones that expired since the fill"): it modelled which live entries had
// expired from user-space clock readings around the pass and from the fill's
// key indices, which the LRU's evictions during the fill had made inexact.
// Here entries expire while the test runs (lifetimes straddle the pass's
// clock), a real pass sweeps them, and the check passes; a report or map that
// differs by one entry fails it.
func TestCheckSteadySweepIsExact(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (BPF maps and programs)")
	}
	const n = 4096
	m, err := ebpf.NewMap(ctmap.TCP4.Spec(2 * n))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	now := monoNow()
	keys := make([]ctmap.CTKey4, n)
	vals := make([]ctmap.Entry, n)
	written := 0
	for i := range keys {
		keys[i] = key(i)
		// -3 .. +2 s around now: some expired when written, some expire
		// before the pass, the rest stay live.
		lt := now - 3 + uint32(i%6)
		if lt < now {
			written++
		}
		vals[i] = ctmap.EncodeEntry(ctmap.EntryFields{Lifetime: lt, Packets: 1})
	}
	if _, err := m.BatchUpdate(keys, vals, nil); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1100 * time.Millisecond) // the +0 ones expire
	maps, err := ctmap.FromMaps([ctmap.NumKinds]*ebpf.Map{ctmap.TCP4: m})
	if err != nil {
		t.Fatal(err)
	}
	sw, err := expiry.New(maps, expiry.Config{Mode: expiry.ModeSweep, Clock: expiry.ClockKtime, PassTimeout: time.Minute}, expiry.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer sw.Close()
	before := lifetimes(m)
	r, err := sw.Pass(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	tot := r.Total()
	after := lifetimes(m)
	if err := checkSteadySweep(before, after, tot, written); err != nil {
		t.Fatalf("a real sweep failed the check: %v", err)
	}
	if int(tot.Deleted) <= written {
		t.Fatalf("deleted %d, want more than the %d written expired (entries expired between the fill and the pass)", tot.Deleted, written)
	}
	// The check must be able to fail.
	off := tot
	off.Deleted--
	if checkSteadySweep(before, after, off, written) == nil {
		t.Error("a deleted count one short passed")
	}
	if len(after) > 0 && checkSteadySweep(before, append([]uint32{before[0]}, after[1:]...), tot, written) == nil {
		t.Error("an expired entry left in place of a live one passed")
	}
	if checkSteadySweep(before, after, tot, int(tot.Deleted)+1) == nil {
		t.Error("fewer deletions than entries written expired passed")
	}
}
