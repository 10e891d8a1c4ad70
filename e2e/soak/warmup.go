package main

import (
	"context"
	"time"
)

// warmUpMin is the shortest warm-up: one lifetime of the background's UDP
// entries (the stand-in's non-TCP lifetime, 60 s) and one expiry interval
// (60 s), after which the long-lived pods' CT entries, and so their index
// keys, are as many as they will be.
const warmUpMin = 2 * time.Minute

// warmUp lets the background traffic run, before the first cycle, until
// scrubd is at the steady state of that load: neither its RSS (by more than
// 1 %) nor its index's key count (by more than 2 %) has set a new high for
// 60 s, and at least warmUpMin has passed; at most cfg.WarmupMax. The index
// keeps an IP's stale keys until its set has doubled (then prunes it), so
// its key count rises for a few minutes after the CT entries have levelled
// off, and scrubd's heap with it. Without the warm-up the first tenth of a
// 500-cycle run (about a minute) caught scrubd mid-fill and rss_end was 13-19
// % above rss_start with no leak behind it (docs/soak.md).
func (s *soak) warmUp(ctx context.Context) error {
	start := time.Now()
	s.res.RSSWarmupStart = s.memory()["VmRSS"]
	err := s.steady(ctx)
	s.res.WarmupS = time.Since(start).Seconds()
	s.res.RSSWarmupEnd = s.memory()["VmRSS"]
	s.res.IndexKeysWarmupEnd = int64(s.metric("ctscrub_index_keys"))
	s.logf("warm-up: %.0f s; scrubd RSS %.1f -> %.1f MiB, index %d keys", s.res.WarmupS,
		float64(s.res.RSSWarmupStart)/(1<<20), float64(s.res.RSSWarmupEnd)/(1<<20), s.res.IndexKeysWarmupEnd)
	return err
}

// rewarm is the warm-up again, for the scrubd the last restarting fault
// started: a restarted scrubd fills its index from its snapshot and the
// recorder again (after a SIGKILL every restored IP is incomplete, and the
// long-lived pods' flows are recorded anew), and its heap with it. The
// RSS baseline (rss_start) is taken from the cycles right after it, so the
// run compares that process with itself at the end, at the same load,
// instead of one process's first tenth with another's last (the runs of
// 2 Dec, docs/soak.md: the index at 15,000 keys right after the restart,
// 27,000 at the end).
func (s *soak) rewarm(ctx context.Context) error {
	start := time.Now()
	rss0, keys0 := s.memory()["VmRSS"], s.metric("ctscrub_index_keys")
	err := s.steady(ctx)
	s.res.RewarmS = time.Since(start).Seconds()
	s.res.IndexKeysRewarmEnd = int64(s.metric("ctscrub_index_keys"))
	s.logf("re-warm after scrubd's restart: %.0f s; scrubd RSS %.1f -> %.1f MiB, index %.0f -> %d keys", s.res.RewarmS,
		float64(rss0)/(1<<20), float64(s.memory()["VmRSS"])/(1<<20), keys0, s.res.IndexKeysRewarmEnd)
	return err
}

// steady waits, with the background traffic running, until neither
// scrubd's RSS (by more than 1 %) nor its index's key count (by more than
// 2 %) has set a new high for 60 s, and at least warmUpMin has passed; at
// most cfg.WarmupMax.
func (s *soak) steady(ctx context.Context) error {
	if s.cfg.WarmupMax <= 0 {
		return nil
	}
	start := time.Now()
	var highRSS, highKeys float64
	lastHigh := start
	for {
		now := time.Now()
		if r, k := float64(s.memory()["VmRSS"]), s.metric("ctscrub_index_keys"); r > highRSS*1.01 || k > highKeys*1.02 {
			highRSS, highKeys, lastHigh = max(highRSS, r), max(highKeys, k), now
		}
		switch {
		case now.Sub(start) >= s.cfg.WarmupMax:
			return nil
		case now.Sub(start) >= warmUpMin && now.Sub(lastHigh) >= time.Minute:
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(5 * time.Second):
		}
	}
}
