// Package standin is TEST SUPPORT ONLY: a stand-in for Cilium's datapath on
// machines without Cilium. It creates CT entries in Cilium's map layout,
// with Cilium's key conventions, from real packets, so tests, benchmarks and
// the demo have real entries to index and scrub. scrubd never uses it.
//
// The BPF side is cilium_standin.c (this directory), attached with tcx to the HOST-side
// veth of a pod: ingress (the pod sends) creates OUT entries as Cilium's
// cil_from_container does, egress (the pod receives) creates IN entries as
// Cilium's ingress policy path does, each with its "related" ICMP entry;
// packets to a service VIP registered with AddService create a SERVICE entry
// and an OUT entry towards the service's first backend. Packets are never
// rewritten: a service's traffic still goes to the VIP.
//
// Usage:
//
//	dir := standin.TempDir(t)                  // private bpffs dir
//	if err := standin.CreateMaps(dir, 65536); err != nil { ... }
//	dp, err := standin.Load(dir, nil)          // ctmap.Open(dir) finds the maps
//	dp.AttachHostSide("veth1234")              // in the netns holding the veth
//	defer dp.Close()
package standin

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// Cilium's service map names (v1.16), created beside the CT maps.
const (
	Services4 = "cilium_lb4_services_v2"
	Services6 = "cilium_lb6_services_v2"
	Backends4 = "cilium_lb4_backends_v3"
	Backends6 = "cilium_lb6_backends_v3"
)

// ServiceEntries is the size of the stand-in's service and backend maps.
const ServiceEntries = 4096

// TempDir creates a private directory on bpffs for a test's pins and
// removes it (with everything pinned in it) when the test ends.
func TempDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("/sys/fs/bpf", "ctscrub-test-")
	if err != nil {
		t.Fatalf("standin: create bpffs dir (is bpffs mounted at /sys/fs/bpf, are we root?): %v", err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// CreateMaps creates Cilium's four global CT maps (ctEntries entries each)
// and its service maps, pinned under dir with Cilium's names, as Cilium
// pins them under /sys/fs/bpf/tc/globals. ctmap.Open(dir) then opens them
// and recorder.Options{CTRoot: dir} finds the service maps.
func CreateMaps(dir string, ctEntries uint32) error {
	var specs []*ebpf.MapSpec
	for _, k := range ctmap.Kinds {
		specs = append(specs, k.Spec(ctEntries))
	}
	if err := create(dir, specs); err != nil {
		return err
	}
	return CreateServiceMaps(dir)
}

// CreateServiceMaps creates only the (empty) service and backend maps in
// Cilium's layout, pinned under dir; for callers that make CT maps of
// their own sizes.
func CreateServiceMaps(dir string) error {
	cs, err := loadCiliumStandin()
	if err != nil {
		return fmt.Errorf("standin: parse BPF object: %w", err)
	}
	var specs []*ebpf.MapSpec
	for _, n := range []string{Services4, Services6, Backends4, Backends6} {
		s := cs.Maps[n].Copy()
		s.MaxEntries = ServiceEntries
		specs = append(specs, s)
	}
	return create(dir, specs)
}

// RecreateServiceMap4 does to dir what a Cilium agent restart that
// re-creates its IPv4 service map does: the pin then names a new, empty map
// (programs loaded over the old one keep reading it).
func RecreateServiceMap4(dir string) error {
	if err := os.Remove(filepath.Join(dir, Services4)); err != nil {
		return fmt.Errorf("standin: unpin %s: %w", Services4, err)
	}
	sub, err := os.MkdirTemp(dir, "recreate")
	if err != nil {
		return err
	}
	defer os.RemoveAll(sub)
	if err := CreateServiceMaps(sub); err != nil {
		return err
	}
	return os.Rename(filepath.Join(sub, Services4), filepath.Join(dir, Services4))
}

func create(dir string, specs []*ebpf.MapSpec) error {
	for _, s := range specs {
		m, err := ebpf.NewMap(s)
		if err != nil {
			return fmt.Errorf("standin: create map %s: %w", s.Name, err)
		}
		err = m.Pin(filepath.Join(dir, s.Name))
		m.Close()
		if err != nil {
			return fmt.Errorf("standin: pin map %s under %s: %w", s.Name, dir, err)
		}
	}
	return nil
}

// Lifetimes are the entries' lifetimes in seconds of Cilium's clock (ktime
// seconds); zero fields keep Cilium's defaults (TCP 21600, SYN 60, other 60).
// Close is Cilium's close timeout (CT_CLOSE_TIMEOUT, 10 s by default): a TCP
// entry that has seen a FIN or an RST gets it at each packet instead of TCP.
// Zero leaves it off: closed connections keep TCP's lifetime.
type Lifetimes struct {
	TCP, SYN, NonTCP, Close uint32
}

// Datapath is the loaded stand-in.
type Datapath struct {
	dir  string
	objs ciliumStandinObjects

	mu          sync.Mutex
	links       []link.Link
	nextBackend uint32
	nextRevNAT  uint16
}

// Options configure LoadOptions.
type Options struct {
	Lifetimes *Lifetimes
	// ServiceLoopback4 is Cilium's IPv4 service loopback address (hairpin
	// SNAT; Cilium's default 169.254.42.1). Unset: hairpin traffic is not
	// SNATed.
	ServiceLoopback4 netip.Addr
	// ServiceLoopback6 is the same for IPv6, which Cilium SNATs from 1.19
	// (default fe80::1). Unset: IPv6 hairpins are not SNATed.
	ServiceLoopback6 netip.Addr
}

// Load loads the stand-in's programs over the maps pinned in dir (see
// CreateMaps). lt may be nil.
func Load(dir string, lt *Lifetimes) (*Datapath, error) {
	return LoadOptions(dir, &Options{Lifetimes: lt})
}

// LoadOptions is Load with every option.
func LoadOptions(dir string, o *Options) (*Datapath, error) {
	spec, err := loadCiliumStandin()
	if err != nil {
		return nil, fmt.Errorf("standin: parse BPF object: %w", err)
	}
	lt := o.Lifetimes
	if o.ServiceLoopback4.Is4() {
		a := o.ServiceLoopback4.As4()
		if err := spec.Variables["service_loopback4"].Set(binary.NativeEndian.Uint32(a[:])); err != nil {
			return nil, fmt.Errorf("standin: set service_loopback4: %w", err)
		}
	}
	if o.ServiceLoopback6.Is6() {
		if err := spec.Variables["service_loopback6"].Set(o.ServiceLoopback6.As16()); err != nil {
			return nil, fmt.Errorf("standin: set service_loopback6: %w", err)
		}
	}
	if lt != nil {
		for name, v := range map[string]uint32{"lifetime_tcp": lt.TCP, "lifetime_syn": lt.SYN, "lifetime_nontcp": lt.NonTCP, "lifetime_close": lt.Close} {
			if v == 0 {
				continue
			}
			if err := spec.Variables[name].Set(v); err != nil {
				return nil, fmt.Errorf("standin: set %s: %w", name, err)
			}
		}
	}
	repl := make(map[string]*ebpf.Map)
	defer func() {
		for _, m := range repl {
			m.Close()
		}
	}()
	names := []string{Services4, Services6, Backends4, Backends6}
	for _, k := range ctmap.Kinds {
		names = append(names, k.Name())
	}
	for _, n := range names {
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, n), nil)
		if errors.Is(err, os.ErrNotExist) && (n == ctmap.TCP6.Name() || n == ctmap.Any6.Name()) {
			continue // IPv6 off: the program keeps its placeholder
		}
		if err != nil {
			return nil, fmt.Errorf("standin: open %s in %s (made with CreateMaps?): %w", n, dir, err)
		}
		spec.Maps[n].MaxEntries = m.MaxEntries()
		spec.Maps[n].Flags = m.Flags()
		repl[n] = m
	}
	d := &Datapath{dir: dir, nextBackend: 1, nextRevNAT: 1}
	if err := spec.LoadAndAssign(&d.objs, &ebpf.CollectionOptions{MapReplacements: repl}); err != nil {
		return nil, fmt.Errorf("standin: load BPF programs: %w", err)
	}
	return d, nil
}

// Dir is the directory holding the maps.
func (d *Datapath) Dir() string { return d.dir }

// Maps opens the CT maps the stand-in writes (the caller closes them).
func (d *Datapath) Maps() (*ctmap.Maps, error) { return ctmap.Open(d.dir) }

// AttachHostSide attaches the stand-in with tcx to ifname, the host-side
// veth of a pod, in the current network namespace (call it inside the node
// namespace when the veth lives there), at the tail as Cilium attaches its
// own (the recorder's host-side link stays at the head). Close detaches it.
func (d *Datapath) AttachHostSide(ifname string) error {
	l, err := netlink.LinkByName(ifname)
	if err != nil {
		return fmt.Errorf("standin: find host-side veth %q: %w", ifname, err)
	}
	idx := l.Attrs().Index
	in, err := link.AttachTCX(link.TCXOptions{Interface: idx, Program: d.objs.StandinFromPod, Attach: ebpf.AttachTCXIngress, Anchor: link.Tail()})
	if err != nil {
		return fmt.Errorf("standin: tcx ingress on %s: %w", ifname, err)
	}
	eg, err := link.AttachTCX(link.TCXOptions{Interface: idx, Program: d.objs.StandinToPod, Attach: ebpf.AttachTCXEgress, Anchor: link.Tail()})
	if err != nil {
		in.Close()
		return fmt.Errorf("standin: tcx egress on %s: %w", ifname, err)
	}
	d.mu.Lock()
	d.links = append(d.links, in, eg)
	d.mu.Unlock()
	return nil
}

// AddService registers a service frontend (vip, protocol proto) with its
// backends, in Cilium's v1.16 service map layout (frontend key with
// backend_slot 0 and protocol 0, one slot per backend, backends by ID).
func (d *Datapath) AddService(proto uint8, vip netip.AddrPort, backends ...netip.AddrPort) error {
	return d.AddServiceFlags(proto, vip, 0, 0, backends...)
}

// SvcFlag2L7LB is lb_service.flags2's SVC_FLAG_L7_LOADBALANCER (bit 2 in
// 1.16 to 1.20): the stand-in then behaves as Cilium with ENABLE_L7_LB
// (no SERVICE entry, no backend: the plain OUT entry to the VIP).
// AddServiceFlags writes L7ProxyPort as the frontend's l7_lb_proxy_port,
// which 1.19+ require non-zero.
const SvcFlag2L7LB = 1 << 2

// L7ProxyPort is the Envoy port AddServiceFlags gives an L7 frontend.
const L7ProxyPort = 15001

// AddServiceFlags is AddService with the frontend's flags and flags2
// (struct lb4_service / lb6_service).
func (d *Datapath) AddServiceFlags(proto uint8, vip netip.AddrPort, flags, flags2 uint8, backends ...netip.AddrPort) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	revNAT := d.nextRevNAT
	d.nextRevNAT++
	v6 := vip.Addr().Is6() && !vip.Addr().Is4In6()
	svcMap, beMap := d.objs.CiliumLb4ServicesV2, d.objs.CiliumLb4BackendsV3
	if v6 {
		svcMap, beMap = d.objs.CiliumLb6ServicesV2, d.objs.CiliumLb6BackendsV3
	}
	for slot, be := range backends {
		id := d.nextBackend
		d.nextBackend++
		if err := beMap.Put(id, backendValue(be, proto, v6)); err != nil {
			return fmt.Errorf("standin: add backend %s: %w", be, err)
		}
		if err := svcMap.Put(serviceKey(vip, uint16(slot+1), v6), serviceValue(id, 0, revNAT)); err != nil {
			return fmt.Errorf("standin: add backend slot %d of %s: %w", slot+1, vip, err)
		}
	}
	var port uint32
	if flags2&SvcFlag2L7LB != 0 {
		port = L7ProxyPort
	}
	fv := serviceValue(port, uint16(len(backends)), revNAT)
	fv[8], fv[9] = flags, flags2
	if err := svcMap.Put(serviceKey(vip, 0, v6), fv); err != nil {
		return fmt.Errorf("standin: add service %s: %w", vip, err)
	}
	return nil
}

// serviceKey is struct lb4_key / lb6_key with protocol 0, scope external.
func serviceKey(vip netip.AddrPort, slot uint16, v6 bool) []byte {
	var b []byte
	if v6 {
		a := vip.Addr().As16()
		b = append(b, a[:]...)
	} else {
		a := vip.Addr().Unmap().As4()
		b = append(b, a[:]...)
	}
	b = binary.BigEndian.AppendUint16(b, vip.Port())
	b = binary.NativeEndian.AppendUint16(b, slot)
	return append(b, 0, 0, 0, 0) // proto, scope, pad[2]
}

// serviceValue is struct lb4_service / lb6_service.
func serviceValue(backendID uint32, count, revNAT uint16) []byte {
	b := binary.NativeEndian.AppendUint32(nil, backendID)
	b = binary.NativeEndian.AppendUint16(b, count)
	b = binary.NativeEndian.AppendUint16(b, revNAT)
	return append(b, 0, 0, 0, 0) // flags, flags2, pad[2]
}

// backendValue is struct lb4_backend / lb6_backend.
func backendValue(be netip.AddrPort, proto uint8, v6 bool) []byte {
	var b []byte
	if v6 {
		a := be.Addr().As16()
		b = append(b, a[:]...)
	} else {
		a := be.Addr().Unmap().As4()
		b = append(b, a[:]...)
	}
	b = binary.BigEndian.AppendUint16(b, be.Port())
	return append(b, proto, 0, 0, 0, 0, 0) // flags, cluster_id, pad[3]
}

// Close detaches the stand-in and releases its programs. The pinned maps
// stay (TempDir's cleanup removes them).
func (d *Datapath) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	var errs []error
	for _, l := range d.links {
		errs = append(errs, l.Close())
	}
	d.links = nil
	errs = append(errs, d.objs.Close())
	return errors.Join(errs...)
}

// RunFromPod runs the stand-in's ingress program (the pod sends) on one
// Ethernet frame with BPF_PROG_TEST_RUN, as if it crossed the host-side
// veth. The conformance suite (e2e/conformance) feeds the stand-in and
// Cilium's real programs the same frames this way and compares the keys.
func (d *Datapath) RunFromPod(frame []byte) error {
	_, err := d.objs.StandinFromPod.Run(&ebpf.RunOptions{Data: frame})
	return err
}

// RunToPod runs the stand-in's egress program (the pod receives) on one
// frame, as RunFromPod.
func (d *Datapath) RunToPod(frame []byte) error {
	_, err := d.objs.StandinToPod.Run(&ebpf.RunOptions{Data: frame})
	return err
}
