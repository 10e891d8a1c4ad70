package cilium

import (
	"context"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// After Cilium's LRU evicts a live flow's entry, the other side's next packet
// makes Cilium create the flow again with that side as the initiator; the
// recorder caches flows without their direction and does not record it. The
// index scrub must delete that key too (index.Covered).
func TestScrubDeletesOtherInitiator(t *testing.T) {
	needRoot(t)
	m := pinnedMaps(t, 1<<12, true)
	ix := newIndex()
	ix.Track(podA)
	ix.Track(podA6)
	w := newWorld(t, m, ix)
	w.addFlows(podA, podB, 3, true)
	w.addFlows(podA6, podB6, 3, true)
	c := newCilium(t, m, ix)

	// Evict (delete, as the LRU would) a flow podA initiated and a flow a
	// remote peer initiated, then re-create each with the other initiator,
	// as Cilium does when the other side's packet arrives first.
	val := ctmap.EncodeEntry(ctmap.EntryFields{Lifetime: 1000, Packets: 1})
	out := ctmap.NewKey4(podA, remote4, 443, 40001, ctmap.ProtoTCP, ctmap.FlagOut)
	in := ctmap.NewKey4(remote4, podA, 8080, 40002, ctmap.ProtoTCP, ctmap.FlagIn)
	out6 := ctmap.NewKey6(podA6, remote6, 443, 40003, ctmap.ProtoTCP, ctmap.FlagOut)
	var mirrors4 []ctmap.CTKey4
	for _, k := range []ctmap.CTKey4{out, in} {
		w.addFlow(flow{key4: &k}, true)
		for _, gone := range []ctmap.CTKey4{k, k.Related()} {
			if err := m.Map(gone.Kind()).Delete(gone); err != nil {
				t.Fatal(err)
			}
			delete(w.all4, gone)
		}
		mk := index.Mirror4(k)
		mirrors4 = append(mirrors4, mk, mk.Related())
	}
	w.addFlow(flow{key6: &out6}, true)
	if err := m.Map(out6.Kind()).Delete(out6); err != nil {
		t.Fatal(err)
	}
	delete(w.all6, out6)
	mirror6 := index.Mirror6(out6)
	for _, k := range mirrors4 {
		if err := m.Map(k.Kind()).Put(k, val); err != nil {
			t.Fatal(err)
		}
		w.all4[k] = true
	}
	if err := m.Map(mirror6.Kind()).Put(mirror6, val); err != nil {
		t.Fatal(err)
	}
	w.all6[mirror6] = true
	if mirror6.DAddr() != remote6 || mirror6.SAddr() != podA6 || mirror6.Flags() != ctmap.FlagIn || mirror6.DPort() != 40003 || mirror6.SPort() != 443 {
		t.Fatalf("mirror of %s is %s", out6, mirror6)
	}

	want := w.expected(podA, podA6)
	res, err := c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{podA, podA6}, Reason: scrub.ReasonDel})
	if err != nil || res.Outcome != scrub.Complete || res.Method != scrub.MethodIndex {
		t.Fatalf("scrub: %+v, %v", res, err)
	}
	checkDeleted(t, res, want)
	if n := w.verify(podA, podA6); n != res.Total {
		t.Errorf("world held %d entries of the IPs, scrub deleted %d", n, res.Total)
	}
	// The audit's definition agrees: every re-created key is covered.
	ix.Return(podA, []ctmap.CTKey4{out, in}, nil)
	k4, _, _ := ix.ScrubKeys(podA)
	for _, mk := range mirrors4 {
		found := false
		for _, k := range k4 {
			found = found || k == mk
		}
		if !found {
			t.Errorf("ScrubKeys(%s) misses %s", podA, mk)
		}
	}
}

// A dry run reads and changes nothing in the kernel: not the CT maps, not
// the recorder's maps (the generations the index's Taken hook would bump to
// forget the IP's cached flows).
func TestDryRunChangesNoKernelState(t *testing.T) {
	w, c := trackedWorld(t, 1<<16)
	dir, err := os.MkdirTemp("/sys/fs/bpf", "ctscrub-test-rec-")
	if err != nil {
		t.Skipf("no bpffs: %v", err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	pins := filepath.Join(dir, "ctscrub")
	rec, err := recorder.Load(recorder.Options{PinDir: pins, CTRoot: dir, CT: w.maps})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rec.Close() })
	gens, err := ebpf.LoadPinnedMap(filepath.Join(pins, "rec_gen"), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer gens.Close()
	sum := func() (n uint64) { // the generations of every address slot
		var k, v uint32
		it := gens.Iterate()
		for it.Next(&k, &v) {
			n += uint64(v)
		}
		return n
	}

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); rec.Run(ctx, c.ix) }()
	t.Cleanup(func() { cancel(); <-done })
	// Run installs the index hooks: wait until a Take of a probe IP makes
	// the recorder forget that probe's cached flows (a generation bump).
	probe := netip.MustParseAddr("10.244.9.9")
	pk := ctmap.NewKey4(probe, remote4, 80, 999, ctmap.ProtoTCP, ctmap.FlagOut)
	c.ix.Hold(probe)
	deadline := time.Now().Add(5 * time.Second)
	for {
		g := sum()
		c.ix.Add4(pk)
		c.ix.Take(probe)
		if sum() != g {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("recorder hooks never installed")
		}
		time.Sleep(20 * time.Millisecond)
	}

	before := kernelState(t, w.maps, pins)
	if len(before["rec_gen"]) == 0 {
		t.Fatal("recorder's generations not dumped")
	}
	for _, ip := range []netip.Addr{podA, podA6} {
		res, err := c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{ip}, DryRun: true})
		if err != nil || res.Outcome != scrub.Complete || res.Method != scrub.MethodIndex {
			t.Fatalf("dry run %s: %+v, %v", ip, res, err)
		}
	}
	after := kernelState(t, w.maps, pins)
	for name, b := range before {
		if !maps.Equal(b, after[name]) {
			t.Errorf("dry run changed %s: %d entries before, %d after", name, len(b), len(after[name]))
		}
	}
}

// kernelState dumps every CT map and every map the recorder pinned (the ring
// buffer cannot be dumped and is skipped), key -> value bytes.
func kernelState(t *testing.T, m *ctmap.Maps, pins string) map[string]map[string]string {
	t.Helper()
	out := map[string]map[string]string{}
	dumpMap := func(name string, mp *ebpf.Map) {
		d := map[string]string{}
		k := make([]byte, mp.KeySize())
		it := mp.Iterate()
		if perCPU(mp) {
			if mp.ValueSize() != 8 {
				t.Fatalf("dump %s: per-CPU values of %d bytes", name, mp.ValueSize())
			}
			var v []uint64
			for it.Next(&k, &v) {
				d[string(k)] = fmt.Sprint(v)
			}
		} else {
			v := make([]byte, mp.ValueSize())
			for it.Next(&k, &v) {
				d[string(k)] = string(v)
			}
		}
		if err := it.Err(); err != nil {
			t.Fatalf("dump %s: %v", name, err)
		}
		out[name] = d
	}
	for _, k := range ctmap.Kinds {
		if mp := m.Map(k); mp != nil {
			dumpMap(k.Name(), mp)
		}
	}
	ents, err := os.ReadDir(pins)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if e.IsDir() {
			continue
		}
		mp, err := ebpf.LoadPinnedMap(filepath.Join(pins, e.Name()), nil)
		if err != nil {
			t.Fatal(err)
		}
		if mp.Type() != ebpf.RingBuf {
			dumpMap(e.Name(), mp)
		}
		mp.Close()
	}
	return out
}

func perCPU(mp *ebpf.Map) bool {
	switch mp.Type() {
	case ebpf.PerCPUHash, ebpf.PerCPUArray, ebpf.LRUCPUHash:
		return true
	}
	return false
}
