package cilium

import (
	"context"
	"net/netip"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// TestDeleteSkipsAbsentKeys: the index path deletes lists in which most keys
// are absent (index.Covered's other-initiator forms). The delete program
// must delete exactly the present ones, in both families, across chunk
// boundaries, leave every other entry alone, and cost one program run per
// chunk rather than a syscall per absent key (the reason it exists: checked here
// by the backend really using it).
//
// Both ways of filling the program's key slots: the memory-mapped slots
// (plain stores, what this kernel gives) and the batch update the deleter
// falls back to where a kernel has no mmapable arrays. 3,000 keys per
// family are three chunks, the last one shorter, so a chunk must not see
// the keys a longer one left in the slot.
func TestDeleteSkipsAbsentKeys(t *testing.T) {
	needRoot(t)
	maps := pinnedMaps(t, 1<<16, true)
	c := newCilium(t, maps, newIndex())
	if c.del == nil {
		t.Fatalf("delete program not loaded (batch deletes instead): %v", c.delErr)
	}
	if c.del.mem[0] == nil || c.del.mem[1] == nil {
		t.Fatalf("delete key slots not memory-mapped (%v, %v): every chunk pays a batch update", c.del.mem[0], c.del.mem[1])
	}
	mem := c.del.mem
	for i, fill := range []string{"mapped", "batch update"} {
		t.Run(fill, func(t *testing.T) {
			c.del.mem = mem
			if fill == "batch update" {
				c.del.mem = [2]*ebpf.Memory{}
			}
			deleteSkipsAbsentKeys(t, c, maps, byte(i))
		})
	}
}

func deleteSkipsAbsentKeys(t *testing.T, c *Backend, maps *ctmap.Maps, n byte) {
	pod4, peer4 := netip.AddrFrom4([4]byte{10, 244, 0, 7 + n}), netip.MustParseAddr("192.0.2.9")
	pod6, peer6 := netip.AddrFrom16([16]byte{0xfd, 0, 2, 0x44, 15: 7 + n}), netip.MustParseAddr("2001:db8::9")
	var val ctmap.Entry
	var k4, keep4 []ctmap.CTKey4
	var k6, keep6 []ctmap.CTKey6
	present := 0
	for port := uint16(1); port <= 3000; port++ {
		a := ctmap.NewKey4(pod4, peer4, 80, port, 6, ctmap.FlagOut)
		b := ctmap.NewKey6(pod6, peer6, 80, port, 17, ctmap.FlagOut)
		k4, k6 = append(k4, a), append(k6, b)
		switch port % 3 {
		case 0: // present and listed: deleted
			if err := maps.Map(a.Kind()).Put(a, val); err != nil {
				t.Fatal(err)
			}
			if err := maps.Map(b.Kind()).Put(b, val); err != nil {
				t.Fatal(err)
			}
			present++
		case 1: // present but not listed: must stay
			x := ctmap.NewKey4(pod4, peer4, 81, port, 6, ctmap.FlagOut)
			y := ctmap.NewKey6(pod6, peer6, 81, port, 17, ctmap.FlagOut)
			if err := maps.Map(x.Kind()).Put(x, val); err != nil {
				t.Fatal(err)
			}
			if err := maps.Map(y.Kind()).Put(y, val); err != nil {
				t.Fatal(err)
			}
			keep4, keep6 = append(keep4, x), append(keep6, y)
		}
	}
	deleted := map[string]int{}
	left4, left6, err := c.deleteKeys(context.Background(), k4, k6, deleted, nil)
	if err != nil || len(left4)+len(left6) != 0 {
		t.Fatalf("deleteKeys: err %v, %d+%d keys not attempted", err, len(left4), len(left6))
	}
	if deleted[ctmap.TCP4.Name()] != present || deleted[ctmap.Any6.Name()] != present {
		t.Fatalf("deleted %v, want %d in %s and in %s", deleted, present, ctmap.TCP4.Name(), ctmap.Any6.Name())
	}
	for _, k := range k4 {
		if maps.Map(k.Kind()).Lookup(k, &val) == nil {
			t.Fatalf("%s left", k)
		}
	}
	for _, k := range k6 {
		if maps.Map(k.Kind()).Lookup(k, &val) == nil {
			t.Fatalf("%s left", k)
		}
	}
	for _, k := range keep4 {
		if err := maps.Map(k.Kind()).Lookup(k, &val); err != nil {
			t.Fatalf("%s deleted but not listed: %v", k, err)
		}
	}
	for _, k := range keep6 {
		if err := maps.Map(k.Kind()).Lookup(k, &val); err != nil {
			t.Fatalf("%s deleted but not listed: %v", k, err)
		}
	}
}

// TestDeleteKeysMapFails: deleteKeys runs the maps' deletes at once
// (parallelMin and more keys). When one map's job fails (here: the IPv6 maps
// are not there), its keys come back as left and the error says why, while
// the other maps' keys are deleted and counted as in turn.
func TestDeleteKeysMapFails(t *testing.T) {
	needRoot(t)
	maps := pinnedMaps(t, 1<<14, false)
	c := newCilium(t, maps, newIndex())
	pod4, peer4 := netip.MustParseAddr("10.244.0.8"), netip.MustParseAddr("192.0.2.10")
	pod6, peer6 := netip.MustParseAddr("fd00:244::8"), netip.MustParseAddr("2001:db8::10")
	var val ctmap.Entry
	var k4 []ctmap.CTKey4
	var k6 []ctmap.CTKey6
	for port := uint16(1); port <= parallelMin; port++ {
		for _, proto := range []uint8{6, 17} {
			a := ctmap.NewKey4(pod4, peer4, 80, port, proto, ctmap.FlagOut)
			if err := maps.Map(a.Kind()).Put(a, val); err != nil {
				t.Fatal(err)
			}
			k4 = append(k4, a)
		}
		k6 = append(k6, ctmap.NewKey6(pod6, peer6, 80, port, 6, ctmap.FlagOut))
	}
	deleted := map[string]int{}
	left4, left6, err := c.deleteKeys(context.Background(), k4, k6, deleted, nil)
	if err == nil || !strings.Contains(err.Error(), "map not present") {
		t.Fatalf("deleteKeys without the IPv6 maps: err %v, want one saying the map is not present", err)
	}
	if len(left4) != 0 || len(left6) != len(k6) {
		t.Fatalf("left %d IPv4 and %d IPv6 keys, want 0 and %d", len(left4), len(left6), len(k6))
	}
	if deleted[ctmap.TCP4.Name()] != parallelMin || deleted[ctmap.Any4.Name()] != parallelMin {
		t.Fatalf("deleted %v, want %d in each IPv4 map", deleted, parallelMin)
	}
	for _, k := range k4 {
		if maps.Map(k.Kind()).Lookup(k, &val) == nil {
			t.Fatalf("%s left", k)
		}
	}
}

// BenchmarkDeleteKeys: one scrub's delete step for 1,000 flows whose
// index.Covered list is 4,000 keys, 2,000 of them present (the key and its
// RELATED twin) and 2,000 absent (the other-initiator forms), through the
// delete program and through BPF_MAP_DELETE_BATCH, which stops at every
// absent key.
func BenchmarkDeleteKeys(b *testing.B) {
	needRoot(b)
	maps := pinnedMaps(b, 1<<16, false)
	c := newCilium(b, maps, newIndex())
	pod := netip.MustParseAddr("10.244.0.7")
	var keys, present []ctmap.CTKey4
	for port := uint16(1); port <= 1000; port++ {
		// One peer per flow: RELATED keys have no ports, so flows to one
		// peer would share theirs.
		peer := netip.AddrFrom4([4]byte{198, 18, byte(port >> 8), byte(port)})
		k := ctmap.NewKey4(pod, peer, 80, port, 6, ctmap.FlagOut)
		x4, _ := index.Covered([]ctmap.CTKey4{k, k.Related()}, nil)
		keys = append(keys, x4...)
		present = append(present, k, k.Related())
	}
	var val ctmap.Entry
	fill := func() {
		for _, k := range present {
			if err := maps.Map(k.Kind()).Put(k, val); err != nil {
				b.Fatal(err)
			}
		}
	}
	for _, mode := range []string{"program", "batch"} {
		b.Run(mode, func(b *testing.B) {
			d := c.del
			if mode == "batch" {
				d = nil
			}
			for b.Loop() {
				b.StopTimer()
				fill()
				b.StartTimer()
				deleted := map[string]int{}
				var left []ctmap.CTKey4
				var tcp, other []ctmap.CTKey4
				for _, k := range keys {
					if k.Kind() == ctmap.TCP4 {
						tcp = append(tcp, k)
					} else {
						other = append(other, k)
					}
				}
				if err := deleteFrom(context.Background(), maps.Map(ctmap.TCP4), d, ctmap.TCP4, tcp, 1024, deleted, &left); err != nil {
					b.Fatal(err)
				}
				if err := deleteFrom(context.Background(), maps.Map(ctmap.Any4), d, ctmap.Any4, other, 1024, deleted, &left); err != nil {
					b.Fatal(err)
				}
				if got := deleted[ctmap.TCP4.Name()] + deleted[ctmap.Any4.Name()]; got != len(present) {
					b.Fatalf("%s: deleted %v, want %d in all", mode, deleted, len(present))
				}
			}
		})
	}
}

// TestDeleteKeysEarlyHelper: the scrub starts the deletes' helper before
// its keys are known. Handed the work while it waits, or after it gave up
// waiting (deleteKeys then starts another), or given a list too short to
// share, every present key is deleted and counted once, whichever of the
// two took it.
func TestDeleteKeysEarlyHelper(t *testing.T) {
	needRoot(t)
	if runtime.GOMAXPROCS(0) < 2 {
		t.Skip("GOMAXPROCS < 2: the scrub starts no early helper")
	}
	maps := pinnedMaps(t, 1<<16, false)
	c := newCilium(t, maps, newIndex())
	var val ctmap.Entry
	for i, tc := range []struct {
		name string
		keys int
		wait time.Duration
	}{{"handed while waiting", 3000, 0}, {"after it gave up", 3000, 2 * helperSpin}, {"too few keys to share", 100, 0}} {
		t.Run(tc.name, func(t *testing.T) {
			pod, peer := netip.AddrFrom4([4]byte{10, 244, 1, byte(i)}), netip.MustParseAddr("192.0.2.11")
			var keys []ctmap.CTKey4
			present := 0
			for port := range uint16(tc.keys) {
				k := ctmap.NewKey4(pod, peer, 80, port, []uint8{6, 17}[port%2], ctmap.FlagOut)
				keys = append(keys, k)
				if port%3 == 0 {
					if err := maps.Map(k.Kind()).Put(k, val); err != nil {
						t.Fatal(err)
					}
					present++
				}
			}
			h := startDeleteHelper()
			time.Sleep(tc.wait)
			deleted := map[string]int{}
			left4, _, err := c.deleteKeys(context.Background(), keys, nil, deleted, h)
			if err != nil || len(left4) != 0 {
				t.Fatalf("deleteKeys: err %v, %d keys not attempted", err, len(left4))
			}
			if got := deleted[ctmap.TCP4.Name()] + deleted[ctmap.Any4.Name()]; got != present {
				t.Fatalf("deleted %v, want %d in all", deleted, present)
			}
			for _, k := range keys {
				if maps.Map(k.Kind()).Lookup(k, &val) == nil {
					t.Fatalf("%s left", k)
				}
			}
		})
	}
}

// TestDeleteJobShared: the index scrub hands the deletes' helper its keys
// before it has made their forms, and adds the forms after. Whether the
// helper deletes while the forms are made, or has given up waiting for
// them (finish starts another), or there is none, every present key of
// both lists is deleted and counted once and none is left.
func TestDeleteJobShared(t *testing.T) {
	needRoot(t)
	if runtime.GOMAXPROCS(0) < 2 {
		t.Skip("GOMAXPROCS < 2: the scrub starts no early helper")
	}
	maps := pinnedMaps(t, 1<<16, false)
	c := newCilium(t, maps, newIndex())
	var val ctmap.Entry
	for i, tc := range []struct {
		name   string
		helper bool
		wait   time.Duration // between the first list and the second
	}{{"helper deletes while the forms are made", true, 0}, {"helper gave up waiting for the forms", true, 3 * helperSpin}, {"no helper", false, 0}} {
		t.Run(tc.name, func(t *testing.T) {
			pod, peer := netip.AddrFrom4([4]byte{10, 244, 2, byte(i)}), netip.MustParseAddr("192.0.2.12")
			var first, second []ctmap.CTKey4
			present := 0
			for port := range uint16(1500) {
				k := ctmap.NewKey4(pod, peer, 80, port, []uint8{6, 17}[port%2], ctmap.FlagOut)
				if port < 500 {
					first = append(first, k)
				} else {
					second = append(second, k)
				}
				if port%3 == 0 {
					if err := maps.Map(k.Kind()).Put(k, val); err != nil {
						t.Fatal(err)
					}
					present++
				}
			}
			j := c.newDeleteJob(context.Background())
			j.add(first, nil)
			if tc.helper {
				if !j.share(startDeleteHelper()) {
					t.Fatal("a helper just started did not take the job")
				}
			}
			time.Sleep(tc.wait)
			j.add(second, nil)
			deleted := map[string]int{}
			left4, _, err := j.finish(deleted)
			if err != nil || len(left4) != 0 {
				t.Fatalf("finish: err %v, %d keys not attempted", err, len(left4))
			}
			if got := deleted[ctmap.TCP4.Name()] + deleted[ctmap.Any4.Name()]; got != present {
				t.Fatalf("deleted %v, want %d in all", deleted, present)
			}
			for _, k := range append(first, second...) {
				if maps.Map(k.Kind()).Lookup(k, &val) == nil {
					t.Fatalf("%s left", k)
				}
			}
		})
	}
}
