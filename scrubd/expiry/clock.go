package expiry

import (
	"fmt"
	"math"
)

// Evidence is what one pass saw of the entries' lifetimes, under each clock,
// summed over the maps.
type Evidence struct {
	Entries uint64
	// Plausible: entries whose lifetime that clock can produce (live within
	// MaxLifetime of now, or expired and at or above the clock's floor).
	Plausible [numClocks]uint64
	// Implausible: entries further in the future than any CT timeout, or
	// below the clock's floor.
	Implausible [numClocks]uint64
	// Live: entries not yet expired in that clock.
	Live [numClocks]uint64
}

func (e *Evidence) add(a passArgs) {
	e.Entries += a.Visited
	for c := range numClocks {
		e.Plausible[c] += a.C[c].Plausible
		e.Implausible[c] += a.C[c].Implausible
		e.Live[c] += a.C[c].Live
	}
}

// Decision is which clock the pass judges expiry by, and whether it may
// delete by it.
type Decision struct {
	Clock     Clock // never ClockAuto; the best guess when not confirmed
	Confirmed bool  // the entries confirm Clock
	Delete    bool  // a sweep may delete by Clock
	Why       string
}

// refuted: more than 0.1 % of the entries are impossible in the clock. A
// little tolerance, because an agent can write odd lifetimes from user space
// (restores, tests); a wrong clock makes (nearly) every entry implausible.
func refuted(e Evidence, c int) bool {
	return e.Implausible[c] > 0 && e.Implausible[c]*1000 > e.Entries
}

func clockName(c int) Clock {
	if c == clockJiffies {
		return ClockJiffies
	}
	return ClockKtime
}

func clockIndex(c Clock) int {
	if c == ClockJiffies {
		return clockJiffies
	}
	return clockKtime
}

// Decide picks the clock from evidence. Auto confirms a clock only when at
// least minEvidence entries are plausible in it, it is not refuted, and the
// other clock is refuted, or (both fitting, which happens for ktime after
// ~194 days of uptime, when seconds of ktime reach jiffies' floor) at least
// minEvidence entries are live in it and none in the other. Anything else is
// ambiguous and deletes nothing. A configured clock deletes unless the
// entries refute it.
func Decide(cfg Clock, e Evidence, minEvidence int) Decision {
	if cfg == ClockKtime || cfg == ClockJiffies {
		c := clockIndex(cfg)
		d := Decision{Clock: cfg, Delete: true, Why: "clock configured"}
		switch {
		case refuted(e, c):
			d.Delete = false
			d.Why = fmt.Sprintf("configured clock %s is refuted: %d of %d entries have lifetimes impossible in it (check Cilium's \"Clock Source for BPF\"); not deleting", cfg, e.Implausible[c], e.Entries)
		case e.Plausible[c] >= uint64(minEvidence) && refuted(e, 1-c):
			d.Confirmed = true
			d.Why = "clock configured and confirmed by the entries"
		}
		return d
	}
	var ok []int
	for c := range numClocks {
		if !refuted(e, c) {
			ok = append(ok, c)
		}
	}
	switch len(ok) {
	case 0:
		return Decision{Clock: ClockKtime, Why: fmt.Sprintf("ambiguous clock: the entries fit neither ktime (%d implausible) nor jiffies (%d implausible) of %d; not deleting (set the clock explicitly if you know it)", e.Implausible[clockKtime], e.Implausible[clockJiffies], e.Entries)}
	case 2:
		// Live entries of one clock read as expired in the other: a clock in
		// which nothing is live while the other has live entries is wrong.
		for c := range numClocks {
			if e.Live[c] >= uint64(minEvidence) && e.Live[1-c] == 0 {
				return Decision{Clock: clockName(c), Confirmed: true, Delete: true, Why: fmt.Sprintf("clock %s confirmed: the entries fit both clocks, but %d are live in %s and none in %s", clockName(c), e.Live[c], clockName(c), clockName(1-c))}
			}
		}
		return Decision{Clock: ClockKtime, Why: fmt.Sprintf("ambiguous clock: the %d entries fit both ktime and jiffies; not deleting (set the clock explicitly if you know it)", e.Entries)}
	}
	c := ok[0]
	if e.Plausible[c] < uint64(minEvidence) {
		return Decision{Clock: clockName(c), Why: fmt.Sprintf("too few entries to confirm the clock: %d plausible in %s, need %d; not deleting", e.Plausible[c], clockName(c), minEvidence)}
	}
	return Decision{Clock: clockName(c), Confirmed: true, Delete: true, Why: fmt.Sprintf("clock %s confirmed: %d of %d entries plausible in it, %d implausible in %s", clockName(c), e.Plausible[c], e.Entries, e.Implausible[1-c], clockName(1-c))}
}

// kernelHZ estimates CONFIG_HZ from one reading of both clocks: jiffies_64
// starts at 2^32 - 300*HZ, so jiffies64 = 2^32 + HZ*(uptime - 300 s). Near
// uptime 300 s the estimate is useless; 0 then.
func kernelHZ(jiffies64, ktimeNs uint64) int {
	up := float64(ktimeNs) / 1e9
	if math.Abs(up-300) < 60 {
		return 0
	}
	hz := (float64(jiffies64) - float64(uint64(1)<<32)) / (up - 300)
	for _, c := range []float64{100, 250, 300, 1000, 1024} {
		if math.Abs(hz-c) < c*0.02 {
			return int(c)
		}
	}
	if hz < 1 || hz > 10000 {
		return 0
	}
	return int(math.Round(hz))
}

// secondsToUnits converts a duration in seconds to clock units
// (Cilium's bpf_sec_to_mono: jiffies units are HZ/256 per second).
func secondsToUnits(c int, s float64, hz int) float64 {
	if c == clockJiffies {
		return s * float64(hz) / 256
	}
	return s
}
