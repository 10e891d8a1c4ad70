package main

import (
	"context"
	"fmt"
	"log"
	"net/netip"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/expiry"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// auditCost measures what the audit adds to a report pass over the same map:
// an index holding every key of auditIPs initiator addresses (each has 256
// entries in the map), all complete, so the pass copies out auditIPs × 256
// keys and user space checks them. Two passes with the audit and two
// without, alternating; the minimum of each (the pass is one syscall, so the
// minimum is the least disturbed by other work on the machine). Wall time of
// Runner.Pass, user-space check included.
func auditCost(ctx context.Context, maps *ctmap.Maps, n int) (extra, extraCPU, with time.Duration, ips, keys int) {
	ix := index.New(index.Config{PodCIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/16")}})
	// 64 IPs × 256 keys = 16,384 keys: the audit's per-pass key budget.
	ips = min(64, n/256)
	for j := range ips {
		ip := netip.AddrFrom4([4]byte{10, 0, byte(j >> 8), byte(j)})
		ix.Track(ip)
		for i := j * 256; i < (j+1)*256 && i < n; i++ {
			ix.Add4(key(i))
		}
	}
	keys = int(ix.Keys())
	plain, err := expiry.New(maps, expiry.Config{Mode: expiry.ModeReport, Clock: expiry.ClockKtime, PassTimeout: 10 * time.Minute}, expiry.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer plain.Close()
	aud, err := expiry.New(maps, expiry.Config{Mode: expiry.ModeReport, Clock: expiry.ClockKtime, PassTimeout: 10 * time.Minute}, expiry.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer aud.Close()
	if err := aud.EnableAudit(expiry.AuditConfig{Index: ix}, prometheus.NewRegistry()); err != nil {
		log.Fatal(err)
	}
	// Wall time, and the process's CPU time (the check runs on other
	// threads than the pass's syscall).
	pass := func(r *expiry.Runner) (time.Duration, time.Duration) {
		c, t := processCPU(), time.Now()
		if _, err := r.Pass(ctx); err != nil {
			log.Fatal(err)
		}
		return time.Since(t), processCPU() - c
	}
	var without, withCPU, withoutCPU time.Duration
	for i := range 2 {
		a, ac := pass(aud)
		b, bc := pass(plain)
		if i == 0 || a < with {
			with = a
		}
		if i == 0 || ac < withCPU {
			withCPU = ac
		}
		if i == 0 || b < without {
			without = b
		}
		if i == 0 || bc < withoutCPU {
			withoutCPU = bc
		}
	}
	for j := range ips {
		if st := ix.State(netip.AddrFrom4([4]byte{10, 0, byte(j >> 8), byte(j)})); !st.Complete {
			log.Fatalf("audit: %s marked incomplete (%s): the bench's index holds every key", st.IP, st.Incomplete)
		}
	}
	fmt.Printf("audit: report pass %.3fs (CPU %.3fs) with the audit of %d IPs (%d keys), %.3fs (CPU %.3fs) without: +%.3fs (CPU +%.3fs)\n",
		with.Seconds(), withCPU.Seconds(), ips, keys, without.Seconds(), withoutCPU.Seconds(), (with - without).Seconds(), (withCPU - withoutCPU).Seconds())
	return with - without, withCPU - withoutCPU, with, ips, keys
}

func processCPU() time.Duration {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
