package netnsnode

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/internal/ciliumwalk"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// Synthetic flows' remote peers: addresses outside the pod CIDRs, from the
// benchmarking and documentation ranges, so they can never be a real host.
var (
	remoteBase4 = netip.MustParseAddr("198.19.0.0")
	remoteBase6 = netip.MustParseAddr("2001:db8:c7::")
)

// CTMaps is the demo's own set of Cilium-layout CT maps, pinned under a
// private bpffs directory that scrubd opens with --ct-root.
type CTMaps struct {
	dir  string
	maps [ctmap.NumKinds]*ebpf.Map
}

// CreateCTMaps creates the four global CT maps under dir, each big enough for
// its share of entries with room to spare (see mapSize).
func CreateCTMaps(dir string, entries int) (*CTMaps, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create bpffs dir %s: %w (is bpffs mounted at /sys/fs/bpf? run scripts/setup.sh)", dir, err)
	}
	m := &CTMaps{dir: dir}
	for _, k := range ctmap.Kinds {
		spec := k.Spec(mapSize(k, entries))
		mp, err := ebpf.NewMap(spec)
		if err != nil {
			m.Close()
			return nil, fmt.Errorf("create CT map %s with %d entries: %w", k.Name(), spec.MaxEntries, err)
		}
		path := filepath.Join(dir, k.Name())
		if err := mp.Pin(path); err != nil {
			mp.Close()
			m.Close()
			return nil, fmt.Errorf("pin CT map at %s: %w", path, err)
		}
		m.maps[k] = mp
	}
	return m, nil
}

// Recreate does what a Cilium agent restart that re-creates its CT maps
// does: each map is unpinned and a new, empty one with the same spec pinned
// in its place. The old maps are closed.
func (m *CTMaps) Recreate(entries int) error {
	for _, k := range ctmap.Kinds {
		spec := k.Spec(mapSize(k, entries))
		mp, err := ebpf.NewMap(spec)
		if err != nil {
			return fmt.Errorf("re-create CT map %s: %w", k.Name(), err)
		}
		path := filepath.Join(m.dir, k.Name())
		if old := m.maps[k]; old != nil {
			if err := old.Unpin(); err != nil {
				mp.Close()
				return fmt.Errorf("unpin CT map %s: %w", path, err)
			}
			old.Close()
		}
		m.maps[k] = mp
		if err := mp.Pin(path); err != nil {
			return fmt.Errorf("pin CT map at %s: %w", path, err)
		}
	}
	return nil
}

// share is the fraction of all entries each map holds with the fill's mix
// (see fill): v4 3/4 of flows, half TCP; every flow also has a related entry
// in the "any" map of its family.
func share(k ctmap.Kind, entries int) int {
	switch k {
	case ctmap.TCP4:
		return entries * 3 / 16
	case ctmap.Any4:
		return entries * 9 / 16
	case ctmap.TCP6:
		return entries / 16
	default:
		return entries * 3 / 16
	}
}

// mapSize leaves a quarter of each map free: an LRU hash evicts only when
// it has no free element, so every entry put in stays.
func mapSize(k ctmap.Kind, entries int) uint32 {
	return uint32(share(k, entries)*5/4 + 4096)
}

// Dir is the bpffs directory the maps are pinned in (scrubd's --ct-root).
func (m *CTMaps) Dir() string { return m.dir }

// Map is the map of kind k.
func (m *CTMaps) Map(k ctmap.Kind) *ebpf.Map { return m.maps[k] }

// All is the four maps, indexed by kind, as internal/ciliumwalk takes them.
func (m *CTMaps) All() [ctmap.NumKinds]*ebpf.Map { return m.maps }

// Close closes and unpins the maps.
func (m *CTMaps) Close() error {
	var errs []error
	for i, mp := range m.maps {
		if mp == nil {
			continue
		}
		errs = append(errs, mp.Unpin(), mp.Close())
		m.maps[i] = nil
	}
	return errors.Join(errs...)
}

// Count returns the number of entries in each map and their sum.
func (m *CTMaps) Count() (per [ctmap.NumKinds]int, total int, err error) {
	for _, k := range ctmap.Kinds {
		st, err := ciliumwalk.BatchMap(m.maps[k], k, func(ctmap.Kind, []byte, *ctmap.Entry) bool { return false }, ciliumwalk.Options{CountOnly: true})
		if err != nil {
			return per, 0, err
		}
		per[k] = st.Visited
		total += st.Visited
	}
	return per, total, nil
}

// MonotonicSeconds is Cilium's default BPF clock (ktime in seconds).
func MonotonicSeconds() uint32 {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return uint32(ts.Sec)
}

// flowGen writes synthetic flows in Cilium's layout: each flow is one OUT or
// IN entry in the TCP or "any" map plus its related ICMP entry, exactly as the
// datapath would create them. Keys are unique by construction (one remote
// address per flow of a pod), so the maps end up with exactly what was put in.
type flowGen struct {
	lifetime uint32
	k4       [ctmap.NumKinds][]ctmap.CTKey4
	k6       [ctmap.NumKinds][]ctmap.CTKey6
	maps     *CTMaps
	put      int
}

const genBatch = 1 << 14

func newFlowGen(m *CTMaps) *flowGen {
	// Six hours ahead, Cilium's TCP lifetime: nothing the daemon's expiry pass
	// does may remove the demo's entries while it runs.
	return &flowGen{maps: m, lifetime: MonotonicSeconds() + 6*3600}
}

// flow adds flow j of pod: v4 or v6 by the pod's family; TCP for even j, UDP
// for odd; the pod initiated (OUT) for j%4 < 2, a remote peer (IN) otherwise.
func (g *flowGen) flow(pod netip.Addr, j int) error {
	proto := ctmap.ProtoTCP
	dport := uint16(443)
	if j%2 == 1 {
		proto, dport = ctmap.ProtoUDP, 53
	}
	sport := uint16(32768 + j%28000)
	if pod.Is4() {
		r := remoteBase4.As4()
		r[2], r[3] = byte(j>>8), byte(j)
		r[1] += byte(j >> 16)
		remote := netip.AddrFrom4(r)
		var k ctmap.CTKey4
		if j%4 < 2 {
			k = ctmap.NewKey4(pod, remote, dport, sport, proto, ctmap.FlagOut)
		} else {
			k = ctmap.NewKey4(remote, pod, dport, sport, proto, ctmap.FlagIn)
		}
		g.k4[k.Kind()] = append(g.k4[k.Kind()], k)
		g.k4[ctmap.Any4] = append(g.k4[ctmap.Any4], k.Related())
	} else {
		r := remoteBase6.As16()
		r[13], r[14], r[15] = byte(j>>16), byte(j>>8), byte(j)
		remote := netip.AddrFrom16(r)
		var k ctmap.CTKey6
		if j%4 < 2 {
			k = ctmap.NewKey6(pod, remote, dport, sport, proto, ctmap.FlagOut)
		} else {
			k = ctmap.NewKey6(remote, pod, dport, sport, proto, ctmap.FlagIn)
		}
		g.k6[k.Kind()] = append(g.k6[k.Kind()], k)
		g.k6[ctmap.Any6] = append(g.k6[ctmap.Any6], k.Related())
	}
	for _, kd := range ctmap.Kinds {
		if len(g.k4[kd]) >= genBatch || len(g.k6[kd]) >= genBatch {
			if err := g.flush(kd); err != nil {
				return err
			}
		}
	}
	return nil
}

var fillValues []ctmap.Entry

func (g *flowGen) flush(kd ctmap.Kind) error {
	n := max(len(g.k4[kd]), len(g.k6[kd]))
	if n == 0 {
		return nil
	}
	if len(fillValues) < n || fillValues[0].Lifetime() != g.lifetime {
		fillValues = make([]ctmap.Entry, max(n, genBatch))
		e := ctmap.EncodeEntry(ctmap.EntryFields{Lifetime: g.lifetime, Packets: 1, Bytes: 64, TxFlagsSeen: 0x02})
		for i := range fillValues {
			fillValues[i] = e
		}
	}
	var (
		put int
		err error
	)
	if kd.IPv6() {
		put, err = g.maps.maps[kd].BatchUpdate(g.k6[kd], fillValues[:n], nil)
		g.k6[kd] = g.k6[kd][:0]
	} else {
		put, err = g.maps.maps[kd].BatchUpdate(g.k4[kd], fillValues[:n], nil)
		g.k4[kd] = g.k4[kd][:0]
	}
	g.put += put
	if err != nil {
		return fmt.Errorf("fill %s: batch update of %d entries: %w", kd.Name(), n, err)
	}
	return nil
}

func (g *flowGen) Flush() error {
	for _, kd := range ctmap.Kinds {
		if err := g.flush(kd); err != nil {
			return err
		}
	}
	return nil
}

// FillPlan says how the synthetic entries are spread over pod IPs.
type FillPlan struct {
	Entries    int          // total entries to put in (flows × 2)
	Background []netip.Addr // the node's other pods
	Owners     []netip.Addr // previous owners of the IPs the demo's pods get
	PerOwner   int          // entries each previous owner leaves behind
}

// Fill writes plan into the maps and returns the number of entries put in.
func Fill(ctx context.Context, m *CTMaps, plan FillPlan) (int, time.Duration, error) {
	start := time.Now()
	g := newFlowGen(m)
	for _, ip := range plan.Owners {
		for j := 0; j < plan.PerOwner/2; j++ {
			if err := g.flow(ip, j); err != nil {
				return g.put, time.Since(start), err
			}
		}
	}
	flows := (plan.Entries - len(plan.Owners)*(plan.PerOwner/2)*2) / 2
	nbg := len(plan.Background)
	for i := 0; i < flows; i++ {
		if i%65536 == 0 && ctx.Err() != nil {
			return g.put, time.Since(start), ctx.Err()
		}
		if err := g.flow(plan.Background[i%nbg], i/nbg); err != nil {
			return g.put, time.Since(start), err
		}
	}
	err := g.Flush()
	return g.put, time.Since(start), err
}

// BackgroundPodCount is how many other pods a fill of entries spreads over:
// 256 entries each, at least 64 and at most 16,384 pods so their v4
// addresses stay inside BGPods4, a multiple of 4 (BackgroundPods' mix).
func BackgroundPodCount(entries int) int {
	n := min(max(64, entries/256), 16384)
	return n - n%4
}

// BackgroundPods returns n addresses for the node's other pods: 3/4 v4 from
// v4 (past the part host-local hands out), 1/4 v6, matching the fill's mix.
func BackgroundPods(v4, v6 netip.Prefix, n int) []netip.Addr {
	out := make([]netip.Addr, 0, n)
	a4, a6 := v4.Addr(), v6.Addr()
	for i := 0; i < n; i++ {
		if i%4 == 3 && v6.IsValid() {
			a6 = a6.Next()
			out = append(out, a6)
		} else {
			a4 = a4.Next()
			out = append(out, a4)
		}
	}
	return out
}
