package main

import (
	"testing"
	"time"
)

// TestSoakConfigFromEnv: the defaults of CRI_EVERY (5) and WARMUP_S (7
// min), 0 for either (none), and refused values.
func TestSoakConfigFromEnv(t *testing.T) {
	criEvery := func(c SoakConfig) any { return c.CRIEvery }
	warmup := func(c SoakConfig) any { return c.WarmupMax }
	for _, c := range []struct {
		env, val string
		get      func(SoakConfig) any
		want     any // nil: refused
	}{
		{"CRI_EVERY", "", criEvery, 5}, {"CRI_EVERY", "0", criEvery, 0}, {"CRI_EVERY", "3", criEvery, 3},
		{"CRI_EVERY", "-1", criEvery, nil}, {"CRI_EVERY", "x", criEvery, nil},
		{"WARMUP_S", "", warmup, 7 * time.Minute}, {"WARMUP_S", "0", warmup, time.Duration(0)},
		{"WARMUP_S", "90", warmup, 90 * time.Second}, {"WARMUP_S", "-1", warmup, nil}, {"WARMUP_S", "2m", warmup, nil},
	} {
		t.Run(c.env+"="+c.val, func(t *testing.T) {
			t.Setenv(c.env, c.val) // restored when the subtest ends
			cfg, err := soakConfigFromEnv()
			switch {
			case c.want != nil && (err != nil || c.get(cfg) != c.want):
				t.Errorf("%v, %v; want %v", c.get(cfg), err, c.want)
			case c.want == nil && err == nil:
				t.Errorf("accepted (%v)", c.get(cfg))
			}
		})
	}
}
