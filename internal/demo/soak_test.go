package demo

import (
	"testing"
	"time"
)

// TestSoakConfigFromEnv: CRI_EVERY's default, 0 (no CRI pods), and refused
// values with the variable named in the error.
func TestSoakConfigFromEnv(t *testing.T) {
	for _, c := range []struct {
		val  string
		want int
		ok   bool
	}{{"", 5, true}, {"0", 0, true}, {"3", 3, true}, {"-1", 0, false}, {"x", 0, false}} {
		t.Setenv("CRI_EVERY", c.val)
		cfg, err := soakConfigFromEnv()
		if c.ok && (err != nil || cfg.CRIEvery != c.want) {
			t.Errorf("CRI_EVERY=%q: %d, %v; want %d", c.val, cfg.CRIEvery, err, c.want)
		}
		if !c.ok && err == nil {
			t.Errorf("CRI_EVERY=%q accepted (%d)", c.val, cfg.CRIEvery)
		}
	}
}

// TestSoakWarmupFromEnv: WARMUP_S's default (7 min), 0 (no warm-up), and
// refused values.
func TestSoakWarmupFromEnv(t *testing.T) {
	for _, c := range []struct {
		val  string
		want time.Duration
		ok   bool
	}{{"", 7 * time.Minute, true}, {"0", 0, true}, {"90", 90 * time.Second, true}, {"-1", 0, false}, {"2m", 0, false}} {
		t.Setenv("WARMUP_S", c.val)
		cfg, err := soakConfigFromEnv()
		if c.ok && (err != nil || cfg.WarmupMax != c.want) {
			t.Errorf("WARMUP_S=%q: %s, %v; want %s", c.val, cfg.WarmupMax, err, c.want)
		}
		if !c.ok && err == nil {
			t.Errorf("WARMUP_S=%q accepted (%s)", c.val, cfg.WarmupMax)
		}
	}
}
