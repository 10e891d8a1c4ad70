// Package expiry keeps Cilium's CT maps lean and shows their health: a pass
// over each map, in the kernel, counts live and expired entries and, in sweep
// mode, deletes the expired ones, on a fixed interval.
//
// Cilium garbage-collects its CT maps itself, on an interval it adapts
// (towards 12 h on a quiet node); every full walk of a map, Cilium's scrubs
// included, pays for the expired entries left in between. The pass is the
// kernel-side complement: one bpf_for_each_map_elem walk per map, a few
// seconds of one CPU at 16 M entries, no per-entry syscalls. Each pass also
// audits a rotating sample of the IPs the index calls complete against the
// kernel (audit.go). See docs/expiry.md.
package expiry

import (
	"fmt"
	"strings"
	"time"
)

// Mode says what the pass does.
type Mode string

const (
	// ModeOff runs no pass at all.
	ModeOff Mode = "off"
	// ModeReport counts live and expired entries; it deletes nothing.
	ModeReport Mode = "report"
	// ModeSweep counts, and deletes expired entries once the clock is known.
	ModeSweep Mode = "sweep"
)

// ParseMode parses a mode name.
func ParseMode(s string) (Mode, error) {
	switch m := Mode(strings.ToLower(strings.TrimSpace(s))); m {
	case ModeOff, ModeReport, ModeSweep:
		return m, nil
	}
	return "", fmt.Errorf("expiry mode %q: want off, report or sweep", s)
}

// Clock is the clock ct_entry.lifetime is kept in.
type Clock string

const (
	// ClockAuto decides from the entries' lifetimes (see Decide).
	ClockAuto Clock = "auto"
	// ClockKtime is seconds of ktime (bpf_ktime_get_ns() / 1e9), Cilium's default.
	ClockKtime Clock = "ktime"
	// ClockJiffies is jiffies >> 8 (bpf_jiffies64() >> 8), when Cilium chose jiffies.
	ClockJiffies Clock = "jiffies"
)

// ParseClock parses a clock name.
func ParseClock(s string) (Clock, error) {
	switch c := Clock(strings.ToLower(strings.TrimSpace(s))); c {
	case ClockAuto, ClockKtime, ClockJiffies:
		return c, nil
	}
	return "", fmt.Errorf("expiry clock %q: want auto, ktime or jiffies", s)
}

// Config configures the Runner.
type Config struct {
	Mode Mode
	// Interval between passes; fixed: nothing adapts it (Cilium's adaptive
	// GC interval grew towards 12 h in the incident). Default 60 s.
	Interval time.Duration
	// Clock of ct_entry.lifetime; ClockAuto decides from the entries.
	Clock Clock
	// MaxLifetime is the longest CT timeout Cilium can set (ct-timeout-*,
	// default 6 h for established TCP and services) plus slack. A live entry
	// further in the future than this is implausible in that clock.
	MaxLifetime time.Duration
	// MinEvidence is the fewest entries plausible in a clock before ClockAuto
	// trusts it with deletes.
	MinEvidence int
	// PassTimeout bounds one pass over all maps; the stop flag ends it when it
	// passes. Default Interval / 2.
	PassTimeout time.Duration
}

// Defaults.
const (
	DefaultInterval    = 60 * time.Second
	DefaultMaxLifetime = 6*time.Hour + 15*time.Minute
	DefaultMinEvidence = 16
	DefaultMode        = ModeSweep
)

// DefaultConfig is sweep mode, every 60 s, clock auto.
func DefaultConfig() Config {
	return Config{
		Mode:        DefaultMode,
		Interval:    DefaultInterval,
		Clock:       ClockAuto,
		MaxLifetime: DefaultMaxLifetime,
		MinEvidence: DefaultMinEvidence,
	}
}

// withDefaults fills zero fields and checks the rest.
func (c Config) withDefaults() (Config, error) {
	d := DefaultConfig()
	if c.Mode == "" {
		c.Mode = d.Mode
	}
	if _, err := ParseMode(string(c.Mode)); err != nil {
		return c, err
	}
	if c.Clock == "" {
		c.Clock = d.Clock
	}
	if _, err := ParseClock(string(c.Clock)); err != nil {
		return c, err
	}
	if c.Interval == 0 {
		c.Interval = d.Interval
	}
	if c.Interval < time.Second {
		return c, fmt.Errorf("expiry interval %s: must be at least 1s (default %s)", c.Interval, DefaultInterval)
	}
	if c.MaxLifetime == 0 {
		c.MaxLifetime = d.MaxLifetime
	}
	if c.MaxLifetime < time.Minute {
		return c, fmt.Errorf("expiry max lifetime %s: must cover Cilium's longest CT timeout (default %s)", c.MaxLifetime, DefaultMaxLifetime)
	}
	if c.MinEvidence == 0 {
		c.MinEvidence = d.MinEvidence
	}
	if c.PassTimeout == 0 {
		c.PassTimeout = c.Interval / 2
	}
	return c, nil
}
