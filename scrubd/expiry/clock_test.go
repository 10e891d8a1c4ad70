package expiry

import (
	"strings"
	"testing"
	"time"
)

func TestDecide(t *testing.T) {
	ev := func(entries uint64, plausK, plausJ, implK, implJ, liveK, liveJ uint64) Evidence {
		return Evidence{Entries: entries, Plausible: [2]uint64{plausK, plausJ}, Implausible: [2]uint64{implK, implJ}, Live: [2]uint64{liveK, liveJ}}
	}
	cases := []struct {
		name      string
		cfg       Clock
		e         Evidence
		clock     Clock
		confirmed bool
		delete    bool
		why       string
	}{
		{"ktime entries", ClockAuto, ev(1000, 1000, 0, 0, 1000, 600, 0), ClockKtime, true, true, "confirmed"},
		{"jiffies entries", ClockAuto, ev(1000, 0, 1000, 1000, 0, 0, 600), ClockJiffies, true, true, "confirmed"},
		{"a few odd lifetimes are tolerated", ClockAuto, ev(100000, 99990, 0, 10, 100000, 50000, 0), ClockKtime, true, true, "confirmed"},
		{"both refuted", ClockAuto, ev(1000, 500, 500, 500, 500, 250, 250), ClockKtime, false, false, "neither"},
		{"too few entries", ClockAuto, ev(5, 5, 0, 0, 5, 2, 0), ClockKtime, false, false, "too few"},
		{"empty maps", ClockAuto, ev(0, 0, 0, 0, 0, 0, 0), ClockKtime, false, false, "ambiguous"},
		{"both fit, live only in ktime", ClockAuto, ev(1000, 1000, 1000, 0, 0, 400, 0), ClockKtime, true, true, "live"},
		{"both fit, nothing live", ClockAuto, ev(1000, 1000, 1000, 0, 0, 0, 0), ClockKtime, false, false, "both"},
		{"configured, no entries yet", ClockJiffies, ev(0, 0, 0, 0, 0, 0, 0), ClockJiffies, false, true, "configured"},
		{"configured and confirmed", ClockKtime, ev(1000, 1000, 0, 0, 1000, 10, 0), ClockKtime, true, true, "confirmed"},
		{"configured but refuted", ClockJiffies, ev(1000, 1000, 0, 0, 1000, 10, 0), ClockJiffies, false, false, "refuted"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := Decide(c.cfg, c.e, 16)
			if d.Clock != c.clock || d.Confirmed != c.confirmed || d.Delete != c.delete || !strings.Contains(d.Why, c.why) {
				t.Errorf("Decide = %+v, want clock %s confirmed %v delete %v, why containing %q", d, c.clock, c.confirmed, c.delete, c.why)
			}
		})
	}
}

func TestKernelHZ(t *testing.T) {
	for _, hz := range []uint64{100, 250, 300, 1000} {
		for _, up := range []uint64{30, 1000, 86400, 100 * 86400} {
			j := uint64(1)<<32 - 300*hz + hz*up
			got := kernelHZ(j, up*1e9+123456789)
			if got != int(hz) {
				t.Errorf("HZ %d, uptime %d s: estimated %d", hz, up, got)
			}
		}
	}
	if got := kernelHZ(1<<32, 300e9); got != 0 {
		t.Errorf("uptime 300 s: estimated %d, want 0 (unknown)", got)
	}
}

func TestParse(t *testing.T) {
	if m, err := ParseMode(" Sweep "); err != nil || m != ModeSweep {
		t.Errorf("ParseMode(Sweep) = %q, %v", m, err)
	}
	if _, err := ParseMode("delete"); err == nil || !strings.Contains(err.Error(), "off, report or sweep") {
		t.Errorf("ParseMode(delete) error %v: want the valid modes named", err)
	}
	if c, err := ParseClock("jiffies"); err != nil || c != ClockJiffies {
		t.Errorf("ParseClock(jiffies) = %q, %v", c, err)
	}
	if _, err := ParseClock("tsc"); err == nil {
		t.Error("ParseClock(tsc) accepted")
	}
	if _, err := (Config{Interval: 10 * time.Millisecond}).withDefaults(); err == nil {
		t.Error("a 10 ms interval was accepted")
	}
	c, err := Config{}.withDefaults()
	if err != nil || c.Mode != ModeSweep || c.Interval != DefaultInterval || c.Clock != ClockAuto || c.PassTimeout != DefaultInterval/2 {
		t.Errorf("defaults %+v, %v", c, err)
	}
}
