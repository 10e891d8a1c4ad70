package expiry

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/bpf"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// Clock indices in bpf/expiry.c.
const (
	clockKtime   = 0
	clockJiffies = 1
	numClocks    = 2
)

const flagSweep = 1 // EXPIRY_F_SWEEP

// jiffiesFloor is the smallest jiffies >> 8 a 64-bit kernel can show:
// jiffies_64 starts at INITIAL_JIFFIES = 2^32 - 300*HZ, HZ <= 1024. A lifetime
// below it cannot be in the jiffies clock (uptimes under ~194 days: seconds of
// ktime all lie below it).
const jiffiesFloor = ((1 << 32) - 300*1024) >> 8

// clockStats mirrors struct clock_stats in bpf/expiry.c.
type clockStats struct {
	Live, Expired, Plausible, Implausible uint64
	MinExpired                            uint32
	_                                     uint32
}

// passArgs mirrors struct expiry_args in bpf/expiry.c (200 bytes): the
// BPF_PROG_TEST_RUN context, parameters in, counters out.
type passArgs struct {
	Flags     uint32
	Clock     uint32
	MaxFuture [numClocks]uint32
	Floor     [numClocks]uint32

	NowKtimeNs   uint64
	NowJiffies64 uint64
	Now          [numClocks]uint32
	Stopped      uint32
	_            uint32
	Visited      uint64
	Deleted      uint64
	Refreshed    uint64
	Guarded      uint64
	C            [numClocks]clockStats

	Audit         uint32 // copy out the keys of the audited IPs (audit.go)
	_             uint32
	AuditFound    uint64
	AuditOverflow uint64
	NATDeleted    uint64 // SNAT mappings deleted with the expired entries
}

// mapPass is bpf/expiry.c loaded for one CT map.
type mapPass struct {
	kind ctmap.Kind
	coll *ebpf.Collection
	prog *ebpf.Program
	stop *ebpf.Variable
	mu   sync.Mutex // one pass at a time: the stop flag is per program

	// The audit's IP set and key buffer (audit_ips4/6, audit_keys4/6,
	// audit_filter4/6 of this map's family) and the IPs loaded in them.
	auditIPs    *ebpf.Map
	auditKeys   *ebpf.Map
	auditFilter *ebpf.Variable
	auditSet    []netip.Addr
}

// loadExpirySpec is bpf/expiry.c's object. Tests of the pass's delete race
// load the same source built with its refresh hook instead
// (internal/testsupport/standin), which scrubd never ships.
var loadExpirySpec = bpf.LoadExpiry

// loadPass loads the expiry program for map m of kind k, with m in place of
// the program's placeholder map, and nat (nil: none) in place of its SNAT
// map's: the pass deletes the SNAT mappings of the expired entries it
// deletes, as Cilium's GC does (bpf/include/ctscrub_nat.h).
func loadPass(k ctmap.Kind, m, nat *ebpf.Map) (*mapPass, error) {
	spec, err := loadExpirySpec()
	if err != nil {
		return nil, fmt.Errorf("load expiry program spec: %w", err)
	}
	mapName, progName, other, otherProg := "ct4", "expiry4", "ct6", "expiry6"
	fam, otherFam := "4", "6"
	if k.IPv6() {
		mapName, progName, other, otherProg = "ct6", "expiry6", "ct4", "expiry4"
		fam, otherFam = "6", "4"
	}
	delete(spec.Programs, otherProg)
	delete(spec.Maps, other)
	delete(spec.Maps, "audit_ips"+otherFam)
	delete(spec.Maps, "audit_keys"+otherFam)
	ms := spec.Maps[mapName]
	ms.Type = m.Type()
	ms.MaxEntries = m.MaxEntries()
	ms.Flags = m.Flags()
	repl := map[string]*ebpf.Map{mapName: m}
	if nat != nil {
		ns := spec.Maps["nat"+fam]
		ns.Type, ns.MaxEntries, ns.Flags = nat.Type(), nat.MaxEntries(), nat.Flags()
		repl["nat"+fam] = nat
	}
	coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{MapReplacements: repl})
	if err != nil {
		return nil, fmt.Errorf("load expiry program for %s: %w (needs root and a kernel with BPF_PROG_TYPE_SYSCALL, 5.14+)", k.Name(), err)
	}
	p := &mapPass{kind: k, coll: coll, prog: coll.Programs[progName], stop: coll.Variables["stop"],
		auditIPs: coll.Maps["audit_ips"+fam], auditKeys: coll.Maps["audit_keys"+fam], auditFilter: coll.Variables["audit_filter"+fam]}
	if p.prog == nil || p.stop == nil || p.auditIPs == nil || p.auditKeys == nil || p.auditFilter == nil {
		coll.Close()
		return nil, fmt.Errorf("load expiry program for %s: program %s, variable stop or the audit maps missing from bpf/expiry_bpfel.o (run make generate)", k.Name(), progName)
	}
	return p, nil
}

func (p *mapPass) Close() { p.coll.Close() }

// errStopped reports a pass the stop flag ended early.
var errStopped = errors.New("pass stopped early")

// run runs one pass with args. When ctx ends during the pass, the stop flag
// ends it within one element; the counters then cover what it visited and
// Stopped is set.
func (p *mapPass) run(ctx context.Context, args passArgs) (passArgs, time.Duration, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := ctx.Err(); err != nil {
		return passArgs{}, 0, err
	}
	if err := p.stop.Set(uint32(0)); err != nil {
		return passArgs{}, 0, fmt.Errorf("clear stop flag: %w", err)
	}
	done := make(chan struct{})
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		select {
		case <-ctx.Done():
			// Errors here cannot happen on a loaded program (the .bss is
			// mmapped); the pass then ends on its own.
			_ = p.stop.Set(uint32(1))
		case <-done:
		}
	}()
	if len(p.auditSet) > 0 {
		args.Audit = 1
	}
	out := args
	start := time.Now()
	_, err := p.prog.Run(&ebpf.RunOptions{Context: args, ContextOut: &out})
	took := time.Since(start)
	close(done)
	<-watched
	if err != nil {
		return out, took, fmt.Errorf("run expiry pass on %s: %w", p.kind.Name(), err)
	}
	return out, took, nil
}
