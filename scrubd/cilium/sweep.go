package cilium

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/scrub"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/bpf"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// Flags of struct sweep_args (bpf/sweep.c).
const (
	sweepDryRun uint32 = 1
	sweepCount  uint32 = 2
)

// MaxSweepIPs is the size of the sweep's IP sets (SWEEP_MAX_IPS in bpf/sweep.c):
// the most IPs of one family a single pass can carry.
const MaxSweepIPs = 65536

// sweepArgs mirrors struct sweep_args, the BPF_PROG_TEST_RUN context.
type sweepArgs struct {
	Flags      uint32
	Stopped    uint32
	Visited    uint64
	Matched    uint64
	Deleted    uint64
	NATDeleted uint64
}

// ipCount mirrors struct ip_count, an IP's counts in the sweep's IP set.
type ipCount struct {
	CT, NAT uint64
}

// countArgs mirrors struct count_args.
type countArgs struct {
	Count int64
}

// mapProg is the sweep program loaded for one CT map.
type mapProg struct {
	kind   ctmap.Kind
	sweep  *ebpf.Program
	stop   *ebpf.Variable
	filter *ebpf.Variable // filter4 or filter6: the pass's address bitmap
	count  *ebpf.Program  // nil when the kernel lacks bpf_map_sum_elem_count
	mu     sync.Mutex     // one run at a time: the program's stop flag is per instance
}

// PassStats is what one run of the sweep program over one map reports.
type PassStats struct {
	Visited, Matched, Deleted uint64
	NATDeleted                uint64 // SNAT mappings deleted with the entries
	Stopped                   bool   // ended early on the stop flag
	Duration                  time.Duration
}

// run runs the program once over its map.
func (p *mapProg) run(flags uint32) (PassStats, error) {
	args := sweepArgs{Flags: flags}
	start := time.Now()
	if _, err := p.sweep.Run(&ebpf.RunOptions{Context: &args, ContextOut: &args}); err != nil {
		return PassStats{}, fmt.Errorf("run sweep program over %s: %w", p.kind.Name(), err)
	}
	return PassStats{
		Visited:    args.Visited,
		Matched:    args.Matched,
		Deleted:    args.Deleted,
		NATDeleted: args.NATDeleted,
		Stopped:    args.Stopped != 0,
		Duration:   time.Since(start),
	}, nil
}

func (p *mapProg) close() {
	p.sweep.Close()
	if p.count != nil {
		p.count.Close()
	}
}

// loadProgs loads bpf/sweep.c once per CT map present in maps, with the map
// given as the replacement of the program's placeholder, and the IP sets
// shared by every instance.
func loadProgs(maps *ctmap.Maps) (progs [ctmap.NumKinds]*mapProg, ips4, ips6 *ebpf.Map, countErr, err error) {
	spec, err := bpf.LoadSweep()
	if err != nil {
		return progs, nil, nil, nil, fmt.Errorf("load sweep program spec: %w", err)
	}
	closeAll := func() {
		for _, p := range progs {
			if p != nil {
				p.close()
			}
		}
		if ips4 != nil {
			ips4.Close()
		}
		if ips6 != nil {
			ips6.Close()
		}
	}
	if ips4, err = ebpf.NewMap(spec.Maps["ips4"]); err != nil {
		return progs, nil, nil, nil, fmt.Errorf("create sweep IP set ips4: %w", err)
	}
	if ips6, err = ebpf.NewMap(spec.Maps["ips6"]); err != nil {
		closeAll()
		return progs, nil, nil, nil, fmt.Errorf("create sweep IP set ips6: %w", err)
	}
	for _, k := range ctmap.Kinds {
		m := maps.Map(k)
		if m == nil {
			continue
		}
		fam, ips := "4", ips4
		if k.IPv6() {
			fam, ips = "6", ips6
		}
		p := &mapProg{kind: k}
		var objs struct {
			Sweep   *ebpf.Program  `ebpf:"sweep"`
			Stop    *ebpf.Variable `ebpf:"stop"`
			Filter4 *ebpf.Variable `ebpf:"filter4"`
			Filter6 *ebpf.Variable `ebpf:"filter6"`
		}
		s := placeholderSpec(spec, m, fam)
		// Keep only this family's sweep program (and the maps it needs).
		s.Programs = map[string]*ebpf.ProgramSpec{"sweep": s.Programs["sweep"+fam]}
		keep := map[string]*ebpf.MapSpec{"ct" + fam: s.Maps["ct"+fam], "ips" + fam: s.Maps["ips"+fam], ".bss": s.Maps[".bss"]}
		repl := map[string]*ebpf.Map{"ct" + fam: m, "ips" + fam: ips}
		withNAT(s, keep, repl, maps, fam)
		s.Maps = keep
		err := s.LoadAndAssign(&objs, &ebpf.CollectionOptions{MapReplacements: repl})
		if err != nil {
			closeAll()
			return progs, nil, nil, nil, fmt.Errorf("load sweep program for %s: %w", k.Name(), err)
		}
		p.sweep, p.stop, p.filter = objs.Sweep, objs.Stop, objs.Filter4
		if k.IPv6() {
			p.filter = objs.Filter6
		}
		progs[k] = p

		// The cheap entry count needs a kfunc (Linux 6.6+); without it
		// Count falls back to a counting walk.
		var cobjs struct {
			Count *ebpf.Program `ebpf:"count"`
		}
		cs := placeholderSpec(spec, m, fam)
		cs.Programs = map[string]*ebpf.ProgramSpec{"count": cs.Programs["count_ct"+fam]}
		cs.Maps = map[string]*ebpf.MapSpec{"ct" + fam: cs.Maps["ct"+fam]}
		if err := cs.LoadAndAssign(&cobjs, &ebpf.CollectionOptions{
			MapReplacements: map[string]*ebpf.Map{"ct" + fam: m},
		}); err == nil {
			p.count = cobjs.Count
		} else if countErr == nil {
			countErr = fmt.Errorf("load the entry-count program for %s: %w", k.Name(), err)
		}
	}
	return progs, ips4, ips6, countErr, nil
}

// placeholderSpec copies spec and gives its ct4/ct6 placeholder the real
// map's type, size and flags, which a map replacement must match.
func placeholderSpec(spec *ebpf.CollectionSpec, m *ebpf.Map, fam string) *ebpf.CollectionSpec {
	s := spec.Copy()
	fitPlaceholder(s.Maps["ct"+fam], m)
	return s
}

func fitPlaceholder(ph *ebpf.MapSpec, m *ebpf.Map) {
	ph.Type = m.Type()
	ph.MaxEntries = m.MaxEntries()
	ph.Flags = m.Flags()
}

// withNAT adds the family's SNAT map placeholder (nat4/nat6,
// bpf/include/ctscrub_nat.h) to the maps a program of s keeps, and Cilium's
// SNAT map to its replacements when maps has one: the program's CT deletes
// then delete the entries' SNAT mappings too. Without one the placeholder
// stays, empty, and the program deletes none.
func withNAT(s *ebpf.CollectionSpec, keep map[string]*ebpf.MapSpec, repl map[string]*ebpf.Map, maps *ctmap.Maps, fam string) {
	name := "nat" + fam
	keep[name] = s.Maps[name]
	if nat := maps.NAT(fam == "6"); nat != nil {
		fitPlaceholder(s.Maps[name], nat)
		repl[name] = nat
	}
}

// Sweeper runs the sweep for sets of IPs. Callers that need the sweep at the
// same moment share one pass: they join a pending set; a single runner takes
// the whole set, runs one pass over every map and wakes each caller with the
// counts of its own IPs. A caller whose ctx ends leaves; an IP of the running
// pass that no caller waits for any more leaves the kernel set at once (see
// Sweeper.leave), and when no caller remains the runner's stop flag ends the
// pass.
type Sweeper struct {
	progs      [ctmap.NumKinds]*mapProg
	ips4, ips6 *ebpf.Map

	mu      sync.Mutex
	pending [2]*pass // [0] deleting, [1] dry run
	running *pass
	active  bool // a runner goroutine exists

	joins  uint64        // callers that joined a pending set (under mu)
	passes atomic.Uint64 // passes run (each over every map it needed)
	inProg atomic.Bool   // the sweep program is running in the kernel
	last   [ctmap.NumKinds]PassStats
	// left are IPs a pass could not take out of the shared IP set: every
	// later pass would delete their entries too (the runner alone touches
	// it). No pass runs until they are gone (runner, clearLeft).
	left []netip.Addr

	// hooks stops the runner at the points where callers join and leave;
	// nil but in this package's tests (export_test.go).
	hooks passHooks
}

// passHooks are the runner's points a test holds it at.
type passHooks interface {
	taken()   // the runner took a pass, before it sweeps
	walking() // right before the program walks a map
}

// pass is one shared run of the sweep.
type pass struct {
	dry     bool
	ips     map[netip.Addr]int // IP -> callers that asked for it
	callers int                // callers still waiting
	done    chan struct{}

	// gone are the IPs of the started pass whose last caller left: out of
	// ips, and out of the kernel set once the runner filled it (leave).
	gone map[netip.Addr]bool

	// Written by the runner under Sweeper.mu.
	started bool
	filled  bool // the IPs are in the kernel set and the filters (runPass)
	perIP   map[netip.Addr]*[ctmap.NumKinds]int
	natIP   map[netip.Addr]int   // SNAT mappings deleted with each IP's entries
	swept   [ctmap.NumKinds]bool // maps fully swept
	stopped bool
	err     error
	stats   [ctmap.NumKinds]PassStats
}

// SweepResult is one caller's view of a pass.
type SweepResult struct {
	// Deleted per map: entries holding one of the caller's IPs that the pass
	// deleted (dry run: would delete). An entry holding two of the caller's
	// IPs counts twice.
	Deleted [ctmap.NumKinds]int
	// PerIP counts per IP and map.
	PerIP map[netip.Addr][ctmap.NumKinds]int
	// NATDeleted counts the SNAT mappings deleted with the caller's IPs'
	// entries, IPv4's then IPv6's (an entry of two of them counts twice).
	NATDeleted [2]int
	// Complete: every map the caller's IPs need was swept to the end.
	Complete bool
	// Pass is the number of the pass that served the caller (Passes() after it).
	Pass uint64
}

// Sweep deletes (dryRun: counts) every entry whose daddr or saddr is one of
// ips, in every map of the IPs' family. It shares a pass with concurrent
// callers. When ctx ends first it returns ctx's error with what was counted
// so far and Complete false. ips are checked with CheckIPs.
func (s *Sweeper) Sweep(ctx context.Context, ips []netip.Addr, dryRun bool) (SweepResult, error) {
	ips, err := scrub.CheckIPs(ips)
	if err != nil {
		return SweepResult{}, err
	}
	if len(ips) > MaxSweepIPs {
		return SweepResult{}, fmt.Errorf("sweep: %d IPs in one request, at most %d", len(ips), MaxSweepIPs)
	}
	for _, ip := range ips {
		if ip.Is6() && s.progs[ctmap.TCP6] == nil {
			return SweepResult{}, fmt.Errorf("sweep %s: the IPv6 CT maps are not present (IPv6 disabled in Cilium?)", ip)
		}
	}
	mode := 0
	if dryRun {
		mode = 1
	}
	s.mu.Lock()
	p := s.pending[mode]
	if p == nil || p.full(ips) {
		if p != nil {
			// A full pending set runs first; this caller waits for it and
			// then joins the next one. Rare: 64 k IPs of one family.
			s.mu.Unlock()
			select {
			case <-p.done:
			case <-ctx.Done():
				return SweepResult{}, ctx.Err()
			}
			return s.Sweep(ctx, ips, dryRun)
		}
		p = &pass{dry: dryRun, ips: map[netip.Addr]int{}, gone: map[netip.Addr]bool{}, done: make(chan struct{})}
		s.pending[mode] = p
	}
	for _, ip := range ips {
		p.ips[ip]++
	}
	p.callers++
	s.joins++
	if !s.active {
		s.active = true
		go s.runner()
	}
	s.mu.Unlock()

	select {
	case <-p.done:
		return s.resultFor(p, ips)
	case <-ctx.Done():
	}

	s.mu.Lock()
	select {
	case <-p.done:
		s.mu.Unlock()
		return s.resultFor(p, ips)
	default:
	}
	if !p.started {
		// Not run yet: leave the pending set.
		for _, ip := range ips {
			if p.ips[ip]--; p.ips[ip] == 0 {
				delete(p.ips, ip)
			}
		}
		p.callers--
		if p.callers == 0 && s.pending[mode] == p {
			s.pending[mode] = nil
		}
		s.mu.Unlock()
		return SweepResult{}, ctx.Err()
	}
	p.callers--
	last := p.callers == 0
	s.leave(p, ips)
	if last {
		s.setStop(1)
	}
	s.mu.Unlock()
	if last {
		// The pass ends within one element of the stop flag; wait for it so
		// the counts are final.
		<-p.done
	}
	r, err := s.resultFor(p, ips)
	r.Complete = false
	if err == nil {
		err = ctx.Err()
	}
	return r, err
}

// full reports whether adding ips would overflow one family's IP set.
func (p *pass) full(ips []netip.Addr) bool {
	var n4, n6 int
	for ip := range p.ips {
		if ip.Is4() {
			n4++
		} else {
			n6++
		}
	}
	for _, ip := range ips {
		if _, ok := p.ips[ip]; ok {
			continue
		}
		if ip.Is4() {
			n4++
		} else {
			n6++
		}
	}
	return n4 > MaxSweepIPs || n6 > MaxSweepIPs
}

// resultFor extracts a caller's counts from a pass.
func (s *Sweeper) resultFor(p *pass, ips []netip.Addr) (SweepResult, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := SweepResult{PerIP: make(map[netip.Addr][ctmap.NumKinds]int, len(ips)), Complete: true}
	for _, ip := range ips {
		var c [ctmap.NumKinds]int
		if pc := p.perIP[ip]; pc != nil {
			c = *pc
		}
		r.PerIP[ip] = c
		for k, n := range c {
			r.Deleted[k] += n
		}
		if ip.Is6() {
			r.NATDeleted[1] += p.natIP[ip]
		} else {
			r.NATDeleted[0] += p.natIP[ip]
		}
		for _, k := range kindsOf(ip) {
			if s.progs[k] != nil && !p.swept[k] {
				r.Complete = false
			}
		}
	}
	r.Pass = s.passes.Load()
	return r, p.err
}

func kindsOf(ip netip.Addr) []ctmap.Kind {
	if ip.Is4() {
		return []ctmap.Kind{ctmap.TCP4, ctmap.Any4}
	}
	return []ctmap.Kind{ctmap.TCP6, ctmap.Any6}
}

func (s *Sweeper) setStop(v uint32) {
	for _, p := range s.progs {
		if p != nil {
			// The variable is mmapped .bss memory: Set is a plain store.
			_ = p.stop.Set(v)
		}
	}
}

// Callers that arrive together (50 pod starts at once, each request on its
// own connection) reach Sweep a few milliseconds apart. Before it takes the
// pending set, the runner waits until no caller has joined for gatherQuiet,
// at most gatherMax: a few ms beside a pass of 100 ms and more, and it keeps
// the callers of one burst in one pass instead of two or more.
const (
	gatherQuiet = 3 * time.Millisecond
	gatherMax   = 25 * time.Millisecond
)

func (s *Sweeper) gather() {
	until := time.Now().Add(gatherMax)
	for {
		s.mu.Lock()
		before := s.joins
		s.mu.Unlock()
		time.Sleep(gatherQuiet)
		s.mu.Lock()
		after := s.joins
		s.mu.Unlock()
		if after == before || time.Now().After(until) {
			return
		}
	}
}

// runner runs pending passes until none is left; deleting passes go first.
func (s *Sweeper) runner() {
	for {
		s.gather()
		s.mu.Lock()
		p := s.pending[0]
		if p == nil {
			p = s.pending[1]
		}
		if p == nil {
			s.active = false
			s.mu.Unlock()
			return
		}
		mode := 0
		if p.dry {
			mode = 1
		}
		s.pending[mode] = nil
		p.started = true
		s.running = p
		s.setStop(0)
		hooks := s.hooks
		s.mu.Unlock()

		if hooks != nil {
			hooks.taken()
		}
		err := s.clearLeft()
		if err == nil {
			err = s.runPass(p, hooks)
		}

		s.mu.Lock()
		p.err = err
		p.filled = false // clearSet took the IPs out; the next pass may put them back
		s.last = p.stats
		s.running = nil
		s.setStop(0)
		s.mu.Unlock()
		close(p.done)
	}
}

// runPass sweeps every map the pass's IPs need.
func (s *Sweeper) runPass(p *pass, hooks passHooks) error {
	// Callers of the started pass may leave (and take their IPs out of
	// p.ips) at any time: the IPs are read under the lock.
	var v4 []netip.Addr
	var v6 []netip.Addr
	s.mu.Lock()
	for ip := range p.ips {
		if ip.Is4() {
			v4 = append(v4, ip)
		} else {
			v6 = append(v6, ip)
		}
	}
	perIP := make(map[netip.Addr]*[ctmap.NumKinds]int, len(p.ips))
	for ip := range p.ips {
		perIP[ip] = new([ctmap.NumKinds]int)
	}
	p.perIP = perIP
	p.natIP = make(map[netip.Addr]int, len(p.ips))
	s.mu.Unlock()
	s.passes.Add(1)

	// Registered before the first write: a pass that fails half-way must
	// not leave its IPs to the next callers' passes.
	defer s.clearSet(v4, v6)
	if err := fillSet(s.ips4, s.ips6, v4, v6); err != nil {
		return err
	}
	// From here on a leaving caller takes its IPs out of the set itself;
	// those that left during the fill go now, before any walk.
	s.mu.Lock()
	p.filled = true
	var left []netip.Addr
	for _, ip := range append(v4[:len(v4):len(v4)], v6...) {
		if p.gone[ip] {
			left = append(left, ip)
		}
	}
	s.dropFromSet(p, left)
	err := s.setFilters(p)
	s.mu.Unlock()
	if err != nil {
		return err
	}

	flags := uint32(0)
	if p.dry {
		flags = sweepDryRun
	}
	for _, k := range ctmap.Kinds {
		prog := s.progs[k]
		if prog == nil || (k.IPv6() && len(v6) == 0) || (!k.IPv6() && len(v4) == 0) {
			continue
		}
		s.mu.Lock()
		nobody := p.callers == 0
		wanted := false // an IP of the map's family is still swept
		for ip := range p.ips {
			if wanted = ip.Is6() == k.IPv6(); wanted {
				break
			}
		}
		s.mu.Unlock()
		if nobody {
			p.stopped = true
			return nil
		}
		if !wanted {
			continue // every caller of the family's IPs left
		}
		if hooks != nil {
			hooks.walking()
		}
		prog.mu.Lock()
		s.inProg.Store(true)
		st, err := prog.run(flags)
		s.inProg.Store(false)
		prog.mu.Unlock()
		if err != nil {
			return err
		}
		// Per-IP counters are cumulative over the pass; this map's share is
		// the difference.
		ipsOfKind, set := v4, s.ips4
		if k.IPv6() {
			ipsOfKind, set = v6, s.ips6
		}
		counts := make(map[netip.Addr]int, len(ipsOfKind))
		nat := make(map[netip.Addr]int, len(ipsOfKind))
		var missing []netip.Addr
		for _, ip := range ipsOfKind {
			var c ipCount
			if err := set.Lookup(setKey(ip), &c); err != nil {
				if errors.Is(err, ebpf.ErrKeyNotExist) {
					missing = append(missing, ip) // its last caller left (below)
					continue
				}
				return fmt.Errorf("sweep: read count of %s: %w", ip, err)
			}
			counts[ip] = int(c.CT)
			nat[ip] = int(c.NAT) // cumulative over the pass too
		}
		s.mu.Lock()
		for _, ip := range missing {
			if !p.gone[ip] {
				s.mu.Unlock()
				return fmt.Errorf("sweep: read count of %s: not in the IP set", ip)
			}
		}
		for ip, n := range nat {
			if !p.gone[ip] { // leave counted it when it took the IP out
				p.natIP[ip] = n
			}
		}
		for ip, c := range counts {
			if p.gone[ip] {
				continue
			}
			pc := perIP[ip]
			prev := 0
			for _, kk := range kindsOf(ip) {
				if kk != k {
					prev += pc[kk]
				}
			}
			pc[k] = c - prev
		}
		p.stats[k] = st
		if st.Stopped {
			p.stopped = true
		} else {
			p.swept[k] = true
		}
		s.mu.Unlock()
		if st.Stopped {
			return nil
		}
	}
	return nil
}

// leave withdraws a leaving caller's ips from the started pass p (under
// s.mu): an IP no other caller of p waits for is gone, and once the runner
// has filled the kernel set it leaves the set and the address filters at
// once, so the rest of the pass deletes none of its entries. Those are the
// entries of the IP's next pod from now on: the caller left because its
// deadline passed, and whoever asked (the agent) went on without this
// scrub (its own walk, then the pod's start).
//
// What may still go after the caller left: the program reads the set once
// per element, so from the end of the delete syscall on no element matches
// the IP. The element the program was on may have matched just before; its
// delete is one step late (bpf/sweep.c, the delayed delete), so at most one
// CT entry of the IP, with its SNAT mappings, goes after leave returns, and
// it was in the map before the IP left the set. One program runs at a time
// (the maps are walked in turn), so that is one entry per pass, not per map.
// The caller who left is answered incomplete whatever its counts say
// (Sweep), and its IPs stay incomplete in the index: the next scrub sweeps.
func (s *Sweeper) leave(p *pass, ips []netip.Addr) {
	var out []netip.Addr
	for _, ip := range ips {
		n, ok := p.ips[ip]
		if !ok {
			continue // listed twice by this caller, already out
		}
		if n > 1 {
			p.ips[ip] = n - 1
			continue
		}
		delete(p.ips, ip)
		p.gone[ip] = true
		out = append(out, ip)
	}
	if !p.filled || len(out) == 0 {
		return // not in the set yet: the runner leaves them out (runPass)
	}
	s.dropFromSet(p, out)
	// The filter is a shortcut before the set's lookups; a stale bit costs
	// lookups, never a delete. It fails only on a closed program, which a
	// pass does not outlive.
	_ = s.setFilters(p)
}

// dropFromSet takes ips, gone from the running pass p, out of the kernel set
// (under s.mu, p filled) and keeps what the set counted for them as their
// final counts. An IP that cannot be taken out would lose its next pod's
// entries to the rest of the pass: the pass is stopped instead, and the
// runner's clearSet retries (and keeps it in s.left if it fails again).
func (s *Sweeper) dropFromSet(p *pass, ips []netip.Addr) {
	for _, ip := range ips {
		set := s.ips4
		if ip.Is6() {
			set = s.ips6
		}
		var c ipCount
		err := set.LookupAndDelete(setKey(ip), &c)
		if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			// A kernel without lookup-and-delete on hash maps: the count
			// may miss the deletes between the two calls.
			if err = set.Lookup(setKey(ip), &c); err == nil {
				err = s.unset(ip)
			}
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			continue // already out (the pass ended): its counts are final
		}
		if err != nil {
			s.setStop(1)
			continue
		}
		p.natIP[ip] = int(c.NAT)
		// The set's count is cumulative over the family's maps, which the
		// pass walks in turn: what the maps already counted is final, the
		// rest is the share of the first map not swept (the one walking, or
		// next; the later ones never see the IP).
		pc := p.perIP[ip]
		if pc == nil {
			continue
		}
		for _, k := range kindsOf(ip) {
			if s.progs[k] == nil || p.swept[k] {
				continue
			}
			rest := int(c.CT)
			for _, kk := range kindsOf(ip) {
				if kk != k {
					rest -= pc[kk]
				}
			}
			pc[k] = rest
			break
		}
	}
}

// setFilters writes the address filters of the IPs p still sweeps into
// every program (under s.mu).
func (s *Sweeper) setFilters(p *pass) error {
	var v4, v6 []netip.Addr
	for ip := range p.ips {
		if ip.Is4() {
			v4 = append(v4, ip)
		} else {
			v6 = append(v6, ip)
		}
	}
	f4, f6 := addrFilter(v4), addrFilter(v6)
	for _, prog := range s.progs {
		if prog == nil {
			continue
		}
		f := &f4
		if prog.kind.IPv6() {
			f = &f6
		}
		if err := prog.filter.Set(f); err != nil {
			return fmt.Errorf("sweep: set the address filter of %s: %w", prog.kind.Name(), err)
		}
	}
	return nil
}

// filterWords is FILTER_WORDS in bpf/sweep.c: a 65,536-bit address filter.
const filterWords = 1024

// addrFilter sets the bit of each IP, folded as bpf/sweep.c folds the
// address word it loads (the last four bytes, in the CPU's byte order).
func addrFilter(ips []netip.Addr) (f [filterWords]uint64) {
	for _, ip := range ips {
		b := ip.AsSlice()
		a := binary.NativeEndian.Uint32(b[len(b)-4:])
		bit := (a ^ a>>16) & 0xffff
		f[bit>>6] |= 1 << (bit & 63)
	}
	return f
}

// setKey is an IP's key in ips4 (4 bytes, network order) or ips6 (16 bytes).
func setKey(ip netip.Addr) any {
	if ip.Is4() {
		a := ip.As4()
		return a
	}
	a := ip.As16()
	return a
}

func fillSet(ips4, ips6 *ebpf.Map, v4, v6 []netip.Addr) error {
	var zero ipCount
	for _, ip := range v4 {
		if err := ips4.Put(setKey(ip), zero); err != nil {
			return fmt.Errorf("sweep: add %s to the IP set: %w", ip, err)
		}
	}
	for _, ip := range v6 {
		if err := ips6.Put(setKey(ip), zero); err != nil {
			return fmt.Errorf("sweep: add %s to the IP set: %w", ip, err)
		}
	}
	return nil
}

// clearSet takes a pass's IPs out of the shared IP set; the ones it cannot
// take out stay in s.left.
func (s *Sweeper) clearSet(v4, v6 []netip.Addr) {
	var left []netip.Addr
	for _, ip := range append(v4[:len(v4):len(v4)], v6...) {
		if err := s.unset(ip); err != nil {
			left = append(left, ip)
		}
	}
	s.mu.Lock()
	s.left = append(s.left, left...)
	s.mu.Unlock()
}

// clearLeft retries taking out the IPs earlier passes left in the set; while
// one stays, no pass may run.
func (s *Sweeper) clearLeft() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var err error
	left := s.left[:0]
	for _, ip := range s.left {
		if e := s.unset(ip); e != nil {
			left = append(left, ip)
			err = e
		}
	}
	s.left = left
	if err != nil {
		return fmt.Errorf("sweep refused: %d IPs of an earlier pass are stuck in the sweep's IP set (%w), and a pass would delete their entries too; Reopen the backend or restart scrubd", len(left), err)
	}
	return nil
}

// unset takes ip out of its family's set; an IP not in it is fine (the pass
// failed before it was added).
func (s *Sweeper) unset(ip netip.Addr) error {
	set := s.ips4
	if ip.Is6() {
		set = s.ips6
	}
	if err := set.Delete(setKey(ip)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("remove %s from the sweep's IP set: %w", ip, err)
	}
	return nil
}

// Passes is the number of passes run so far; concurrent callers served by one
// pass advance it once.
func (s *Sweeper) Passes() uint64 { return s.passes.Load() }

// Waiting reports the callers of the pending (not yet started) passes and of
// the running pass; tests use it to know when callers have joined.
func (s *Sweeper) Waiting() (pending, running int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range s.pending {
		if p != nil {
			pending += p.callers
		}
	}
	if s.running != nil {
		running = s.running.callers
	}
	return pending, running
}

// lastStats returns the per-map statistics of the last pass.
func (s *Sweeper) lastStats() [ctmap.NumKinds]PassStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.last
}

// countWalk counts a map's entries with the sweep program in count mode: a
// full in-kernel walk, used only when the kfunc count is unavailable.
func (s *Sweeper) countWalk(k ctmap.Kind) (int64, error) {
	p := s.progs[k]
	if p == nil {
		return 0, fmt.Errorf("count %s: map not present", k.Name())
	}
	// Serialised with the passes: the stop flag belongs to them.
	s.mu.Lock()
	busy := s.running != nil
	s.mu.Unlock()
	if busy {
		return 0, errSweepBusy
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	st, err := p.run(sweepCount)
	if err != nil {
		return 0, err
	}
	if st.Stopped {
		return 0, errSweepBusy
	}
	return int64(st.Visited), nil
}

var errSweepBusy = errors.New("a sweep is running; entry count by walk skipped")

func (s *Sweeper) close() {
	for i, p := range s.progs {
		if p != nil {
			p.close()
			s.progs[i] = nil
		}
	}
	s.ips4.Close()
	s.ips6.Close()
}
