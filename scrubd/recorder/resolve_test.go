package recorder

import (
	"context"
	"encoding/binary"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// The paths of Resolve on real BPF maps with Cilium's layouts: the four
// global CT maps and the two backend maps, pinned in a bpffs directory as
// the agent pins them. Cilium's datapath (which fills them for real) runs
// in e2e/conformance; here each test writes what the datapath would have
// written at each step, so that orders the suite cannot drive on purpose
// (a backend removed before anything read it, an ID reused, a SERVICE entry
// evicted) are checked one by one.
//
// Every "cannot be learnt" test checks two things: the client ends
// incomplete with ReasonServiceUnresolved, and an entry of the client's is
// in the CT maps but not among the keys its scrub would delete (left). The
// second shows the mark is needed: without it the IP would be called
// complete with that entry left.

type svcWorld struct {
	t   *testing.T
	r   *Recorder
	ix  *index.Index
	ct  *ctmap.Maps
	be  [2]*ebpf.Map
	dir string
	v6  bool
}

func newSvcWorld(t *testing.T, v6 bool) *svcWorld {
	t.Helper()
	requireRoot(t)
	dir, err := os.MkdirTemp("/sys/fs/bpf", "ctscrub-resolve-")
	if err != nil {
		t.Skipf("bpffs at /sys/fs/bpf: %v", err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	var maps [ctmap.NumKinds]*ebpf.Map
	for _, k := range ctmap.Kinds {
		m, err := ebpf.NewMap(k.Spec(1024))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		maps[k] = m
	}
	ct, err := ctmap.FromMaps(maps)
	if err != nil {
		t.Fatal(err)
	}
	w := &svcWorld{t: t, ct: ct, dir: dir, v6: v6, ix: index.New(index.Config{})}
	for i := range w.be {
		w.be[i] = w.newBackendMap(i)
	}
	w.r = &Recorder{opts: Options{CTRoot: dir, CT: ct, Log: slog.New(slog.NewTextHandler(io.Discard, nil))}}
	return w
}

// newBackendMap creates and pins backend map i (0 IPv4, 1 IPv6) with
// Cilium's layout (struct lb4_backend 12 bytes, lb6_backend 24 bytes, the
// same in 1.16 to 1.20), replacing a pin that is there.
func (w *svcWorld) newBackendMap(i int) *ebpf.Map {
	w.t.Helper()
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 4, ValueSize: uint32(12 + 12*i), MaxEntries: 64})
	if err != nil {
		w.t.Fatal(err)
	}
	w.t.Cleanup(func() { m.Close() })
	path := filepath.Join(w.dir, []string{ctmap.BackendMap4, ctmap.BackendMap6}[i])
	os.Remove(path)
	if err := m.Pin(path); err != nil {
		w.t.Fatal(err)
	}
	return m
}

func (w *svcWorld) fam() int {
	if w.v6 {
		return 1
	}
	return 0
}

// addr is an address of the world's family: 10.x.y.z or fd00:x::y:z.
func (w *svcWorld) addr(a, b, c byte) netip.Addr {
	if w.v6 {
		return netip.AddrFrom16([16]byte{0xfd, 0, 0, a, 12: 0, 13: b, 15: c})
	}
	return netip.AddrFrom4([4]byte{10, a, b, c})
}

// setBackend writes backend id as the agent does.
func (w *svcWorld) setBackend(id uint32, a netip.AddrPort) {
	w.t.Helper()
	v := make([]byte, w.be[w.fam()].ValueSize())
	n := copy(v, a.Addr().AsSlice())
	binary.BigEndian.PutUint16(v[n:], a.Port())
	if err := w.be[w.fam()].Put(id, v); err != nil {
		w.t.Fatal(err)
	}
}

func (w *svcWorld) removeBackend(id uint32) {
	w.t.Helper()
	if err := w.be[w.fam()].Delete(id); err != nil {
		w.t.Fatal(err)
	}
}

// flow is one client flow to a VIP (TCP unless udp).
type flow struct {
	client, vip  netip.Addr
	cport, vport uint16
	proto        uint8
}

func (w *svcWorld) flow(client netip.Addr) flow {
	return flow{client: client, vip: w.addr(96, 0, 10), cport: 40001, vport: 80, proto: ctmap.ProtoTCP}
}

func (w *svcWorld) put(daddr, saddr netip.Addr, dport, sport uint16, proto, flags uint8, backend uint32) {
	w.t.Helper()
	e := ctmap.EncodeEntry(ctmap.EntryFields{BackendID: uint64(backend), Lifetime: 1 << 30})
	var err error
	if w.v6 {
		k := ctmap.NewKey6(daddr, saddr, dport, sport, proto, flags)
		err = w.ct.Map(k.Kind()).Put(k, e)
	} else {
		k := ctmap.NewKey4(daddr, saddr, dport, sport, proto, flags)
		err = w.ct.Map(k.Kind()).Put(k, e)
	}
	if err != nil {
		w.t.Fatal(err)
	}
}

func (w *svcWorld) del(daddr, saddr netip.Addr, dport, sport uint16, proto, flags uint8) {
	w.t.Helper()
	var err error
	if w.v6 {
		k := ctmap.NewKey6(daddr, saddr, dport, sport, proto, flags)
		err = w.ct.Map(k.Kind()).Delete(k)
	} else {
		k := ctmap.NewKey4(daddr, saddr, dport, sport, proto, flags)
		err = w.ct.Map(k.Kind()).Delete(k)
	}
	if err != nil {
		w.t.Fatal(err)
	}
}

// pick is what Cilium's per-packet LB does for a packet of f that makes or
// re-picks the SERVICE entry: the entry names backend id, and an OUT entry
// (client -> backend) with its RELATED twin is created.
func (w *svcWorld) pick(f flow, id uint32, backend netip.AddrPort) {
	w.put(f.vip, f.client, f.cport, f.vport, f.proto, ctmap.FlagService, id)
	w.put(f.client, backend.Addr(), backend.Port(), f.cport, f.proto, ctmap.FlagOut, 0)
	e := ctmap.EncodeEntry(ctmap.EntryFields{Lifetime: 1 << 30})
	var err error
	if w.v6 {
		k := ctmap.NewKey6(f.client, backend.Addr(), backend.Port(), f.cport, f.proto, ctmap.FlagOut).Related()
		err = w.ct.Map(k.Kind()).Put(k, e)
	} else {
		k := ctmap.NewKey4(f.client, backend.Addr(), backend.Port(), f.cport, f.proto, ctmap.FlagOut).Related()
		err = w.ct.Map(k.Kind()).Put(k, e)
	}
	if err != nil {
		w.t.Fatal(err)
	}
}

// record is the recorder's record of a packet of f: the backend its
// SERVICE entry held when the packet passed (0: none yet).
func (w *svcWorld) record(f flow, backend uint32) {
	r := Record{Family: 4, Kind: RecServiceEntry, Backend: backend}
	if w.v6 {
		r.Family = 6
		k := ctmap.NewKey6(f.vip, f.client, f.cport, f.vport, f.proto, ctmap.FlagService)
		copy(r.Key[:], k[:])
	} else {
		k := ctmap.NewKey4(f.vip, f.client, f.cport, f.vport, f.proto, ctmap.FlagService)
		copy(r.Key[:], k[:])
	}
	rr, err := ParseRecord(r.Encode()) // the wire format, as Run reads it
	if err != nil {
		w.t.Fatal(err)
	}
	Apply(w.ix, &rr)
}

// left lists the CT entries holding ip that ip's scrub would not delete.
func (w *svcWorld) left(ip netip.Addr) []string {
	w.t.Helper()
	k4, k6, _ := w.ix.ScrubKeys(ip)
	return w.outside(ip, k4, k6)
}

// outside lists the CT entries holding ip that are not among k4 and k6.
func (w *svcWorld) outside(ip netip.Addr, k4 []ctmap.CTKey4, k6 []ctmap.CTKey6) []string {
	w.t.Helper()
	var out []string
	for _, kind := range ctmap.Kinds {
		if kind.IPv6() != w.v6 {
			continue
		}
		it := w.ct.Map(kind).Iterate()
		var v ctmap.Entry
		if w.v6 {
			var k ctmap.CTKey6
			for it.Next(&k, &v) {
				if k.Has(ip) && !slices.Contains(k6, k) {
					out = append(out, k.String())
				}
			}
		} else {
			var k ctmap.CTKey4
			for it.Next(&k, &v) {
				if k.Has(ip) && !slices.Contains(k4, k) {
					out = append(out, k.String())
				}
			}
		}
		if err := it.Err(); err != nil {
			w.t.Fatal(err)
		}
	}
	return out
}

// client is a fresh pod IP, tracked (complete, no keys).
func (w *svcWorld) client(i byte) netip.Addr {
	ip := w.addr(244, 0, i)
	w.ix.Hold(ip)
	w.ix.Track(ip)
	return ip
}

func (w *svcWorld) wantComplete(ip netip.Addr) {
	w.t.Helper()
	if st := w.ix.State(ip); !st.Complete {
		w.t.Fatalf("%s: %+v, want complete", ip, st)
	}
	if l := w.left(ip); len(l) > 0 {
		w.t.Fatalf("%s complete with entries its scrub would not delete: %v", ip, l)
	}
}

// wantUnresolved: ip marked, and an entry of ip's that no scrub of the
// index would delete (the mark is what saves it).
func (w *svcWorld) wantUnresolved(ip netip.Addr) {
	w.t.Helper()
	if st := w.ix.State(ip); st.Incomplete != index.ReasonServiceUnresolved {
		w.t.Fatalf("%s: %+v, want incomplete (%s)", ip, st, index.ReasonServiceUnresolved)
	}
	if l := w.left(ip); len(l) == 0 {
		w.t.Fatalf("%s: marked, but every entry of its is indexed: the case does not test the mark", ip)
	} else {
		w.t.Logf("left outside the index (the mark makes the scrub sweep them): %v", l)
	}
	if w.r.ServiceUnresolved() == 0 {
		w.t.Fatal("ctscrub_service_unresolved_total not counted")
	}
}

func bothFamilies(t *testing.T, f func(t *testing.T, w *svcWorld)) {
	for _, v6 := range []bool{false, true} {
		name := "IPv4"
		if v6 {
			name = "IPv6"
		}
		t.Run(name, func(t *testing.T) { f(t, newSvcWorld(t, v6)) })
	}
}

// The common path: the first packet made the entry (record: backend 0),
// the scrub's resolution alone (no early one: as when its queue dropped
// the IP) learns the backend; SERVICE, OUT and RELATED are all indexed.
func TestResolveLearnsBackend(t *testing.T) {
	bothFamilies(t, func(t *testing.T, w *svcWorld) {
		c := w.client(1)
		f := w.flow(c)
		be := netip.AddrPortFrom(w.addr(245, 0, 5), 8080)
		w.setBackend(7, be)
		w.record(f, 0)
		w.pick(f, 7, be)
		if l := w.left(c); len(l) != 2 {
			t.Fatalf("before resolution: %v left, want the OUT and RELATED entries", l)
		}
		w.r.Resolve(w.ix, c, true)
		w.wantComplete(c)
	})
}

// A backend picked by the first packet, removed before anything read its
// address; the next packet re-picked another (the recorder read the first
// one on that packet, before Cilium re-picked). The OUT entry towards the
// removed backend is there and its address is unknown.
func TestResolveBackendRemovedBeforeRead(t *testing.T) {
	bothFamilies(t, func(t *testing.T, w *svcWorld) {
		c := w.client(1)
		f := w.flow(c)
		b1, b2 := netip.AddrPortFrom(w.addr(245, 0, 5), 8080), netip.AddrPortFrom(w.addr(245, 0, 6), 8080)
		w.setBackend(7, b1)
		w.record(f, 0)
		w.pick(f, 7, b1)
		w.removeBackend(7)
		w.setBackend(8, b2)
		w.record(f, 7) // packet 2 read backend 7 ...
		w.pick(f, 8, b2)
		w.r.Resolve(w.ix, c, false) // ... so even the early pass knows: a fact, not a window
		w.wantUnresolved(c)
	})
}

// The same removal after the early resolution read the address: learnt,
// so the client stays complete with both flows' OUT entries indexed.
func TestResolveBackendRemovedAfterEarlyRead(t *testing.T) {
	bothFamilies(t, func(t *testing.T, w *svcWorld) {
		c := w.client(1)
		f := w.flow(c)
		b1, b2 := netip.AddrPortFrom(w.addr(245, 0, 5), 8080), netip.AddrPortFrom(w.addr(245, 0, 6), 8080)
		w.setBackend(7, b1)
		w.record(f, 0)
		w.pick(f, 7, b1)
		w.r.Resolve(w.ix, c, false)
		w.removeBackend(7)
		w.setBackend(8, b2)
		w.record(f, 7)
		w.pick(f, 8, b2)
		w.record(f, 8)
		w.r.Resolve(w.ix, c, true)
		w.wantComplete(c)
	})
}

// The SERVICE entry gone (LRU, GC) while the pick the first packet made
// was never read: its OUT entry may outlive it and names a backend nobody
// learnt.
func TestResolveServiceEntryGoneWithPickUnread(t *testing.T) {
	bothFamilies(t, func(t *testing.T, w *svcWorld) {
		c := w.client(1)
		f := w.flow(c)
		be := netip.AddrPortFrom(w.addr(245, 0, 5), 8080)
		w.setBackend(7, be)
		w.record(f, 0)
		w.pick(f, 7, be)
		w.del(f.vip, f.client, f.cport, f.vport, f.proto, ctmap.FlagService)
		w.r.Resolve(w.ix, c, false) // early: Cilium may not have made it yet
		if st := w.ix.State(c); !st.Complete {
			t.Fatalf("the early pass marked %s (%+v): an absent entry is only a window there", c, st)
		}
		w.r.Resolve(w.ix, c, true)
		w.wantUnresolved(c)
	})
}

// The same eviction after the pick was learnt: the flow's state and its
// SERVICE key leave the index; its OUT entries stay indexed.
func TestResolveServiceEntryGoneAfterLearnt(t *testing.T) {
	bothFamilies(t, func(t *testing.T, w *svcWorld) {
		c := w.client(1)
		f := w.flow(c)
		be := netip.AddrPortFrom(w.addr(245, 0, 5), 8080)
		w.setBackend(7, be)
		w.record(f, 0)
		w.pick(f, 7, be)
		w.r.Resolve(w.ix, c, false)
		w.del(f.vip, f.client, f.cport, f.vport, f.proto, ctmap.FlagService)
		// The early pass leaves a settled flow alone (it reads only
		// what records unsettled); the final pass reads every entry.
		w.r.Resolve(w.ix, c, false)
		if s := w.ix.Services(c); len(s) != 1 {
			t.Fatalf("the early pass touched a settled flow: %+v", s)
		}
		w.r.Resolve(w.ix, c, true)
		w.wantComplete(c)
		if s := w.ix.Services(c); len(s) != 0 {
			t.Fatalf("state kept for a flow whose SERVICE entry is gone: %+v", s)
		}
	})
}

// The entry names backend 7, but 7 was removed and its ID reused for
// another address before anything read the pick: the backend map answers
// with the new address, towards which there is no OUT entry; the real one
// (towards the old address) cannot be found.
func TestResolveIDReused(t *testing.T) {
	bothFamilies(t, func(t *testing.T, w *svcWorld) {
		c := w.client(1)
		f := w.flow(c)
		old, reused := netip.AddrPortFrom(w.addr(245, 0, 5), 8080), netip.AddrPortFrom(w.addr(245, 0, 9), 9090)
		w.setBackend(7, old)
		w.record(f, 0)
		w.pick(f, 7, old)
		w.setBackend(7, reused)
		w.r.Resolve(w.ix, c, false) // early: the OUT entry may be on its way
		if st := w.ix.State(c); !st.Complete {
			t.Fatalf("the early pass marked %s (%+v)", c, st)
		}
		w.r.Resolve(w.ix, c, true)
		w.wantUnresolved(c)
	})
}

// Re-picks, each read by the recorder at the flow's next packet, the last
// one read only by the scrub's resolution: every OUT entry indexed.
func TestResolveRepicks(t *testing.T) {
	bothFamilies(t, func(t *testing.T, w *svcWorld) {
		c := w.client(1)
		f := w.flow(c)
		bs := []netip.AddrPort{
			netip.AddrPortFrom(w.addr(245, 0, 5), 8080),
			netip.AddrPortFrom(w.addr(245, 0, 6), 8080),
			netip.AddrPortFrom(w.addr(245, 0, 7), 8080),
		}
		for i, b := range bs {
			w.setBackend(uint32(7+i), b)
		}
		w.record(f, 0)
		w.pick(f, 7, bs[0])
		w.record(f, 7)
		w.r.Resolve(w.ix, c, false)
		// Backend 7 goes; the next packet re-picks 8 (its record read 7,
		// unchanged: none), the one after reads 8.
		w.removeBackend(7)
		w.pick(f, 8, bs[1])
		w.record(f, 8)
		w.r.Resolve(w.ix, c, false) // the early pass learns 8's address
		// 8 goes too; the next packet re-picks 9, read by nothing but the
		// scrub's resolution.
		w.removeBackend(8)
		w.pick(f, 9, bs[2])
		w.r.Resolve(w.ix, c, true)
		w.wantComplete(c)
		k4, k6, _ := w.ix.KeysOf(c)
		if n := len(k4) + len(k6); n != 7 {
			t.Fatalf("%d keys, want SERVICE + 3 x (OUT, RELATED): %v %v", n, k4, k6)
		}
	})
}

// Two re-picks between resolutions, the first read by the recorder only:
// the read must be resolved, not just the entry's last backend. Without
// the read (Apply dropping it) the OUT entry towards 8 would be left.
func TestResolveRepickReadBetweenResolutions(t *testing.T) {
	bothFamilies(t, func(t *testing.T, w *svcWorld) {
		c := w.client(1)
		f := w.flow(c)
		b1, b2, b3 := netip.AddrPortFrom(w.addr(245, 0, 5), 8080), netip.AddrPortFrom(w.addr(245, 0, 6), 8080), netip.AddrPortFrom(w.addr(245, 0, 7), 8080)
		w.setBackend(7, b1)
		w.setBackend(8, b2)
		w.setBackend(9, b3)
		w.record(f, 0)
		w.pick(f, 7, b1)
		w.r.Resolve(w.ix, c, false)
		w.pick(f, 8, b2) // 7 not active: re-picked
		w.record(f, 8)
		w.pick(f, 9, b3)
		w.r.Resolve(w.ix, c, true)
		w.wantComplete(c)
	})
}

// Cilium's backend map re-created (an agent restart that does not restore
// it, a map migration): Resolve reads the map pinned now, not one it
// opened earlier. The old map still names the backend; the new one names
// another address for the same ID (the OUT entry is not towards it), then
// none.
func TestResolveBackendMapRecreated(t *testing.T) {
	bothFamilies(t, func(t *testing.T, w *svcWorld) {
		c := w.client(1)
		f := w.flow(c)
		be := netip.AddrPortFrom(w.addr(245, 0, 5), 8080)
		w.setBackend(7, be)
		w.record(f, 0)
		w.pick(f, 7, be)
		old := w.be[w.fam()]
		w.be[w.fam()] = w.newBackendMap(w.fam())
		w.setBackend(7, netip.AddrPortFrom(w.addr(245, 0, 9), 8080))
		var v = make([]byte, old.ValueSize())
		if err := old.Lookup(uint32(7), v); err != nil {
			t.Fatalf("the old map lost backend 7: %v", err)
		}
		w.r.Resolve(w.ix, c, true)
		w.wantUnresolved(c)
	})
	bothFamilies(t, func(t *testing.T, w *svcWorld) {
		c := w.client(1)
		f := w.flow(c)
		be := netip.AddrPortFrom(w.addr(245, 0, 5), 8080)
		w.setBackend(7, be)
		w.record(f, 0)
		w.pick(f, 7, be)
		w.be[w.fam()] = w.newBackendMap(w.fam()) // empty: 7 is gone
		w.r.Resolve(w.ix, c, true)
		w.wantUnresolved(c)
	})
}

// A backend map Resolve cannot use (another layout) marks the IP, as a
// missing CT map does: nothing is resolved from a layout not known.
func TestResolveUnknownBackendLayout(t *testing.T) {
	w := newSvcWorld(t, false)
	c := w.client(1)
	f := w.flow(c)
	be := netip.AddrPortFrom(w.addr(245, 0, 5), 8080)
	w.record(f, 0)
	w.pick(f, 7, be)
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 4, ValueSize: 16, MaxEntries: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	path := filepath.Join(w.dir, ctmap.BackendMap4)
	os.Remove(path)
	if err := m.Pin(path); err != nil {
		t.Fatal(err)
	}
	w.r.Resolve(w.ix, c, true)
	w.wantUnresolved(c)
}

// A scrub's Take after a final resolution that left a pick pending (the
// entry's backend removed, the flow idle: its next packet would re-pick,
// and may do so between the resolution and Take) marks the IP: the state
// goes with the keys, so the scrub could not know that pick's OUT entry.
func TestTakeWithPickPending(t *testing.T) {
	w := newSvcWorld(t, false)
	c := w.client(1)
	f := w.flow(c)
	b1, b2 := netip.AddrPortFrom(w.addr(245, 0, 5), 8080), netip.AddrPortFrom(w.addr(245, 0, 6), 8080)
	w.setBackend(7, b1)
	w.record(f, 0)
	w.pick(f, 7, b1)
	w.r.Resolve(w.ix, c, false)
	w.removeBackend(7)
	w.r.Resolve(w.ix, c, true)
	if st := w.ix.State(c); !st.Complete {
		t.Fatalf("%+v: a removed backend whose OUT key is indexed is no reason to mark", st)
	}
	// The re-pick, between the resolution and Take. No recorder installed
	// its hooks: nothing can confirm, so Take marks.
	w.setBackend(8, b2)
	w.pick(f, 8, b2)
	_, _, st := w.ix.Take(c)
	if st.Incomplete != index.ReasonServiceUnresolved {
		t.Fatalf("Take: %+v, want incomplete (%s)", st, index.ReasonServiceUnresolved)
	}
}

// confirmWorld installs the hooks a running recorder installs, minus the
// kernel's flow cache (Taken: the test itself stands for "every packet is
// recorded from now on"): Resolve final, and Confirm.
func (w *svcWorld) confirmHooks() {
	w.ix.SetHooks(&index.Hooks{
		Taken:   func(netip.Addr, []ctmap.CTKey4, []ctmap.CTKey6) {},
		Resolve: func(ip netip.Addr) { w.r.Resolve(w.ix, ip, true) },
		Confirm: w.r.confirmRepicks,
	})
}

// takenLeft lists the CT entries holding ip that a scrub of the keys Take
// handed out (with their covered forms) would not delete.
func (w *svcWorld) takenLeft(ip netip.Addr, k4 []ctmap.CTKey4, k6 []ctmap.CTKey6) []string {
	w.t.Helper()
	k4, k6 = index.Covered(k4, k6)
	return w.outside(ip, k4, k6)
}

// removedBeforeScrub: a flow's backend learnt, then removed (its pod
// deleted, as the churn's Service loses its backends), before the
// client's own scrub; the final resolution reads the SERVICE entry still
// naming it. Found on kind with CILIUM_LB=default: such a client swept.
func (w *svcWorld) removedBeforeScrub() (c netip.Addr, f flow) {
	w.t.Helper()
	c = w.client(1)
	f = w.flow(c)
	w.setBackend(7, netip.AddrPortFrom(w.addr(245, 0, 5), 8080))
	w.record(f, 0)
	w.pick(f, 7, netip.AddrPortFrom(w.addr(245, 0, 5), 8080))
	w.r.Resolve(w.ix, c, false)
	w.removeBackend(7)
	w.r.Resolve(w.ix, c, true)
	if st := w.ix.State(c); !st.Complete {
		w.t.Fatalf("%+v: a removed backend whose OUT key is indexed is no reason to mark", st)
	}
	return c, f
}

// No packet re-picked: the scrub confirms it and stays on the index, with
// every entry of the client's among the keys it deletes.
func TestTakeConfirmsNoRepick(t *testing.T) {
	bothFamilies(t, func(t *testing.T, w *svcWorld) {
		c, _ := w.removedBeforeScrub()
		w.confirmHooks()
		t0 := time.Now()
		k4, k6, st := w.ix.Take(c)
		if !st.Complete {
			t.Fatalf("Take: %+v, want complete (the pick is known and none was made since)", st)
		}
		if d := time.Since(t0); d < settleDelay {
			t.Fatalf("Take returned after %v: it must wait %v for packets that passed the recorder", d, settleDelay)
		}
		if l := w.takenLeft(c, k4, k6); len(l) > 0 {
			t.Fatalf("complete, but entries the scrub would not delete: %v", l)
		}
		if w.r.RepicksConfirmed() != 1 {
			t.Fatalf("ctscrub_service_repick_confirmed_total = %d, want 1", w.r.RepicksConfirmed())
		}
	})
}

// A packet that passed the recorder before Take re-picked (Cilium handled
// it after the resolution): the scrub finds the new pick and deletes its
// OUT and RELATED entries too.
func TestTakeConfirmFindsRepick(t *testing.T) {
	bothFamilies(t, func(t *testing.T, w *svcWorld) {
		c, f := w.removedBeforeScrub()
		b2 := netip.AddrPortFrom(w.addr(245, 0, 6), 8080)
		w.setBackend(8, b2)
		w.confirmHooks()
		go func() {
			time.Sleep(settleDelay / 4) // while Take waits
			w.pick(f, 8, b2)
		}()
		k4, k6, st := w.ix.Take(c)
		if !st.Complete {
			t.Fatalf("Take: %+v, want complete (the new pick's OUT entry is there to read)", st)
		}
		if l := w.takenLeft(c, k4, k6); len(l) > 0 {
			t.Fatalf("complete, but entries the scrub would not delete: %v", l)
		}
		if n := len(k4) + len(k6); n != 5 {
			t.Fatalf("Take handed %d keys, want 5 (SERVICE, OUT and RELATED to each backend)", n)
		}
	})
}

// What cannot be confirmed marks: the SERVICE entry gone before the scrub
// could read it (a re-pick may have been made and its entry deleted), or
// a re-pick to a backend removed in turn.
func TestTakeConfirmCannotTell(t *testing.T) {
	bothFamilies(t, func(t *testing.T, w *svcWorld) {
		t.Run("entry gone", func(t *testing.T) {
			c, f := w.removedBeforeScrub()
			w.confirmHooks()
			w.del(f.vip, f.client, f.cport, f.vport, f.proto, ctmap.FlagService)
			_, _, st := w.ix.Take(c)
			if st.Incomplete != index.ReasonServiceUnresolved {
				t.Fatalf("Take: %+v, want incomplete (%s)", st, index.ReasonServiceUnresolved)
			}
			if st := w.ix.State(c); st.Complete {
				t.Fatalf("after Take: %+v, want the mark kept for the next scrub", st)
			}
		})
		w2 := newSvcWorld(t, w.v6)
		t.Run("re-picked backend removed", func(t *testing.T) {
			c, f := w2.removedBeforeScrub()
			b2 := netip.AddrPortFrom(w2.addr(245, 0, 6), 8080)
			w2.confirmHooks()
			w2.pick(f, 8, b2) // backend 8 is not (or no longer) in the backend map
			_, _, st := w2.ix.Take(c)
			if st.Incomplete != index.ReasonServiceUnresolved {
				t.Fatalf("Take: %+v, want incomplete (%s)", st, index.ReasonServiceUnresolved)
			}
			if w2.r.ServiceUnresolved() == 0 {
				t.Fatal("ctscrub_service_unresolved_total not counted")
			}
		})
	})
}

// A record after the final resolution (a packet passed the recorder, so
// the next resolution must read what it did) ends the Repick state: Take
// without a resolution in between marks, and confirms nothing.
func TestRecordEndsRepick(t *testing.T) {
	w := newSvcWorld(t, false)
	c, f := w.removedBeforeScrub()
	w.record(f, 0)
	w.ix.SetHooks(&index.Hooks{
		Taken:   func(netip.Addr, []ctmap.CTKey4, []ctmap.CTKey6) {},
		Confirm: w.r.confirmRepicks,
	})
	_, _, st := w.ix.Take(c)
	if st.Incomplete != index.ReasonServiceUnresolved {
		t.Fatalf("Take: %+v, want incomplete (%s)", st, index.ReasonServiceUnresolved)
	}
	if w.r.RepicksConfirmed() != 0 {
		t.Fatal("a flow with a record after its resolution was confirmed")
	}
}

// A burst of pods with service flows: the early resolution's queue stays
// bounded (what it cannot take is counted, not kept), and IPs queued at
// once are resolved at Resolve's pace, not one delay apiece.
func TestResolveQueueBurst(t *testing.T) {
	q := newResolveQueue(64)
	now := time.Now()
	for i := range 10_000 {
		q.offer(netip.AddrFrom4([4]byte{10, 244, byte(i >> 8), byte(i)}), now)
	}
	if len(q.ch) != 64 || len(q.queued) != 64 {
		t.Fatalf("queue holds %d, %d queued IPs; want the bound, 64", len(q.ch), len(q.queued))
	}
	if d := q.dropped.Load(); d != 10_000-64 {
		t.Fatalf("dropped %d, want %d", d, 10_000-64)
	}
	// The same IP again while queued: not queued twice, not dropped.
	q.offer(netip.AddrFrom4([4]byte{10, 244, 0, 0}), now)
	if d := q.dropped.Load(); d != 10_000-64 {
		t.Fatalf("a queued IP offered again counted as dropped")
	}

	w := newSvcWorld(t, false)
	var clients []netip.Addr
	be := netip.AddrPortFrom(w.addr(245, 0, 5), 8080)
	w.setBackend(7, be)
	q = newResolveQueue(256)
	for i := range 200 {
		c := w.client(byte(i))
		f := w.flow(c)
		w.record(f, 0)
		w.pick(f, 7, be)
		clients = append(clients, c)
		q.offer(c, time.Now())
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { w.r.resolveEarly(ctx, w.ix, q); close(done) }()
	// 200 x resolveDelay would be 20 s; queued together they are due
	// together. 5 s leaves room for a loaded machine.
	deadline := time.Now().Add(5 * time.Second)
	for _, c := range clients {
		for {
			s := w.ix.Services(c)
			if len(s) == 1 && !s[0].Pending && s[0].ID == 7 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s not resolved within 5 s of a burst of 200: %+v", c, s)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	cancel()
	<-done
	if len(q.queued) != 0 {
		t.Fatalf("%d IPs still marked queued", len(q.queued))
	}
}

// Issue 35 item 5: the first packet found no entry (a pick pending), a
// later packet's record read the entry's backend, and then the SERVICE
// entry went (GC, LRU) before the scrub: every pick is known (the read
// names the pick the earlier packets made), so the client is complete and
// its OUT entry indexed. Before, the read left the pick pending and the
// scrub's resolution marked the client ("the SERVICE entry is gone and its
// last backend was never read"): one sweep of the table for nothing.
func TestResolvePendingPickReadThenEntryGone(t *testing.T) {
	bothFamilies(t, func(t *testing.T, w *svcWorld) {
		c := w.client(1)
		f := w.flow(c)
		be := netip.AddrPortFrom(w.addr(245, 0, 5), 8080)
		w.setBackend(7, be)
		w.record(f, 0)
		w.pick(f, 7, be)
		w.record(f, 7) // the flow's next packet read the pick
		w.del(f.vip, f.client, f.cport, f.vport, f.proto, ctmap.FlagService)
		w.r.Resolve(w.ix, c, true)
		w.wantComplete(c)
	})
}

// A hairpin: the client reaches itself through its service. Cilium
// source-NATs it to the service loopback address (IPv4 at every version,
// IPv6 from 1.19), so the OUT entry names the loopback, not the client,
// and the pod's recorder sees the packet arrive from the loopback (an IN
// key whose twin covers the OUT entry). The client is complete with every
// entry covered, in both families. Before, the exception was IPv4-only and
// the IPv6 client was marked ("no OUT entry towards the SERVICE entry's
// backend"): a sweep of the table for nothing (issue 35 item 5).
func TestResolveHairpin(t *testing.T) {
	bothFamilies(t, func(t *testing.T, w *svcWorld) {
		c := w.client(1)
		f := w.flow(c)
		lo := w.addr(254, 42, 1) // the service loopback address
		w.setBackend(7, netip.AddrPortFrom(c, 8080))
		w.record(f, 0)
		w.put(f.vip, f.client, f.cport, f.vport, f.proto, ctmap.FlagService, 7)
		w.put(lo, c, 8080, f.cport, f.proto, ctmap.FlagOut, 0)
		// The recorder's record of the SNATed packet arriving at the pod.
		r := Record{Family: 4, Kind: RecFlow}
		if w.v6 {
			r.Family = 6
			k := ctmap.NewKey6(lo, c, 8080, f.cport, f.proto, ctmap.FlagIn)
			copy(r.Key[:], k[:])
		} else {
			k := ctmap.NewKey4(lo, c, 8080, f.cport, f.proto, ctmap.FlagIn)
			copy(r.Key[:], k[:])
		}
		Apply(w.ix, &r)
		w.r.Resolve(w.ix, c, true)
		w.wantComplete(c)
	})
}
