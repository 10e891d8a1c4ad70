// Command nfct benchmarks cleaning one pod IP out of the kernel's nf_conntrack:
// conntrack-tools' `conntrack -D` (what Calico runs), vishvananda/netlink's
// ConntrackDeleteFilters (what kube-proxy and OVN-Kubernetes run), the
// kernel's filtered flush, and ctscrub's index scrub, all on one table of
// ENTRIES real kernel entries (created through netlink in a private network
// namespace) in which the target IP owns PER_IP of them. It also ramps the
// rate of new flows to find the highest the index ingests without losing an
// event. The last line of output is JSON.
//
// Root only. nf_conntrack_max (and the hash size, when smaller than ENTRIES)
// are raised for the run and restored after, also on error or interrupt. Every
// run takes /tmp/ctscrub-bigbench.lock: the machine and its sysctls are shared.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/scrubd/nfct"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

const (
	sysMax     = "/proc/sys/net/netfilter/nf_conntrack_max"
	sysBuckets = "/proc/sys/net/netfilter/nf_conntrack_buckets"
	lockPath   = "/tmp/ctscrub-bigbench.lock"

	rampTop  = 300_000 // flows/s, the event ramp's last step
	rampStep = 2 * time.Second
)

var (
	podCIDR = netip.MustParsePrefix("10.200.0.0/16")
	target  = netip.MustParseAddr("10.200.0.1")
	vip     = netip.MustParseAddr("10.96.0.10")
)

func envInt(name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(strings.ReplaceAll(v, "_", ""))
	if err != nil || n <= 0 {
		fail("%s=%q: want a positive integer", name, v)
	}
	return n
}

// restore undoes the run's changes to the host; it runs on every exit path.
var (
	restoreMu sync.Mutex
	restores  []func()
)

func onExit(f func()) {
	restoreMu.Lock()
	restores = append(restores, f)
	restoreMu.Unlock()
}

func cleanup() {
	restoreMu.Lock()
	defer restoreMu.Unlock()
	for i := len(restores) - 1; i >= 0; i-- {
		restores[i]()
	}
	restores = nil
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "bench-nfct: "+format+"\n", args...)
	cleanup()
	os.Exit(1)
}

func readSys(p string) string {
	b, err := os.ReadFile(p)
	if err != nil {
		fail("read %s: %v", p, err)
	}
	return strings.TrimSpace(string(b))
}

func writeSys(p, v string) error { return os.WriteFile(p, []byte(v), 0o644) }

// raiseLimits lets one namespace hold entries entries, and restores the
// previous values on exit.
func raiseLimits(entries int) {
	oldMax, oldBuckets := readSys(sysMax), readSys(sysBuckets)
	want := entries + entries/4 + 100_000
	if cur, _ := strconv.Atoi(oldMax); cur < want {
		onExit(func() {
			if err := writeSys(sysMax, oldMax); err != nil {
				fmt.Fprintf(os.Stderr, "bench-nfct: RESTORE FAILED: write %s=%s: %v\n", sysMax, oldMax, err)
			}
		})
		if err := writeSys(sysMax, strconv.Itoa(want)); err != nil {
			fail("raise %s to %d: %v", sysMax, want, err)
		}
	}
	b := 1
	for b < entries {
		b <<= 1
	}
	if cur, _ := strconv.Atoi(oldBuckets); cur < b {
		onExit(func() {
			if err := writeSys(sysBuckets, oldBuckets); err != nil {
				fmt.Fprintf(os.Stderr, "bench-nfct: RESTORE FAILED: write %s=%s: %v\n", sysBuckets, oldBuckets, err)
			}
		})
		if err := writeSys(sysBuckets, strconv.Itoa(b)); err != nil {
			fail("raise %s to %d: %v", sysBuckets, b, err)
		}
	}
}

func newNetns(tag string) (name, path string) {
	b := make([]byte, 4)
	rand.Read(b)
	name = "ctscrub-bench-" + tag + "-" + hex.EncodeToString(b)
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		fail("ip netns add %s: %v: %s", name, err, out)
	}
	onExit(func() { exec.Command("ip", "netns", "del", name).Run() })
	return name, "/var/run/netns/" + name
}

func udp(src, dst netip.Addr, sport, dport uint16) nfct.Entry {
	return nfct.Entry{
		Orig:  nfct.Tuple{Src: src, Dst: dst, Proto: unix.IPPROTO_UDP, Ports: true, SPort: sport, DPort: dport},
		Reply: nfct.Tuple{Src: dst, Dst: src, Proto: unix.IPPROTO_UDP, Ports: true, SPort: dport, DPort: sport},
	}
}

func tcp(src, dst netip.Addr, sport, dport uint16) nfct.Entry {
	e := udp(src, dst, sport, dport)
	e.Orig.Proto, e.Reply.Proto = unix.IPPROTO_TCP, unix.IPPROTO_TCP
	return e
}

// targetEntries: the target as client (original source), as a Service
// backend behind DNAT (only the reply source), and as a server reached
// directly (original destination and reply source).
func targetEntries(k int) []nfct.Entry {
	es := make([]nfct.Entry, 0, k)
	remote := netip.MustParseAddr("192.168.50.1")
	client := netip.MustParseAddr("10.200.9.9")
	for i := 0; i < k; i++ {
		port := uint16(1024 + i%60000)
		switch i % 3 {
		case 0:
			es = append(es, tcp(target, remote, port, 443))
		case 1:
			e := udp(client, vip, port, 53)
			e.Reply.Src = target
			e.Reply.SPort = 5353
			es = append(es, e)
		default:
			es = append(es, tcp(remote, target, port, 8080))
		}
	}
	return es
}

// otherEntries: n flows of 1,000 other pods to the outside world.
func otherEntries(n int) []nfct.Entry {
	es := make([]nfct.Entry, 0, n)
	for i := 0; i < n; i++ {
		pod := 2 + i%1000
		src := netip.AddrFrom4([4]byte{10, 200, byte(pod >> 8), byte(pod)})
		r := i / 1000
		dst := netip.AddrFrom4([4]byte{172, 16, byte(r >> 8 % 256), byte(r)})
		es = append(es, tcp(src, dst, uint16(1024+(r/65536)%60000), uint16(80+i%7)))
	}
	return es
}

func holds(e nfct.Entry, ip netip.Addr) bool {
	return e.Orig.Src == ip || e.Orig.Dst == ip || e.Reply.Src == ip || e.Reply.Dst == ip
}

// census counts the table's entries and those holding the target: the check
// after every method that it deleted all of them and nothing else.
func census(tab *nfct.Table) (total, mine int) {
	if err := tab.Dump(func(e nfct.Entry) {
		total++
		if holds(e, target) {
			mine++
		}
	}); err != nil {
		fail("dump: %v", err)
	}
	return
}

func refill(tab *nfct.Table, es []nfct.Entry) {
	if n, err := tab.Create(es, 3600); err != nil || n != len(es) {
		fail("refill the target's %d entries: created %d: %v", len(es), n, err)
	}
}

func check(tab *nfct.Table, method string, wantTotal int) {
	total, mine := census(tab)
	if mine != 0 || total != wantTotal {
		fail("%s left %d entries of %s and the table at %d entries (want 0 and %d)", method, mine, target, total, wantTotal)
	}
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

func main() {
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "bench-nfct: needs root (network namespaces, nf_conntrack sysctls)")
		os.Exit(1)
	}
	entries := envInt("ENTRIES", 1_000_000)
	perIP := envInt("PER_IP", 1000)
	reps := envInt("REPS", 5)
	if perIP >= entries {
		fail("PER_IP=%d must be below ENTRIES=%d", perIP, entries)
	}
	if _, err := exec.LookPath("conntrack"); err != nil {
		fail("the conntrack binary is missing (apt-get install conntrack; scripts/setup.sh)")
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	go func() {
		s := <-sig
		fail("interrupted by %v: restoring the host", s)
	}()
	defer cleanup()

	// The lock is taken whatever the size: the run changes host-wide sysctls
	// (two runs at once would restore each other's values) and, at 1M
	// entries, holds gigabytes of kernel memory.
	{
		f, err := os.OpenFile(lockPath, os.O_CREATE|os.O_RDWR, 0o666)
		if err != nil {
			fail("open %s: %v", lockPath, err)
		}
		fmt.Fprintf(os.Stderr, "bench-nfct: waiting for %s (shared machine)\n", lockPath)
		if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
			fail("lock %s: %v", lockPath, err)
		}
		onExit(func() { f.Close() })
	}
	// The event ramp below holds up to rampTop*rampStep entries at once.
	raiseLimits(max(entries, rampTop*int(rampStep/time.Second)))

	nsName, nsPath := newNetns("nfct")
	tab, err := nfct.OpenTable(nsPath)
	if err != nil {
		fail("%v", err)
	}
	onExit(func() { tab.Close() })

	mine := targetEntries(perIP)
	others := otherEntries(entries - perIP)
	t0 := time.Now()
	if n, err := tab.Create(others, 3600); err != nil || n != len(others) {
		fail("fill %d entries: created %d: %v", len(others), n, err)
	}
	refill(tab, mine)
	fillDur := time.Since(t0)
	total, got := census(tab)
	if total != entries || got != perIP {
		fail("table has %d entries, %d of the target; want %d and %d", total, got, entries, perIP)
	}
	fmt.Printf("table: %d entries in netns %s (%d of %s), filled through netlink in %.2f s\n", total, nsName, got, target, fillDur.Seconds())
	others = nil
	runtime.GC()
	rest := entries - perIP

	// conntrack-tools, as Calico runs it: --orig-src then --reply-src.
	t0 = time.Now()
	for _, flag := range []string{"--orig-src", "--reply-src"} {
		out, err := exec.Command("ip", "netns", "exec", nsName, "conntrack", "-D", flag, target.String()).CombinedOutput()
		// conntrack exits 1 when it deleted nothing; the census below is the judge.
		if err != nil && !strings.Contains(string(out), "flow entries have been deleted") {
			fail("conntrack -D %s %s: %v: %s", flag, target, err, out)
		}
	}
	toolDur := time.Since(t0)
	check(tab, "conntrack -D", rest)
	fmt.Printf("conntrack -D --orig-src + --reply-src:   %8.3f s\n", toolDur.Seconds())

	// vishvananda/netlink ConntrackDeleteFilters, as kube-proxy and OVN-K.
	refill(tab, mine)
	nsh, err := netns.GetFromPath(nsPath)
	if err != nil {
		fail("open %s: %v", nsPath, err)
	}
	h, err := netlink.NewHandleAt(nsh, unix.NETLINK_NETFILTER)
	if err != nil {
		fail("netlink handle in %s: %v", nsPath, err)
	}
	var fsrc, frep netlink.ConntrackFilter
	fsrc.AddIP(netlink.ConntrackOrigSrcIP, net.IP(target.AsSlice()))
	frep.AddIP(netlink.ConntrackReplySrcIP, net.IP(target.AsSlice()))
	t0 = time.Now()
	nDel, err := h.ConntrackDeleteFilters(netlink.ConntrackTable, unix.AF_INET, &fsrc, &frep)
	dfDur := time.Since(t0)
	if err != nil {
		fail("ConntrackDeleteFilters: %v", err)
	}
	h.Close()
	nsh.Close()
	runtime.GC()
	check(tab, "ConntrackDeleteFilters", rest)
	fmt.Printf("netlink ConntrackDeleteFilters:          %8.3f s (%d deleted)\n", dfDur.Seconds(), nDel)

	// ctscrub's backend: seeding the index is one dump of the table.
	refill(tab, mine)
	var ms0, ms1 runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms0)
	t0 = time.Now()
	n, err := nfct.New(nfct.Config{PodCIDRs: []netip.Prefix{podCIDR}, Netns: nsPath, Fallback: nfct.FallbackFlush})
	if err != nil {
		fail("start the nfct backend: %v", err)
	}
	seedDur := time.Since(t0)
	onExit(func() { n.Close() })
	st := n.Stats()
	runtime.GC()
	runtime.ReadMemStats(&ms1)
	indexBytes := int64(ms1.HeapInuse) - int64(ms0.HeapInuse)
	fmt.Printf("index seeded from one dump in %.3f s: %d keys for %d IPs, %.1f MiB of Go heap (%.0f B/key)\n",
		seedDur.Seconds(), st.Keys, st.IPs, float64(indexBytes)/(1<<20), float64(indexBytes)/float64(max(st.Keys, 1)))
	ctx := context.Background()
	req := scrub.Request{IPs: []netip.Addr{target}, Reason: scrub.ReasonDel}

	// The kernel's filtered flush (CTA_FILTER, 6.12+): four walks, one per
	// position the IP can hold.
	res, err := n.Sweep(ctx, req)
	if err != nil {
		fail("filtered flush: %v", err)
	}
	flushDur := res.Duration
	check(tab, "filtered flush", rest)
	fmt.Printf("kernel filtered flush (4 directions):    %8.3f s\n", flushDur.Seconds())

	// The dump fallback (kernels before 6.12, and IPv6).
	nd, err := nfct.New(nfct.Config{PodCIDRs: []netip.Prefix{netip.MustParsePrefix("10.201.0.0/16")}, Netns: nsPath, Fallback: nfct.FallbackDump, ResyncAfterLoss: -1})
	if err != nil {
		fail("start the dump-fallback backend: %v", err)
	}
	refill(tab, mine)
	res, err = nd.Sweep(ctx, req)
	nd.Close()
	if err != nil || res.Deleted[nfct.MapName] != perIP {
		fail("dump fallback: %+v, %v", res, err)
	}
	dumpDur := res.Duration
	check(tab, "dump fallback", rest)
	fmt.Printf("ctscrub dump fallback (one walk):        %8.3f s\n", dumpDur.Seconds())

	// The index scrub, REPS times, refilled between (through events).
	var idx []time.Duration
	for i := 0; i < reps; i++ {
		ev0 := n.Stats().Events
		refill(tab, mine)
		// Time the scrub, not the index catching up with the refill's burst
		// of NEW events (a node's scrubs do not follow a burst of the IP's
		// own flows).
		for deadline := time.Now().Add(10 * time.Second); n.Stats().Events-ev0 < uint64(perIP) && time.Now().Before(deadline); {
			time.Sleep(5 * time.Millisecond)
		}
		res, err := n.Scrub(ctx, req)
		if err != nil {
			fail("index scrub: %v", err)
		}
		if res.Method != scrub.MethodIndex || res.Deleted[nfct.MapName] != perIP {
			fail("index scrub %d: want method index deleting %d, got %+v", i, perIP, res)
		}
		idx = append(idx, res.Duration)
		check(tab, "index scrub", rest)
	}
	idxMed := median(idx)
	fmt.Printf("ctscrub index scrub (median of %d):       %8.5f s  %v\n", reps, idxMed.Seconds(), idx)
	if st := n.Stats(); st.Lost != 0 {
		fmt.Printf("note: %d events lost during the scrub runs\n", st.Lost)
	}
	n.Close()

	rate, rateLossy, rampLog := rampEvents()
	fmt.Print(rampLog)

	out := map[string]any{
		"entries":                 entries,
		"per_ip":                  perIP,
		"fill_s":                  round(fillDur.Seconds()),
		"seed_s":                  round(seedDur.Seconds()),
		"index_keys":              st.Keys,
		"index_heap_bytes":        indexBytes,
		"conntrack_tool_s":        round(toolDur.Seconds()),
		"delete_filters_s":        round(dfDur.Seconds()),
		"filtered_flush_s":        round(flushDur.Seconds()),
		"dump_fallback_s":         round(dumpDur.Seconds()),
		"index_median_s":          idxMed.Seconds(),
		"index_runs_s":            secs(idx),
		"events_per_s_lossless":   rate,
		"events_per_s_first_loss": rateLossy,
		"conntrack_tool_x":        round(toolDur.Seconds() / idxMed.Seconds()),
		"delete_filters_x":        round(dfDur.Seconds() / idxMed.Seconds()),
		"filtered_flush_x":        round(flushDur.Seconds() / idxMed.Seconds()),
		"kernel":                  kernel(),
		"cpus":                    runtime.NumCPU(),
	}
	b, _ := json.Marshal(out)
	cleanup()
	fmt.Println(string(b))
}

func round(f float64) float64 { return float64(int64(f*1000+0.5)) / 1000 }

func secs(ds []time.Duration) []float64 {
	var out []float64
	for _, d := range ds {
		out = append(out, d.Seconds())
	}
	return out
}

func kernel() string {
	var u unix.Utsname
	unix.Uname(&u)
	return unix.ByteSliceToString(u.Release[:])
}

// rampEvents creates flows of local pods at rising rates in a fresh namespace
// for 2 s each and returns the highest rate at which the index lost no event
// (the lower of the creation rate and the rate at which the index applied
// the step's events), and the first rate at which it did (0: none up to the
// top step).
// Each step starts from an empty table.
func rampEvents() (lossless, lossy int, log string) {
	var sb strings.Builder
	_, path := newNetns("events")
	const creators = 2
	var tabs []*nfct.Table
	for w := 0; w < creators; w++ {
		tab, err := nfct.OpenTable(path)
		if err != nil {
			fail("%v", err)
		}
		defer tab.Close()
		tabs = append(tabs, tab)
	}
	n, err := nfct.New(nfct.Config{PodCIDRs: []netip.Prefix{podCIDR}, Netns: path, ResyncAfterLoss: -1})
	if err != nil {
		fail("start the nfct backend for the event ramp: %v", err)
	}
	defer n.Close()
	fmt.Fprintf(&sb, "event ramp (event socket buffer %d bytes, %v per step):\n", n.Stats().EventBuffer, rampStep)
	step := rampStep
	base := 0
	for _, rate := range []int{25_000, 50_000, 100_000, 150_000, 200_000, rampTop} {
		lost0, ev0 := n.Lost(), n.Stats().Events
		want := rate * int(step/time.Second)
		es := make([]nfct.Entry, want)
		for i := range es {
			k := base + i
			pod := 2 + k%1000
			src := netip.AddrFrom4([4]byte{10, 200, byte(pod >> 8), byte(pod)})
			dst := netip.AddrFrom4([4]byte{172, 17, byte(k >> 16), byte(k >> 8)})
			es[i] = udp(src, dst, uint16(1024+k%50000), uint16(1+k%255))
		}
		base += want
		// Two creators (one per CPU, as softirqs on several CPUs create
		// flows on a node), each paced in 10 ms slices of rate/200 entries.
		chunk := max(rate/100/creators, 1)
		t0 := time.Now()
		var wg sync.WaitGroup
		for w := 0; w < creators; w++ {
			part := es[w*len(es)/creators : (w+1)*len(es)/creators]
			wg.Add(1)
			go func(tab *nfct.Table) {
				defer wg.Done()
				for i := 0; i < len(part); i += chunk {
					if _, err := tab.Create(part[i:min(i+chunk, len(part))], 600); err != nil {
						fail("event ramp at %d/s: %v", rate, err)
					}
					if d := time.Until(t0.Add(time.Duration(i/chunk+1) * 10 * time.Millisecond)); d > 0 {
						time.Sleep(d)
					}
				}
			}(tabs[w])
		}
		wg.Wait()
		took := time.Since(t0)
		achieved := int(float64(want) / took.Seconds())
		// Let the reader drain what is queued, then compare.
		deadline := time.Now().Add(5 * time.Second)
		for n.Stats().Events-ev0 < uint64(want) && n.Lost() == lost0 && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		// The rate the index kept up with: events over the time from the
		// step's start until the last one was applied (the socket's buffer
		// can hide a reader slower than the creators for a while).
		drained := time.Since(t0)
		ingestRate := int(float64(want) / drained.Seconds())
		lost := n.Lost() - lost0
		ingested := n.Stats().Events - ev0
		fmt.Fprintf(&sb, "  asked %7d/s, created %7d/s: %d events ingested (all applied %.2f s after the step began: %d/s), %d lost\n",
			rate, achieved, ingested, drained.Seconds(), ingestRate, lost)
		if lost > 0 || ingested < uint64(want) {
			lossy = achieved
			break
		}
		lossless = min(achieved, ingestRate)
		if achieved < rate*9/10 {
			fmt.Fprintf(&sb, "  (creation cannot go faster here: the ramp stops)\n")
			break
		}
		// Empty the table for the next step.
		if out, err := exec.Command("ip", "netns", "exec", path[len("/var/run/netns/"):], "conntrack", "-F").CombinedOutput(); err != nil {
			fail("conntrack -F in the ramp netns: %v: %s", err, out)
		}
		time.Sleep(200 * time.Millisecond)
	}
	return lossless, lossy, sb.String()
}
