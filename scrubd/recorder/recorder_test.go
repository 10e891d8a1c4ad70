package recorder_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/internal/testsupport/netpods"
	"github.com/ctscrub/ctscrub/internal/testsupport/standin"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
)

// world is one node with pods, the Cilium stand-in creating CT entries on
// the host-side veths and the recorder attached inside each pod feeding a
// real index.
type world struct {
	node   *netpods.Node
	pods   []*netpods.Pod
	dp     *standin.Datapath
	ct     *ctmap.Maps
	rec    *recorder.Recorder
	pinDir string
	ctDir  string
	ix     *index.Index
	stop   func()
	opt    func(*recorder.Options) // adjusts the recorder's options (newWorldOpts)
}

func newWorld(t *testing.T, npods int) *world {
	t.Helper()
	return newWorldOpts(t, npods, nil)
}

// newWorldOpts is newWorld with the recorder's options adjusted by opt.
func newWorldOpts(t *testing.T, npods int, opt func(*recorder.Options)) *world {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: BPF, tc filters and network namespaces")
	}
	w := &world{node: netpods.NewNode(t)}
	ctDir := standin.TempDir(t)
	w.ctDir = ctDir
	if err := standin.CreateMaps(ctDir, 65536); err != nil {
		t.Fatal(err)
	}
	dp, err := standin.Load(ctDir, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dp.Close() })
	w.dp = dp
	if w.ct, err = dp.Maps(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.ct.Close() })

	w.pinDir = filepath.Join(standin.TempDir(t), "ctscrub")
	w.opt = opt
	w.rec = w.loadRecorder(t, ctDir)
	w.ix = w.newIndex()
	w.run(t)

	for range npods {
		p := w.node.AddPod()
		w.ix.Hold(p.Addr4) // a pod of this node, as after its index start
		w.ix.Hold(p.Addr6)
		if err := w.node.Do(func() error { return dp.AttachHostSide(p.HostVeth) }); err != nil {
			t.Fatal(err)
		}
		if _, err := w.rec.Attach(p.Path, "eth0"); err != nil {
			t.Fatal(err)
		}
		p.ServeEcho()
		// Cleanup order: detach before the netns goes away is not
		// required (Detach copes), but keeps pins from leaking.
		t.Cleanup(func() {
			if err := w.rec.Detach(p.Path, "eth0"); err != nil {
				t.Errorf("detach: %v", err)
			}
		})
		w.pods = append(w.pods, p)
	}
	w.node.Remote.ServeEcho()
	w.node.ServeEcho()
	return w
}

func (w *world) loadRecorder(t *testing.T, ctDir string) *recorder.Recorder {
	t.Helper()
	o := recorder.Options{PinDir: w.pinDir, CTRoot: ctDir, RingBytes: 1 << 20, CT: w.ct, ReopenIdle: time.Second, NodeNetns: w.node.Path}
	if w.opt != nil {
		w.opt(&o)
	}
	rec, err := recorder.Load(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rec.Close() })
	if v4, v6 := rec.VIPDetection(); !v4 || !v6 {
		t.Fatalf("VIP detection off (v4 %v, v6 %v) although the stand-in's service maps are pinned in %s", v4, v6, ctDir)
	}
	return rec
}

func (w *world) run(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	rec, ix := w.rec, w.ix
	go func() { done <- rec.Run(ctx, ix) }()
	w.stop = func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("recorder.Run: %v", err)
		}
	}
	t.Cleanup(func() {
		if w.stop != nil {
			w.stop()
			w.stop = nil
		}
	})
}

// podIPs are all pod addresses of the world.
// newIndex is a fresh index in which the world's pods hold their IPs, as
// after their index start (only held or tracked IPs collect keys).
func (w *world) newIndex() *index.Index {
	ix := index.New(index.Config{PodCIDRs: w.node.PodCIDRs()})
	for _, p := range w.pods {
		ix.Hold(p.Addr4)
		ix.Hold(p.Addr6)
	}
	return ix
}

func (w *world) podIPs() []netip.Addr {
	var ips []netip.Addr
	for _, p := range w.pods {
		ips = append(ips, p.Addr4, p.Addr6)
	}
	return ips
}

// missing dumps all four CT maps and returns every (pod IP, key) pair of an
// entry that contains a pod IP but is not among that IP's indexed keys, and
// the number of such (IP, entry) pairs in the maps.
func (w *world) missing(t *testing.T, ips []netip.Addr) (missing []string, total int) {
	t.Helper()
	have4 := map[netip.Addr]map[ctmap.CTKey4]bool{}
	have6 := map[netip.Addr]map[ctmap.CTKey6]bool{}
	for _, ip := range ips {
		k4, k6, _ := w.ix.KeysOf(ip)
		have4[ip], have6[ip] = map[ctmap.CTKey4]bool{}, map[ctmap.CTKey6]bool{}
		for _, k := range k4 {
			have4[ip][k] = true
		}
		for _, k := range k6 {
			have6[ip][k] = true
		}
	}
	for _, kind := range ctmap.Kinds {
		m := w.ct.Map(kind)
		var v ctmap.Entry
		if kind.IPv6() {
			var k ctmap.CTKey6
			it := m.Iterate()
			for it.Next(&k, &v) {
				for _, ip := range ips {
					if k.Has(ip) {
						total++
						if !have6[ip][k] {
							missing = append(missing, fmt.Sprintf("%s: %s (%s)", ip, k, kind))
						}
					}
				}
			}
			if err := it.Err(); err != nil {
				t.Fatal(err)
			}
		} else {
			var k ctmap.CTKey4
			it := m.Iterate()
			for it.Next(&k, &v) {
				for _, ip := range ips {
					if k.Has(ip) {
						total++
						if !have4[ip][k] {
							missing = append(missing, fmt.Sprintf("%s: %s (%s)", ip, k, kind))
						}
					}
				}
			}
			if err := it.Err(); err != nil {
				t.Fatal(err)
			}
		}
	}
	return missing, total
}

// requireIndexed waits (the ring buffer is asynchronous) until every CT
// entry with one of ips is indexed under that IP.
func (w *world) requireIndexed(t *testing.T, ips []netip.Addr, minEntries int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		missing, total := w.missing(t, ips)
		if len(missing) == 0 && total >= minEntries {
			t.Logf("%d (pod IP, CT entry) pairs, all indexed", total)
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d (pod IP, CT entry) pairs not indexed (want at least %d pairs):\n%s",
				len(missing), total, minEntries, strings.Join(missing, "\n"))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func lookup4(t *testing.T, m *ebpf.Map, k ctmap.CTKey4) bool {
	t.Helper()
	var v ctmap.Entry
	err := m.Lookup(k, &v)
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return false
	}
	if err != nil {
		t.Fatal(err)
	}
	return true
}

func lookup6(t *testing.T, m *ebpf.Map, k ctmap.CTKey6) bool {
	t.Helper()
	var v ctmap.Entry
	err := m.Lookup(k, &v)
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return false
	}
	if err != nil {
		t.Fatal(err)
	}
	return true
}

// Every CT entry that real TCP, UDP and ICMP traffic (v4 and v6; pod to
// pod on the node, pod to outside, outside to pod) creates is found in the
// index of each pod IP it contains.
func TestEveryEntryIndexed(t *testing.T) {
	w := newWorld(t, 2)
	a, b, remote := w.pods[0], w.pods[1], w.node.Remote

	type flow struct {
		from *netpods.Host
		to   netip.Addr
	}
	var flows []flow
	for _, fam := range []int{4, 6} {
		pick := func(h *netpods.Host) netip.Addr {
			if fam == 4 {
				return h.Addr4
			}
			return h.Addr6
		}
		flows = append(flows,
			flow{&a.Host, pick(&b.Host)},      // pod -> pod, same node
			flow{&b.Host, pick(&a.Host)},      // and back, as a new flow
			flow{&a.Host, pick(remote)},       // pod -> outside
			flow{remote, pick(&b.Host)},       // outside -> pod
			flow{&a.Host, pick(&a.Host)},      // pod -> itself (never leaves the pod)
			flow{&b.Host, pick(&w.node.Host)}, // pod -> node (gateway)
		)
	}
	for _, f := range flows {
		if err := f.from.TCP(f.to, netpods.EchoPort); err != nil {
			t.Fatal(err)
		}
		if err := f.from.UDP(f.to, netpods.EchoPort); err != nil {
			t.Fatal(err)
		}
		if _, err := f.from.Ping(f.to); err != nil {
			t.Fatal(err)
		}
	}

	// The stand-in must have produced the entries this test is about,
	// or the check below proves nothing. a -> b TCP over IPv4: OUT and
	// IN entries with a as initiator.
	tcp4 := w.ct.Map(ctmap.TCP4)
	var found bool
	var k ctmap.CTKey4
	var v ctmap.Entry
	it := tcp4.Iterate()
	for it.Next(&k, &v) {
		if k.DAddr() == a.Addr4 && k.SAddr() == b.Addr4 && k.DPort() == netpods.EchoPort && k.Flags() == ctmap.FlagOut {
			found = lookup4(t, tcp4, k.WithFlags(ctmap.FlagIn)) && lookup4(t, w.ct.Map(ctmap.Any4), k.Related())
		}
	}
	if !found {
		t.Fatalf("stand-in created no OUT+IN+related entries for TCP %s -> %s", a.Addr4, b.Addr4)
	}

	// 5 pod-bearing flows per family and protocol at least, each an entry
	// plus a related entry.
	w.requireIndexed(t, w.podIPs(), 2*3*2*5)
	if lost := w.rec.Lost(); lost != 0 {
		t.Errorf("recorder lost %d records", lost)
	}
	// Kernel-made replies (TCP handshakes, echo replies) included.
	if n := w.rec.ForeignSources(); n != 0 {
		t.Errorf("genuine traffic counted %d foreign sources", n)
	}
	for _, ip := range w.podIPs() {
		if st := w.ix.State(ip); st.Incomplete == index.ReasonLost || st.Incomplete == index.ReasonService || st.Incomplete == index.ReasonForeignSource {
			t.Errorf("%s marked incomplete (%s) without a loss or a service", ip, st.Incomplete)
		}
	}
}

// Five pods talking all-to-all (and to and from the remote host), over
// both families and three protocols, concurrently: every entry with a pod
// IP is indexed under that IP.
func TestAllToAll(t *testing.T) {
	w := newWorld(t, 5)
	hosts := []*netpods.Host{w.node.Remote}
	for _, p := range w.pods {
		hosts = append(hosts, &p.Host)
	}
	errs := make(chan error, 1024)
	var wg sync.WaitGroup
	for _, from := range hosts {
		for _, to := range hosts {
			if from == to {
				continue
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				for _, dst := range []netip.Addr{to.Addr4, to.Addr6} {
					if err := from.TCP(dst, netpods.EchoPort); err != nil {
						errs <- err
					}
					if err := from.UDP(dst, netpods.EchoPort); err != nil {
						errs <- err
					}
					if _, err := from.Ping(dst); err != nil {
						errs <- err
					}
				}
			}()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	// 5 pods x 5 peers x 2 families x 3 protocols, at least one entry
	// with the pod each (plus related and twin entries).
	w.requireIndexed(t, w.podIPs(), 5*5*2*3)
	if lost := w.rec.Lost(); lost != 0 {
		t.Errorf("recorder lost %d records", lost)
	}
	if n := w.rec.ForeignSources(); n != 0 {
		t.Errorf("genuine traffic counted %d foreign sources", n)
	}
}

// Pods attached concurrently (as 50 pods starting together are) are all
// recorded.
func TestConcurrentAttach(t *testing.T) {
	w := newWorld(t, 0)
	var pods []*netpods.Pod
	for range 8 {
		p := w.node.AddPod()
		w.ix.Hold(p.Addr4) // a pod of this node, as after its index start
		w.ix.Hold(p.Addr6)
		if err := w.node.Do(func() error { return w.dp.AttachHostSide(p.HostVeth) }); err != nil {
			t.Fatal(err)
		}
		pods = append(pods, p)
	}
	var wg sync.WaitGroup
	errs := make(chan error, len(pods))
	for _, p := range pods {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := w.rec.Attach(p.Path, "eth0"); err != nil {
				errs <- err
			}
		}()
		t.Cleanup(func() { w.rec.Detach(p.Path, "eth0") })
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	var ips []netip.Addr
	for _, p := range pods {
		if _, err := p.Ping(w.node.Remote.Addr4); err != nil {
			t.Fatal(err)
		}
		ips = append(ips, p.Addr4)
	}
	w.requireIndexed(t, ips, 2*len(pods))
}

// ICMP echo keys follow Cilium's convention: the requester's identifier is
// the initiator's "port" (sport = id, dport = 0).
func TestICMPEchoKey(t *testing.T) {
	w := newWorld(t, 1)
	a, remote := w.pods[0], w.node.Remote
	id, err := a.Ping(remote.Addr4)
	if err != nil {
		t.Fatal(err)
	}
	want := ctmap.NewKey4(a.Addr4, remote.Addr4, 0, id, ctmap.ProtoICMP, ctmap.FlagOut)
	if !lookup4(t, w.ct.Map(ctmap.Any4), want) {
		t.Fatalf("stand-in: no entry %s", want)
	}
	id6, err := remote.Ping(a.Addr6)
	if err != nil {
		t.Fatal(err)
	}
	want6 := ctmap.NewKey6(remote.Addr6, a.Addr6, 0, id6, ctmap.ProtoICMPv6, ctmap.FlagIn)
	if !lookup6(t, w.ct.Map(ctmap.Any6), want6) {
		t.Fatalf("stand-in: no entry %s", want6)
	}
	w.requireIndexed(t, []netip.Addr{a.Addr4, a.Addr6}, 4)
	k4, _, _ := w.ix.KeysOf(a.Addr4)
	if !containsKey(k4, want) {
		t.Fatalf("index of %s lacks %s: %v", a.Addr4, want, k4)
	}
}

func containsKey[K comparable](ks []K, k K) bool {
	for _, x := range ks {
		if x == k {
			return true
		}
	}
	return false
}

// A flow to a service VIP (per-packet load balancing: Cilium's entries name
// a backend the pod never sees) marks the pod IP incomplete.
func TestServiceVIPMarksIncomplete(t *testing.T) {
	w := newWorld(t, 2)
	a, b := w.pods[0], w.pods[1]
	vip4 := netip.MustParseAddrPort("10.96.0.10:53")
	vip6 := netip.MustParseAddrPort("[fd00:96::10]:53")
	if err := w.dp.AddService(ctmap.ProtoUDP, vip4, netip.AddrPortFrom(b.Addr4, netpods.EchoPort)); err != nil {
		t.Fatal(err)
	}
	if err := w.dp.AddService(ctmap.ProtoUDP, vip6, netip.AddrPortFrom(b.Addr6, netpods.EchoPort)); err != nil {
		t.Fatal(err)
	}
	for _, vip := range []netip.AddrPort{vip4, vip6} {
		if err := a.SendUDP(vip.Addr(), vip.Port()); err != nil {
			t.Fatal(err)
		}
	}
	// The stand-in's SERVICE entry: pod in saddr, VIP in daddr.
	var k ctmap.CTKey4
	var v ctmap.Entry
	var svc bool
	it := w.ct.Map(ctmap.Any4).Iterate()
	for it.Next(&k, &v) {
		if k.Flags() == ctmap.FlagService && k.SAddr() == a.Addr4 && k.DAddr() == vip4.Addr() && k.SPort() == vip4.Port() {
			svc = true
		}
	}
	if !svc {
		t.Fatal("stand-in created no SERVICE entry")
	}
	// The flow's SERVICE key is filed under the client (Resolve then
	// learns its OUT key; e2e/conformance checks that against Cilium).
	for _, ip := range []netip.Addr{a.Addr4, a.Addr6} {
		deadline := time.Now().Add(5 * time.Second)
		for !hasServiceKey(w.ix, ip) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: no SERVICE key after a flow to a VIP: %+v", ip, w.ix.State(ip))
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	// b talked to no VIP: its state must not say so.
	if st := w.ix.State(b.Addr4); st.Incomplete == index.ReasonService {
		t.Fatalf("%s marked as a VIP client", b.Addr4)
	}
}

// Cilium re-creates its service map (an agent restart that changes its
// size): the programs still read the old map, so a flow to a service that
// exists only in the new one passes for a plain flow to its VIP, a key
// Cilium never makes. After ReloadPrograms and Attach (what scrubd does when
// it notices, docs/recorder.md), a flow to the service marks the IP.
func TestServiceMapRecreatedReload(t *testing.T) {
	w := newWorld(t, 2)
	a, b := w.pods[0], w.pods[1]
	if err := standin.RecreateServiceMap4(w.ctDir); err != nil {
		t.Fatal(err)
	}
	if !w.rec.ServiceMapsChanged() {
		t.Fatal("re-created service map not noticed")
	}
	// The new map gets a service (a stand-in loaded over the pins now
	// writes there, as Cilium would).
	dp2, err := standin.Load(w.ctDir, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer dp2.Close()
	vip := netip.MustParseAddrPort("10.96.0.20:53")
	if err := dp2.AddService(ctmap.ProtoUDP, vip, netip.AddrPortFrom(b.Addr4, netpods.EchoPort)); err != nil {
		t.Fatal(err)
	}
	// Before the reload: the flow to the new service is not seen as one.
	if err := a.SendUDP(vip.Addr(), vip.Port()); err != nil {
		t.Fatal(err)
	}
	w.requireIndexed(t, []netip.Addr{a.Addr4}, 0)
	time.Sleep(200 * time.Millisecond)
	if st := w.ix.State(a.Addr4); st.Incomplete == index.ReasonService {
		t.Fatalf("the old programs saw the new map's service (%+v): the test shows nothing", st)
	}
	if err := w.rec.ReloadPrograms(); err != nil {
		t.Fatal(err)
	}
	if _, err := w.rec.Attach(a.Path, "eth0"); err != nil {
		t.Fatal(err)
	}
	if w.rec.ServiceMapsChanged() {
		t.Fatal("still changed after ReloadPrograms")
	}
	if err := a.SendUDP(vip.Addr(), vip.Port()); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for !hasServiceKey(w.ix, a.Addr4) {
		if time.Now().After(deadline) {
			t.Fatalf("%s not recorded as a service client after the reload: %+v", a.Addr4, w.ix.State(a.Addr4))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// The recorder's pins removed under it (a cleanup script, a bpffs
// remount), then Cilium's maps re-created: ReloadPrograms must put the new
// programs on the maps the reader reads, not on fresh ones made where the
// pins were. Found by make soak (the pins fault at 45 %, the CT maps fault
// at 65 %): after the reload no pod's flow was recorded, and every pod's
// DEL said complete by the index with its entries left.
func TestReloadAfterPinsRemoved(t *testing.T) {
	w := newWorld(t, 1)
	a, remote := w.pods[0], w.node.Remote
	if err := a.TCP(remote.Addr4, netpods.EchoPort); err != nil {
		t.Fatal(err)
	}
	w.requireIndexed(t, []netip.Addr{a.Addr4}, 2)
	pins, err := os.ReadDir(w.pinDir)
	if err != nil || len(pins) == 0 {
		t.Fatalf("the recorder's pins under %s: %d, %v", w.pinDir, len(pins), err)
	}
	for _, p := range pins {
		if err := os.RemoveAll(filepath.Join(w.pinDir, p.Name())); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.rec.ReloadPrograms(); err != nil {
		t.Fatal(err)
	}
	if _, err := w.rec.Attach(a.Path, "eth0"); err != nil {
		t.Fatal(err)
	}
	// A new flow through the reloaded programs reaches the index.
	if err := a.UDP(remote.Addr4, netpods.EchoPort); err != nil {
		t.Fatal(err)
	}
	w.requireIndexed(t, []netip.Addr{a.Addr4}, 3)
}

// hasServiceKey: ip's keys include a SERVICE key (a flow of its to a VIP).
func hasServiceKey(ix *index.Index, ip netip.Addr) bool {
	k4, k6, _ := ix.KeysOf(ip)
	for _, k := range k4 {
		if k.Flags() == ctmap.FlagService {
			return true
		}
	}
	for _, k := range k6 {
		if k.Flags() == ctmap.FlagService {
			return true
		}
	}
	return false
}

// A daemon restart: the filters stay attached while no daemon runs,
// records made meanwhile wait in the pinned ring buffer, and a new Load with
// the same PinDir reads them and keeps recording.
func TestRestartKeepsRecording(t *testing.T) {
	w := newWorld(t, 1)
	a, remote := w.pods[0], w.node.Remote
	if err := a.TCP(remote.Addr4, netpods.EchoPort); err != nil {
		t.Fatal(err)
	}
	w.requireIndexed(t, []netip.Addr{a.Addr4}, 2)

	// Daemon down.
	w.stop()
	w.stop = nil
	if err := w.rec.Close(); err != nil {
		t.Fatal(err)
	}
	// The filters stay on the interface and hold the program.
	if ok, err := recorder.Attached(a.Path, "eth0"); err != nil || !ok {
		t.Fatalf("filters after close: attached %v, %v", ok, err)
	}
	// Traffic while down.
	if err := a.UDP(remote.Addr4, netpods.EchoPort); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Ping(remote.Addr6); err != nil {
		t.Fatal(err)
	}

	// Daemon up again, with a fresh index fed by the same pins.
	w.rec = w.loadRecorder(t, w.ct.Root)
	w.ix = w.newIndex()
	w.run(t)
	// Re-attaching after a restart is idempotent.
	for range 2 {
		if _, err := w.rec.Attach(a.Path, "eth0"); err != nil {
			t.Fatal(err)
		}
	}
	// Made while down: UDP v4 and ICMPv6 entries of a.
	deadline := time.Now().Add(5 * time.Second)
	for {
		k4, k6, _ := w.ix.KeysOf(a.Addr4)
		var udp bool
		for _, k := range k4 {
			udp = udp || (k.NextHdr() == ctmap.ProtoUDP && k.SAddr() == remote.Addr4)
		}
		k4, k6, _ = w.ix.KeysOf(a.Addr6)
		var icmp6 bool
		for _, k := range k6 {
			icmp6 = icmp6 || (k.NextHdr() == ctmap.ProtoICMPv6 && k.SAddr() == remote.Addr6 && k.Flags() == ctmap.FlagOut)
		}
		if udp && icmp6 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("records made while the daemon was down not read after restart (udp %v, icmpv6 %v)", udp, icmp6)
		}
		time.Sleep(50 * time.Millisecond)
	}
	// And new traffic is recorded by the new instance.
	if err := a.TCP(remote.Addr6, netpods.EchoPort); err != nil {
		t.Fatal(err)
	}
	w.requireIndexed(t, []netip.Addr{a.Addr6}, 3) // TCP and ICMPv6 towards remote share the related entry
}

// Detach stops recording, and succeeds again when the links or the
// network namespace are gone.
func TestDetach(t *testing.T) {
	w := newWorld(t, 1)
	a, remote := w.pods[0], w.node.Remote
	if err := w.rec.Detach(a.Path, "eth0"); err != nil {
		t.Fatal(err)
	}
	if err := a.UDP(remote.Addr4, netpods.EchoPort); err != nil {
		t.Fatal(err)
	}
	// The stand-in saw it; the recorder must not have.
	time.Sleep(300 * time.Millisecond)
	if missing, total := w.missing(t, []netip.Addr{a.Addr4}); total == 0 || len(missing) != total {
		t.Fatalf("after Detach: %d entries, %d not indexed; want all not indexed", total, len(missing))
	}
	if err := w.rec.Detach(a.Path, "eth0"); err != nil {
		t.Fatalf("second Detach: %v", err)
	}
	if err := w.rec.Detach("/var/run/netns/ctscrub-does-not-exist", "eth0"); err != nil {
		t.Fatalf("Detach of a gone netns: %v", err)
	}
	if _, err := w.rec.Attach("/var/run/netns/ctscrub-does-not-exist", "eth0"); err == nil {
		t.Fatal("Attach to a missing netns succeeded")
	}
	if _, err := w.rec.Attach(a.Path, "nosuchif"); err == nil || !strings.Contains(err.Error(), "nosuchif") {
		t.Fatalf("Attach to a missing interface: %v", err)
	}
	// An interface without an Ethernet header: the programs could not
	// parse its packets, so Attach must refuse rather than record nothing.
	err := a.Do(func() error {
		return netlink.LinkAdd(&netlink.Tuntap{LinkAttrs: netlink.LinkAttrs{Name: "tun0"}, Mode: netlink.TUNTAP_MODE_TUN})
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.rec.Attach(a.Path, "tun0"); err == nil || !strings.Contains(err.Error(), "not Ethernet") {
		t.Fatalf("Attach to a tun device: %v, want a not-Ethernet error", err)
	}
}

// Prune drops the keys of entries Cilium no longer holds and forgets their
// flows, so the same 5-tuple is recorded again when it comes back.
func TestPrune(t *testing.T) {
	w := newWorld(t, 1)
	a, remote := w.pods[0], w.node.Remote
	if err := a.UDP(remote.Addr4, netpods.EchoPort); err != nil {
		t.Fatal(err)
	}
	w.requireIndexed(t, []netip.Addr{a.Addr4}, 2)
	k4, _, _ := w.ix.KeysOf(a.Addr4)
	var flowKey ctmap.CTKey4
	for _, k := range k4 {
		if k.NextHdr() == ctmap.ProtoUDP {
			flowKey = k
		}
	}
	if flowKey.NextHdr() != ctmap.ProtoUDP {
		t.Fatalf("no UDP key indexed: %v", k4)
	}
	// Cilium's GC removes the flow's entries.
	for _, k := range []ctmap.CTKey4{flowKey, flowKey.Related()} {
		if err := w.ct.Map(k.Kind()).Delete(k); err != nil {
			t.Fatalf("delete %s: %v", k, err)
		}
	}
	dropped, err := w.rec.Prune(w.ix, w.ct, a.Addr4)
	if err != nil {
		t.Fatal(err)
	}
	if dropped != 2 {
		t.Fatalf("Prune dropped %d keys, want 2 (the flow and its related key)", dropped)
	}
	k4, _, _ = w.ix.KeysOf(a.Addr4)
	if containsKey(k4, flowKey) {
		t.Fatalf("%s still indexed after Prune", flowKey)
	}

	// The same 5-tuple again: Cilium re-creates the entry, the recorder
	// (its seen cache forgotten) records it again.
	err = a.Do(func() error { return sendUDPFrom(flowKey.SPort(), remote.Addr4, flowKey.DPort()) })
	if err != nil {
		t.Fatal(err)
	}
	w.requireIndexed(t, []netip.Addr{a.Addr4}, 2)
	k4, _, _ = w.ix.KeysOf(a.Addr4)
	if !containsKey(k4, flowKey) {
		t.Fatalf("flow %s not recorded again after Prune", flowKey)
	}
}

// With Options.CT, Run prunes an IP on its own once its set doubled.
func TestAutoPrune(t *testing.T) {
	w := newWorld(t, 1)
	a, remote := w.pods[0], w.node.Remote
	// 600 UDP flows (distinct source ports) now and 500 later: 1,101 keys
	// (they share one related key), past the first prune threshold
	// (1,024) while the second batch is recorded.
	var sent []uint16
	err := a.Do(func() error {
		for port := uint16(20000); port < 20600; port++ {
			if err := sendUDPFrom(port, remote.Addr4, silentPort); err != nil {
				return err
			}
			sent = append(sent, port)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	w.requireIndexed(t, []netip.Addr{a.Addr4}, 601)
	// Cilium's GC removes the first 600 flows.
	for _, port := range sent {
		k := ctmap.NewKey4(a.Addr4, remote.Addr4, silentPort, port, ctmap.ProtoUDP, ctmap.FlagOut)
		if err := w.ct.Map(ctmap.Any4).Delete(k); err != nil {
			t.Fatalf("delete %s: %v", k, err)
		}
	}
	err = a.Do(func() error {
		for port := uint16(30000); port < 30500; port++ {
			if err := sendUDPFrom(port, remote.Addr4, silentPort); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		st := w.ix.State(a.Addr4)
		// 1,101 keys at most were indexed; a prune leaves the 500 live
		// flows, their related key and whatever arrived after it.
		if st.Keys <= 600 {
			t.Logf("%d keys after the automatic prune", st.Keys)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no automatic prune: %d keys indexed for %s", st.Keys, a.Addr4)
		}
		time.Sleep(100 * time.Millisecond)
	}
	w.requireIndexed(t, []netip.Addr{a.Addr4}, 501)
}

// A UDP flow the pod opened, idle until Cilium's entry is gone, then
// reopened by the peer: Cilium creates a key with the peer as initiator and
// the recorder records it although the flow is in its seen cache.
func TestUDPReopenedByPeer(t *testing.T) {
	w := newWorld(t, 1)
	a, remote := w.pods[0], w.node.Remote
	const podPort, peerPort = 41000, 41001 // nothing listens on the peer's port
	if err := a.Do(func() error { return sendUDPFrom(podPort, remote.Addr4, peerPort) }); err != nil {
		t.Fatal(err)
	}
	out := ctmap.NewKey4(a.Addr4, remote.Addr4, peerPort, podPort, ctmap.ProtoUDP, ctmap.FlagOut)
	w.requireIndexed(t, []netip.Addr{a.Addr4}, 2)
	// The entry expires and Cilium's GC removes it.
	for _, k := range []ctmap.CTKey4{out, out.Related()} {
		if err := w.ct.Map(k.Kind()).Delete(k); err != nil {
			t.Fatalf("delete %s: %v", k, err)
		}
	}
	time.Sleep(2200 * time.Millisecond) // > ReopenIdle (1 s) at its ~1.07 s resolution
	if err := remote.Do(func() error { return sendUDPFrom(peerPort, a.Addr4, podPort) }); err != nil {
		t.Fatal(err)
	}
	in := ctmap.NewKey4(remote.Addr4, a.Addr4, podPort, peerPort, ctmap.ProtoUDP, ctmap.FlagIn)
	if !lookup4(t, w.ct.Map(ctmap.Any4), in) {
		t.Fatalf("stand-in did not create %s", in)
	}
	w.requireIndexed(t, []netip.Addr{a.Addr4}, 2)
}

// A UDP flow the pod keeps sending on for longer than ReopenIdle, then a
// reply: the flow was never idle, so the reply is no reopening and makes no
// record. The pod's packets hit the front cache (rec_front4) after the
// first; it must still note the flow's time once a second (the LRU path
// does, for the first packet of each second on a CPU), or the reply is
// taken for a reopening and records a key Cilium never made.
func TestUDPActiveFlowReplyIsNoReopening(t *testing.T) {
	// ReopenIdle 3 s (3 units of ~1.07 s): a reply 100 ms after the pod's
	// last packet is at most 1 unit later, whatever the unit boundaries.
	w := newWorldOpts(t, 1, func(o *recorder.Options) { o.ReopenIdle = 3 << 30 })
	a, remote := w.pods[0], w.node.Remote
	const podPort, peerPort = 41100, 41101
	end := time.Now().Add(5500 * time.Millisecond) // > 5 units: more than ReopenIdle since the first packet
	for time.Now().Before(end) {
		if err := a.Do(func() error { return sendUDPFrom(podPort, remote.Addr4, peerPort) }); err != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	w.requireIndexed(t, []netip.Addr{a.Addr4}, 2)
	if err := remote.Do(func() error { return sendUDPFrom(peerPort, a.Addr4, podPort) }); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	if err := w.ix.Sync(context.Background()); err != nil {
		t.Fatal(err)
	}
	// What a reopening records: the key with the peer as initiator.
	in := ctmap.NewKey4(remote.Addr4, a.Addr4, podPort, peerPort, ctmap.ProtoUDP, ctmap.FlagIn)
	k4, _, _ := w.ix.KeysOf(a.Addr4)
	if slices.Contains(k4, in) {
		t.Fatalf("a reply on a flow the pod kept sending on was taken for a reopening: %s indexed (keys %v)", in, k4)
	}
}

// A full ring buffer (one page, nobody reading) loses records for real:
// the losses are counted against the pod IP, Run marks it incomplete, and
// the flows whose records were lost are recorded on their next packet (they
// were not marked seen).
func TestRingFullMarksLost(t *testing.T) {
	w := newWorld(t, 1)
	a, remote := w.pods[0], w.node.Remote
	w.stop()
	w.stop = nil
	if err := w.rec.Detach(a.Path, "eth0"); err != nil {
		t.Fatal(err)
	}
	rec, err := recorder.Load(recorder.Options{
		PinDir:    filepath.Join(standin.TempDir(t), "ctscrub"),
		CTRoot:    w.ct.Root,
		RingBytes: os.Getpagesize(), // room for ~70 records
		NodeNetns: w.node.Path,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rec.Close() })
	if _, err := rec.Attach(a.Path, "eth0"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rec.Detach(a.Path, "eth0") })

	send := func() {
		t.Helper()
		err := a.Do(func() error {
			for port := uint16(42000); port < 42200; port++ {
				if err := sendUDPFrom(port, remote.Addr4, silentPort); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	// 200 new flows, nobody reading. No replies: a reply retrying a lost
	// record would record the flow with the reply's direction (the IP is
	// incomplete anyway, see docs/recorder.md).
	send()
	time.Sleep(200 * time.Millisecond)
	if rec.Lost() == 0 {
		t.Fatal("no loss counted although 200 new flows went into a one-page ring buffer nobody read")
	}
	t.Logf("%d records lost", rec.Lost())

	w.rec, w.ix = rec, w.newIndex()
	w.ix.Track(a.Addr4) // as if swept: only the loss may make it incomplete
	w.run(t)
	deadline := time.Now().Add(5 * time.Second)
	for w.ix.State(a.Addr4).Incomplete != index.ReasonLost {
		if time.Now().After(deadline) {
			t.Fatalf("%s not marked incomplete after losses: %+v", a.Addr4, w.ix.State(a.Addr4))
		}
		time.Sleep(50 * time.Millisecond)
	}
	// The lost flows' next packets are recorded now that Run drains the
	// ring: every entry ends up indexed (200 flows + 1 shared related key).
	// A busy machine may overflow the small ring again; flows lost again
	// stay unseen and their next round of packets retries.
	for round := 0; ; round++ {
		send()
		time.Sleep(200 * time.Millisecond)
		missing, total := w.missing(t, []netip.Addr{a.Addr4})
		if len(missing) == 0 && total >= 201 {
			t.Logf("all %d entries indexed after %d rounds of retries", total, round+1)
			break
		}
		if round == 20 {
			t.Fatalf("%d of %d entries still not indexed after %d rounds:\n%s", len(missing), total, round+1, strings.Join(missing, "\n"))
		}
	}
}

// A pod IP reused on the node: the new pod's flows are recorded even when
// they reuse a 5-tuple of the old pod's flows, still in the seen cache
// (Attach forgets the flows of the new pod's addresses).
func TestIPReuse(t *testing.T) {
	w := newWorld(t, 1)
	a, remote := w.pods[0], w.node.Remote
	const port = 43000
	if err := a.Do(func() error { return sendUDPFrom(port, remote.Addr4, silentPort) }); err != nil {
		t.Fatal(err)
	}
	w.requireIndexed(t, []netip.Addr{a.Addr4}, 2)

	// The pod goes: detach, delete its entries (not through Take, whose
	// hook would forget the flows: Attach alone must do it here).
	if err := w.rec.Detach(a.Path, "eth0"); err != nil {
		t.Fatal(err)
	}
	k4, _, _ := w.ix.KeysOf(a.Addr4)
	for _, k := range k4 {
		w.ct.Map(k.Kind()).Delete(k)
	}
	// A new pod gets the same IP and reuses the 5-tuple.
	b := w.node.ReplacePod(a)
	if err := w.node.Do(func() error { return w.dp.AttachHostSide(b.HostVeth) }); err != nil {
		t.Fatal(err)
	}
	if _, err := w.rec.Attach(b.Path, "eth0"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.rec.Detach(b.Path, "eth0") })
	w.ix.Track(b.Addr4)
	if err := b.Do(func() error { return sendUDPFrom(port, remote.Addr4, silentPort) }); err != nil {
		t.Fatal(err)
	}
	want := ctmap.NewKey4(b.Addr4, remote.Addr4, silentPort, port, ctmap.ProtoUDP, ctmap.FlagOut)
	// The new pod's first packet waits for ARP before it reaches the host side.
	for deadline := time.Now().Add(5 * time.Second); !lookup4(t, w.ct.Map(ctmap.Any4), want); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("stand-in did not re-create %s", want)
		}
	}
	w.requireIndexed(t, []netip.Addr{b.Addr4}, 2)
}

// A scrub of a live pod's IP: the entries it deletes are re-created by the
// flows' next packets, and those must be indexed again although the flows
// are in the recorder's seen cache. Index path: the keys the scrub takes are
// forgotten (Taken hook); sweep path: the IP's flows are forgotten when it is
// declared complete (Tracked hook).
func TestScrubOfLiveIPReindexes(t *testing.T) {
	w := newWorld(t, 1)
	a, remote := w.pods[0], w.node.Remote
	flow := func(port uint16) ctmap.CTKey4 {
		t.Helper()
		if err := a.Do(func() error { return sendUDPFrom(port, remote.Addr4, silentPort) }); err != nil {
			t.Fatal(err)
		}
		return ctmap.NewKey4(a.Addr4, remote.Addr4, silentPort, port, ctmap.ProtoUDP, ctmap.FlagOut)
	}
	deleteAll := func(keys ...ctmap.CTKey4) {
		for _, k := range keys {
			w.ct.Map(k.Kind()).Delete(k)
		}
	}

	// Index path.
	k := flow(44000)
	w.requireIndexed(t, []netip.Addr{a.Addr4}, 2)
	k4, _, _ := w.ix.Take(a.Addr4)
	deleteAll(k4...)
	flow(44000)
	w.requireIndexed(t, []netip.Addr{a.Addr4}, 2)
	if k4, _, _ := w.ix.KeysOf(a.Addr4); !containsKey(k4, k) {
		t.Fatalf("index path: %s re-created but not indexed", k)
	}

	// Sweep path: declared complete, then every entry of the IP deleted.
	k = flow(44001)
	w.requireIndexed(t, []netip.Addr{a.Addr4}, 3)
	w.ix.Track(a.Addr4)
	var all []ctmap.CTKey4
	var key ctmap.CTKey4
	var v ctmap.Entry
	for _, kind := range []ctmap.Kind{ctmap.TCP4, ctmap.Any4} {
		it := w.ct.Map(kind).Iterate()
		for it.Next(&key, &v) {
			if key.Has(a.Addr4) {
				all = append(all, key)
			}
		}
	}
	deleteAll(all...)
	flow(44001)
	w.requireIndexed(t, []netip.Addr{a.Addr4}, 2)
	if k4, _, st := w.ix.KeysOf(a.Addr4); !containsKey(k4, k) || !st.Complete {
		t.Fatalf("sweep path: %s re-created, indexed %v, state %+v", k, containsKey(k4, k), st)
	}
}

// silentPort is a port nothing listens on: datagrams sent there get no
// reply that could arrive after a test deleted the flow's entry (the
// stand-in would then create an IN entry with the peer as initiator, the
// blind spot docs/recorder.md describes for entries re-created without
// idleness).
const silentPort = 41999

// sendUDPFrom sends one datagram from local port sport (in the current
// netns).
func sendUDPFrom(sport uint16, dst netip.Addr, dport uint16) error {
	c, err := net.ListenUDP("udp4", &net.UDPAddr{Port: int(sport)})
	if err != nil {
		return err
	}
	defer c.Close()
	_, err = c.WriteToUDPAddrPort([]byte("again"), netip.AddrPortFrom(dst, dport))
	return err
}

// A pod that sends from another pod's addresses (IP_TRANSPARENT here; a raw
// or packet socket, CAP_NET_RAW only, does the same) files no key under
// them: the claimed addresses are marked incomplete instead
// (index.ReasonForeignSource), the foreign counter counts, and the pod's
// own traffic is recorded as before. The pods' eth0 share an ifindex in
// their own namespaces: only the namespace cookie tells them apart.
func TestForgedSourceAddress(t *testing.T) {
	w := newWorld(t, 2)
	a, b, remote := w.pods[0], w.pods[1], w.node.Remote
	ifa, ifb := ifindexOf(t, a), ifindexOf(t, b)
	t.Logf("source check %s; eth0 ifindex: victim %d, sender %d", w.rec.SourceCheck(), ifa, ifb)
	if ifa == ifb && w.rec.SourceCheck() != "netns+ifindex" {
		t.Skipf("the pods' eth0 share ifindex %d and this kernel's tc programs cannot read a network namespace's cookie: the ifindex-only check cannot tell them apart (docs/recorder.md)", ifa)
	}
	victim := []netip.Addr{a.Addr4, a.Addr6}
	w.ix.TrackAll(victim) // as if swept: only the forged packets may make them incomplete
	before := w.rec.ForeignSources()

	const sport = 45000
	forged4 := ctmap.NewKey4(a.Addr4, remote.Addr4, silentPort, sport, ctmap.ProtoUDP, ctmap.FlagOut)
	forged6 := ctmap.NewKey6(a.Addr6, remote.Addr6, silentPort, sport, ctmap.ProtoUDP, ctmap.FlagOut)
	err := b.Do(func() error {
		if err := sendUDPForged(netip.AddrPortFrom(a.Addr4, sport), netip.AddrPortFrom(remote.Addr4, silentPort)); err != nil {
			return err
		}
		return sendUDPForged(netip.AddrPortFrom(a.Addr6, sport), netip.AddrPortFrom(remote.Addr6, silentPort))
	})
	if err != nil {
		t.Fatal(err)
	}
	// The packets left b: the stand-in (no source check, like Cilium
	// with source verification disabled) made their entries.
	for deadline := time.Now().Add(5 * time.Second); !lookup4(t, w.ct.Map(ctmap.Any4), forged4) || !lookup6(t, w.ct.Map(ctmap.Any6), forged6); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("stand-in made no entry %s / %s: the forged packets did not leave the sender", forged4, forged6)
		}
	}
	if err := w.ix.Sync(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, ip := range victim {
		if st := w.ix.State(ip); st.Incomplete != index.ReasonForeignSource {
			t.Errorf("%s after forged packets: %+v, want incomplete (%s)", ip, st, index.ReasonForeignSource)
		}
	}
	k4, _, _ := w.ix.KeysOf(a.Addr4)
	_, k6, _ := w.ix.KeysOf(a.Addr6)
	if containsKey(k4, forged4) || containsKey(k4, forged4.Related()) || containsKey(k6, forged6) || containsKey(k6, forged6.Related()) {
		t.Errorf("forged flows filed under the claimed source: v4 %v, v6 %v", k4, k6)
	}
	if n := w.rec.ForeignSources() - before; n != 2 {
		t.Errorf("foreign-source counter moved by %d, want 2", n)
	}

	// The sender's own traffic, both ways and both families, is filed as
	// before and counts nothing foreign.
	before = w.rec.ForeignSources()
	for _, dst := range []netip.Addr{remote.Addr4, remote.Addr6, a.Addr4} {
		if err := b.TCP(dst, netpods.EchoPort); err != nil {
			t.Fatal(err)
		}
		if err := b.UDP(dst, netpods.EchoPort); err != nil {
			t.Fatal(err)
		}
		if _, err := b.Ping(dst); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := remote.Ping(b.Addr4); err != nil {
		t.Fatal(err)
	}
	w.requireIndexed(t, []netip.Addr{b.Addr4, b.Addr6}, 2*3*2+2)
	if n := w.rec.ForeignSources() - before; n != 0 {
		t.Errorf("genuine traffic counted %d foreign sources", n)
	}
	for _, ip := range []netip.Addr{b.Addr4, b.Addr6} {
		if st := w.ix.State(ip); st.Incomplete == index.ReasonForeignSource {
			t.Errorf("%s marked as a forged source by its own traffic", ip)
		}
	}

	// Once swept (Track), the victim's own flow on the forged 5-tuple, in
	// the flow cache since the forged packet, is recorded under it.
	w.ix.Track(a.Addr4)
	if err := a.Do(func() error { return sendUDPFrom(sport, remote.Addr4, silentPort) }); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		k4, _, st := w.ix.KeysOf(a.Addr4)
		if containsKey(k4, forged4) && st.Complete {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the victim's own flow %s not filed after its sweep: %v, %+v", forged4, k4, st)
		}
	}
}

func ifindexOf(t *testing.T, p *netpods.Pod) int {
	t.Helper()
	var i int
	err := p.Do(func() error {
		l, err := netlink.LinkByName("eth0")
		if err == nil {
			i = l.Attrs().Index
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return i
}

// sendUDPForged sends one datagram from src, an address of another host
// (IP_TRANSPARENT lets a socket send from an address not its own).
func sendUDPForged(src, dst netip.AddrPort) error {
	network, level, opt := "udp4", unix.SOL_IP, unix.IP_TRANSPARENT
	if src.Addr().Is6() {
		network, level, opt = "udp6", unix.SOL_IPV6, unix.IPV6_TRANSPARENT
	}
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), level, opt, 1) }); err != nil {
			return err
		}
		return serr
	}}
	c, err := lc.ListenPacket(context.Background(), network, src.String())
	if err != nil {
		return fmt.Errorf("bind %s: %w", src, err)
	}
	defer c.Close()
	_, err = c.WriteTo([]byte("forged"), net.UDPAddrFromAddrPort(dst))
	return err
}
