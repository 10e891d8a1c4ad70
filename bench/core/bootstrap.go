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

// timeBootstrap times scrubd's bootstrap pass (scrubd/bootstrap: one read
// of every CT map filing each key under its pod-CIDR addresses) into a
// fresh index, as at a scrubd start, alternately with Cilium 1.18+'s batch
// walk of the same maps (count only: no entry of the pods goes), both
// ways the pass can read the maps: in the kernel (bpf/bootstrap.c, what
// scrubd runs) and with the batch walk (its fallback, and the pass before
// the kernel read). The index's memory per key after the first pass of
// each is taken by its own account (index.Bytes) and by the Go heap
// (runtime.GC before both readings).
//
// On a loaded machine each wall time moves with what the others run, so
// the process's CPU time for each (every thread; the scrubd of this
// process is idle meanwhile) and each pair's ratio are kept too.
func timeBootstrap(res *result, nd *node) error {
	var walk, walkCPU []time.Duration
	type way struct {
		name              string
		walk              bootstrap.Walk
		pass, cpu         []time.Duration
		ratios            []float64
		bytesKey, heapKey float64
	}
	ways := []*way{{name: "kernel", walk: bootstrap.WalkKernel}, {name: "batch", walk: bootstrap.WalkBatch}}
	for i := range bootstrapPairs {
		start, cpu := time.Now(), processCPU()
		st, err := ciliumwalk.Batch(ciliumwalk.Of(nd.maps), ciliumwalk.HasIP(), ciliumwalk.Options{CountOnly: true})
		if err != nil {
			return fmt.Errorf("batch walk beside the bootstrap pass: %w", err)
		}
		walk, walkCPU = append(walk, time.Since(start)), append(walkCPU, processCPU()-cpu)
		line := fmt.Sprintf("  bootstrap round %d: batch walk %s (CPU %s)", i+1, fmtDur(walk[i]), fmtDur(walkCPU[i]))
		for _, w := range ways {
			var before, after runtime.MemStats
			if i == 0 {
				runtime.GC()
				runtime.ReadMemStats(&before)
			}
			ix := index.New(index.Config{PodCIDRs: []netip.Prefix{podCIDR}})
			ix.SetHooks(&index.Hooks{}) // nothing records here: no Sync to wait for
			cpu = processCPU()
			r, err := bootstrap.Run(context.Background(), ix, nd.maps, bootstrap.Options{Walk: w.walk})
			if err != nil {
				return fmt.Errorf("bootstrap pass (%s): %w", w.name, err)
			}
			w.pass, w.cpu = append(w.pass, r.Duration()), append(w.cpu, processCPU()-cpu)
			w.ratios = append(w.ratios, r.Duration().Seconds()/walk[i].Seconds())
			// Every entry of this node holds exactly one pod-CIDR address (a
			// pod's flow to a peer outside them): one key filed per entry.
			if r.Visited != int64(st.Visited) || r.Pairs != r.Visited {
				return fmt.Errorf("bootstrap pass (%s) read %d entries and filed %d keys, the batch walk read %d", w.name, r.Visited, r.Pairs, st.Visited)
			}
			for m, how := range r.Read {
				if w.walk == bootstrap.WalkKernel && how != bootstrap.ReadKernel {
					return fmt.Errorf("bootstrap pass (kernel) read %s: %s", m, how)
				}
			}
			if i == 0 {
				runtime.GC()
				runtime.ReadMemStats(&after)
				w.bytesKey = float64(ix.Bytes()) / float64(ix.Keys())
				w.heapKey = float64(after.HeapAlloc-before.HeapAlloc) / float64(ix.Keys())
				if w.walk == bootstrap.WalkKernel {
					res.BootstrapKeys, res.BootstrapAddrs = ix.Keys(), len(r.Addrs)
				}
			}
			line += fmt.Sprintf(", pass (%s) %s (CPU %s): %.2fx", w.name, fmtDur(w.pass[i]), fmtDur(w.cpu[i]), w.ratios[i])
			runtime.KeepAlive(ix)
		}
		fmt.Printf("%s (%d entries)\n", line, st.Visited)
	}
	pairMedian := func(r []float64) float64 {
		r = slices.Clone(r)
		slices.Sort(r)
		return r[(len(r)-1)/2]
	}
	k, b := ways[0], ways[1]
	res.BootstrapS, res.BootstrapWalkS, res.BootstrapReps = median(k.pass).Seconds(), median(walk).Seconds(), len(walk)
	res.BootstrapCPUS, res.BootstrapWalkCPUS = median(k.cpu).Seconds(), median(walkCPU).Seconds()
	res.BootstrapPairRatio = pairMedian(k.ratios)
	res.BootstrapBytesKey, res.BootstrapHeapBytesKey = k.bytesKey, k.heapKey
	res.BootstrapBatchS, res.BootstrapBatchCPUS = median(b.pass).Seconds(), median(b.cpu).Seconds()
	res.BootstrapBatchPairRatio = pairMedian(b.ratios)
	res.BootstrapBatchBytesKey = b.bytesKey
	return nil
}
