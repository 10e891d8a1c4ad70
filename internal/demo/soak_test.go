package demo

import "testing"

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
