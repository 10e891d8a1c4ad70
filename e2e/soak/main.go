// Command soak is `make soak`: the demo's node (internal/netnsnode: CT maps
// filled to ENTRIES, the Cilium stand-in datapath, scrubd as a child process,
// a node netns with bridge + host-local + ctscrub through libcni) under churn
// and faults. CYCLES pods
// are created and deleted one after another on two reused addresses while
// long-lived pods keep making flows; after every DEL a full walk of the
// kernel's CT maps checks that no entry of the deleted IPs is left. Faults
// are caused for real on a schedule (see schedule). The last line is JSON.
//
// See docs/soak.md.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"syscall"
	"time"

	"github.com/ctscrub/ctscrub/internal/netnsnode"
)

// SoakConfig is what `make soak` reads from the environment.
type SoakConfig struct {
	Cycles   int           // CYCLES (default 500)
	Entries  int           // ENTRIES (default 4194304)
	Starve   time.Duration // STARVE_S: the CPU starvation fault's length (default 60 s; 0: skipped)
	CRIEvery int           // CRI_EVERY: every n-th cycle's pod goes through containerd's CRI (default 5; 0: none)
	// WARMUP_S: the longest warm-up before the first cycle (default 420 s;
	// 0: none). See warmUp.
	WarmupMax  time.Duration
	BinDir     string
	RefPlugins string
}

func soakConfigFromEnv() (SoakConfig, error) {
	cfg := SoakConfig{Cycles: 500, Entries: 1 << 22, Starve: time.Minute, CRIEvery: 5, WarmupMax: 7 * time.Minute, BinDir: "bin", RefPlugins: "/usr/lib/cni"}
	for _, e := range []struct {
		name     string
		dst      *int
		min, max int
	}{{"CYCLES", &cfg.Cycles, 10, 1 << 20}, {"ENTRIES", &cfg.Entries, 65536, 1 << 25}, {"CRI_EVERY", &cfg.CRIEvery, 0, 1 << 20}} {
		if v := os.Getenv(e.name); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil || n < e.min || n > e.max {
				return cfg, fmt.Errorf("%s=%q: want a whole number from %d to %d", e.name, v, e.min, e.max)
			}
			*e.dst = n
		}
	}
	if v := os.Getenv("STARVE_S"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return cfg, fmt.Errorf("STARVE_S=%q: want seconds", v)
		}
		cfg.Starve = time.Duration(n) * time.Second
	}
	if v := os.Getenv("WARMUP_S"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return cfg, fmt.Errorf("WARMUP_S=%q: want seconds", v)
		}
		cfg.WarmupMax = time.Duration(n) * time.Second
	}
	if v := os.Getenv("DEMO_BIN"); v != "" {
		cfg.BinDir = v
	}
	if v := os.Getenv("CNI_PLUGINS"); v != "" {
		cfg.RefPlugins = v
	}
	return cfg, nil
}

func main() {
	out := os.Stdout
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "soak: run as root (BPF maps, network namespaces)")
		os.Exit(1)
	}
	cfg, err := soakConfigFromEnv()
	if err != nil {
		fmt.Fprintln(os.Stderr, "soak:", err)
		os.Exit(2)
	}
	netnsnode.UseNames("ctscrub-soak")
	lk, err := netnsnode.Lock(10*time.Minute, out)
	if err != nil {
		fmt.Fprintln(os.Stderr, "soak:", err)
		os.Exit(1)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	go func() { <-sigs; cancel() }()
	cleanup := &netnsnode.Cleanup{}
	res, err := runSoak(ctx, cfg, cleanup, out)
	code := 0
	if err != nil {
		fmt.Fprintf(out, "\nsoak FAILED: %v\n", err)
		code = 1
	}
	fmt.Fprintln(out, "\nCleaning up ...")
	if n := cleanup.Run(io.Discard); n > 0 {
		fmt.Fprintf(out, "cleanup: %d step(s) failed\n", n)
	}
	if res != nil {
		if !res.Pass {
			code = 1
		}
		b, _ := json.Marshal(res)
		fmt.Fprintln(out, string(b))
	}
	runtime.KeepAlive(lk)
	os.Exit(code)
}
