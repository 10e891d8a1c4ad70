package expiry

import (
	"context"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/ctscrub/ctscrub/scrubd/cilium"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

var (
	auditCIDR4 = netip.MustParsePrefix("10.244.0.0/16")
	auditCIDR6 = netip.MustParsePrefix("fd00:10:244::/64")
	peer4      = netip.MustParseAddr("192.0.2.10")
	peer6      = netip.MustParseAddr("2001:db8::10")
)

// auditWorld is the four CT maps with live entries of pod IPs, every flow
// recorded through recorder.Apply (the recorder's one path into the index),
// the pods tracked from their start, and background entries of other hosts.
type auditWorld struct {
	t    *testing.T
	raw  [ctmap.NumKinds]*ebpf.Map
	maps *ctmap.Maps
	ix   *index.Index
	now  uint32
	port uint16
}

func newAuditWorld(t *testing.T, pods []netip.Addr) *auditWorld {
	needRoot(t)
	w := &auditWorld{t: t, ix: index.New(index.Config{PodCIDRs: []netip.Prefix{auditCIDR4, auditCIDR6}}), port: 2000}
	for _, k := range ctmap.Kinds {
		w.raw[k] = newMap(t, k, 1<<14)
	}
	cm, err := ctmap.FromMaps(w.raw)
	if err != nil {
		t.Fatal(err)
	}
	w.maps = cm
	w.now, _ = nows(t)
	for _, ip := range pods {
		w.ix.Hold(ip) // pods of this node, as after their ADD
		w.ix.Track(ip)
		for range 5 {
			w.flow(ip, true)
		}
	}
	// Entries of no pod: the audit must not look at them.
	for i := range 200 {
		k := ctmap.NewKey4(netip.AddrFrom4([4]byte{172, 16, 0, byte(i)}), peer4, 80, uint16(i), ctmap.ProtoTCP, ctmap.FlagOut)
		w.put(k)
	}
	return w
}

// flow creates a TCP flow the pod initiated (the entry and its related
// entry) and, with record set, records it.
func (w *auditWorld) flow(ip netip.Addr, record bool) (ctmap.CTKey4, ctmap.CTKey6) {
	w.port++
	r := &recorder.Record{Kind: recorder.RecFlow}
	var k4 ctmap.CTKey4
	var k6 ctmap.CTKey6
	if ip.Is4() {
		k4 = ctmap.NewKey4(ip, peer4, 443, w.port, ctmap.ProtoTCP, ctmap.FlagOut)
		w.put(k4)
		w.put(k4.Related())
		r.Family = 4
		copy(r.Key[:], k4[:])
	} else {
		k6 = ctmap.NewKey6(ip, peer6, 443, w.port, ctmap.ProtoTCP, ctmap.FlagOut)
		w.put6(k6)
		w.put6(k6.Related())
		r.Family = 6
		copy(r.Key[:], k6[:])
	}
	if record {
		parsed, err := recorder.ParseRecord(r.Encode())
		if err != nil {
			w.t.Fatal(err)
		}
		recorder.Apply(w.ix, &parsed)
	}
	return k4, k6
}

func (w *auditWorld) put(k ctmap.CTKey4) {
	w.t.Helper()
	v := ctmap.EncodeEntry(ctmap.EntryFields{Lifetime: w.now + 3000, Packets: 1})
	if err := w.raw[k.Kind()].Put(k, v); err != nil {
		w.t.Fatal(err)
	}
}

func (w *auditWorld) put6(k ctmap.CTKey6) {
	w.t.Helper()
	v := ctmap.EncodeEntry(ctmap.EntryFields{Lifetime: w.now + 3000, Packets: 1})
	if err := w.raw[k.Kind()].Put(k, v); err != nil {
		w.t.Fatal(err)
	}
}

func (w *auditWorld) runner(cfg AuditConfig, reg *prometheus.Registry) *Runner {
	w.t.Helper()
	r := runner(w.t, w.raw, Config{Mode: ModeReport, Clock: ClockKtime}, reg)
	cfg.Index = w.ix
	if cfg.Confirm == 0 {
		cfg.Confirm = 50 * time.Millisecond
	}
	if err := r.EnableAudit(cfg, reg); err != nil {
		w.t.Fatal(err)
	}
	return r
}

func (w *auditWorld) left(ip netip.Addr) int {
	n := 0
	for _, k := range ctmap.Kinds {
		it := w.raw[k].Iterate()
		if k.IPv6() {
			var kk ctmap.CTKey6
			var v ctmap.Entry
			for it.Next(&kk, &v) {
				if kk.Has(ip) {
					n++
				}
			}
		} else {
			var kk ctmap.CTKey4
			var v ctmap.Entry
			for it.Next(&kk, &v) {
				if kk.Has(ip) {
					n++
				}
			}
		}
		if err := it.Err(); err != nil {
			w.t.Fatal(err)
		}
	}
	return n
}

// The acceptance test: an entry of a complete IP that the recorder
// never saw, injected into real CT maps, is found by the next pass (every
// complete IP is audited each pass when there are at most MaxIPs), counted
// with its map and shape, the IP turns incomplete, and the next scrub (a
// sweep now) leaves nothing of the IP.
func TestAuditFindsUnrecordedEntry(t *testing.T) {
	podA, podB := netip.MustParseAddr("10.244.0.5"), netip.MustParseAddr("10.244.0.6")
	podA6 := netip.MustParseAddr("fd00:10:244::5")
	w := newAuditWorld(t, []netip.Addr{podA, podB, podA6})
	reg := prometheus.NewRegistry()
	r := w.runner(AuditConfig{}, reg)

	// A clean pass first: nothing missing, every complete IP checked.
	if _, err := r.Pass(context.Background()); err != nil {
		t.Fatal(err)
	}
	a := r.audit
	if n := value(t, a.m.checked); n != 3 {
		t.Fatalf("ips checked after a clean pass: %v, want 3", n)
	}
	if n := series(a.m.missing); n != 0 {
		t.Fatalf("clean pass counted misses: %d series", n)
	}

	// An entry the recorder never saw: a UDP flow a peer initiated to podA.
	miss := ctmap.NewKey4(peer4, podA, 53, 3333, ctmap.ProtoUDP, ctmap.FlagIn)
	w.put(miss)
	// podB: a flow recorded normally, and the other-initiator form of one
	// of its flows (covered: a scrub deletes it), both not misses.
	w.flow(podB, true)
	kb, _ := w.flow(podB, true)
	w.put(index.Mirror4(kb))
	// podA6: an unrecorded v6 entry.
	_, miss6 := w.flow(podA6, false)

	if _, err := r.Pass(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		labels []string
		want   float64
	}{
		{[]string{ctmap.Any4.Name(), "in", "false", "udp"}, 1},
		{[]string{ctmap.TCP6.Name(), "out", "false", "tcp"}, 1},
	} {
		if got := value(t, a.m.missing.WithLabelValues(c.labels...)); got != c.want {
			t.Errorf("ctscrub_audit_missing_keys_total%v = %v, want %v", c.labels, got, c.want)
		}
	}
	// (podA6's unrecorded flow's RELATED key is the one its recorded flows
	// to the same peer share: ports are 0 in RELATED keys.)
	if n := series(a.m.missing); n != 2 {
		t.Errorf("%d miss series, want 2 (podB's keys are covered)", n)
	}
	for ip, want := range map[netip.Addr]bool{podA: false, podA6: false, podB: true} {
		if st := w.ix.State(ip); st.Complete != want || (!want && st.Incomplete != index.ReasonAuditMiss) {
			t.Errorf("%s after the audit: %+v, want complete=%v", ip, st, want)
		}
	}
	ring := r.RecentMisses()
	if len(ring) != 2 {
		t.Errorf("ring of misses: %+v", ring)
	}
	_ = miss6

	// The next scrub sweeps and leaves nothing of the IPs.
	c, err := cilium.New(w.maps, w.ix, cilium.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	res, err := c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{podA, podA6}, Reason: scrub.ReasonAdd})
	if err != nil || res.Outcome != scrub.Complete || res.Method != scrub.MethodSweep {
		t.Fatalf("scrub after the audit: %+v, %v", res, err)
	}
	for _, ip := range []netip.Addr{podA, podA6} {
		if n := w.left(ip); n != 0 {
			t.Errorf("%d entries of %s left after the scrub", n, ip)
		}
	}
	// Complete again, and the next audit finds nothing missing.
	if _, err := r.Pass(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := series(a.m.missing); n != 2 {
		t.Errorf("misses after the sweep: %d series, want still 2", n)
	}
}

// A scrub that takes the IP's keys between the walk and the check (its
// deletes not yet done) is not a miss: the generation changed.
func TestAuditSkipsIPsAScrubTook(t *testing.T) {
	podA := netip.MustParseAddr("10.244.0.5")
	w := newAuditWorld(t, []netip.Addr{podA})
	reg := prometheus.NewRegistry()
	r := w.runner(AuditConfig{}, reg)
	s := r.loadAudit(time.Now())
	rep, err := r.walk(context.Background(), false, ClockKtime)
	if err != nil {
		t.Fatal(err)
	}
	k4, k6, _ := w.ix.Take(podA) // a scrub in progress: keys out of the index, entries still there
	r.checkAudit(context.Background(), s, rep, true, time.Now())
	if n := series(r.audit.m.missing); n != 0 {
		t.Errorf("a scrub's taken keys counted as misses: %d series", n)
	}
	if !w.ix.State(podA).Complete {
		t.Error("IP marked incomplete")
	}
	w.ix.Return(podA, k4, k6)
}

// Many complete IPs: MaxIPs per pass, oldest first, so every IP is audited
// within ceil(n / MaxIPs) passes, and the oldest-unaudited age says so.
func TestAuditRotation(t *testing.T) {
	var pods []netip.Addr
	for i := range 10 {
		pods = append(pods, netip.AddrFrom4([4]byte{10, 244, 1, byte(i + 1)}))
	}
	w := newAuditWorld(t, pods)
	reg := prometheus.NewRegistry()
	r := w.runner(AuditConfig{MaxIPs: 3}, reg)
	if b := r.AuditBound(len(pods)); b != 4*r.Config().Interval {
		t.Errorf("AuditBound(10) with 3 per pass = %s, want 4 intervals", b)
	}
	for pass := 1; pass <= 4; pass++ {
		if _, err := r.Pass(context.Background()); err != nil {
			t.Fatal(err)
		}
		want := float64(min(3*pass, 12))
		if got := value(t, r.audit.m.checked); got != want {
			t.Fatalf("after pass %d: %v IPs checked, want %v", pass, got, want)
		}
	}
	r.audit.mu.Lock()
	defer r.audit.mu.Unlock()
	if len(r.audit.since) != 0 || len(r.audit.audited) != len(pods) {
		t.Errorf("after 4 passes: %d never audited, %d audited; want 0, %d", len(r.audit.since), len(r.audit.audited), len(pods))
	}
	if n := series(r.audit.m.missing); n != 0 {
		t.Errorf("misses: %d", n)
	}
}

// An IP nobody holds (its pod gone, ctscrub released it) whose entries stay:
// counted as no-owner keys.
func TestAuditCountsUnownedKeys(t *testing.T) {
	podA, podB := netip.MustParseAddr("10.244.0.5"), netip.MustParseAddr("10.244.0.6")
	w := newAuditWorld(t, []netip.Addr{podA, podB})
	reg := prometheus.NewRegistry()
	r := w.runner(AuditConfig{Owned: func(ip netip.Addr) bool { return ip == podB }}, reg)
	if _, err := r.Pass(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got, want := value(t, r.audit.m.unowned), float64(w.left(podA)); got != want || want == 0 {
		t.Errorf("ctscrub_audit_unowned_keys = %v, want %v", got, want)
	}
}

// The on-demand audit's kernel read: exactly the IP's keys, nothing deleted.
func TestCollectKeys(t *testing.T) {
	podA := netip.MustParseAddr("10.244.0.5")
	w := newAuditWorld(t, []netip.Addr{podA})
	r := w.runner(AuditConfig{}, prometheus.NewRegistry())
	before := w.left(podA)
	got, err := r.CollectKeys(context.Background(), []netip.Addr{podA})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != before || before == 0 {
		t.Errorf("collected %d keys, the maps hold %d of %s", len(got), before, podA)
	}
	for _, f := range got {
		if !f.Has(podA) {
			t.Errorf("collected a key without %s: %v", podA, fmt.Sprint(f))
		}
	}
	if w.left(podA) != before {
		t.Error("the on-demand audit deleted entries")
	}
}

// series counts the metrics a collector has.
func series(c prometheus.Collector) int {
	ch := make(chan prometheus.Metric, 1024)
	c.Collect(ch)
	close(ch)
	return len(ch)
}
