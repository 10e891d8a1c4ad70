package cilium

import (
	"context"
	"fmt"

	"github.com/cilium/ebpf"

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
// so a chunk costs two syscalls (fill the slot, run) however many of its
// keys are gone. Most keys a scrub tries are absent: each flow's
// other-initiator forms (index.Covered) exist only after an eviction.
type deleter struct {
	progs [ctmap.NumKinds]*ebpf.Program
	keys  [2]*ebpf.Map // del_keys4, del_keys6
	found *ebpf.Map    // del_found: the first pass's answers
	slots chan uint32  // free slots: one per concurrent caller
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
		if d.keys[i], err = ebpf.NewMap(spec.Maps[name]); err != nil {
			d.close()
			return nil, fmt.Errorf("create %s: %w", name, err)
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
	idx := make([]uint32, 0, chunk)
	for c.attempted < len(keys) {
		if err := ctx.Err(); err != nil {
			return c, err
		}
		part := keys[c.attempted:min(c.attempted+chunk, len(keys))]
		idx = idx[:0]
		for i := range part {
			idx = append(idx, slot*delChunk+uint32(i))
		}
		if _, err := d.keys[fam].BatchUpdate(idx, part, nil); err != nil {
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
