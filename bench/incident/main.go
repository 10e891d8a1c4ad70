// Command incident is `make bench-incident`: the incident on this machine.
// 50 pods' IPs, each owning PER_IP CT entries in Cilium-layout maps of
// ENTRIES entries, are scrubbed by 50 requests sent at once through the
// socket of a real scrubd (running in this process, on its own unix
// socket, with its own maps in a private bpffs directory). In the same run the
// same 50 scrubs are done the way Cilium 1.16 does them: one full
// NextKey+Lookup walk per IP, one after another under one lock. Then half of
// the IPs are made incomplete, so that their scrubs need the sweep and must
// share one pass.
//
// Sizes come from the environment:
//
//	ENTRIES        entries in the CT maps (default 4194304; 16777216 works)
//	PER_IP         entries of each pod IP (default 1000)
//	PODS           pod IPs scrubbed at once (default 50)
//	SERIAL_WALKS   NextKey walks measured (default 1; the total is the
//	               measured mean x PODS unless SERIAL_WALKS >= PODS)
//
// Sizes over 2 M entries take /tmp/ctscrub-bigbench.lock for the whole run
// (2+ GB of kernel memory). The last line of output is one JSON object.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/rlimit"
	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/internal/ciliumwalk"
	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/cilium"
	"github.com/ctscrub/ctscrub/scrubd/client"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/daemon"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

func envInt(name string, def int) (int, error) {
	s := os.Getenv(name)
	if s == "" {
		return def, nil
	}
	v, err := strconv.Atoi(strings.ReplaceAll(s, "_", ""))
	if err != nil || v <= 0 {
		return 0, fmt.Errorf("%s=%q: want a positive integer", name, s)
	}
	return v, nil
}

type config struct {
	entries, perIP, pods, walks int
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "bench-incident:", err)
		os.Exit(1)
	}
}

func run() error {
	var cfg config
	var err error
	if cfg.entries, err = envInt("ENTRIES", 1<<22); err != nil {
		return err
	}
	if cfg.perIP, err = envInt("PER_IP", 1000); err != nil {
		return err
	}
	if cfg.pods, err = envInt("PODS", 50); err != nil {
		return err
	}
	if cfg.walks, err = envInt("SERIAL_WALKS", 1); err != nil {
		return err
	}
	if cfg.pods > 250 {
		return fmt.Errorf("PODS=%d: at most 250 (one /24 of pod IPs)", cfg.pods)
	}
	if cfg.pods*cfg.perIP*2 > cfg.entries {
		return fmt.Errorf("ENTRIES=%d is too small for PODS=%d x PER_IP=%d", cfg.entries, cfg.pods, cfg.perIP)
	}
	if os.Geteuid() != 0 {
		return errors.New("needs root (BPF maps and programs)")
	}
	if err := rlimit.RemoveMemlock(); err != nil {
		return err
	}
	if cfg.entries > 1<<21 {
		unlock, err := bigLock()
		if err != nil {
			return err
		}
		defer unlock()
	}
	dir, err := os.MkdirTemp("/sys/fs/bpf", "ctscrub-bench-incident-")
	if err != nil {
		return fmt.Errorf("private bpffs dir (is bpffs mounted at /sys/fs/bpf?): %w", err)
	}
	defer os.RemoveAll(dir)
	return bench(cfg, dir)
}

// bigLock serialises big runs across the machine's users.
func bigLock() (func(), error) {
	f, err := os.OpenFile("/tmp/ctscrub-bigbench.lock", os.O_CREATE|os.O_RDWR, 0o666)
	if err != nil {
		return nil, err
	}
	if unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB) != nil {
		fmt.Println("waiting for /tmp/ctscrub-bigbench.lock (another big benchmark runs)...")
		if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
			f.Close()
			return nil, err
		}
	}
	return func() { f.Close() }, nil
}

// The table: pod IPs 10.244.0.x, everything else outside the pod CIDR.
var podCIDR = netip.MustParsePrefix("10.244.0.0/16")

func podIP(i int) netip.Addr { return netip.AddrFrom4([4]byte{10, 244, 0, byte(i + 1)}) }

// podKeys are pod i's OUT flows (TCP map) and their related ICMP keys (any
// map): 2 x perIP/2 = perIP entries.
func podKeys(i, perIP int) []ctmap.CTKey4 {
	ip := podIP(i)
	out := make([]ctmap.CTKey4, 0, perIP)
	for j := 0; len(out) < perIP; j++ {
		remote := netip.AddrFrom4([4]byte{203, byte(i), byte(j >> 8), byte(j)})
		k := ctmap.NewKey4(ip, remote, 443, uint16(1024+j), ctmap.ProtoTCP, ctmap.FlagOut)
		out = append(out, k)
		if len(out) < perIP {
			out = append(out, k.Related())
		}
	}
	return out
}

// fill writes n background TCP entries (addresses outside the pod CIDR) in
// batches, generated chunk by chunk to keep the process small.
func fill(m *ebpf.Map, n int) error {
	const chunk = 1 << 16
	keys := make([]ctmap.CTKey4, chunk)
	vals := make([]ctmap.Entry, chunk)
	for i := range vals {
		vals[i].SetLifetime(1 << 30)
	}
	remote := netip.MustParseAddr("198.18.0.1")
	for done := 0; done < n; {
		c := min(chunk, n-done)
		for j := range c {
			x := done + j
			d := netip.AddrFrom4([4]byte{100, byte(64 + x>>24&0x3f), byte(x >> 16), byte(x >> 8)})
			keys[j] = ctmap.NewKey4(d, remote, 443, uint16(x), ctmap.ProtoTCP, ctmap.FlagOut)
		}
		if _, err := m.BatchUpdate(keys[:c], vals[:c], nil); err != nil {
			return fmt.Errorf("fill %s: %w", ctmap.TCP4.Name(), err)
		}
		done += c
	}
	return nil
}

func put(maps [ctmap.NumKinds]*ebpf.Map, keys []ctmap.CTKey4) error {
	var v ctmap.Entry
	v.SetLifetime(1 << 30)
	for _, k := range keys {
		if err := maps[k.Kind()].Put(k, v); err != nil {
			return fmt.Errorf("put %s: %w", k, err)
		}
	}
	return nil
}

func left(maps [ctmap.NumKinds]*ebpf.Map, keys []ctmap.CTKey4) int {
	n := 0
	var v ctmap.Entry
	for _, k := range keys {
		if maps[k.Kind()].Lookup(k, &v) == nil {
			n++
		}
	}
	return n
}

// index feeds pod i's flows into the index through recorder.Apply (the one
// path from the recorder's ring buffer), after declaring the IP tracked.
func indexPod(ix *index.Index, i int, keys []ctmap.CTKey4) {
	ix.Track(podIP(i))
	for _, k := range keys {
		if k.Flags()&ctmap.FlagRelated != 0 {
			continue // Apply adds the related key of each flow itself
		}
		r := recorder.Record{Family: 4, Kind: recorder.RecFlow}
		copy(r.Key[:], k[:])
		recorder.Apply(ix, &r)
	}
}

type round struct {
	total   time.Duration   // first request sent .. last answer
	lat     []time.Duration // per request, sorted
	methods map[scrub.Method]int
	deleted int
	left    int
}

func (r round) p(q float64) time.Duration {
	// Nearest rank: with 50 samples p99 is the largest.
	i := int(float64(len(r.lat))*q+0.999999) - 1
	return r.lat[max(0, min(i, len(r.lat)-1))]
}

// burst sends one scrub per pod, all at once, and waits for every answer.
func burst(c *client.Client, pods int, maps [ctmap.NumKinds]*ebpf.Map, keys [][]ctmap.CTKey4) (round, error) {
	r := round{lat: make([]time.Duration, pods), methods: map[scrub.Method]int{}}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var firstErr error
	gate := make(chan struct{})
	start := time.Now()
	for i := range pods {
		wg.Go(func() {
			<-gate
			t0 := time.Now()
			resp, err := c.Scrub(context.Background(), api.ScrubRequest{IPs: []netip.Addr{podIP(i)}, Reason: scrub.ReasonDel})
			d := time.Since(t0)
			mu.Lock()
			defer mu.Unlock()
			r.lat[i] = d
			if err != nil {
				if firstErr == nil {
					firstErr = fmt.Errorf("scrub %s: %w", podIP(i), err)
				}
				return
			}
			for _, res := range resp.Results {
				r.methods[res.Method]++
				r.deleted += res.Total
			}
		})
	}
	start = time.Now()
	close(gate)
	wg.Wait()
	r.total = time.Since(start)
	slices.Sort(r.lat)
	for _, k := range keys {
		r.left += left(maps, k)
	}
	return r, firstErr
}

func bench(cfg config, dir string) error {
	fmt.Printf("bench-incident: ENTRIES=%d PODS=%d PER_IP=%d (maps in %s)\n", cfg.entries, cfg.pods, cfg.perIP, dir)
	// Cilium's TCP map holds the bulk; the any map the pods' related
	// entries. max_entries leaves an eighth free so that the LRU evicts
	// nothing while the table is filled.
	var maps [ctmap.NumKinds]*ebpf.Map
	sizes := map[ctmap.Kind]uint32{ctmap.TCP4: uint32(cfg.entries + cfg.entries/8), ctmap.Any4: uint32(max(1<<16, 2*cfg.pods*cfg.perIP))}
	for _, k := range []ctmap.Kind{ctmap.TCP4, ctmap.Any4} {
		m, err := ebpf.NewMap(k.Spec(sizes[k]))
		if err != nil {
			return fmt.Errorf("create %s with %d entries: %w", k.Name(), sizes[k], err)
		}
		defer m.Close()
		if err := m.Pin(filepath.Join(dir, k.Name())); err != nil {
			return err
		}
		maps[k] = m
	}
	keys := make([][]ctmap.CTKey4, cfg.pods)
	podEntries := 0
	for i := range keys {
		keys[i] = podKeys(i, cfg.perIP)
		podEntries += len(keys[i])
	}
	t0 := time.Now()
	if err := fill(maps[ctmap.TCP4], cfg.entries-podEntries); err != nil {
		return err
	}
	refill := func() error {
		for _, k := range keys {
			if err := put(maps, k); err != nil {
				return err
			}
		}
		return nil
	}
	if err := refill(); err != nil {
		return err
	}
	fmt.Printf("filled %d entries in %s\n", cfg.entries, time.Since(t0).Round(time.Millisecond))

	// A real scrubd on its own socket over these maps.
	dcfg := daemon.DefaultConfig()
	dcfg.Socket = filepath.Join(os.TempDir(), fmt.Sprintf("ctscrub-bench-incident-%d", os.Getpid()), "scrubd.sock")
	defer os.RemoveAll(filepath.Dir(dcfg.Socket))
	dcfg.StateFile = filepath.Join(filepath.Dir(dcfg.Socket), "attachments.json")
	dcfg.CTRoot = dir
	dcfg.PinDir = filepath.Join(dir, "ctscrub")
	dcfg.PodCIDRs = []string{podCIDR.String()}
	dcfg.MetricsAddr = "off"
	dcfg.Backends = "cilium"
	dcfg.Expiry.Mode = "off"        // no expiry pass competing with the scrubs
	dcfg.StatsInterval.Duration = 0 // no occupancy counting either
	d, err := daemon.Open(dcfg, slog.New(slog.NewJSONHandler(io.Discard, nil)), "bench")
	if err != nil {
		return err
	}
	defer d.Close()
	ctx, stop := context.WithCancel(context.Background())
	runDone := make(chan error, 1)
	go func() { runDone <- d.Run(ctx) }()
	defer func() { stop(); <-runDone }()
	c := client.New(dcfg.Socket)
	for {
		if st, err := c.Status(context.Background()); err == nil && st.Ready {
			break
		}
		select {
		case err := <-runDone:
			return fmt.Errorf("scrubd: %w", err)
		case <-time.After(10 * time.Millisecond):
		}
	}
	ix := d.Index()

	// 1. Every pod IP complete: 50 index scrubs at once.
	for i := range keys {
		indexPod(ix, i, keys[i])
	}
	full, err := burst(c, cfg.pods, maps, keys)
	if err != nil {
		return err
	}

	// 2. One sweep on its own (a single incomplete IP), the yardstick of 3.
	if err := refill(); err != nil {
		return err
	}
	ix.MarkIncomplete(podIP(0), index.ReasonLost)
	t1 := time.Now()
	resp, err := c.Scrub(context.Background(), api.ScrubRequest{IPs: []netip.Addr{podIP(0)}, Reason: scrub.ReasonDel})
	oneSweep := time.Since(t1)
	if err != nil {
		return fmt.Errorf("single sweep: %w", err)
	}
	if resp.Results[0].Method != scrub.MethodSweep {
		return fmt.Errorf("single incomplete IP scrubbed by %s, want sweep", resp.Results[0].Method)
	}

	// 3. Half of the IPs incomplete: their sweeps must share passes.
	if err := refill(); err != nil {
		return err
	}
	for i := range keys {
		indexPod(ix, i, keys[i])
		if i%2 == 1 {
			ix.MarkIncomplete(podIP(i), index.ReasonLost)
		}
	}
	var sweeper *cilium.Sweeper
	for _, b := range d.Backends() {
		if s, ok := b.(interface{ Sweeper() *cilium.Sweeper }); ok {
			sweeper = s.Sweeper()
		}
	}
	passesBefore := sweeper.Passes()
	half, err := burst(c, cfg.pods, maps, keys)
	if err != nil {
		return err
	}
	halfPasses := sweeper.Passes() - passesBefore

	// 4. Cancellation: a sweep whose caller's deadline passes long before
	// the pass could end. The daemon stops the work 50 ms before the
	// deadline (its answer margin) and must answer by the deadline.
	if err := refill(); err != nil {
		return err
	}
	ix.MarkIncomplete(podIP(1), index.ReasonLost)
	budget := min(oneSweep/2, 500*time.Millisecond)
	margin := min(budget/4, 50*time.Millisecond) // the daemon's answer margin (scrubd/daemon withDeadline)
	cctx, ccancel := context.WithTimeout(context.Background(), budget)
	dl, _ := cctx.Deadline()
	_, cerr := c.Scrub(cctx, api.ScrubRequest{IPs: []netip.Addr{podIP(1)}, Reason: scrub.ReasonDel})
	answered := time.Now()
	ccancel()
	cancelStop := answered.Sub(dl.Add(-margin)) // from the daemon's stop time to the answer
	cancelOutcome := "cancelled answer with partial results"
	if e, ok := client.APIError(cerr); !ok || e.Code != api.CodeCancelled {
		cancelOutcome = fmt.Sprintf("no cancelled answer in time: %v", cerr)
	}
	// The retry finishes the job.
	if _, err := c.Scrub(context.Background(), api.ScrubRequest{IPs: []netip.Addr{podIP(1)}, Reason: scrub.ReasonDel}); err != nil {
		return fmt.Errorf("retry after the cancelled sweep: %w", err)
	}
	cancelLeft := left(maps, keys[1])

	// 5. Cilium 1.16: one full NextKey+Lookup walk per IP, serialised.
	if err := refill(); err != nil {
		return err
	}
	walks := min(cfg.walks, cfg.pods)
	var walkTotal time.Duration
	visited := 0
	for i := range walks {
		t := time.Now()
		st, err := ciliumwalk.NextKey(maps, ciliumwalk.HasIP(podIP(i)), ciliumwalk.Options{})
		v, del := st.Visited, st.Deleted
		walkTotal += time.Since(t)
		if err != nil {
			return err
		}
		if del != len(keys[i]) {
			return fmt.Errorf("walk of %s deleted %d entries, want %d", podIP(i), del, len(keys[i]))
		}
		visited = v
	}
	oneWalk := walkTotal / time.Duration(walks)
	serialTotal := walkTotal
	how := fmt.Sprintf("measured: %d walks in a row", walks)
	if walks < cfg.pods {
		serialTotal = oneWalk * time.Duration(cfg.pods)
		how = fmt.Sprintf("measured mean of %d walk(s) x %d pods", walks, cfg.pods)
	}

	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "\n%d pod scrubs, %d entries in the maps, %d per pod\tall done in\tp50\tp99\tmethods\tdeleted\tleft\n", cfg.pods, cfg.entries, cfg.perIP)
	for _, row := range []struct {
		name string
		r    round
	}{{"ctscrub, all IPs indexed (concurrent)", full}, {"ctscrub, half the IPs incomplete (shared sweep)", half}} {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%v\t%d\t%d\n", row.name, row.r.total.Round(time.Microsecond), row.r.p(0.5).Round(time.Microsecond),
			row.r.p(0.99).Round(time.Microsecond), row.r.methods, row.r.deleted, row.r.left)
	}
	fmt.Fprintf(tw, "  (the incomplete IPs shared %d sweep passes)\t\t\t\t\t\t\n", halfPasses)
	fmt.Fprintf(tw, "one sweep alone (1 incomplete IP)\t%s\t\t\t\t\t\n", oneSweep.Round(time.Microsecond))
	fmt.Fprintf(tw, "Cilium 1.16, one NextKey+Lookup walk (%d entries)\t%s\t\t\t\t\t\n", visited, oneWalk.Round(time.Millisecond))
	fmt.Fprintf(tw, "Cilium 1.16, %d walks under one lock (%s)\t%s\t\t\t\t\t\n", cfg.pods, how, serialTotal.Round(time.Millisecond))
	tw.Flush()
	fmt.Printf("\nsweep cancelled by a %s deadline: answered %s after the daemon stopped it (%s before the deadline): %s; the retry left %d entries\n",
		budget.Round(time.Millisecond), cancelStop.Round(time.Millisecond), margin, cancelOutcome, cancelLeft)
	fmt.Printf("speed-up, all indexed: %.0fx; half incomplete: %.1fx one sweep (target <= 2)\n",
		serialTotal.Seconds()/full.total.Seconds(), half.total.Seconds()/oneSweep.Seconds())

	out := map[string]any{
		"entries":                     cfg.entries,
		"pods":                        cfg.pods,
		"per_ip":                      cfg.perIP,
		"ctscrub_total_s":             full.total.Seconds(),
		"ctscrub_p50_s":               full.p(0.5).Seconds(),
		"ctscrub_p99_s":               full.p(0.99).Seconds(),
		"ctscrub_left":                full.left,
		"half_incomplete_total_s":     half.total.Seconds(),
		"half_incomplete_p99_s":       half.p(0.99).Seconds(),
		"half_incomplete_left":        half.left,
		"half_incomplete_passes":      halfPasses,
		"one_sweep_s":                 oneSweep.Seconds(),
		"half_incomplete_over_sweep":  half.total.Seconds() / oneSweep.Seconds(),
		"cancel_budget_s":             budget.Seconds(),
		"cancel_stop_to_answer_s":     cancelStop.Seconds(),
		"cancel_outcome":              cancelOutcome,
		"cancel_retry_left":           cancelLeft,
		"serial_walk_one_s":           oneWalk.Seconds(),
		"serial_walk_total_s":         serialTotal.Seconds(),
		"serial_walk_how":             how,
		"speedup_serial_over_ctscrub": serialTotal.Seconds() / full.total.Seconds(),
	}
	b, _ := json.Marshal(out)
	fmt.Println(string(b))
	if full.left != 0 || half.left != 0 || cancelLeft != 0 {
		return fmt.Errorf("scrubs left entries behind: %d (indexed), %d (half incomplete), %d (retry after cancel)", full.left, half.left, cancelLeft)
	}
	return nil
}
