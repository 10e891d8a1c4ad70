package main

// What the soak reports: its last line, one JSON object.

// FaultResult is one injected fault and what the node did.
type FaultResult struct {
	Name    string  `json:"name"`
	Cycle   int     `json:"cycle"`
	Outcome string  `json:"outcome"`
	OK      bool    `json:"ok"`
	Skipped bool    `json:"skipped,omitempty"` // not caused in this run (the outcome says why)
	WindowS float64 `json:"window_s"`          // how long CNI calls could fail because of it
	// scrubd's RSS right before and right after the fault: which fault a
	// step in rss_start -> rss_end comes from.
	RSSBefore int64 `json:"rss_before_bytes,omitempty"`
	RSSAfter  int64 `json:"rss_after_bytes,omitempty"`
}

// SoakResult is the last line.
type SoakResult struct {
	Cycles           int           `json:"cycles"`
	Entries          int           `json:"entries"`
	StaleEntriesLeft int           `json:"stale_entries_left"`
	WrongDeletions   int           `json:"wrong_deletions"`
	FailedAdds       int           `json:"failed_adds"`
	FailedDels       int           `json:"failed_dels"`
	FailedAddsInWin  int           `json:"failed_adds_in_fault_windows"`
	FailedDelsInWin  int           `json:"failed_dels_in_fault_windows"`
	CRICycles        int           `json:"cri_cycles"`            // cycles whose pod went through containerd's CRI
	CRISkipped       string        `json:"cri_skipped,omitempty"` // why no pod did
	AddP99S          float64       `json:"add_p99_s"`
	AddP50S          float64       `json:"add_p50_s"`
	Faults           []FaultResult `json:"faults"`
	// RSS: the median of one reading per cycle over a tenth of the
	// cycles at the start of the process that runs to the end (the
	// baseline: the first tenth, or when a fault restarts scrubd, the
	// tenth after the last such fault and its re-warm, with no fault in
	// it; BaselineCycle is its first cycle) and over the last tenth
	// (after the last fault). One reading at each end lands anywhere on
	// the GC's sawtooth (a few MiB here), the medians compare like with
	// like, and the same process with itself.
	RSSStart int64 `json:"rss_start_bytes"`
	RSSEnd   int64 `json:"rss_end_bytes"`
	// The first process's first tenth (the run's first baseline, before
	// any fault), kept when a restart moved the baseline.
	RSSFirstProcess int64 `json:"rss_first_process_bytes,omitempty"`
	BaselineCycle   int   `json:"baseline_cycle"`
	// The re-warm after the last restarting fault (rewarm): how long it
	// ran, and the index's keys when it ended.
	RewarmS            float64 `json:"rewarm_s,omitempty"`
	IndexKeysRewarmEnd int64   `json:"index_keys_rewarm_end,omitempty"`
	// Processes of scrubd during the cycles: 1, plus one per restart. A
	// process more than the faults' restarts (PlannedRestarts) is scrubd
	// dying on its own, and fails the run.
	ScrubdProcesses int `json:"scrubd_processes"`
	PlannedRestarts int `json:"planned_restarts"`
	// The heap the last GC found live (go_gc_heap_live_bytes) at the end
	// of the first tenth and at the end: a leak grows it, the GC's
	// sawtooth does not.
	HeapLiveStart int64 `json:"heap_live_start_bytes"`
	HeapLiveEnd   int64 `json:"heap_live_end_bytes"`
	// The same medians of RssAnon alone: scrubd's own memory (heap,
	// stacks, runtime). VmRSS also counts pages mapped from elsewhere:
	// the binary's code as more of it runs, and the ring buffer's pages,
	// which the kernel allocated when it created the map and which count
	// once the reader has reached them (twice: the ring is mapped twice).
	RSSAnonStart int64 `json:"rss_anon_start_bytes"`
	RSSAnonEnd   int64 `json:"rss_anon_end_bytes"`
	// RssFile and RssShmem at the end (the code pages and the ring's).
	RSSFileEnd  int64 `json:"rss_file_end_bytes"`
	RSSShmemEnd int64 `json:"rss_shmem_end_bytes"`
	// Keys in scrubd's index at the end of the baseline tenth and at the
	// end: the long-lived pods' flows are indexed for as long as their CT
	// entries live, so the index (and the heap) follows the CT table.
	// The warm-up before the first cycle (warmUp): how long it ran, and
	// scrubd's RSS and index keys when it began (scrubd just started) and
	// when it ended. Nothing of the run is hidden by it: the cycles' first
	// tenth starts where it ends.
	WarmupS            float64 `json:"warmup_s"`
	RSSWarmupStart     int64   `json:"rss_warmup_start_bytes"`
	RSSWarmupEnd       int64   `json:"rss_warmup_end_bytes"`
	IndexKeysWarmupEnd int64   `json:"index_keys_warmup_end"`
	IndexKeysStart     int64   `json:"index_keys_start"`
	IndexKeysEnd       int64   `json:"index_keys_end"`
	FDsStart           int     `json:"fds_start"`
	FDsEnd             int     `json:"fds_end"`
	GoroutinesStart    int     `json:"goroutines_start"`
	GoroutinesEnd      int     `json:"goroutines_end"`
	DurationS          float64 `json:"duration_s"`
	Pass               bool    `json:"pass"`
}

// passed is the soak's verdict: nothing stale, nothing wrongly deleted, no
// CNI call failed outside a fault's window, scrubd's RSS no more than 10 %
// up and its fds flat (within 10 %) from the baseline tenth to the last, no restart of scrubd
// but the faults', and every fault handled or skipped.
func (r *SoakResult) passed() bool {
	flat := func(a, b int64) bool { return a > 0 && float64(b) <= float64(a)*1.1 && float64(b) >= float64(a)*0.9 }
	// RSS may fall, not rise: since the bootstrap pass (issue 36) scrubd
	// files the pre-filled table at start (4 M keys, about 250 MB), and the
	// CT maps' re-creation fault empties the index; a leak shows as a rise.
	noRise := func(a, b int64) bool { return a > 0 && float64(b) <= float64(a)*1.1 }
	pass := r.StaleEntriesLeft == 0 && r.WrongDeletions == 0 &&
		r.FailedAdds == r.FailedAddsInWin && r.FailedDels == r.FailedDelsInWin &&
		noRise(r.RSSStart, r.RSSEnd) && flat(int64(r.FDsStart), int64(r.FDsEnd)) &&
		r.ScrubdProcesses <= 1+r.PlannedRestarts
	for _, f := range r.Faults {
		pass = pass && (f.OK || f.Skipped)
	}
	return pass
}
