package expiry

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// The audit: each expiry pass also copies out, in the kernel, the CT keys of
// a rotating sample of the IPs the index calls complete, and user space checks
// that every one of them is covered by the index (index.Covered: what a
// scrub of the IP deletes). A key that is not is a miss: counted, logged once,
// the IP marked incomplete (its next scrub sweeps), kept in a short ring for
// `scrubd audit`. See docs/expiry.md, "The audit".
//
// Reads are ordered so that a miss is certain: the IP's index generation is
// read before the kernel walk, the index after it, and a candidate miss is
// confirmed only after AuditConfig.Confirm (records of flows whose entry
// Cilium created before the recorder saw the packet, or still in the ring
// buffer, get applied meanwhile), and only if the entry still exists, no scrub
// took the IP's keys since before the walk (index.Gen), the IP is still
// complete and no scrub of it is running.

// Sizes in bpf/expiry.c.
const (
	auditMaxIPs  = 4096  // AUDIT_MAX_IPS
	auditMaxKeys = 32768 // AUDIT_MAX_KEYS, per map
)

// AuditConfig switches the audit on (Runner.EnableAudit).
type AuditConfig struct {
	Index *index.Index
	// Owned reports whether an attached pod holds ip; nil: none does.
	Owned func(netip.Addr) bool
	// Busy reports whether a scrub of ip is running: its keys are moving
	// between the index and the kernel, so it is not audited this pass.
	Busy func(netip.Addr) bool
	// MaxIPs bounds the IPs audited per pass (default 256, at most 4096):
	// every complete IP is audited within ceil(complete IPs / MaxIPs)
	// intervals.
	MaxIPs int
	// Confirm is how long a candidate miss waits before it is re-checked
	// (default 2 s).
	Confirm time.Duration
	// Ring is the number of recent misses kept for `scrubd audit` (default 64).
	Ring int
}

// Miss is one key of a complete IP that the index did not cover.
type Miss struct {
	IP        netip.Addr `json:"ip"`
	Map       string     `json:"map"`
	Key       string     `json:"key"`
	Direction string     `json:"direction"`
	Related   bool       `json:"related"`
	Protocol  string     `json:"protocol"`
	Owned     bool       `json:"owned"` // an attached pod held the IP
	At        time.Time  `json:"at"`
}

type auditor struct {
	cfg AuditConfig
	ix  *index.Index
	log *slog.Logger
	m   *auditMetrics

	mu      sync.Mutex
	audited map[netip.Addr]time.Time // last audit of a complete IP
	since   map[netip.Addr]time.Time // complete, never audited: first seen so
	unowned map[netip.Addr]int       // keys found at the last audit of an IP with no owner
	logged  map[string]bool          // misses already logged (bounded)
	ring    []Miss
}

type auditMetrics struct {
	missing *prometheus.CounterVec
	checked prometheus.Counter
	oldest  prometheus.Gauge
	unowned prometheus.Gauge
	found   prometheus.Counter
}

func newAuditMetrics(reg prometheus.Registerer) (*auditMetrics, error) {
	m := &auditMetrics{
		missing: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ctscrub_audit_missing_keys_total",
			Help: "CT keys of IPs the index called complete that a scrub would not have deleted (the IP is then marked incomplete).",
		}, []string{"map", "direction", "related", "protocol"}),
		checked: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ctscrub_audit_ips_checked_total",
			Help: "Complete IPs whose CT keys the audit compared with the index.",
		}),
		found: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ctscrub_audit_keys_checked_total",
			Help: "CT keys of audited IPs the audit found in the kernel and checked.",
		}),
		oldest: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "ctscrub_audit_oldest_unaudited_seconds",
			Help: "How long the complete IP audited longest ago has gone without an audit (since it became complete, if never).",
		}),
		unowned: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "ctscrub_audit_unowned_keys",
			Help: "CT keys found at their last audit for complete IPs no attached pod holds and no scrub is running for.",
		}),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.missing, m.checked, m.found, m.oldest, m.unowned} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("register audit metrics: %w", err)
			}
		}
	}
	return m, nil
}

// EnableAudit switches the audit on for every following pass; metrics go to
// reg. It needs the pass's programs (mode report or sweep).
func (r *Runner) EnableAudit(cfg AuditConfig, reg prometheus.Registerer) error {
	if r.cfg.Mode == ModeOff {
		return errors.New("audit: the expiry pass is off (expiry.mode: off); the audit runs in its walk")
	}
	if cfg.Index == nil {
		return errors.New("audit: no index")
	}
	if cfg.MaxIPs <= 0 {
		cfg.MaxIPs = 256
	}
	cfg.MaxIPs = min(cfg.MaxIPs, auditMaxIPs)
	if cfg.Confirm <= 0 {
		cfg.Confirm = 2 * time.Second
	}
	if cfg.Ring <= 0 {
		cfg.Ring = 64
	}
	m, err := newAuditMetrics(reg)
	if err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.audit = &auditor{
		cfg: cfg, ix: cfg.Index, log: r.log, m: m,
		audited: map[netip.Addr]time.Time{},
		since:   map[netip.Addr]time.Time{},
		unowned: map[netip.Addr]int{},
		logged:  map[string]bool{},
	}
	return nil
}

// AuditBound is the time within which every complete IP is audited, for n
// complete IPs: ceil(n / MaxIPs) intervals (plus a pass and the confirm wait).
func (r *Runner) AuditBound(n int) time.Duration {
	r.mu.Lock()
	a := r.audit
	r.mu.Unlock()
	if a == nil {
		return 0
	}
	passes := max(1, (n+a.cfg.MaxIPs-1)/a.cfg.MaxIPs)
	return time.Duration(passes) * r.cfg.Interval
}

// RecentMisses returns the last misses, oldest first.
func (r *Runner) RecentMisses() []Miss {
	r.mu.Lock()
	a := r.audit
	r.mu.Unlock()
	if a == nil {
		return nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	return slices.Clone(a.ring)
}

// sample is what one pass audits: the IPs and their index generation read
// before the kernel walk.
type sample struct {
	ips  []netip.Addr
	gens map[netip.Addr]uint64
}

// pick chooses the IPs of this pass: complete IPs with no running scrub,
// audited longest ago first (never audited first), at most MaxIPs, and
// about as many keys as the kernel buffers hold.
func (a *auditor) pick(now time.Time) sample {
	a.mu.Lock()
	defer a.mu.Unlock()
	type cand struct {
		ip    netip.Addr
		last  time.Time
		keys  int
		never bool
	}
	var cands []cand
	present := map[netip.Addr]bool{}
	for _, ip := range a.ix.IPs() {
		st := a.ix.State(ip)
		if !st.Complete {
			continue
		}
		present[ip] = true
		last, audited := a.audited[ip]
		if !audited {
			var ok bool
			if last, ok = a.since[ip]; !ok {
				last = now
				a.since[ip] = now
			}
		}
		if a.cfg.Busy != nil && a.cfg.Busy(ip) {
			continue
		}
		cands = append(cands, cand{ip, last, st.Keys, !audited})
	}
	// Forget IPs that are no longer complete (or gone): they are audited
	// afresh when they are complete again.
	for _, m := range []map[netip.Addr]time.Time{a.audited, a.since} {
		for ip := range m {
			if !present[ip] {
				delete(m, ip)
			}
		}
	}
	for ip := range a.unowned {
		if !present[ip] {
			delete(a.unowned, ip)
		}
	}
	// Never audited first, then audited longest ago.
	slices.SortStableFunc(cands, func(x, y cand) int {
		if x.never != y.never {
			if x.never {
				return -1
			}
			return 1
		}
		return x.last.Compare(y.last)
	})
	s := sample{gens: map[netip.Addr]uint64{}}
	// A key is found in one map per family; the budget leaves room for
	// peers' keys and the forms Covered adds.
	budget := [2]int{auditMaxKeys / 2, auditMaxKeys / 2}
	for _, c := range cands {
		if len(s.ips) >= a.cfg.MaxIPs {
			break
		}
		f := 0
		if c.ip.Is6() {
			f = 1
		}
		if c.keys > budget[f] && len(s.ips) > 0 {
			continue
		}
		budget[f] -= c.keys
		s.ips = append(s.ips, c.ip)
		s.gens[c.ip] = a.ix.Gen(c.ip)
	}
	return s
}

// setAudit loads the IP set of the map's family into its program.
func (p *mapPass) setAudit(ips []netip.Addr) error {
	var mine []netip.Addr
	for _, ip := range ips {
		if ip.Is6() == p.kind.IPv6() {
			mine = append(mine, ip)
		}
	}
	for _, ip := range p.auditSet {
		if !slices.Contains(mine, ip) {
			if err := p.auditIPs.Delete(auditKey(ip)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
				return fmt.Errorf("audit: drop %s from the IP set of %s: %w", ip, p.kind.Name(), err)
			}
		}
	}
	for _, ip := range mine {
		if err := p.auditIPs.Put(auditKey(ip), uint32(0)); err != nil {
			return fmt.Errorf("audit: add %s to the IP set of %s: %w", ip, p.kind.Name(), err)
		}
	}
	if err := p.auditFilter.Set(auditFilter(mine)); err != nil {
		return fmt.Errorf("audit: set the address filter of %s: %w", p.kind.Name(), err)
	}
	p.auditSet = mine
	return nil
}

func auditKey(ip netip.Addr) any {
	if ip.Is4() {
		return ip.As4()
	}
	return ip.As16()
}

// auditFilter sets the bit of each IP as bpf/expiry.c hashes the address word
// it loads (the last four bytes, in the CPU's byte order).
func auditFilter(ips []netip.Addr) (f [1024]uint64) {
	for _, ip := range ips {
		b := ip.AsSlice()
		w := binary.NativeEndian.Uint32(b[len(b)-4:])
		bit := (w * 2654435761) >> 16
		f[bit>>6] |= 1 << (bit & 63)
	}
	return f
}

// auditFound is what one map's pass copied out.
type auditFound struct {
	k4       []ctmap.CTKey4
	k6       []ctmap.CTKey6
	overflow uint64
}

// readAudit reads the keys the last run copied out.
func (p *mapPass) readAudit(out passArgs) (auditFound, error) {
	f := auditFound{overflow: out.AuditOverflow}
	n := int(min(out.AuditFound, auditMaxKeys))
	if out.Audit == 0 || n == 0 {
		return f, nil
	}
	idx := make([]uint32, n)
	var cur ebpf.MapBatchCursor
	var err error
	var got int
	if p.kind.IPv6() {
		f.k6 = make([]ctmap.CTKey6, n)
		got, err = p.auditKeys.BatchLookup(&cur, idx, f.k6, nil)
		f.k6 = f.k6[:got]
	} else {
		f.k4 = make([]ctmap.CTKey4, n)
		got, err = p.auditKeys.BatchLookup(&cur, idx, f.k4, nil)
		f.k4 = f.k4[:got]
	}
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return f, fmt.Errorf("audit: read the keys found in %s: %w", p.kind.Name(), err)
	}
	return f, nil
}

// candidate is a kernel key of an audited IP its index did not cover.
type candidate struct {
	ip   netip.Addr
	kind ctmap.Kind
	k4   ctmap.CTKey4
	k6   ctmap.CTKey6
	v6   bool
}

// check compares what the walk found with the index. complete says every map
// was walked to its end: only then are the sample's IPs counted audited.
func (a *auditor) check(ctx context.Context, maps *ctmap.Maps, s sample, found map[ctmap.Kind]auditFound, complete bool, now time.Time) {
	in := make(map[netip.Addr]bool, len(s.ips))
	for _, ip := range s.ips {
		in[ip] = true
	}
	type ipKeys struct {
		k4 map[ctmap.CTKey4]ctmap.Kind
		k6 map[ctmap.CTKey6]ctmap.Kind
	}
	per := map[netip.Addr]*ipKeys{}
	get := func(ip netip.Addr) *ipKeys {
		p := per[ip]
		if p == nil {
			p = &ipKeys{k4: map[ctmap.CTKey4]ctmap.Kind{}, k6: map[ctmap.CTKey6]ctmap.Kind{}}
			per[ip] = p
		}
		return p
	}
	overflow := [2]bool{}
	for kind, f := range found {
		if f.overflow > 0 {
			overflow[b2i(kind.IPv6())] = true
			a.log.Warn("audit: more keys of the sampled IPs than the buffer holds; the rest are checked on later passes", "map", kind.Name(), "not_checked", f.overflow)
		}
		for _, k := range f.k4 {
			for _, ip := range [2]netip.Addr{k.DAddr(), k.SAddr()} {
				if in[ip] {
					get(ip).k4[k] = kind
				}
			}
		}
		for _, k := range f.k6 {
			for _, ip := range [2]netip.Addr{k.DAddr(), k.SAddr()} {
				if in[ip] {
					get(ip).k6[k] = kind
				}
			}
		}
	}
	var cands []candidate
	checked := 0
	for _, ip := range s.ips {
		keys := per[ip]
		if keys == nil {
			keys = &ipKeys{}
		}
		// The index, read after the walk; its generation unchanged since
		// before the walk: no scrub took its keys in between.
		c4, c6, st := a.ix.ScrubKeys(ip)
		if !st.Complete || a.ix.Gen(ip) != s.gens[ip] || (a.cfg.Busy != nil && a.cfg.Busy(ip)) {
			continue
		}
		cov4 := make(map[ctmap.CTKey4]bool, len(c4))
		for _, k := range c4 {
			cov4[k] = true
		}
		cov6 := make(map[ctmap.CTKey6]bool, len(c6))
		for _, k := range c6 {
			cov6[k] = true
		}
		for k, kind := range keys.k4 {
			if !cov4[k] {
				cands = append(cands, candidate{ip: ip, kind: kind, k4: k})
			}
		}
		for k, kind := range keys.k6 {
			if !cov6[k] {
				cands = append(cands, candidate{ip: ip, kind: kind, k6: k, v6: true})
			}
		}
		a.m.found.Add(float64(len(keys.k4) + len(keys.k6)))
		owned := a.cfg.Owned != nil && a.cfg.Owned(ip)
		a.mu.Lock()
		if owned {
			delete(a.unowned, ip)
		} else {
			a.unowned[ip] = len(keys.k4) + len(keys.k6)
		}
		if complete && !overflow[b2i(ip.Is6())] {
			a.audited[ip] = now
			delete(a.since, ip)
			checked++
		}
		a.mu.Unlock()
	}
	a.m.checked.Add(float64(checked))
	if len(cands) > 0 {
		select {
		case <-ctx.Done():
			// Unconfirmed: the next audit of these IPs finds them again.
		case <-time.After(a.cfg.Confirm):
			for _, c := range cands {
				a.confirm(maps, s, c)
			}
		}
	}
	a.publish(now)
}

// confirm counts a candidate miss only if it is certain (see the top of the
// file).
func (a *auditor) confirm(maps *ctmap.Maps, s sample, c candidate) {
	m := maps.Map(c.kind)
	if m == nil {
		return
	}
	var val ctmap.Entry
	var err error
	if c.v6 {
		err = m.Lookup(c.k6, &val)
	} else {
		err = m.Lookup(c.k4, &val)
	}
	if err != nil {
		return // gone meanwhile: nothing left behind
	}
	if a.cfg.Busy != nil && a.cfg.Busy(c.ip) {
		return
	}
	c4, c6, st := a.ix.ScrubKeys(c.ip)
	if !st.Complete || a.ix.Gen(c.ip) != s.gens[c.ip] {
		return
	}
	if c.v6 && slices.Contains(c6, c.k6) || !c.v6 && slices.Contains(c4, c.k4) {
		return // recorded since the walk
	}
	var t ctmap.Tuple
	if c.v6 {
		t = c.k6.Tuple()
	} else {
		t = c.k4.Tuple()
	}
	miss := Miss{
		IP: c.ip, Map: c.kind.Name(), Key: t.String(), Direction: direction(t.Flags),
		Related: t.Flags&ctmap.FlagRelated != 0, Protocol: protocol(t.NextHdr),
		Owned: a.cfg.Owned != nil && a.cfg.Owned(c.ip), At: time.Now().UTC(),
	}
	a.m.missing.WithLabelValues(miss.Map, miss.Direction, strconv.FormatBool(miss.Related), miss.Protocol).Inc()
	a.ix.MarkIncomplete(c.ip, index.ReasonAuditMiss)
	a.mu.Lock()
	id := c.ip.String() + " " + miss.Map + " " + miss.Key
	first := !a.logged[id]
	if first {
		if len(a.logged) >= 4096 {
			clear(a.logged)
		}
		a.logged[id] = true
	}
	a.ring = append(a.ring, miss)
	if len(a.ring) > a.cfg.Ring {
		a.ring = a.ring[len(a.ring)-a.cfg.Ring:]
	}
	delete(a.audited, c.ip)
	delete(a.since, c.ip)
	a.mu.Unlock()
	if first {
		a.log.Warn("audit: CT entry of a complete IP missing from the index; IP marked incomplete (its next scrub sweeps)",
			"ip", c.ip, "map", miss.Map, "key", miss.Key, "owned", miss.Owned)
	}
}

// publish sets the age and no-owner gauges.
func (a *auditor) publish(now time.Time) {
	a.mu.Lock()
	defer a.mu.Unlock()
	var oldest time.Duration
	for _, m := range []map[netip.Addr]time.Time{a.audited, a.since} {
		for _, t := range m {
			oldest = max(oldest, now.Sub(t))
		}
	}
	a.m.oldest.Set(oldest.Seconds())
	n := 0
	for _, k := range a.unowned {
		n += k
	}
	a.m.unowned.Set(float64(n))
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

func direction(flags uint8) string {
	switch {
	case flags&ctmap.FlagService != 0:
		return "service"
	case flags&ctmap.FlagIn != 0:
		return "in"
	}
	return "out"
}

func protocol(p uint8) string {
	switch p {
	case ctmap.ProtoTCP:
		return "tcp"
	case ctmap.ProtoUDP:
		return "udp"
	case ctmap.ProtoICMP:
		return "icmp"
	case ctmap.ProtoICMPv6:
		return "icmpv6"
	}
	return strconv.Itoa(int(p))
}

// runAudit is the audit's share of Pass: load the sample before the walk
// (returned), and check what it found after.
func (r *Runner) loadAudit(now time.Time) sample {
	if r.audit == nil {
		return sample{}
	}
	s := r.audit.pick(now)
	for _, p := range r.passes {
		if p == nil {
			continue
		}
		if err := p.setAudit(s.ips); err != nil {
			r.log.Error("audit: no audit this pass", "err", err)
			for _, p := range r.passes {
				if p != nil {
					p.setAudit(nil)
				}
			}
			return sample{}
		}
	}
	return s
}

func (r *Runner) checkAudit(ctx context.Context, s sample, rep Report, walked bool, now time.Time) {
	if r.audit == nil || len(s.ips) == 0 {
		if r.audit != nil {
			r.audit.publish(now)
		}
		return
	}
	found := map[ctmap.Kind]auditFound{}
	for _, mr := range rep.Maps {
		found[mr.kind] = mr.audit
	}
	r.audit.check(ctx, r.maps, s, found, walked && len(rep.Maps) == r.numPasses(), now)
}

func (r *Runner) numPasses() int {
	n := 0
	for _, p := range r.passes {
		if p != nil {
			n++
		}
	}
	return n
}

// FoundKey is a CT key an on-demand audit found in the kernel.
type FoundKey struct {
	Map ctmap.Kind
	K4  ctmap.CTKey4
	K6  ctmap.CTKey6
	V6  bool
}

// Has reports whether the key holds ip.
func (f FoundKey) Has(ip netip.Addr) bool {
	if f.V6 {
		return f.K6.Has(ip)
	}
	return f.K4.Has(ip)
}

// ErrAuditOff is CollectKeys's error when the expiry pass is off.
var ErrAuditOff = errors.New("audit: the expiry pass is off (expiry.mode: off); the audit needs its program")

// CollectKeys runs one read-only pass (no deletes, no metrics, no clock
// evidence) over the maps of the IPs' families and returns every CT key that
// holds one of ips: `scrubd audit --ip`. It waits for a running pass.
func (r *Runner) CollectKeys(ctx context.Context, ips []netip.Addr) ([]FoundKey, error) {
	if r.cfg.Mode == ModeOff {
		return nil, ErrAuditOff
	}
	if len(ips) > auditMaxIPs {
		return nil, fmt.Errorf("audit: %d IPs, at most %d at once", len(ips), auditMaxIPs)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []FoundKey
	for _, p := range r.passes {
		if p == nil {
			continue
		}
		if err := p.setAudit(ips); err != nil {
			return nil, err
		}
		if len(p.auditSet) == 0 {
			continue
		}
		args, _, err := p.run(ctx, r.params(false, r.decision.Clock))
		if err != nil {
			return nil, err
		}
		if args.Stopped != 0 {
			return nil, fmt.Errorf("audit: pass over %s stopped: %w", p.kind.Name(), context.Cause(ctx))
		}
		f, err := p.readAudit(args)
		if err != nil {
			return nil, err
		}
		if f.overflow > 0 {
			return nil, fmt.Errorf("audit: the IPs hold more than %d keys in %s; audit fewer IPs at once", auditMaxKeys, p.kind.Name())
		}
		for _, k := range f.k4 {
			out = append(out, FoundKey{Map: p.kind, K4: k})
		}
		for _, k := range f.k6 {
			out = append(out, FoundKey{Map: p.kind, K6: k, V6: true})
		}
	}
	for _, p := range r.passes {
		if p != nil {
			p.setAudit(nil)
		}
	}
	return out, nil
}
