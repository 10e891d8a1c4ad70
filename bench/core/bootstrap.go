package main

import (
	"context"
	"fmt"
	"net/netip"
	"runtime"
	"slices"
	"time"

	"github.com/ctscrub/ctscrub/internal/ciliumwalk"
	"github.com/ctscrub/ctscrub/scrubd/bootstrap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// bootstrapPairs is how many times the bootstrap pass and Cilium's batch
// walk are timed, alternately, on the same maps.
const bootstrapPairs = 5

// timeBootstrap times scrubd's bootstrap pass (scrubd/bootstrap: one walk
// of every CT map filing each key under its pod-CIDR addresses) into a
// fresh index, as at a scrubd start, alternately with Cilium 1.18+'s batch
// walk of the same maps (count only: no entry of the pods goes). The
// index's memory per key after the first pass is taken by its own account
// (index.Bytes) and by the Go heap (runtime.GC before both readings).
//
// On a loaded machine each wall time moves with what the others run, so
// the process's CPU time for each (every thread: the pass runs on three
// goroutines; the scrubd of this process is idle meanwhile) and each
// pair's ratio are kept too.
func timeBootstrap(res *result, nd *node) error {
	var pass, walk, passCPU, walkCPU []time.Duration
	var ratios []float64
	for i := range bootstrapPairs {
		start, cpu := time.Now(), processCPU()
		st, err := ciliumwalk.Batch(ciliumwalk.Of(nd.maps), ciliumwalk.HasIP(), ciliumwalk.Options{CountOnly: true})
		if err != nil {
			return fmt.Errorf("batch walk beside the bootstrap pass: %w", err)
		}
		walk, walkCPU = append(walk, time.Since(start)), append(walkCPU, processCPU()-cpu)

		var before, after runtime.MemStats
		if i == 0 {
			runtime.GC()
			runtime.ReadMemStats(&before)
		}
		ix := index.New(index.Config{PodCIDRs: []netip.Prefix{podCIDR}})
		ix.SetHooks(&index.Hooks{}) // nothing records here: no Sync to wait for
		cpu = processCPU()
		r, err := bootstrap.Run(context.Background(), ix, nd.maps, bootstrap.Options{})
		if err != nil {
			return fmt.Errorf("bootstrap pass: %w", err)
		}
		pass, passCPU = append(pass, r.Duration()), append(passCPU, processCPU()-cpu)
		ratios = append(ratios, r.Duration().Seconds()/walk[i].Seconds())
		// Every entry of this node holds exactly one pod-CIDR address (a
		// pod's flow to a peer outside them): one key filed per entry.
		if r.Visited != int64(st.Visited) || r.Pairs != r.Visited {
			return fmt.Errorf("bootstrap pass read %d entries and filed %d keys, the batch walk read %d", r.Visited, r.Pairs, st.Visited)
		}
		if i == 0 {
			runtime.GC()
			runtime.ReadMemStats(&after)
			res.BootstrapKeys = ix.Keys()
			res.BootstrapBytesKey = float64(ix.Bytes()) / float64(ix.Keys())
			res.BootstrapHeapBytesKey = float64(after.HeapAlloc-before.HeapAlloc) / float64(ix.Keys())
			res.BootstrapAddrs = len(r.Addrs)
		}
		fmt.Printf("  bootstrap pair %d: batch walk %s (CPU %s), bootstrap pass %s (CPU %s): %.2fx (%d entries, %d keys filed, %d addresses)\n",
			i+1, fmtDur(walk[i]), fmtDur(walkCPU[i]), fmtDur(pass[i]), fmtDur(passCPU[i]), ratios[i], r.Visited, r.Pairs, len(r.Addrs))
		runtime.KeepAlive(ix)
	}
	res.BootstrapS, res.BootstrapWalkS, res.BootstrapReps = median(pass).Seconds(), median(walk).Seconds(), len(pass)
	res.BootstrapCPUS, res.BootstrapWalkCPUS = median(passCPU).Seconds(), median(walkCPU).Seconds()
	slices.Sort(ratios)
	res.BootstrapPairRatio = ratios[(len(ratios)-1)/2]
	return nil
}
