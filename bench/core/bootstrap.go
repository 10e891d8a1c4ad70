package main

import (
	"context"
	"fmt"
	"net/netip"
	"runtime"
	"time"

	"github.com/ctscrub/ctscrub/internal/ciliumwalk"
	"github.com/ctscrub/ctscrub/scrubd/bootstrap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// bootstrapPairs is how many times the bootstrap pass and Cilium's batch
// walk are timed, alternately, on the same maps.
const bootstrapPairs = 3

// timeBootstrap times scrubd's bootstrap pass (scrubd/bootstrap: one walk
// of every CT map filing each key under its pod-CIDR addresses) into a
// fresh index, as at a scrubd start, alternately with Cilium 1.18+'s batch
// walk of the same maps (count only: no entry of the pods goes). The
// index's memory per key after the first pass is taken by its own account
// (index.Bytes) and by the Go heap (runtime.GC before both readings).
func timeBootstrap(res *result, nd *node) error {
	var pass, walk []time.Duration
	for i := range bootstrapPairs {
		start := time.Now()
		st, err := ciliumwalk.Batch(ciliumwalk.Of(nd.maps), ciliumwalk.HasIP(), ciliumwalk.Options{CountOnly: true})
		if err != nil {
			return fmt.Errorf("batch walk beside the bootstrap pass: %w", err)
		}
		walk = append(walk, time.Since(start))

		var before, after runtime.MemStats
		if i == 0 {
			runtime.GC()
			runtime.ReadMemStats(&before)
		}
		ix := index.New(index.Config{PodCIDRs: []netip.Prefix{podCIDR}})
		ix.SetHooks(&index.Hooks{}) // nothing records here: no Sync to wait for
		r, err := bootstrap.Run(context.Background(), ix, nd.maps, bootstrap.Options{})
		if err != nil {
			return fmt.Errorf("bootstrap pass: %w", err)
		}
		pass = append(pass, r.Duration())
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
		fmt.Printf("  bootstrap pair %d: batch walk %s, bootstrap pass %s (%d entries, %d keys filed, %d addresses)\n",
			i+1, fmtDur(walk[i]), fmtDur(pass[i]), r.Visited, r.Pairs, len(r.Addrs))
		runtime.KeepAlive(ix)
	}
	res.BootstrapS, res.BootstrapWalkS, res.BootstrapReps = median(pass).Seconds(), median(walk).Seconds(), len(pass)
	return nil
}
