// Command demo is `make demo` (scripts/demo.sh runs it after set-up and
// build; docs/demo.md): one node on this machine (internal/netnsnode), with
// pods created as network namespaces through the real CNI chain (Debian's
// bridge + host-local, then ctscrub), scrubd running on private
// Cilium-layout CT maps filled to ENTRIES entries, real traffic turned into
// CT entries by the Cilium datapath stand-in (test support), and pods
// deleted and recreated so their IPs are reused. It prints each scrub beside
// one full walk of the same maps.
//
// Everything it creates is private (names under "ctscrub-demo", the bpffs
// dir netnsnode.BPFDir, the work dir netnsnode.WorkDir) and undone at the
// end, also on SIGINT/SIGTERM; a run first removes what an interrupted run
// left.
package main

import (
	"context"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"syscall"
	"time"

	"github.com/ctscrub/ctscrub/internal/netnsnode"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// Config is what the demo's environment sets.
type Config struct {
	Entries    int    // ENTRIES: CT entries to fill the maps with
	PerIP      int    // PER_IP: stale entries each reused IP's previous owner left
	Short      bool   // DEMO_SHORT=1: CI's quick run
	Hold       bool   // DEMO_HOLD=1: keep the node up until Ctrl-C, to look around
	BinDir     string // DEMO_BIN: where bin/scrubd and bin/ctscrub are
	RefPlugins string // CNI_PLUGINS: Debian's reference plugins
}

// ConfigFromEnv reads Config from the environment with the README's defaults.
func ConfigFromEnv() (Config, error) {
	cfg := Config{Entries: 1 << 20, PerIP: 1000, BinDir: "bin", RefPlugins: "/usr/lib/cni"}
	if v := os.Getenv("DEMO_SHORT"); v != "" && v != "0" {
		cfg.Short = true
		cfg.Entries, cfg.PerIP = 1<<16, 200
	}
	for _, e := range []struct {
		name string
		dst  *int
		min  int
	}{{"ENTRIES", &cfg.Entries, 4096}, {"PER_IP", &cfg.PerIP, 2}} {
		v := os.Getenv(e.name)
		if v == "" {
			continue
		}
		n, err := strconv.Atoi(v)
		if err != nil || n < e.min || n > 1<<25 {
			return cfg, fmt.Errorf("%s=%q: want a whole number from %d to %d", e.name, v, e.min, 1<<25)
		}
		*e.dst = n
	}
	if v := os.Getenv("DEMO_HOLD"); v != "" && v != "0" {
		cfg.Hold = true
	}
	if v := os.Getenv("DEMO_BIN"); v != "" {
		cfg.BinDir = v
	}
	if v := os.Getenv("CNI_PLUGINS"); v != "" {
		cfg.RefPlugins = v
	}
	return cfg, nil
}

// main runs the demo: it undoes everything on return, on
// SIGINT/SIGTERM (a second signal stops waiting for the steps in flight), and
// exits non-zero on failure.
func main() {
	out := os.Stdout
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "demo: run as root (BPF maps, network namespaces): sudo make demo")
		os.Exit(1)
	}
	cfg, err := ConfigFromEnv()
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(2)
	}
	// Held until the process exits; KeepAlive below keeps the GC from
	// closing the file (and so dropping the lock) before that.
	lk, err := netnsnode.Lock(5*time.Minute, out)
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cleanup := &netnsnode.Cleanup{}
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	runDone := make(chan error, 1)
	go func() { runDone <- Run(ctx, cfg, cleanup, out) }()

	code := 0
	select {
	case err := <-runDone:
		if err != nil {
			fmt.Fprintf(out, "\ndemo FAILED: %v\n", err)
			code = 1
		}
	case s := <-sigs:
		fmt.Fprintf(out, "\n%s: stopping, then removing everything the demo created ...\n", s)
		cancel()
		code = 128 + int(s.(syscall.Signal)) // as a shell reports a signal
		// Let the step in flight see the cancelled context and return, so
		// cleanup does not race it; a second signal or 15 s end the wait.
		select {
		case err := <-runDone:
			if err == nil && cfg.Hold {
				code = 0 // it had finished and was holding the node up
			}
		case <-sigs:
		case <-time.After(15 * time.Second):
		}
	}
	fmt.Fprintln(out, "\nCleaning up ...")
	if n := cleanup.Run(out); n > 0 {
		fmt.Fprintf(out, "cleanup: %d step(s) failed (see above); the next `make demo` removes what is left\n", n)
		code = max(code, 1)
	} else if left := netnsnode.Leftovers(); len(left) > 0 {
		fmt.Fprintf(out, "cleanup: still present: %v\n", left)
		code = max(code, 1)
	} else {
		fmt.Fprintf(out, "cleanup: done; no netns, bpffs pin, daemon or file of the demo is left\n")
	}
	runtime.KeepAlive(lk)
	os.Exit(code)
}

// Run is the demo. Every resource it creates is pushed on cleanup, which the
// caller runs.
func Run(ctx context.Context, cfg Config, cleanup *netnsnode.Cleanup, w io.Writer) error {
	p := &printer{w: w}
	if err := netnsnode.RemoveLeftovers(w); err != nil {
		return err
	}
	if err := os.MkdirAll(netnsnode.WorkDir, 0o700); err != nil {
		return err
	}
	cleanup.Push("remove "+netnsnode.WorkDir, func() error { return os.RemoveAll(netnsnode.WorkDir) })
	if err := os.MkdirAll(netnsnode.BPFDir, 0o700); err != nil {
		return fmt.Errorf("create %s: %w (is bpffs mounted at /sys/fs/bpf? run scripts/setup.sh)", netnsnode.BPFDir, err)
	}
	cleanup.Push("remove "+netnsnode.BPFDir, func() error { return os.RemoveAll(netnsnode.BPFDir) })

	nPods := 4
	if cfg.Short {
		nPods = 3
	}
	if stale := cfg.PerIP * 2 * nPods; stale > cfg.Entries/2 {
		return fmt.Errorf("PER_IP=%d: the %d reused addresses would hold %d stale entries, over half of ENTRIES=%d; lower PER_IP or raise ENTRIES",
			cfg.PerIP, 2*nPods, stale, cfg.Entries)
	}
	owners4, owners6 := netnsnode.PodRange(nPods)
	owners := append(append([]netip.Addr{}, owners4...), owners6...)

	p.header(cfg, nPods)

	// 1. The CT maps.
	p.section("1. Cilium's four global CT maps, private copies, filled to ENTRIES")
	ctRoot := filepath.Join(netnsnode.BPFDir, "globals")
	maps, err := netnsnode.CreateCTMaps(ctRoot, cfg.Entries)
	if err != nil {
		return err
	}
	cleanup.Push("unpin CT maps in "+ctRoot, maps.Close)
	for _, k := range ctmap.Kinds {
		p.f("   %-24s LRU hash, max %s entries\n", k.Name(), netnsnode.Num(int(maps.Map(k).MaxEntries())))
	}
	nbg := netnsnode.BackgroundPodCount(cfg.Entries)
	put, took, err := netnsnode.Fill(ctx, maps, netnsnode.FillPlan{
		Entries:    cfg.Entries,
		Background: netnsnode.BackgroundPods(netnsnode.BGPods4, netnsnode.BGPods6, nbg),
		Owners:     owners,
		PerOwner:   cfg.PerIP,
	})
	if err != nil {
		return err
	}
	p.f("   filled %s entries in %s (batch updates): flows of %s other pods of this node (%s, %s),\n",
		netnsnode.Num(put), netnsnode.Dur(took), netnsnode.Num(nbg), netnsnode.BGPods4, netnsnode.BGPods6)
	p.f("   and %s stale entries each for the %d v4 + %d v6 addresses host-local will hand out:\n", netnsnode.Num(cfg.PerIP/2*2), nPods, nPods)
	p.f("   what those addresses' previous owners left behind, as after a node's pods came and went.\n")
	if ctx.Err() != nil {
		return ctx.Err()
	}

	// The stand-in and its (empty) service maps exist before scrubd starts:
	// scrubd's recorder looks the service maps up under --ct-root.
	dp, err := netnsnode.NewDatapath(maps, nil)
	if err != nil {
		return err
	}
	cleanup.Push("unload the Cilium datapath stand-in", dp.Close)

	// 2. scrubd.
	p.section("2. scrubd, the node daemon, on those maps")
	d, err := netnsnode.StartDaemon(ctx, cleanup, netnsnode.NodeDaemonConfig(cfg.BinDir, ctRoot))
	if err != nil {
		return err
	}
	p.f("   pid %d  socket %s\n   log %s\n   metrics http://%s/metrics\n", d.Pid(), d.Socket, d.LogPath, d.Metrics)
	p.f("   at its start scrubd makes one bootstrap pass over the maps and files every entry of the pod\n")
	p.f("   CIDRs already there, so even the first scrub of a pre-filled IP goes by the index; from then\n")
	p.f("   on its recorder indexes every new flow of the pods.\n")

	// 3. The node, the outside host and the CNI chain.
	node, err := netnsnode.AddNode(cleanup, netnsnode.NodeNS)
	if err != nil {
		return err
	}
	if _, err := netnsnode.AddOutside(cleanup); err != nil {
		return err
	}
	ch, err := netnsnode.NewChain(netnsnode.ChainConfig{
		Node:       node,
		WorkDir:    netnsnode.WorkDir,
		RefPlugins: cfg.RefPlugins,
		Plugin:     filepath.Join(cfg.BinDir, "ctscrub"),
		Socket:     d.Socket,
		RangeSize:  nPods,
	})
	if err != nil {
		return err
	}

	s := &session{cfg: cfg, p: p, ch: ch, d: d, maps: maps, dp: dp, node: node, cleanup: cleanup}
	return s.run(ctx, nPods)
}
