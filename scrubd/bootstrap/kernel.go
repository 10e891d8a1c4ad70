package bootstrap

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/bpf"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// The in-kernel read of one CT map (bpf/bootstrap.c): one
// BPF_PROG_TEST_RUN of a syscall program that walks the map with
// bpf_for_each_map_elem and copies the keys holding a pod-CIDR address
// into an mmapped array, which the filing goroutine then reads in place.
// Cilium's values and the keys of no pod-CIDR address never leave the
// kernel, and there is one syscall per map instead of one per 8,192
// entries: the walk costs about what the kernel's own pass over the
// elements costs (docs/design.md, "What it costs").

// maxPrefixes is bpf/bootstrap.c's MAX_PREFIXES: more pod CIDRs of one
// family than that and the pass reads with the batch walk.
const maxPrefixes = 16

// out4Elem and out6Elem mirror struct out4_elem and out6_elem
// (bpf/bootstrap.c): one key per output array element, padded to the
// array's element size.
type out4Elem struct {
	k ctmap.CTKey4
	_ [2]byte
}

type out6Elem struct {
	k ctmap.CTKey6
	_ [2]byte
}

// passArgs mirrors struct pass_args (bpf/bootstrap.c).
type passArgs struct {
	Stopped uint32
	Full    uint32
	Visited uint64
	Written uint64
}

type prefix4 struct{ Addr, Mask uint32 }
type prefix6 struct{ Addr, Mask [2]uint64 }

// errOutputFull is a kernel run's answer when the map held more keys to
// copy than the output array has room for (entries made again during the
// walk can be visited twice): the map is read again with the batch walk.
var errOutputFull = errors.New("the output array is full")

// errStopped is a run that saw its stop flag with its ctx still live.
var errStopped = errors.New("the program saw its stop flag")

// kernelRead is one map's program and output, loaded for one run.
type kernelRead struct {
	kind ctmap.Kind
	coll *ebpf.Collection
	prog *ebpf.Program
	stop *ebpf.Variable
	out  *ebpf.Map
	mem  []byte // out, mmapped read-only
	// The program's .bss, mmapped read-only, and in it what the running
	// program last published.
	bss              []byte
	written, visited *uint64
}

// cidrFilter is the pod CIDRs as bpf/bootstrap.c takes them.
type cidrFilter struct {
	all    bool // no pod CIDRs: every address is the index's
	p4     [maxPrefixes]prefix4
	p6     [maxPrefixes]prefix6
	n4, n6 uint32
}

func newCIDRFilter(cidrs []netip.Prefix) (*cidrFilter, error) {
	f := &cidrFilter{all: len(cidrs) == 0}
	for _, p := range cidrs {
		p = p.Masked()
		bits := p.Bits()
		if p.Addr().Is4() {
			if f.n4 == maxPrefixes {
				return nil, fmt.Errorf("more than %d IPv4 pod CIDRs", maxPrefixes)
			}
			a := p.Addr().As4()
			var m [4]byte
			fillMask(m[:], bits)
			f.p4[f.n4] = prefix4{binary.NativeEndian.Uint32(a[:]), binary.NativeEndian.Uint32(m[:])}
			f.n4++
			continue
		}
		if f.n6 == maxPrefixes {
			return nil, fmt.Errorf("more than %d IPv6 pod CIDRs", maxPrefixes)
		}
		a := p.Addr().As16()
		var m [16]byte
		fillMask(m[:], bits)
		f.p6[f.n6] = prefix6{
			Addr: [2]uint64{binary.NativeEndian.Uint64(a[:8]), binary.NativeEndian.Uint64(a[8:])},
			Mask: [2]uint64{binary.NativeEndian.Uint64(m[:8]), binary.NativeEndian.Uint64(m[8:])},
		}
		f.n6++
	}
	return f, nil
}

// fillMask sets the first bits bits of m.
func fillMask(m []byte, bits int) {
	for i := range m {
		switch {
		case bits >= 8:
			m[i] = 0xff
			bits -= 8
		case bits > 0:
			m[i] = byte(0xff << (8 - bits))
			bits = 0
		}
	}
}

// loadKernelRead loads bpf/bootstrap.c for m with an output array of room
// for keys keys (0: the map's max_entries, every entry it can hold).
func loadKernelRead(m *ebpf.Map, kind ctmap.Kind, filter *cidrFilter, keys uint32) (kr *kernelRead, err error) {
	spec, err := bpf.LoadBootstrap()
	if err != nil {
		return nil, fmt.Errorf("load the program's spec: %w", err)
	}
	fam := "4"
	if kind.IPv6() {
		fam = "6"
	}
	if keys == 0 {
		keys = m.MaxEntries()
	}
	ct, out := spec.Maps["ct"+fam], spec.Maps["out"+fam]
	ct.Type, ct.MaxEntries, ct.Flags = m.Type(), m.MaxEntries(), m.Flags()
	out.MaxEntries = keys
	var offs [2]uint32
	for i, name := range []string{"published_written", "published_visited"} {
		v := spec.Variables[name]
		if v == nil || v.Offset%8 != 0 {
			return nil, fmt.Errorf("the program's %s: %v", name, v)
		}
		offs[i] = v.Offset
	}
	spec.Programs = map[string]*ebpf.ProgramSpec{"pass" + fam: spec.Programs["pass"+fam]}
	spec.Maps = map[string]*ebpf.MapSpec{"ct" + fam: ct, "out" + fam: out, ".bss": spec.Maps[".bss"]}
	// The output array is made here and goes with the read (close): Run
	// keeps at most two at once.
	coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{MapReplacements: map[string]*ebpf.Map{"ct" + fam: m}})
	if err != nil {
		return nil, fmt.Errorf("load the program: %w", err)
	}
	kr = &kernelRead{kind: kind, coll: coll, prog: coll.Programs["pass"+fam], stop: coll.Variables["stop"], out: coll.Maps["out"+fam]}
	defer func() {
		if err != nil {
			kr.close()
			kr = nil
		}
	}()
	all := uint32(0)
	if filter.all {
		all = 1
	}
	for _, set := range []struct {
		name string
		x    any
	}{{"all", all}, {"prefixes4", filter.p4}, {"prefixes6", filter.p6}, {"nprefixes4", filter.n4}, {"nprefixes6", filter.n6}} {
		if err := coll.Variables[set.name].Set(set.x); err != nil {
			return nil, fmt.Errorf("set the pod CIDRs (%s): %w", set.name, err)
		}
	}
	info, err := kr.out.Info()
	if err != nil {
		return nil, fmt.Errorf("output array: %w", err)
	}
	size := int(info.ValueSize) * int(info.MaxEntries)
	if kr.mem, err = unix.Mmap(kr.out.FD(), 0, size, unix.PROT_READ, unix.MAP_SHARED); err != nil {
		return nil, fmt.Errorf("mmap the output array (%d bytes): %w", size, err)
	}
	bss := coll.Maps[".bss"]
	if kr.bss, err = unix.Mmap(bss.FD(), 0, int(bss.ValueSize()), unix.PROT_READ, unix.MAP_SHARED); err != nil {
		return nil, fmt.Errorf("mmap the program's .bss: %w", err)
	}
	kr.written = (*uint64)(unsafe.Pointer(&kr.bss[offs[0]]))
	kr.visited = (*uint64)(unsafe.Pointer(&kr.bss[offs[1]]))
	return kr, nil
}

// run walks the map once. A cancelled ctx sets the program's stop flag:
// the run ends at the next element.
func (kr *kernelRead) run(ctx context.Context) (passArgs, error) {
	var args passArgs
	if err := ctx.Err(); err != nil {
		return args, err
	}
	// The variable is mmapped .bss memory: Set is a plain store the
	// running program reads on its next element.
	unstop := context.AfterFunc(ctx, func() { _ = kr.stop.Set(uint32(1)) })
	_, err := kr.prog.Run(&ebpf.RunOptions{Context: &args, ContextOut: &args})
	unstop()
	switch {
	case err != nil:
		return args, fmt.Errorf("run the program: %w", err)
	case args.Stopped != 0:
		if err := context.Cause(ctx); err != nil {
			return args, err
		}
		return args, errStopped
	case args.Full != 0:
		return args, errOutputFull
	}
	return args, nil
}

// published is the keys written and the entries visited so far, as the
// running program last published them.
func (kr *kernelRead) published() (written, visited uint64) {
	return atomic.LoadUint64(kr.written), atomic.LoadUint64(kr.visited)
}

// keys4 and keys6 are the keys [from, to) the run wrote, in place in the
// output array (after its header): valid until close.
func (kr *kernelRead) keys4(from, to uint64) []out4Elem {
	all := unsafe.Slice((*out4Elem)(unsafe.Pointer(&kr.mem[0])), len(kr.mem)/int(unsafe.Sizeof(out4Elem{})))
	return all[from:to]
}

func (kr *kernelRead) keys6(from, to uint64) []out6Elem {
	all := unsafe.Slice((*out6Elem)(unsafe.Pointer(&kr.mem[0])), len(kr.mem)/int(unsafe.Sizeof(out6Elem{})))
	return all[from:to]
}

// close unmaps and closes the output array (the kernel frees it) and the
// program.
func (kr *kernelRead) close() {
	for _, m := range [][]byte{kr.mem, kr.bss} {
		if m != nil {
			_ = unix.Munmap(m)
		}
	}
	kr.mem, kr.bss = nil, nil
	kr.coll.Close()
}

// readKernel reads kinds' maps, each with one run of bpf/bootstrap.c,
// GOMAXPROCS-1 runs at once (at least one): a run holds its CPU until it
// ends (the kernel does not preempt it inside the walk), so one CPU is
// left to the filing and the rest of the node. The filing goroutine files
// each run's keys in place as the program publishes them, so the filing
// of a map overlaps its walk, and a loader prepares the next map's program
// and output array (verifier, and zeroed pages) while a run goes on. At
// most runs+1 output arrays exist at once, each sized from its map's
// max_entries. A map whose program cannot load, or whose output array
// filled, is read with the batch walk; read says how each was read.
//
// A run cannot be preempted, but it can be stopped: a cancelled ctx sets
// the program's stop flag, read on every element.
func (w *walker) readKernel(ctx context.Context, maps *ctmap.Maps, kinds []ctmap.Kind, cidrs []netip.Prefix, keys uint32, read map[string]string) error {
	defer w.close()
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	filter, ferr := newCIDRFilter(cidrs)
	runs := max(1, min(len(kinds), runtime.GOMAXPROCS(0)-1))
	slots := make(chan struct{}, runs+1)
	type loaded struct {
		k   ctmap.Kind
		kr  *kernelRead
		why string // the program did not load: read with the batch walk
	}
	next := make(chan loaded)
	go func() {
		defer close(next)
		for _, k := range kinds {
			l := loaded{k: k}
			if ferr != nil {
				l.why = ferr.Error()
			} else {
				select {
				case slots <- struct{}{}:
				case <-ctx.Done():
					return
				}
				var err error
				if l.kr, err = loadKernelRead(maps.Map(k), k, filter, keys); err != nil {
					<-slots
					l.why = err.Error()
				}
			}
			select {
			case next <- l:
			case <-ctx.Done():
				if l.kr != nil {
					l.kr.close()
					<-slots
				}
				return
			}
		}
	}()
	var mu sync.Mutex
	var wg sync.WaitGroup
	for range runs {
		wg.Go(func() {
			for l := range next {
				why := l.why
				if l.kr != nil {
					var err error
					if why, err = w.readOne(ctx, l.kr, l.k, slots); err != nil {
						cancel(fmt.Errorf("bootstrap: read %s in the kernel: %w", l.k.Name(), err))
						continue // the loader stops; drain what it made
					}
				}
				mu.Lock()
				if why == "" {
					read[l.k.Name()] = ReadKernel
				} else {
					read[l.k.Name()] = "batch: " + why
				}
				mu.Unlock()
				if why == "" || ctx.Err() != nil {
					continue
				}
				if err := w.walk(ctx, maps.Map(l.k), l.k); err != nil {
					cancel(fmt.Errorf("bootstrap: walk %s: %w", l.k.Name(), err))
				}
			}
		})
	}
	wg.Wait()
	return context.Cause(ctx)
}

// stream is one kernel run's keys on their way to the filing goroutine.
type stream struct {
	kr   *kernelRead
	done chan struct{} // closed when the run ended; args and ok set then
	args passArgs
	ok   bool // the keys written are the map's (the run ended, or filled its output)
	// release closes the run's program and output once its keys are filed.
	release func()
}

// readOne runs one map's loaded program, its keys filed as the program
// publishes them (kr and its slot are released once they are). It returns why the map must be read with the batch walk
// instead (the keys filed before the output filled stay: they were in the
// map, and the index keeps one of each key), or an error that fails the
// pass (a cancel, a run that failed).
func (w *walker) readOne(ctx context.Context, kr *kernelRead, k ctmap.Kind, slots chan struct{}) (why string, err error) {
	s := &stream{kr: kr, done: make(chan struct{}), release: func() {
		kr.close()
		<-slots
	}}
	w.full <- &chunk{v6: k.IPv6(), stream: s}
	s.args, err = kr.run(ctx)
	full := errors.Is(err, errOutputFull)
	s.ok = err == nil || full
	close(s.done)
	if full {
		return fmt.Sprintf("%v after %d keys of %d entries visited", err, s.args.Written, s.args.Visited), nil
	}
	if err != nil {
		return "", err
	}
	if w.afterBatch != nil {
		w.hookMu.Lock()
		w.afterBatch(k, 1)
		w.hookMu.Unlock()
	}
	return "", nil
}

// fileStream files a run's keys as its program publishes them, until the
// run ended and every key it wrote is filed, then releases the run.
func (w *walker) fileStream(v6 bool, s *stream) {
	defer s.release()
	var filed, seen uint64
	for {
		var ended bool
		select {
		case <-s.done:
			ended = true
		default:
		}
		written, visited := s.kr.published()
		if ended {
			if !s.ok {
				return
			}
			written, visited = s.args.Written, s.args.Visited
		}
		if visited > seen {
			w.p.visited.Add(int64(visited - seen))
			seen = visited
		}
		if written > filed {
			// One key at a time: the output array's keys are padded.
			if v6 {
				for _, e := range s.kr.keys6(filed, written) {
					w.f.Add6(unsafe.Slice(&e.k, 1))
				}
			} else {
				for _, e := range s.kr.keys4(filed, written) {
					w.f.Add4(unsafe.Slice(&e.k, 1))
				}
			}
			filed = written
			continue
		}
		if ended {
			return
		}
		select {
		case <-s.done:
		case <-time.After(200 * time.Microsecond):
		}
	}
}
