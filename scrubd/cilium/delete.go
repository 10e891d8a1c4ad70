package cilium

import (
	"context"
	"fmt"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/bpf"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// Sizes of the delete program's key slots: DEL_CHUNK and DEL_SLOTS in
// bpf/sweep.c.
const (
	delChunk = 1024
	delSlots = 16
)

// delArgs is struct del_args in bpf/sweep.c.
type delArgs struct {
	Base, N, Deleted, NATDeleted uint32
}

// deleter deletes lists of keys with bpf/sweep.c's delete4/delete6 programs:
// unlike BPF_MAP_DELETE_BATCH, which stops at the first absent key (one more
// syscall per absent key), a program run skips absent keys in the kernel,
// so a chunk costs one syscall (the run) however many of its keys are
// gone. Most keys a scrub tries are absent: each flow's other-initiator
// forms (index.Covered) exist only after an eviction.
//
// The key slots are memory-mapped (BPF_F_MMAPABLE arrays): the caller
// copies its chunk into its slot with plain stores, and the run's syscall
// orders them before the program reads them. Filling the slot with
// BPF_MAP_UPDATE_BATCH instead cost 0.1-0.15 µs per key in the kernel's
// per-element copy and update, about as much as the program's own run
// over those keys on a 1 M-entry table (make bench, 2026-12-02). Without
// the mapping (a kernel that refuses it) the slot is filled by a batch
// update as before.
type deleter struct {
	progs [ctmap.NumKinds]*ebpf.Program
	keys  [2]*ebpf.Map    // del_keys4, del_keys6
	mem   [2]*ebpf.Memory // their mappings, or nil
	step  [2]int64        // bytes per slot entry in mem: the value size rounded up to 8
	found *ebpf.Map       // del_found: the first pass's answers
	slots chan uint32     // free slots: one per concurrent caller
}

// loadDeleter loads the delete program once per CT map of maps.
func loadDeleter(maps *ctmap.Maps) (*deleter, error) {
	spec, err := bpf.LoadSweep()
	if err != nil {
		return nil, fmt.Errorf("load delete program spec: %w", err)
	}
	d := &deleter{slots: make(chan uint32, delSlots)}
	for i := range uint32(delSlots) {
		d.slots <- i
	}
	for i, name := range []string{"del_keys4", "del_keys6"} {
		ms := spec.Maps[name]
		ms.Flags |= unix.BPF_F_MMAPABLE
		if d.keys[i], err = ebpf.NewMap(ms); err != nil {
			// A kernel without mmapable arrays (before 5.5): batch fills.
			ms.Flags &^= unix.BPF_F_MMAPABLE
			if d.keys[i], err = ebpf.NewMap(ms); err != nil {
				d.close()
				return nil, fmt.Errorf("create %s: %w", name, err)
			}
		}
		if mem, err := d.keys[i].Memory(); err == nil && !mem.ReadOnly() {
			d.mem[i], d.step[i] = mem, int64(ms.ValueSize+7)&^7
		}
	}
	if d.found, err = ebpf.NewMap(spec.Maps["del_found"]); err != nil {
		d.close()
		return nil, fmt.Errorf("create del_found: %w", err)
	}
	for _, k := range ctmap.Kinds {
		m := maps.Map(k)
		if m == nil {
			continue
		}
		fam, keys := "4", d.keys[0]
		if k.IPv6() {
			fam, keys = "6", d.keys[1]
		}
		s := placeholderSpec(spec, m, fam)
		s.Programs = map[string]*ebpf.ProgramSpec{"del": s.Programs["delete"+fam]}
		keep := map[string]*ebpf.MapSpec{"ct" + fam: s.Maps["ct"+fam], "del_keys" + fam: s.Maps["del_keys"+fam], "del_found": s.Maps["del_found"]}
		repl := map[string]*ebpf.Map{"ct" + fam: m, "del_keys" + fam: keys, "del_found": d.found}
		withNAT(s, keep, repl, maps, fam)
		s.Maps = keep
		var objs struct {
			Del *ebpf.Program `ebpf:"del"`
		}
		if err := s.LoadAndAssign(&objs, &ebpf.CollectionOptions{MapReplacements: repl}); err != nil {
			d.close()
			return nil, fmt.Errorf("load delete program for %s: %w", k.Name(), err)
		}
		d.progs[k] = objs.Del
	}
	return d, nil
}

// close closes the programs and maps. A key slot's mapping goes with the
// last reference to it (cilium/ebpf unmaps it in a cleanup), and keeps its
// map's memory until then.
func (d *deleter) close() {
	for _, p := range d.progs {
		if p != nil {
			p.Close()
		}
	}
	for _, m := range append(d.keys[:], d.found) {
		if m != nil {
			m.Close()
		}
	}
}

// deleteProg deletes keys (all of kind k) in chunks of at most chunk keys,
// checking ctx between chunks.
func deleteProg[K ctmap.CTKey4 | ctmap.CTKey6](ctx context.Context, d *deleter, k ctmap.Kind, keys []K, chunk int) (batchCount, error) {
	var c batchCount
	var slot uint32
	select {
	case slot = <-d.slots:
	case <-ctx.Done():
		return c, ctx.Err()
	}
	defer func() { d.slots <- slot }()
	fam := 0
	if k.IPv6() {
		fam = 1
	}
	chunk = min(chunk, delChunk)
	for c.attempted < len(keys) {
		if err := ctx.Err(); err != nil {
			return c, err
		}
		part := keys[c.attempted:min(c.attempted+chunk, len(keys))]
		if err := fillSlot(d, fam, slot, part); err != nil {
			return c, fmt.Errorf("fill delete slot: %w", err)
		}
		args := delArgs{Base: slot * delChunk, N: uint32(len(part))}
		if _, err := d.progs[k].Run(&ebpf.RunOptions{Context: &args, ContextOut: &args}); err != nil {
			return c, fmt.Errorf("run delete program on %s: %w", k.Name(), err)
		}
		c.deleted += int(args.Deleted)
		c.natDeleted += int(args.NATDeleted)
		c.stale += len(part) - int(args.Deleted)
		c.attempted += len(part)
	}
	return c, nil
}

// fillSlot writes part into slot of the family's key slots: through the
// mapping when there is one, else with a batch update.
func fillSlot[K ctmap.CTKey4 | ctmap.CTKey6](d *deleter, fam int, slot uint32, part []K) error {
	base := slot * delChunk
	if mem := d.mem[fam]; mem != nil {
		step, off := d.step[fam], int64(base)*d.step[fam]
		for i := range part {
			b := unsafe.Slice((*byte)(unsafe.Pointer(&part[i])), unsafe.Sizeof(part[i]))
			if _, err := mem.WriteAt(b, off+int64(i)*step); err != nil {
				return err
			}
		}
		return nil
	}
	idx := make([]uint32, len(part))
	for i := range idx {
		idx[i] = base + uint32(i)
	}
	_, err := d.keys[fam].BatchUpdate(idx, part, nil)
	return err
}
