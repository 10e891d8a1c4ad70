// Command core is `make bench`: one IP's CT scrub through the index against
// Cilium 1.16's NextKey walk, Cilium 1.18+'s batch-lookup walk and the
// in-kernel sweep, all on the same Cilium-layout maps in one run, plus the
// recorder's cost per packet and the index's memory per key.
//
// It creates its own maps in a private bpffs directory and never touches
// Cilium's. Sizes come from the environment:
//
//	ENTRIES     entries in the CT maps (default 1048576)
//	PER_IP      entries of the scrubbed IP (default 1000)
//	PODS        pod IPs owning the other entries (default 1024)
//	INDEX_REPS  index scrubs, each through scrubd's socket and each through
//	            the backend alone (default 200 of each, at least 20)
//	REF_1M      0 to skip the 1M-entry reference series run when ENTRIES > 1M
//	NEXTKEY_MAX_VISITS  stop the NextKey walk after that many entries and
//	            extrapolate its time to the whole table (default 0: whole
//	            walk; at 16 M on a loaded machine it takes many minutes)
//
// What an index scrub is timed on: a real scrubd (scrubd/daemon, in this
// process) over the maps. Every pod IP and every target is made complete by
// a sweep scrub through its socket before the fill (as scrubd does for a pod
// it has not seen whole); the fill puts every key through recorder.Apply,
// the path of each ring buffer record. Each timed scrub takes a target IP
// not scrubbed before, whose keys were indexed during the fill and not
// touched since. socket_* times the whole request through the socket as the
// plugin sends it; index_* the backend's Scrub alone (take, deletes), beside
// it. Each walk run also scrubs a fresh target.
//
// The last line of output is one JSON object with every figure.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/signal"
	"runtime"
	"slices"
	"syscall"
	"time"

	"github.com/cilium/ebpf/rlimit"

	"github.com/ctscrub/ctscrub/internal/ciliumwalk"
	"github.com/ctscrub/ctscrub/internal/machcost"
	"github.com/ctscrub/ctscrub/scrubd/cilium"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

func main() {
	if socket := os.Getenv(clientEnv); socket != "" {
		os.Exit(clientChild(socket))
	}
	cfg, err := parseConfig()
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(2)
	}
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "bench: needs root (creates BPF maps and runs BPF programs); run it with sudo")
		os.Exit(2)
	}
	if err := rlimit.RemoveMemlock(); err != nil {
		fmt.Fprintln(os.Stderr, "bench: lift RLIMIT_MEMLOCK:", err)
		os.Exit(1)
	}
	res, err := run(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
	printTable(res)
	line, err := json.Marshal(res)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
	fmt.Println(string(line))
}

func run(cfg config) (result, error) {
	removeOnInterrupt()
	res := result{
		Date:    time.Now().UTC().Format(time.RFC3339),
		Machine: machine(),
		Entries: cfg.entries, PerIP: cfg.perIP, Pods: cfg.pods,
		Targets: map[string]bool{},
	}
	fmt.Printf("ctscrub core bench: %d entries, %d of them the target IP's, %d pod IPs; %s\n",
		cfg.entries, cfg.perIP, cfg.pods, res.Machine)
	var err error
	if res.MachineCosts, err = machcost.Measure(); err != nil {
		return res, fmt.Errorf("machine costs: %w", err)
	}
	fmt.Println("this machine now:", res.MachineCosts)

	// The recorder's cost per packet (H1's measurement, BPF_PROG_TEST_RUN).
	newNs, estNs, err := recorder.MeasurePacketCost(20000)
	if err != nil {
		return res, fmt.Errorf("recorder cost: %w", err)
	}
	res.IndexerNsPacket, res.IndexerNsNew = estNs, newNs

	if cfg.ref1M {
		fmt.Printf("reference: index scrubs at %d entries (same PER_IP) for the size ratio ...\n", refEntries)
		med, sock, err := indexOnly(cfg, refEntries)
		if err != nil {
			return res, fmt.Errorf("1M reference: %w", err)
		}
		res.IndexMedian1MS, res.SocketMedian1MS = med.Seconds(), sock.Seconds()
		runtime.GC()
	}

	nd, c, err := setup(cfg, cfg.entries)
	if err != nil {
		return res, err
	}
	defer nd.close()
	defer c.Close()
	res.FillS = nd.fillTime.Seconds()
	res.ApplyNsRecord = float64(nd.applyTime.Nanoseconds()) / float64(nd.records)
	res.IndexBytesKey = nd.heapPerKey
	res.IndexKeys = nd.indexKeys
	res.CountCheap = c.CountIsCheap()
	fmt.Printf("filled in %.1f s (BatchUpdate + recorder.Apply of %d records into scrubd's index, %.0f ns each); index: %d keys, %.1f bytes/key\n",
		nd.fillTime.Seconds(), nd.records, res.ApplyNsRecord, nd.indexKeys, nd.heapPerKey)

	t := time.Now()
	const countReps = 100
	for range countReps {
		if _, err := c.Count(ctmap.TCP4); err != nil {
			return res, err
		}
	}
	res.CountUs = float64(time.Since(t).Microseconds()) / countReps

	if err := timeIndex(&res, nd, c, cfg.indexReps); err != nil {
		return res, err
	}
	if err := timeFloor(&res, nd); err != nil {
		return res, err
	}
	if err := timeWalks(&res, nd, c, cfg); err != nil {
		return res, err
	}
	if err := timeBootstrap(&res, nd); err != nil {
		return res, err
	}
	res.compare(cfg)
	return res, nil
}

// removeOnInterrupt removes the live node's private maps on SIGINT or
// SIGTERM and exits.
func removeOnInterrupt() {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	go func() {
		<-sig
		select {
		case nd := <-live:
			os.RemoveAll(nd.dir)
		default:
		}
		fmt.Fprintln(os.Stderr, "bench: interrupted; private maps removed")
		os.Exit(130)
	}()
}

// timeIndex times the index scrubs, through scrubd's socket and through the
// backend alone, and each step of the socket's.
func timeIndex(res *result, nd *node, c *cilium.Backend, reps int) error {
	// (4) The index scrub.
	nd.scrubd.steps = nil
	idx, sock, idxCPU, idxWait, err := indexSeries(nd, c, reps)
	if err != nil {
		return err
	}
	res.SocketSteps = map[string]float64{}
	var names []string
	for name, d := range nd.scrubd.steps {
		res.SocketSteps[name] = quantile(d, 0.5).Seconds()
		names = append(names, name)
	}
	slices.Sort(names)
	fmt.Printf("  socket scrubs per step, median (dial and client: the client's side; the rest scrubd's, Server-Timing):")
	for _, name := range names {
		fmt.Printf(" %s %s", name, fmtDur(quantile(nd.scrubd.steps[name], 0.5)))
	}
	fmt.Println()
	res.SocketMedianS = quantile(sock, 0.5).Seconds()
	res.SocketP99S = quantile(sock, 0.99).Seconds()
	res.SocketMaxS = slices.Max(sock).Seconds()
	res.IndexReps = len(idx)
	res.IndexMedianS = quantile(idx, 0.5).Seconds()
	res.IndexP99S = quantile(idx, 0.99).Seconds()
	res.IndexMaxS = slices.Max(idx).Seconds()
	res.IndexCPUMedianS = quantile(idxCPU, 0.5).Seconds()
	res.IndexCPUP99S = quantile(idxCPU, 0.99).Seconds()
	res.IndexWaitP99S = quantile(idxWait, 0.99).Seconds()
	return nil
}

// timeFloor times the kernel's own cost of deleting a target's keys.
func timeFloor(res *result, nd *node) error {
	// (5) The kernel's floor: deleting the target's present keys and
	// nothing else, the maps in turn and at once.
	seq, par, err := deleteFloor(nd)
	if err != nil {
		return err
	}
	res.DeleteFloorNsKey = float64(seq.Nanoseconds()) / float64(nd.k)
	res.DeleteFloorParNsKey = float64(par.Nanoseconds()) / float64(nd.k)
	fmt.Printf("  kernel floor: BPF_MAP_DELETE_BATCH of a fresh target's %d present keys, median of %d: %s (%.0f ns per key); both maps at once from two threads: %s (%.0f ns per key)\n",
		nd.k, floorReps, fmtDur(seq), res.DeleteFloorNsKey, fmtDur(par), res.DeleteFloorParNsKey)
	return nil
}

// timeWalks times the full-table methods, each scrubbing fresh targets: the
// sweep, Cilium 1.18+'s batch walk and Cilium 1.16's NextKey walk.
func timeWalks(res *result, nd *node, c *cilium.Backend, cfg config) error {
	// (3) The sweep, through the backend (the IP marked incomplete).
	sweep, err := series("sweep", sweepReps, 30*time.Second, nd, func(target netip.Addr) error {
		nd.ix.MarkIncomplete(target, index.ReasonLost)
		r, err := c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{target}, Reason: scrub.ReasonDel})
		if err == nil && (r.Method != scrub.MethodSweep || r.Total != nd.k) {
			err = fmt.Errorf("sweep scrub: %+v, want method sweep and %d deleted", r, nd.k)
		}
		return err
	})
	if err != nil {
		return err
	}
	res.SweepS, res.SweepReps = median(sweep).Seconds(), len(sweep)

	// (2) Cilium 1.18+'s batch-lookup walk.
	batch, err := series("batch walk", batchReps, 30*time.Second, nd, func(target netip.Addr) error {
		st, err := ciliumwalk.Batch(ciliumwalk.Of(nd.maps), ciliumwalk.HasIP(target), ciliumwalk.Options{})
		if err == nil && st.Deleted != nd.k {
			err = fmt.Errorf("batch walk deleted %d, want %d", st.Deleted, nd.k)
		}
		return err
	})
	if err != nil {
		return err
	}
	res.BatchWalkS, res.BatchReps = median(batch).Seconds(), len(batch)

	// (1) Cilium 1.16's NextKey + Lookup walk. With NEXTKEY_MAX_VISITS the
	// walk stops early; its time is extrapolated to the whole table and the
	// target's entries it did not reach are deleted by key afterwards.
	nextKey, err := series("NextKey walk", nextKeyReps, 30*time.Second, nd, func(target netip.Addr) error {
		start := time.Now()
		st, err := ciliumwalk.NextKey(ciliumwalk.Of(nd.maps), ciliumwalk.HasIP(target), ciliumwalk.Options{MaxVisits: cfg.nextKeyMax})
		if err == nil && st.Partial {
			res.NextKeyExtrap = true
			extra := time.Duration(float64(time.Since(start)) * (float64(nd.n-nd.deleted)/float64(st.Visited) - 1))
			fmt.Printf("  NextKey walk stopped after %d of %d entries; its time is extrapolated (+%s)\n", st.Visited, nd.n-nd.deleted, fmtDur(extra))
			nd.extra = extra
			return nd.deleteTarget(target)
		}
		if err == nil && st.Deleted != nd.k {
			err = fmt.Errorf("NextKey walk deleted %d, want %d", st.Deleted, nd.k)
		}
		return err
	})
	if err != nil {
		return err
	}
	res.NextKeyWalkS, res.NextKeyReps = median(nextKey).Seconds(), len(nextKey)
	return nil
}
