// Command cni is `make bench-cni`: what the ctscrub CNI plugin costs a pod
// start and a pod delete, as a container runtime calls it, on a node whose
// CT maps hold ENTRIES entries and where scrubd runs, side by side with a
// bare process start (CNI_COMMAND=VERSION) and the bridge plugin's ADD/DEL
// in the same run. It builds on the demo's node (internal/netnsnode: the
// same maps, datapath stand-in, scrubd process, node netns and outside
// host); see BenchCNI for what each pair does.
//
//	ENTRIES  CT entries (default 16777216)
//	PAIRS    timed ADD/DEL pairs (default 1000)
//	RANGE    addresses host-local hands out; each is reused every RANGE pairs (default 4)
//	DEMO_BIN where scrubd and ctscrub are (default bin; `make bench-cni` builds them)
//	TRACE    0: no per-step breakdown of the plugin's ADD and DEL (default on)
//	STATE_DIR where scrubd keeps its state file (default: a tmpfs, as /run on a real node)
//
// The last line of output is one JSON object.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"syscall"
	"time"

	"github.com/ctscrub/ctscrub/internal/netnsnode"
)

func envInt(name string, def, lo, hi int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < lo || n > hi {
		fmt.Fprintf(os.Stderr, "bench-cni: %s=%q: want a whole number from %d to %d\n", name, v, lo, hi)
		os.Exit(2)
	}
	return n
}

func main() {
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "bench-cni: run as root (BPF maps, network namespaces)")
		os.Exit(2)
	}
	cfg := BenchCNIConfig{
		Entries:    envInt("ENTRIES", 1<<24, 4096, 1<<25),
		Pairs:      envInt("PAIRS", 1000, 10, 1_000_000),
		RangeSize:  envInt("RANGE", 4, 2, 200),
		BinDir:     "bin",
		RefPlugins: "/usr/lib/cni",
		NoTrace:    os.Getenv("TRACE") == "0",
	}
	if v := os.Getenv("DEMO_BIN"); v != "" {
		cfg.BinDir = v
	}
	cfg.Baseline = os.Getenv("BASELINE")
	if v := os.Getenv("CNI_PLUGINS"); v != "" {
		cfg.RefPlugins = v
	}
	// The demo's names and paths: one run of either at a time.
	lk, err := netnsnode.Lock(5*time.Minute, os.Stdout)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench-cni:", err)
		os.Exit(1)
	}
	ctx, cancel := context.WithCancel(context.Background())
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	go func() { <-sigs; cancel() }()
	cleanup := &netnsnode.Cleanup{}
	res, err := BenchCNI(ctx, cfg, cleanup, os.Stdout)
	code := 0
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench-cni:", err)
		code = 1
	}
	if n := cleanup.Run(os.Stdout); n > 0 {
		fmt.Fprintf(os.Stderr, "bench-cni: %d cleanup step(s) failed\n", n)
		code = 1
	}
	runtime.KeepAlive(lk)
	if err == nil {
		fmt.Printf("\nper call, p50 / p99: ctscrub ADD %.2f / %.2f ms, DEL %.2f / %.2f ms; bare process start (VERSION) %.2f / %.2f ms; bridge ADD %.2f / %.2f ms, DEL p50 %.2f ms\n",
			res.AddP50*1e3, res.AddP99*1e3, res.DelP50*1e3, res.DelP99*1e3, res.ExecP50*1e3, res.ExecP99*1e3,
			res.BridgeAddP50*1e3, res.BridgeAddP99*1e3, res.BridgeDelP50*1e3)
		fmt.Printf("ctscrub over a bare process start, p50: ADD %.2f ms, DEL %.2f ms (targets: 2 ms each; ADD p99 10 ms on a quiet machine); load %s\n",
			res.AddOverExec*1e3, res.DelOverExec*1e3, res.Load1)
		if res.ChecksLeft != 0 {
			fmt.Fprintf(os.Stderr, "bench-cni: %d entries of deleted pods left at %d checks\n", res.ChecksLeft, res.Checks)
			code = 1
		}
		line, _ := json.Marshal(res)
		fmt.Println(string(line))
	}
	os.Exit(code)
}
