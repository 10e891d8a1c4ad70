package main

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

const refEntries = 1 << 20

// targetEntries is the size the acceptance targets are stated for.
const targetEntries = 1 << 24

type config struct {
	entries, perIP, pods, indexReps int
	ref1M                           bool
	nextKeyMax                      int
}

func envInt(name string, def int) (int, error) {
	s := os.Getenv(name)
	if s == "" {
		return def, nil
	}
	v, err := strconv.Atoi(strings.ReplaceAll(s, "_", ""))
	if err != nil || v < 0 {
		return 0, fmt.Errorf("%s=%q: want a non-negative integer", name, s)
	}
	return v, nil
}

func parseConfig() (config, error) {
	var c config
	var err error
	if c.entries, err = envInt("ENTRIES", refEntries); err != nil {
		return c, err
	}
	if c.perIP, err = envInt("PER_IP", 1000); err != nil {
		return c, err
	}
	if c.pods, err = envInt("PODS", 1024); err != nil {
		return c, err
	}
	if c.indexReps, err = envInt("INDEX_REPS", 200); err != nil {
		return c, err
	}
	if c.nextKeyMax, err = envInt("NEXTKEY_MAX_VISITS", 0); err != nil {
		return c, err
	}
	ref, err := envInt("REF_1M", 1)
	if err != nil {
		return c, err
	}
	c.ref1M = ref != 0 && c.entries > refEntries
	switch {
	case c.perIP < 2:
		return c, fmt.Errorf("PER_IP=%d: want at least 2 (a flow and its related entry)", c.perIP)
	case c.entries < c.targets()*c.perIP+2*c.pods:
		return c, fmt.Errorf("ENTRIES=%d: want at least %d (%d target IPs of PER_IP=%d entries, each scrubbed once, plus the other pods'); lower PER_IP or INDEX_REPS",
			c.entries, c.targets()*c.perIP+2*c.pods, c.targets(), c.perIP)
	case c.entries > 1<<26:
		return c, fmt.Errorf("ENTRIES=%d: at most %d (Cilium clamps CT maps to 16,777,216)", c.entries, 1<<26)
	case c.pods < 1 || c.pods > 1<<20:
		return c, fmt.Errorf("PODS=%d: want 1 to %d", c.pods, 1<<20)
	case c.indexReps < 20:
		return c, fmt.Errorf("INDEX_REPS=%d: want at least 20 (the p99 needs them)", c.indexReps)
	}
	return c, nil
}

// Walk runs at most: sweep, batch walk, NextKey walk.
// The floor: floorReps targets each way (deleteFloor).
const sweepReps, batchReps, nextKeyReps, floorReps = 5, 5, 3, 20

// targets is the size of the target pool: every scrub takes a fresh one.
func (c config) targets() int {
	return 2*c.indexReps + sweepReps + batchReps + nextKeyReps + 2*floorReps
}
