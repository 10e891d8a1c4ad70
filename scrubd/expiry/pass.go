package expiry

import (
	"context"
	"errors"
	"fmt"
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

// passArgs mirrors struct expiry_args in bpf/expiry.c (176 bytes): the
// BPF_PROG_TEST_RUN context, parameters in, counters out.
type passArgs struct {
	Flags             uint32
	Clock             uint32
	MaxFuture         [numClocks]uint32
	Floor             [numClocks]uint32
	TestRefreshMarker uint64

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
}

// mapPass is bpf/expiry.c loaded for one CT map.
type mapPass struct {
	kind ctmap.Kind
	coll *ebpf.Collection
	prog *ebpf.Program
	stop *ebpf.Variable
	mu   sync.Mutex // one pass at a time: the stop flag is per program
}

// loadPass loads the expiry program for map m of kind k, with m in place of
// the program's placeholder map.
func loadPass(k ctmap.Kind, m *ebpf.Map) (*mapPass, error) {
	spec, err := bpf.LoadExpiry()
	if err != nil {
		return nil, fmt.Errorf("load expiry program spec: %w", err)
	}
	mapName, progName, other, otherProg := "ct4", "expiry4", "ct6", "expiry6"
	if k.IPv6() {
		mapName, progName, other, otherProg = "ct6", "expiry6", "ct4", "expiry4"
	}
	delete(spec.Programs, otherProg)
	delete(spec.Maps, other)
	ms := spec.Maps[mapName]
	ms.Type = m.Type()
	ms.MaxEntries = m.MaxEntries()
	ms.Flags = m.Flags()
	coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{
		MapReplacements: map[string]*ebpf.Map{mapName: m},
	})
	if err != nil {
		return nil, fmt.Errorf("load expiry program for %s: %w (needs root and a kernel with BPF_PROG_TYPE_SYSCALL, 5.14+)", k.Name(), err)
	}
	p := &mapPass{kind: k, coll: coll, prog: coll.Programs[progName], stop: coll.Variables["stop"]}
	if p.prog == nil || p.stop == nil {
		coll.Close()
		return nil, fmt.Errorf("load expiry program for %s: program %s or variable stop missing from bpf/expiry_bpfel.o (run make generate)", k.Name(), progName)
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
