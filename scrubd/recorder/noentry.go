package recorder

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// A flow to a VIP whose service has no backend: Cilium's lb4_local /
// lb6_local return DROP_NO_SERVICE before ct_create, so there is no
// SERVICE entry, no OUT entry, nothing. The recorder saw the packet and
// filed the flow as pending (a pick nobody read); this file settles such a
// flow as "Cilium made no entry" when that is certain, so the IP stays
// complete. The rule and its windows: docs/recorder.md ("Service VIPs",
// "A service without backends").

// settleDelay: how old the flow's latest packet must be before the absence
// of its SERVICE entry is read as Cilium's: the datapath handles a packet
// right after the recorder (the pod's veth, then bpf_lxc on the same
// softirq path: microseconds).
const settleDelay = resolveDelay

// lifetimeMargin is taken off the SERVICE entry's shortest lifetime: the
// datapath keeps lifetimes in whole seconds (or jiffies) and Cilium's GC
// compares them with its own reading of the clock.
const lifetimeMargin = time.Second

// fillPeriod: how often the CT maps' fill is sampled (fill watch).
const fillPeriod = time.Second

// lruFreeTarget is the kernel's LOCAL_FREE_TARGET (kernel/bpf/bpf_lru_list.c,
// since 4.10; since 6.16 the per-map target is at most this): a common
// LRU's CPU refills its free list with up to this many nodes and evicts
// only when the global free list holds fewer.
const lruFreeTarget = 128

// DefaultNodeConfig is where the Cilium agent writes the node's datapath
// configuration (option.Config.GetNodeConfigPath, 1.16 to 1.20): the CT
// lifetimes compiled into bpf_lxc.
const DefaultNodeConfig = "/var/run/cilium/state/globals/node_config.h"

// Lifetimes are the shortest lifetime Cilium's datapath gives a SERVICE
// entry when a packet creates or refreshes it (ct_update_timeout, and the
// close timeout on a FIN or RST), per protocol.
type Lifetimes struct {
	TCP, Other time.Duration
}

// lifetimeDefines are node_config.h's defines that set a SERVICE entry's
// lifetime, in seconds (pkg/datapath/linux/config, 1.16 to 1.20).
var lifetimeDefines = []string{"CT_SERVICE_LIFETIME_TCP", "CT_SERVICE_LIFETIME_NONTCP", "CT_SYN_TIMEOUT", "CT_CLOSE_TIMEOUT"}

// ParseLifetimes reads the SERVICE entries' lifetimes from a node_config.h.
// A define missing is an error: the lifetimes are never assumed.
func ParseLifetimes(b []byte) (Lifetimes, error) {
	v := map[string]time.Duration{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 3 || f[0] != "#define" {
			continue
		}
		for _, d := range lifetimeDefines {
			if f[1] == d {
				s, err := strconv.ParseUint(f[2], 10, 32)
				if err != nil {
					return Lifetimes{}, fmt.Errorf("%s %q: %w", d, f[2], err)
				}
				v[d] = time.Duration(s) * time.Second
			}
		}
	}
	for _, d := range lifetimeDefines {
		if _, ok := v[d]; !ok {
			return Lifetimes{}, fmt.Errorf("no #define %s", d)
		}
	}
	return Lifetimes{
		TCP:   min(v["CT_SERVICE_LIFETIME_TCP"], v["CT_SYN_TIMEOUT"], v["CT_CLOSE_TIMEOUT"]),
		Other: v["CT_SERVICE_LIFETIME_NONTCP"],
	}, nil
}

// lifetimes reads the node's lifetimes, again whenever the file changes,
// and keeps the shortest ever read: entries refreshed by programs built
// from an older configuration may still be there.
type lifetimes struct {
	mu   sync.Mutex
	path string
	stat [2]int64 // mtime, size of the last read
	lt   Lifetimes
	err  error
}

func (l *lifetimes) get() (Lifetimes, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.path == "" {
		return Lifetimes{}, errors.New("no Cilium node configuration to read lifetimes from")
	}
	fi, err := os.Stat(l.path)
	if err != nil {
		return Lifetimes{}, fmt.Errorf("Cilium's node configuration %s: %w (mount the agent's state directory into scrubd)", l.path, err)
	}
	st := [2]int64{fi.ModTime().UnixNano(), fi.Size()}
	if st == l.stat && l.err == nil {
		return l.lt, nil
	}
	b, err := os.ReadFile(l.path)
	if err == nil {
		var lt Lifetimes
		if lt, err = ParseLifetimes(b); err == nil {
			if l.lt.TCP == 0 {
				l.lt = lt
			}
			l.lt.TCP, l.lt.Other = min(l.lt.TCP, lt.TCP), min(l.lt.Other, lt.Other)
		}
	}
	if err != nil {
		l.err = fmt.Errorf("Cilium's node configuration %s: %w", l.path, err)
		return Lifetimes{}, l.err
	}
	l.stat, l.err = st, nil
	return l.lt, nil
}

// fillWatch samples the fill of Cilium's CT maps: an LRU evicts only near
// full, so a map whose every sample since before a flow's first packet
// stayed well below full evicted nothing of it.
type fillWatch struct {
	mu       sync.Mutex
	calmFrom [ctmap.NumKinds]int64 // first good sample of the current unbroken run of good ones (0: none)
	last     [ctmap.NumKinds]int64 // the latest sample
}

// monoNow is CLOCK_MONOTONIC in ns: bpf_ktime_get_ns's clock.
func monoNow() int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		panic(err) // cannot fail on Linux
	}
	return ts.Nano()
}

// fillGood samples map k (r.ctMu held): good when the map is a common LRU
// (per-CPU LRUs evict by each CPU's share) filled to at most half and far
// from the fill at which the kernel can evict (every CPU's local free list
// and the global target taken off, twice over).
func (r *Recorder) fillGood(k ctmap.Kind) bool {
	ct := r.opts.CT
	if ct == nil || r.opts.CTFill == nil {
		return false
	}
	m := ct.Map(k)
	if m == nil || m.Type() != ebpf.LRUHash || m.Flags()&unix.BPF_F_NO_COMMON_LRU != 0 {
		return false
	}
	cpus, err := ebpf.PossibleCPU()
	if err != nil {
		return false
	}
	n, err := r.opts.CTFill(k)
	if err != nil || n < 0 {
		return false
	}
	max := int64(m.MaxEntries())
	return n <= max/2 && n+2*lruFreeTarget*int64(cpus+1) <= max
}

// sampleFill takes one sample of map k at now and updates its run.
func (r *Recorder) sampleFill(k ctmap.Kind, now int64) bool {
	good := r.fillGood(k)
	w := &r.fill
	w.mu.Lock()
	defer w.mu.Unlock()
	switch {
	case !good:
		w.calmFrom[k] = 0
	case w.calmFrom[k] == 0 || now-w.last[k] > int64(2*fillPeriod):
		w.calmFrom[k] = now // a gap in the samples: the run starts again
	}
	w.last[k] = now
	return good
}

// calm reports whether map k can have evicted nothing since since: a
// sample now is good, and so was every sample since one at or before since.
func (r *Recorder) calm(k ctmap.Kind, since int64) bool {
	if !r.sampleFill(k, monoNow()) {
		return false
	}
	r.fill.mu.Lock()
	defer r.fill.mu.Unlock()
	return r.fill.calmFrom[k] != 0 && r.fill.calmFrom[k] <= since
}

// WatchFill samples the CT maps' fill every fillPeriod until ctx ends (Run
// starts it; a harness without Run may start it itself). Without
// Options.CTFill it returns at once: no flow is then settled as no entry.
func (r *Recorder) WatchFill(done <-chan struct{}) {
	if r.opts.CTFill == nil {
		return
	}
	t := time.NewTicker(fillPeriod)
	defer t.Stop()
	for {
		r.ctMu.RLock()
		now := monoNow()
		for _, k := range ctmap.Kinds {
			r.sampleFill(k, now)
		}
		r.ctMu.RUnlock()
		select {
		case <-done:
			return
		case <-t.C:
		}
	}
}

// resetFill forgets every run (the CT maps were replaced).
func (r *Recorder) resetFill() {
	r.fill.mu.Lock()
	r.fill.calmFrom = [ctmap.NumKinds]int64{}
	r.fill.mu.Unlock()
}

// svcNone is the flow-cache value of a service flow whose SERVICE entry
// was absent at the pod's latest packet (SVC_FLOW|SVC_NONE in
// bpf/recorder.c): last is then that packet's time.
const svcNone = 1 | 2

// flowTime reads the flow cache's entry of s's flow: the time of the pod's
// latest packet on it (an upper bound, CLOCK_MONOTONIC ns) when its SERVICE
// entry was absent at that packet. why says why there is none.
func (r *Recorder) flowTime(s index.Service, now int64) (ts int64, why string) {
	var key []byte
	m := r.objs.RecFlows4
	if s.V6 {
		m = r.objs.RecFlows6
		key = make([]byte, 40)
		pod, vip := s.K6.SAddr().As16(), s.K6.DAddr().As16()
		copy(key[0:16], pod[:])
		copy(key[16:32], vip[:])
		putPorts(key[32:], s.K6.DPort(), s.K6.SPort(), s.K6.NextHdr())
	} else {
		key = make([]byte, 16)
		pod, vip := s.K4.SAddr().As4(), s.K4.DAddr().As4()
		copy(key[0:4], pod[:])
		copy(key[4:8], vip[:])
		putPorts(key[8:], s.K4.DPort(), s.K4.SPort(), s.K4.NextHdr())
	}
	if m == nil {
		return 0, "no flow cache"
	}
	// Read twice: the program writes svc and last in one 8-byte store,
	// and a lookup's copy is not guaranteed to read them in one.
	var v1, v2 [16]byte
	if err := m.Lookup(key, &v1); err != nil {
		return 0, "the flow is no longer in the recorder's flow cache"
	}
	if err := m.Lookup(key, &v2); err != nil || v1 != v2 {
		return 0, "the flow's cache entry changed while read"
	}
	if v1[1] != svcNone {
		return 0, "a packet of the flow found a SERVICE entry"
	}
	last := uint64(uint32(v1[4]) | uint32(v1[5])<<8 | uint32(v1[6])<<16 | uint32(v1[7])<<24)
	units := uint64(now) >> SvcTimeShift
	full := units - uint64(uint32(units)-uint32(last)) // the latest time <= now with these low 32 bits
	return int64((full+1)<<SvcTimeShift) - 1, ""
}

// putPorts writes a flow-cache key's tail: the pod's port, the VIP's
// port (network order), the protocol, 3 bytes of padding.
func putPorts(b []byte, lport, rport uint16, proto uint8) {
	b[0], b[1] = byte(lport>>8), byte(lport)
	b[2], b[3] = byte(rport>>8), byte(rport)
	b[4] = proto
}

// noEntry decides whether s, whose SERVICE entry the caller found absent,
// can be settled as a flow Cilium made no entry for (and settles it).
// Eligible: no pick read, and either pending since a known time (Since)
// or already settled. Settled when all of these hold:
//   - the flow cache holds the flow, and its latest packet found no entry;
//   - that packet is older than settleDelay (Cilium has handled it), the
//     entry is still absent after that, and
//   - the run's first possible packet (Since) is younger than the SERVICE
//     entry's shortest lifetime on this node: an entry a packet made
//     cannot have expired, so Cilium's GC cannot have deleted it;
//   - the flow's CT map was far from full at every sample since before
//     Since: the LRU cannot have evicted it.
//
// A settled flow whose latest packet is still the settled one stays
// settled. retry > 0: only the latest packet's age failed; try again then.
func (r *Recorder) noEntry(ix *index.Index, ip netip.Addr, ct *ctmap.Maps, s index.Service) (settled bool, retry time.Duration, why string) {
	if len(s.Read) > 0 || !(s.NoEntry || s.Pending && s.Since > 0) {
		return false, 0, ""
	}
	lt, err := r.life.get()
	if err != nil {
		return false, 0, err.Error()
	}
	life, kind := lt.Other, s.K4.Kind()
	if s.V6 {
		kind = s.K6.Kind()
	}
	if kind == ctmap.TCP4 || kind == ctmap.TCP6 {
		life = lt.TCP
	}
	ts, why := r.flowTime(s, monoNow())
	if why != "" {
		return false, 0, why
	}
	t0 := monoNow()
	var e ctmap.Entry
	if s.V6 {
		err = ct.Map(kind).Lookup(s.K6, &e)
	} else {
		err = ct.Map(kind).Lookup(s.K4, &e)
	}
	if !errors.Is(err, ebpf.ErrKeyNotExist) {
		return false, 0, "the SERVICE entry appeared"
	}
	t1 := monoNow()
	if s.NoEntry && ts == s.Since {
		// No packet since the settled one. The cache's time wraps after
		// 2^52 ns: past half of that, a new packet could read the same.
		if t1-s.Since < 1<<51 {
			return true, 0, ""
		}
		return false, 0, "settled too long ago to tell a later packet"
	}
	switch {
	case ts < s.Since-(1<<SvcTimeShift):
		return false, 0, "the flow cache's time is older than the flow's record"
	case ts+int64(settleDelay) > t0:
		return false, time.Duration(ts + int64(settleDelay) - t0 + 1), "the flow's latest packet is too recent for Cilium to have handled it"
	case time.Duration(t1-s.Since) >= life-lifetimeMargin:
		return false, 0, fmt.Sprintf("the flow's first packet without an entry is older than the SERVICE entry's shortest lifetime on this node (%v): an entry may have expired", life)
	case !r.calm(kind, s.Since):
		return false, 0, "the CT map was not far from full at every sample since the flow's first packet (an LRU eviction cannot be excluded)"
	}
	ix.ServiceNoEntry(ip, s, ts)
	r.noEntries.Add(1)
	return true, 0, ""
}

// ServiceNoEntries counts the flows settled as "Cilium made no entry".
func (r *Recorder) ServiceNoEntries() uint64 { return r.noEntries.Load() }
