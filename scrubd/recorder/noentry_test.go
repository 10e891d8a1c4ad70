package recorder

import (
	"encoding/binary"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// A flow to a service without backends: Cilium drops its packets before
// making any CT entry (e2e/conformance: service-no-backends runs Cilium's
// own bpf_lxc). Here each step of the recorder's side is written by hand
// (the record, the flow cache's value as recorder.c leaves it) so each
// condition of the "no entry" rule can be broken on its own.

const nodeConfig = `#define CT_CONNECTION_LIFETIME_TCP 21600
#define CT_SERVICE_LIFETIME_TCP 21600
#define CT_SERVICE_LIFETIME_NONTCP 60
#define CT_SYN_TIMEOUT 60
#define CT_CLOSE_TIMEOUT 10
`

func TestParseLifetimes(t *testing.T) {
	lt, err := ParseLifetimes([]byte(nodeConfig))
	if err != nil || lt.TCP != 10*time.Second || lt.Other != 60*time.Second {
		t.Fatalf("%+v, %v: want TCP 10s (the close timeout), other 60s", lt, err)
	}
	_, err = ParseLifetimes([]byte(strings.Replace(nodeConfig, "#define CT_SYN_TIMEOUT 60\n", "", 1)))
	if err == nil || !strings.Contains(err.Error(), "CT_SYN_TIMEOUT") {
		t.Fatalf("a define missing: %v, want an error naming it", err)
	}
}

// noEntryWorld is a svcWorld whose recorder has flow caches, the node's
// lifetimes and a CT fill counter.
func noEntryWorld(t *testing.T, v6 bool) (*svcWorld, *int64) {
	w := newSvcWorld(t, v6)
	for i, ks := range []uint32{16, 40} {
		m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.LRUHash, KeySize: ks, ValueSize: 16, MaxEntries: 64})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		if i == 0 {
			w.r.objs.RecFlows4 = m
		} else {
			w.r.objs.RecFlows6 = m
		}
	}
	cfg := filepath.Join(t.TempDir(), "node_config.h")
	if err := os.WriteFile(cfg, []byte(nodeConfig), 0o600); err != nil {
		t.Fatal(err)
	}
	w.r.life.path = cfg
	fill := new(int64)
	w.r.opts.CTFill = func(ctmap.Kind) (int64, error) { return *fill, nil }
	// The fill watch has sampled since long before the flows below.
	for _, k := range ctmap.Kinds {
		w.r.sampleFill(k, monoNow()-int64(time.Minute))
		w.r.sampleFill(k, monoNow()-int64(time.Minute)+int64(time.Second))
	}
	now := monoNow()
	for s := now - int64(time.Minute); s < now; s += int64(time.Second) {
		for _, k := range ctmap.Kinds {
			w.r.sampleFill(k, s)
		}
	}
	return w, fill
}

// dropped is a packet of f that found no SERVICE entry at the recorder,
// at (CLOCK_MONOTONIC ns); record: it was the flow's first such packet
// (a REC_SERVICE_ENTRY with backend 0), as recorder.c emits it.
func (w *svcWorld) dropped(f flow, at int64, record bool) {
	w.t.Helper()
	if record {
		r := Record{Family: 4, Kind: RecServiceEntry, At: uint64(at) >> SvcTimeShift}
		if w.v6 {
			r.Family = 6
			k := ctmap.NewKey6(f.vip, f.client, f.cport, f.vport, f.proto, ctmap.FlagService)
			copy(r.Key[:], k[:])
		} else {
			k := ctmap.NewKey4(f.vip, f.client, f.cport, f.vport, f.proto, ctmap.FlagService)
			copy(r.Key[:], k[:])
		}
		rr, err := ParseRecord(r.Encode())
		if err != nil {
			w.t.Fatal(err)
		}
		Apply(w.ix, &rr)
	}
	key, m := w.seenKey(f)
	v := make([]byte, 16)
	v[1] = svcNone
	binary.LittleEndian.PutUint32(v[4:], uint32(uint64(at)>>SvcTimeShift))
	if err := m.Put(key, v); err != nil {
		w.t.Fatal(err)
	}
}

func (w *svcWorld) seenKey(f flow) ([]byte, *ebpf.Map) {
	if w.v6 {
		k := make([]byte, 40)
		a, b := f.client.As16(), f.vip.As16()
		copy(k, a[:])
		copy(k[16:], b[:])
		putPorts(k[32:], f.cport, f.vport, f.proto)
		return k, w.r.objs.RecFlows6
	}
	k := make([]byte, 16)
	a, b := f.client.As4(), f.vip.As4()
	copy(k, a[:])
	copy(k[4:], b[:])
	putPorts(k[8:], f.cport, f.vport, f.proto)
	return k, w.r.objs.RecFlows4
}

func (w *svcWorld) wantMarked(ip netip.Addr, why string) {
	w.t.Helper()
	if st := w.ix.State(ip); st.Incomplete != index.ReasonServiceUnresolved {
		w.t.Fatalf("%s (%s): %+v, want incomplete (%s)", ip, why, st, index.ReasonServiceUnresolved)
	}
}

const ms = int64(time.Millisecond)

// Settled: the client stays complete, nothing of its is left, and the
// settled flow stays settled at later scrubs while no packet follows.
// Without the rule, the final resolution marked it (issue 23's kind run).
func TestResolveNoEntrySettles(t *testing.T) {
	bothFamilies(t, func(t *testing.T, w *svcWorld) {
		w, _ = noEntryWorld(t, w.v6)
		c := w.client(1)
		f := w.flow(c)
		now := monoNow()
		w.dropped(f, now-500*ms, true)
		w.dropped(f, now-300*ms, false)
		w.r.Resolve(w.ix, c, true)
		w.wantComplete(c)
		if w.r.ServiceNoEntries() != 1 {
			t.Fatalf("settled %d flows, want 1", w.r.ServiceNoEntries())
		}
		w.r.Resolve(w.ix, c, true)
		w.wantComplete(c)
	})
}

// A packet after the settling finds no entry at the recorder but makes
// one (a backend arrived): the scrub reads the entry and learns the OUT
// entry it made.
func TestResolveNoEntryLaterPacketMakesEntries(t *testing.T) {
	bothFamilies(t, func(t *testing.T, w *svcWorld) {
		w, _ = noEntryWorld(t, w.v6)
		c := w.client(1)
		f := w.flow(c)
		now := monoNow()
		w.dropped(f, now-500*ms, true)
		w.r.Resolve(w.ix, c, false)
		if s := w.ix.Services(c); len(s) != 1 || !s[0].NoEntry {
			t.Fatalf("after the early pass: %+v, want settled as no entry", s)
		}
		be := netip.AddrPortFrom(w.addr(245, 0, 5), 8080)
		w.setBackend(7, be)
		w.dropped(f, now-200*ms, false) // passed the recorder without an entry...
		w.pick(f, 7, be)                // ...and Cilium made one
		w.r.Resolve(w.ix, c, true)
		w.wantComplete(c)
	})
}

// Each condition broken on its own: the client is marked, never settled.
func TestResolveNoEntryRefuses(t *testing.T) {
	for _, tc := range []struct {
		name string
		run  func(w *svcWorld, f flow, fill *int64)
	}{
		{"first packet older than the entry's shortest lifetime", func(w *svcWorld, f flow, _ *int64) {
			w.dropped(f, monoNow()-11*int64(time.Second), true) // TCP: the 10 s close timeout
			w.dropped(f, monoNow()-200*ms, false)
		}},
		{"CT map not far from full", func(w *svcWorld, f flow, fill *int64) {
			w.dropped(f, monoNow()-500*ms, true)
			*fill = 600 // of 1024
		}},
		{"flow not in the flow cache", func(w *svcWorld, f flow, _ *int64) {
			w.dropped(f, monoNow()-500*ms, true)
			k, m := w.seenKey(f)
			m.Delete(k)
		}},
		{"a packet found an entry", func(w *svcWorld, f flow, _ *int64) {
			w.dropped(f, monoNow()-500*ms, true)
			k, m := w.seenKey(f)
			v := make([]byte, 16)
			v[1], v[4] = 1, 7 // SVC_FLOW, backend 7: its record not applied yet
			m.Put(k, v)
		}},
		{"lifetimes unknown", func(w *svcWorld, f flow, _ *int64) {
			w.dropped(f, monoNow()-500*ms, true)
			w.r.life = lifetimes{path: "/nonexistent/node_config.h"}
		}},
		{"an older program's record (no time)", func(w *svcWorld, f flow, _ *int64) {
			w.record(f, 0)
			w.dropped(f, monoNow()-500*ms, false)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			bothFamilies(t, func(t *testing.T, w *svcWorld) {
				w, fill := noEntryWorld(t, w.v6)
				c := w.client(1)
				f := w.flow(c)
				tc.run(w, f, fill)
				w.r.Resolve(w.ix, c, true)
				w.wantMarked(c, tc.name)
			})
		})
	}
}

// The latest packet too recent for Cilium to have handled it: the early
// pass leaves the flow pending and asks to come back; the final pass waits
// for it rather than mark.
func TestResolveNoEntryWaitsForTheDatapath(t *testing.T) {
	bothFamilies(t, func(t *testing.T, w *svcWorld) {
		w, _ = noEntryWorld(t, w.v6)
		c := w.client(1)
		f := w.flow(c)
		w.dropped(f, monoNow()-20*ms, true)
		if retry := w.r.resolve(w.ix, c, false); retry <= 0 || retry > settleDelay+2*time.Millisecond {
			t.Fatalf("early pass: retry %v, want within the settle delay", retry)
		}
		if s := w.ix.Services(c); len(s) != 1 || !s[0].Pending {
			t.Fatalf("early pass: %+v, want still pending", s)
		}
		w.r.Resolve(w.ix, c, true)
		w.wantComplete(c)
	})
}
