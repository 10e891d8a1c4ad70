package conformance

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/internal/testsupport/standin"
	"github.com/ctscrub/ctscrub/scrubd/cilium"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
)

// tc verdicts (TC_ACT_*), as Cilium's programs return them.
const (
	VerdictOK       = 0
	VerdictShot     = 2
	VerdictRedirect = 7
)

// Identities.
const (
	worldID     = 2
	remotePodID = 5001
	nativeIf    = 2 // the node's native device (interface_ifindex of bpf_host)
)

// Node is one Cilium node in the harness: Cilium's bpf_lxc and bpf_host
// programs of one version sharing their maps (pinned by name in a private
// bpffs directory, as under /sys/fs/bpf/tc/globals), ctscrub's recorder
// loaded over Cilium's service maps, and an index fed by recorder.Apply.
type Node struct {
	t    testing.TB
	O    *Objects
	Dir  string // Cilium's pins
	LXC  *Collection
	Host *Collection
	// Overlay is bpf_overlay's cil_from_overlay (default node only).
	Overlay *Collection
	// Globals holds Cilium's CT and service maps pinned again under their
	// production names (1.16's test configuration names them test_*):
	// what ctmap.Open and the recorder's CTRoot expect.
	Globals string
	CT      *ctmap.Maps
	// Feat is the daemon's detection of Cilium features that put entries
	// out of the index's reach, over Globals.
	Feat *cilium.Features
	// extra: pins of per-endpoint or per-cluster CT maps a case made
	extra []string
	// cfgDir holds the node_config.h Feat reads (SetNodeConfig).
	cfgDir string
	Rec    *recorder.Recorder
	Ix     *index.Index
	// SI is ctscrub's test-only stand-in for Cilium's datapath, fed the
	// same frames on its own CT maps (SICT), to be compared with Cilium.
	SI   *standin.Datapath
	SICT *ctmap.Maps

	mu     sync.Mutex
	pods   map[netip.Addr]*Pod
	nextID uint16
	revNAT uint16
}

// Pod is a local endpoint.
type Pod struct {
	Name     string
	IP4, IP6 netip.Addr
	ID       uint16
	Ifindex  uint32
}

// IP is the pod's address of the family of v6.
func (p *Pod) IP(v6 bool) netip.Addr {
	if v6 {
		return p.IP6
	}
	return p.IP4
}

// PodCIDRs of the harness's node.
var PodCIDRs = []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16"), netip.MustParsePrefix("fd00:244::/48")}

// NodeConfig is a node's datapath configuration.
type NodeConfig int

const (
	// NodeDefault: Cilium's default values (no socket LB: bpf_lxc
	// load-balances per packet), legacy host routing.
	NodeDefault NodeConfig = iota
	// NodeHostFWDSR: bpf_lxc and bpf_host with the host firewall, bpf_host
	// with NodePort DSR.
	NodeHostFWDSR
	// NodeSocketLBHostNS: socket LB in host-namespace-only mode
	// (bpf_lxc built with ENABLE_SOCKET_LB_HOST_ONLY), bpf_host as default.
	NodeSocketLBHostNS
	// NodeL7LB: bpf_lxc built with ENABLE_L7_LB (--enable-envoy-config),
	// and the recorder told so (node_config.h would say it).
	NodeL7LB
	numNodeConfigs
)

// NewNode loads a node of configuration cfg.
func NewNode(t testing.TB, o *Objects, nc NodeConfig) *Node {
	t.Helper()
	dir, err := os.MkdirTemp("/sys/fs/bpf", "ctscrub-conformance-")
	if err != nil {
		t.Fatalf("bpffs dir (root, bpffs at /sys/fs/bpf?): %v", err)
	}
	n := &Node{t: t, O: o, Dir: dir, pods: map[netip.Addr]*Pod{}, nextID: 100, revNAT: 1}
	t.Cleanup(func() { n.close() })
	lb := loopback4(o).As4()
	cfg := configs{"interface_ifindex": uint64(nativeIf), "service_loopback_ipv4": uint64(binary.NativeEndian.Uint32(lb[:])),
		// 1.19+: the agent's default (--enable-no-service-endpoints-routable,
		// pkg/svcrouteconfig): a service without backends drops
		// (DROP_NO_SERVICE), as 1.16-1.18 always do; off, bpf_lxc passes
		// the packet on untranslated.
		"enable_no_service_endpoints_routable": uint64(1),
		// 1.19+: IPv6 hairpins are source-NATed too, to the agent's
		// --ipv6-service-loopback-address (default fe80::1,
		// daemon/infraendpoints/cell.go); earlier versions lack it.
		"service_loopback_ipv6": loopback6.As16()}
	lxc := o.LXC
	switch nc {
	case NodeHostFWDSR:
		lxc = o.LXCHostFW
	case NodeSocketLBHostNS:
		lxc = o.LXCHostNS
	case NodeL7LB:
		lxc = o.LXCL7LB
	}
	if n.LXC, err = loadObject(lxc, dir, o.Minor, cfg); err != nil {
		t.Fatal(err)
	}
	host := o.Host
	if nc == NodeHostFWDSR {
		host = o.HostDSR
	}
	if n.Host, err = loadObject(host, dir, o.Minor, cfg); err != nil {
		t.Fatal(err)
	}
	if nc == NodeDefault {
		if n.Overlay, err = loadObject(o.Overlay, dir, o.Minor, cfg); err != nil {
			t.Fatal(err)
		}
	}
	for i, m := range n.LXC.CT {
		if m == nil {
			t.Fatalf("cilium %s: CT map %s not found in bpf_lxc", o.Version, ctmap.Kinds[i].Name())
		}
	}
	n.Globals = filepath.Join(dir, "globals")
	if err := os.Mkdir(n.Globals, 0o700); err != nil {
		t.Fatal(err)
	}
	for i, m := range n.LXC.CT {
		if err := pinAlso(m, filepath.Join(n.Globals, ctmap.Kinds[i].Name())); err != nil {
			t.Fatal(err)
		}
	}
	for name, m := range n.LXC.Maps {
		for _, want := range []string{recorder.ServiceMap4, recorder.ServiceMap6, ctmap.BackendMap4, ctmap.BackendMap6} {
			// 1.17+: the production name; 1.16's test config:
			// test_cilium_lb4_services, test_cilium_lb4_backends.
			if name == want || name == "test_"+want[:len(want)-3] {
				if err := pinAlso(m, filepath.Join(n.Globals, want)); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	// cilium_lxc under its production name (1.16's test config:
	// test_cilium_lxc), for the daemon's feature detection.
	for name, m := range n.LXC.Maps {
		if name == "cilium_lxc" || name == "test_cilium_lxc" {
			if err := pinAlso(m, filepath.Join(n.Globals, "cilium_lxc")); err != nil {
				t.Fatal(err)
			}
		}
	}
	n.Feat = cilium.NewFeatures(n.Globals)
	// No node_config.h until a case writes one (SetNodeConfig): not the
	// machine's own agent's file.
	n.cfgDir = t.TempDir()
	n.SetNodeConfig(nil)
	if n.CT, err = ctmap.Open(n.Globals); err != nil {
		t.Fatal(err)
	}
	// The daemon's CT map counter (the kernel's element count), so the
	// recorder can exclude LRU evictions when it settles a flow to a
	// service without backends.
	be, err := cilium.New(n.CT, index.New(index.Config{PodCIDRs: PodCIDRs}), cilium.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.Close() })
	if !be.CountIsCheap() {
		t.Fatalf("no kernel entry counter for the CT maps (%v): flows to a service without backends cannot be settled", be.CountError())
	}
	n.Rec, err = recorder.Load(recorder.Options{
		PinDir: filepath.Join(dir, "recorder"), CTRoot: n.Globals,
		RingBytes: 1 << 20, SeenEntries: 4096,
		Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		// The lifetimes this build compiled in (Cilium's test
		// configuration), as the agent's node_config.h on a node.
		NodeConfig: filepath.Join(o.Source, "bpf", "node_config.h"),
		CTFill:     be.Count,
		L7LB:       func() bool { return nc == NodeL7LB },
	})
	if err != nil {
		t.Fatal(err)
	}
	n.Rec.SetCT(n.CT) // Resolve reads SERVICE and OUT entries there
	done := make(chan struct{})
	go n.Rec.WatchFill(done)
	t.Cleanup(func() { close(done) })
	if v4, v6 := n.Rec.VIPDetection(); !v4 || !v6 {
		t.Fatalf("recorder did not find Cilium %s's service maps (v4 %v, v6 %v)", o.Version, v4, v6)
	}
	n.Ix = index.New(index.Config{PodCIDRs: PodCIDRs})
	sdir := standin.TempDir(t)
	if err := standin.CreateMaps(sdir, 65536); err != nil {
		t.Fatal(err)
	}
	if n.SI, err = standin.LoadOptions(sdir, &standin.Options{ServiceLoopback4: loopback4(o), ServiceLoopback6: standinLoopback6(o)}); err != nil {
		t.Fatal(err)
	}
	if n.SICT, err = ctmap.Open(sdir); err != nil {
		t.Fatal(err)
	}
	n.setup(confArgs{Op: 0}, "conf_policy")
	return n
}

// loopback6 is the default IPv6 service loopback address of 1.19 and 1.20.
var loopback6 = netip.MustParseAddr("fe80::1")

// standinLoopback6 is what the stand-in SNATs IPv6 hairpins to: nothing
// before 1.19 (bpf_lxc then keeps the client's address).
func standinLoopback6(o *Objects) netip.Addr {
	if o.Minor >= 19 {
		return loopback6
	}
	return netip.Addr{}
}

// loopback4 is the node's IPv4 service loopback address (hairpin SNAT):
// the test configuration of 1.16 and 1.17 compiles in 10.245.255.31
// (bpf/node_config.h IPV4_LOOPBACK); from 1.18 it is runtime configuration,
// set to Cilium's default.
func loopback4(o *Objects) netip.Addr {
	if o.Minor <= 17 {
		return netip.MustParseAddr("10.245.255.31")
	}
	return netip.MustParseAddr("169.254.42.1")
}

func pinAlso(m *ebpf.Map, path string) error {
	c, err := m.Clone()
	if err != nil {
		return err
	}
	defer c.Close()
	return c.Pin(path)
}

func (n *Node) close() {
	if n.Rec != nil {
		n.Rec.Close()
	}
	if n.SI != nil {
		n.SI.Close()
	}
	if n.SICT != nil {
		n.SICT.Close()
	}
	if n.CT != nil {
		n.CT.Close()
	}
	for _, c := range []*Collection{n.LXC, n.Host, n.Overlay} {
		if c != nil {
			c.Close()
		}
	}
	os.RemoveAll(n.Dir)
}

// confArgs mirrors struct conf_args (bpf/setup.h).
type confArgs struct {
	Op, Ifindex, LXCID, SecID uint32
	IP4, TunnelEP             [4]byte
	IP6                       [16]byte
	MAC, NodeMAC              [8]byte
	VIP6                      [16]byte
	VIP4                      [4]byte
	VPort, BPort              [2]byte // network order
	BackendID                 uint32
	RevNAT                    uint16
	Proto, SvcFlags, Family   uint8
	SvcFlags2                 uint8
	_                         [6]byte
}

func (n *Node) setup(a confArgs, prog string) {
	n.t.Helper()
	var b bytes.Buffer
	if err := binary.Write(&b, binary.NativeEndian, &a); err != nil {
		n.t.Fatal(err)
	}
	data := b.Bytes()
	for len(data) < 64 {
		data = append(data, 0)
	}
	p := n.LXC.Programs[prog]
	if p == nil {
		n.t.Fatalf("program %s not in bpf_lxc", prog)
	}
	ret, err := p.Run(&ebpf.RunOptions{Data: data})
	if err != nil || ret != 0 {
		n.t.Fatalf("%s(op %d): ret %d, %v", prog, a.Op, ret, err)
	}
}

// AddPod adds a local endpoint with the next endpoint ID: Cilium's
// endpoints map and ipcache, its policy program in cilium_call_policy, and
// the index tracks both its addresses from now on (a fresh pod: complete).
func (n *Node) AddPod(name string, ip4, ip6 netip.Addr) *Pod {
	n.t.Helper()
	n.mu.Lock()
	n.nextID++
	p := &Pod{Name: name, IP4: ip4, IP6: ip6, ID: n.nextID, Ifindex: uint32(n.nextID)}
	n.pods[ip4], n.pods[ip6] = p, p
	n.mu.Unlock()
	a := confArgs{Op: 1, Ifindex: p.Ifindex, LXCID: uint32(p.ID), SecID: 10000 + uint32(p.ID),
		IP4: ip4.As4(), IP6: ip6.As16()}
	copy(a.MAC[:], podMAC[:])
	copy(a.NodeMAC[:], nodeMAC[:])
	n.setup(a, "conf_setup")
	calls := n.LXC.Maps[policyCallMapName(n.LXC)]
	if err := calls.Put(uint32(p.ID), n.LXC.PolicyProg); err != nil {
		n.t.Fatalf("policy program of endpoint %d: %v", p.ID, err)
	}
	// The pod holds its IPs, as after its index start (a mark of an IP no
	// pod holds drops the slot instead).
	n.Ix.Hold(ip4)
	n.Ix.Hold(ip6)
	n.Ix.TrackAll([]netip.Addr{ip4, ip6})
	return p
}

func policyCallMapName(c *Collection) string {
	for name, m := range c.Maps {
		if m.Type() == ebpf.ProgramArray && (name == policyCallMap || name == "test_cilium_policy") {
			return name
		}
	}
	return policyCallMap
}

// AddRemote puts a remote address (another node's pod, identity
// remotePodID, or world) into the ipcache.
func (n *Node) AddRemote(ip netip.Addr, identity uint32) {
	n.t.Helper()
	a := confArgs{Op: 2, SecID: identity, Family: 4}
	if ip.Is4() {
		a.IP4 = ip.As4()
	} else {
		a.IP6, a.Family = ip.As16(), 6
	}
	n.setup(a, "conf_setup")
}

// Service flags (SVC_FLAG_*).
const (
	SvcExternalIP = 1 << 0
	SvcNodePort   = 1 << 1
	SvcRoutable   = 1 << 6
)

// AddService registers a service frontend with one backend (slot 1) and
// returns the backend's ID. Again for the same frontend, it replaces the
// backend in slot 1, as the agent does when a backend changes.
func (n *Node) AddService(proto uint8, vip, backend netip.AddrPort, flags uint8) uint32 {
	n.t.Helper()
	n.mu.Lock()
	rev := n.revNAT
	n.revNAT++
	n.mu.Unlock()
	a := confArgs{Op: 3, Proto: proto, SvcFlags: flags, RevNAT: rev, BackendID: uint32(rev), Family: 4}
	binary.BigEndian.PutUint16(a.VPort[:], vip.Port())
	binary.BigEndian.PutUint16(a.BPort[:], backend.Port())
	if vip.Addr().Is4() {
		a.VIP4, a.IP4 = vip.Addr().As4(), backend.Addr().As4()
	} else {
		a.VIP6, a.IP6, a.Family = vip.Addr().As16(), backend.Addr().As16(), 6
	}
	n.setup(a, "conf_setup")
	if err := n.SI.AddService(proto, vip, backend); err != nil {
		n.t.Fatal(err)
	}
	n.checkBackend(vip.Addr().Is6(), a.BackendID, backend)
	return a.BackendID
}

// AddServiceL7 registers an L7 load-balancer service (flags2
// SVC_FLAG_L7_LOADBALANCER, as the agent writes it for a CiliumEnvoyConfig
// or an Ingress) with one backend, which bpf_lxc built with ENABLE_L7_LB
// never picks.
func (n *Node) AddServiceL7(proto uint8, vip, backend netip.AddrPort) {
	n.t.Helper()
	n.mu.Lock()
	rev := n.revNAT
	n.revNAT++
	n.mu.Unlock()
	a := confArgs{Op: 3, Proto: proto, SvcFlags2: standin.SvcFlag2L7LB, RevNAT: rev, BackendID: uint32(rev), Family: 4}
	binary.BigEndian.PutUint16(a.VPort[:], vip.Port())
	binary.BigEndian.PutUint16(a.BPort[:], backend.Port())
	if vip.Addr().Is4() {
		a.VIP4, a.IP4 = vip.Addr().As4(), backend.Addr().As4()
	} else {
		a.VIP6, a.IP6, a.Family = vip.Addr().As16(), backend.Addr().As16(), 6
	}
	n.setup(a, "conf_setup")
	if err := n.SI.AddServiceFlags(proto, vip, 0, standin.SvcFlag2L7LB, backend); err != nil {
		n.t.Fatal(err)
	}
}

// AddServiceNoBackends registers a service frontend without backends
// (count 0), as the agent leaves a service whose endpoints are all gone:
// bpf_lxc drops a pod's new flow to it (DROP_NO_SERVICE) before creating
// any CT entry. Not given to the stand-in, which has no such service.
func (n *Node) AddServiceNoBackends(proto uint8, vip netip.AddrPort) {
	n.t.Helper()
	n.mu.Lock()
	rev := n.revNAT
	n.revNAT++
	n.mu.Unlock()
	a := confArgs{Op: 3, Proto: proto, RevNAT: rev, Family: 4}
	binary.BigEndian.PutUint16(a.VPort[:], vip.Port())
	if vip.Addr().Is4() {
		a.VIP4 = vip.Addr().As4()
	} else {
		a.VIP6, a.Family = vip.Addr().As16(), 6
	}
	n.setup(a, "conf_setup")
}

// dropNoService is DROP_NO_SERVICE's reason in cilium_metrics (-158).
const dropNoService = 158

// NoServiceDrops counts the packets Cilium dropped as DROP_NO_SERVICE.
func (n *Node) NoServiceDrops() uint64 {
	var sum uint64
	for name, m := range n.LXC.Maps {
		if name != "cilium_metrics" && name != "test_cilium_metrics" {
			continue
		}
		it := m.Iterate()
		k := make([]byte, m.KeySize())
		var v [][16]byte // per CPU: count, bytes
		for it.Next(&k, &v) {
			if k[0] == dropNoService {
				for _, c := range v {
					sum += binary.NativeEndian.Uint64(c[:8])
				}
			}
		}
	}
	return sum
}

// checkBackend reads backend id back through ctmap.Backends (what
// recorder.Resolve uses) from the map Cilium's own helpers wrote: the
// layout ctscrub decodes is this version's.
func (n *Node) checkBackend(v6 bool, id uint32, want netip.AddrPort) {
	n.t.Helper()
	be, err := ctmap.OpenBackends(n.Globals)
	if err != nil {
		n.t.Fatalf("cilium %s: %v", n.O.Version, err)
	}
	defer be.Close()
	got, ok, err := be.Lookup(v6, id)
	if err != nil || !ok || got.Addr != want.Addr() || got.Port != want.Port() {
		n.t.Fatalf("cilium %s: backend %d read through ctmap.Backends as %+v (found %v, err %v), Cilium wrote %s", n.O.Version, id, got, ok, err, want)
	}
}

// RemoveBackend deletes backend id from Cilium's backend map of the
// family of v6, as the agent does when the backend's pod goes: a flow's
// next packet then makes Cilium pick another (ct_update_svc_entry).
func (n *Node) RemoveBackend(v6 bool, id uint32) {
	n.t.Helper()
	want := ctmap.BackendMap4
	if v6 {
		want = ctmap.BackendMap6
	}
	for name, m := range n.LXC.Maps {
		if name == want || name == "test_"+want[:len(want)-3] {
			if err := m.Delete(id); err != nil {
				n.t.Fatalf("remove backend %d from %s: %v", id, name, err)
			}
			return
		}
	}
	n.t.Fatalf("no backend map %s in bpf_lxc of %s", want, n.O.Version)
}

// Settle does what the daemon does soon after records arrive: applies
// them and runs the early resolution of the pods' service flows.
func (n *Node) Settle(pods ...*Pod) {
	n.t.Helper()
	if _, err := n.Rec.Drain(n.Ix); err != nil {
		n.t.Fatal(err)
	}
	for _, p := range pods {
		n.Rec.Resolve(n.Ix, p.IP4, false)
		n.Rec.Resolve(n.Ix, p.IP6, false)
	}
}

// AddL7 writes a policy entry that redirects the flows of identity,
// direction (egress: identity is the destination's), protocol and port to
// the L7 proxy on proxyPort, the way the agent writes an L7 rule. The
// harness's endpoints share one policy map (Cilium's test configuration):
// the entry's identity keeps it to the case that adds it.
func (n *Node) AddL7(egress bool, identity uint32, proto uint8, port, proxyPort uint16) {
	n.t.Helper()
	a := confArgs{Op: 4, SecID: identity, Proto: proto}
	if egress {
		a.Family = 1
	}
	binary.BigEndian.PutUint16(a.VPort[:], port)
	binary.BigEndian.PutUint16(a.BPort[:], proxyPort)
	n.setup(a, "conf_setup")
}

// PinPolicy pins the harness's policy map as p's own under the agent's name
// (cilium_policy_<id> 1.16, cilium_policy_v2_<id> 1.17-1.19,
// cilium_policy_v3_<id> 1.20), where the daemon looks for L7 redirects.
func (n *Node) PinPolicy(p *Pod) {
	n.t.Helper()
	prefix := "cilium_policy_"
	switch {
	case n.O.Minor >= 20:
		prefix = "cilium_policy_v3_"
	case n.O.Minor >= 17:
		prefix = "cilium_policy_v2_"
	}
	for name, m := range n.LXC.Maps {
		// 1.16/1.17 test config: test_cilium_policy_65535; 1.18-1.19:
		// cilium_policy_v2; 1.20: cilium_policy (not the egress gateway's
		// or SRv6's policy tries).
		if m.Type() == ebpf.LPMTrie && (strings.HasPrefix(name, "cilium_policy") || strings.HasPrefix(name, "test_cilium_policy")) {
			if err := pinAlso(m, filepath.Join(n.Globals, fmt.Sprintf("%s%05d", prefix, p.ID))); err != nil {
				n.t.Fatal(err)
			}
			return
		}
	}
	n.t.Fatalf("no policy map (LPM trie) in bpf_lxc of %s", n.O.Version)
}

// PinExtraCT creates a CT map with like's spec (Cilium's own, from the
// loaded object) and pins it under Globals as name; UnpinExtraCT removes it.
func (n *Node) PinExtraCT(name string, like *ebpf.Map) {
	n.t.Helper()
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: like.Type(), KeySize: like.KeySize(), ValueSize: like.ValueSize(),
		MaxEntries: like.MaxEntries(), Flags: like.Flags()})
	if err != nil {
		n.t.Fatal(err)
	}
	defer m.Close()
	n.pinExtra(name, m)
}

func (n *Node) pinExtra(name string, m *ebpf.Map) {
	n.t.Helper()
	p := filepath.Join(n.Globals, name)
	if err := pinAlso(m, p); err != nil {
		n.t.Fatal(err)
	}
	n.extra = append(n.extra, p)
}

// PinPerClusterCT pins per-cluster CT maps as the agent does for a remote
// cluster 1: the outer cilium_per_cluster_ct_tcp4 and the inner map
// cilium_per_cluster_ct_tcp4_1 (in slot 1). From 1.19 they are the maps of
// Cilium's own bpf_lxc (its test build fills slot 1); before, made with the
// agent's spec (ctmap.newPerClusterCTMap: 256 slots, inner = the global CT
// map's spec).
func (n *Node) PinPerClusterCT() {
	n.t.Helper()
	outer, inner := n.LXC.Maps["cilium_per_cluster_ct_tcp4"], n.LXC.Maps["per_cluster_ct_tcp4_1"]
	if outer != nil && inner != nil {
		n.pinExtra("cilium_per_cluster_ct_tcp4", outer)
		n.pinExtra("cilium_per_cluster_ct_tcp4_1", inner)
		return
	}
	ct := n.LXC.CT[ctmap.TCP4]
	innerSpec := &ebpf.MapSpec{Type: ct.Type(), KeySize: ct.KeySize(), ValueSize: ct.ValueSize(), MaxEntries: ct.MaxEntries(), Flags: ct.Flags()}
	im, err := ebpf.NewMap(innerSpec)
	if err != nil {
		n.t.Fatal(err)
	}
	defer im.Close()
	om, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.ArrayOfMaps, KeySize: 4, ValueSize: 4, MaxEntries: 256, InnerMap: innerSpec})
	if err != nil {
		n.t.Fatal(err)
	}
	defer om.Close()
	if err := om.Put(uint32(1), im); err != nil {
		n.t.Fatal(err)
	}
	n.pinExtra("cilium_per_cluster_ct_tcp4", om)
	n.pinExtra("cilium_per_cluster_ct_tcp4_1", im)
}

// UnpinExtraCT removes what PinExtraCT and PinPerClusterCT pinned.
func (n *Node) UnpinExtraCT() {
	for _, p := range n.extra {
		os.Remove(p)
	}
	n.extra = nil
}

// HostID is Cilium's identity of the node itself.
const HostID = 1

// ToHost: a frame a pod sent to the node's own address reaches the host
// stack through cilium_host, whose ingress runs bpf_host's cil_to_host
// (the host firewall's ingress policy).
func (n *Node) ToHost(frame []byte) Result {
	n.t.Helper()
	return n.run(n.Host, "cil_to_host", frame)
}

// FromHost: the node's own stack sends frame to a local pod; cilium_host's
// egress runs bpf_host's cil_from_host (the host firewall's egress
// policy), which delivers it to the pod.
func (n *Node) FromHost(frame []byte) Result {
	n.t.Helper()
	r := n.runMark(n.Host, "cil_from_host", frame, markMagicHost)
	n.deliver(r)
	return r
}

// FromProxy: the node's L7 proxy (Envoy) sends frame upstream with
// identity's mark (MARK_MAGIC_PROXY_EGRESS, the identity in the mark's top
// half, as the agent's proxy sets SO_MARK), through cilium_host.
func (n *Node) FromProxy(frame []byte, identity uint32) Result {
	n.t.Helper()
	r := n.runMark(n.Host, "cil_from_host", frame, markMagicProxyEgress|identity<<16)
	n.deliver(r)
	return r
}

// markMagicProxyEgress is MARK_MAGIC_PROXY_EGRESS (0x0B00 at 1.16-1.20).
const markMagicProxyEgress = 0x0B00

// markMagicHost is MARK_MAGIC_HOST (0x0C00 at 1.16-1.20): the mark
// Cilium's iptables rule (CILIUM_OUTPUT) puts on the host's own packets,
// from which cil_from_host takes the source identity host (else world).
const markMagicHost = 0x0C00

// Result is what one datapath program did with a packet.
type Result struct {
	Verdict uint32
	Out     []byte // the packet as the program left it
}

func (n *Node) run(c *Collection, prog string, frame []byte) Result {
	n.t.Helper()
	return n.runMark(c, prog, frame, 0)
}

// runMark runs prog on frame with the skb's mark set to mark (struct
// __sk_buff's third field; the fields before it must be zero).
func (n *Node) runMark(c *Collection, prog string, frame []byte, mark uint32) Result {
	n.t.Helper()
	p := c.Programs[prog]
	if p == nil {
		n.t.Fatalf("program %s not loaded", prog)
	}
	out := make([]byte, len(frame)+512)
	opts := &ebpf.RunOptions{Data: frame, DataOut: out}
	if mark != 0 {
		opts.Context = [3]uint32{0, 0, mark}
	}
	ret, err := p.Run(opts)
	if err != nil {
		n.t.Fatalf("%s: test run: %v", prog, err)
	}
	return Result{Verdict: ret, Out: opts.DataOut}
}

// local returns the local pod owning the frame's destination address.
func (n *Node) local(frame []byte) *Pod {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.pods[dstOf(frame)]
}

func dstOf(frame []byte) netip.Addr {
	if len(frame) < 14+40 {
		if len(frame) >= 14+20 && frame[12] == 0x08 {
			return netip.AddrFrom4([4]byte(frame[30:34]))
		}
		return netip.Addr{}
	}
	if binary.BigEndian.Uint16(frame[12:]) == 0x0800 {
		return netip.AddrFrom4([4]byte(frame[30:34]))
	}
	return netip.AddrFrom16([16]byte(frame[38:54]))
}

// Send: pod p sends frame. The recorder sees it leave the pod (container
// side, egress), then Cilium's cil_from_container handles it; when Cilium
// delivers it to a local pod (redirect after the ingress policy tail call)
// that pod's recorder sees Cilium's output arrive.
func (n *Node) Send(p *Pod, frame []byte) Result {
	n.t.Helper()
	if err := n.Rec.RunFrame(true, frame); err != nil {
		n.t.Fatal(err)
	}
	if err := n.SI.RunFromPod(frame); err != nil {
		n.t.Fatal(err)
	}
	r := n.run(n.LXC, "cil_from_container", frame)
	n.deliver(r)
	return r
}

// SendBypassed: pod p sends frame with PACKET_QDISC_BYPASS (a packet
// socket): its eth0's tc egress, where the container-side recorder sits,
// never sees it; the recorder's host-side link, at the head of the veth's
// ingress, does, then Cilium's cil_from_container.
func (n *Node) SendBypassed(p *Pod, frame []byte) Result {
	n.t.Helper()
	if err := n.Rec.RunHostFrame(frame); err != nil {
		n.t.Fatal(err)
	}
	if err := n.SI.RunFromPod(frame); err != nil {
		n.t.Fatal(err)
	}
	r := n.run(n.LXC, "cil_from_container", frame)
	n.deliver(r)
	return r
}

// FromNetdev: frame arrives on the node's native device (from the world,
// a remote node's pod, a NodePort client, a DSR load balancer). Cilium's
// cil_from_netdev handles it; what it delivers to a local pod reaches that
// pod's recorder.
func (n *Node) FromNetdev(frame []byte) Result {
	n.t.Helper()
	r := n.run(n.Host, "cil_from_netdev", frame)
	n.deliver(r)
	return r
}

// FromOverlay: frame arrives over the tunnel from another node (the kernel
// took the outer header off; the tunnel key, mocked, carries a remote
// pod's identity). bpf_overlay's cil_from_overlay handles it; what it
// delivers to a local pod reaches that pod's recorder.
func (n *Node) FromOverlay(frame []byte) Result {
	n.t.Helper()
	if n.Overlay == nil {
		n.t.Fatalf("no bpf_overlay on this node")
	}
	r := n.run(n.Overlay, "cil_from_overlay", frame)
	n.deliver(r)
	return r
}

// Receive: frame reaches pod p through the stack (Cilium's legacy host
// routing): cil_to_container on the pod's veth, then the pod's recorder.
func (n *Node) Receive(frame []byte) Result {
	n.t.Helper()
	r := n.run(n.LXC, "cil_to_container", frame)
	if r.Verdict == VerdictOK || r.Verdict == VerdictRedirect {
		n.received(r.Out)
	}
	return r
}

// deliver follows a packet Cilium let through: a redirect to a local pod
// (after its ingress policy ran by tail call) reaches the pod's recorder;
// a packet for a local pod passed to the stack (TC_ACT_OK) is routed to the
// pod's veth, where cil_to_container runs before the pod receives it.
func (n *Node) deliver(r Result) {
	if n.local(r.Out) == nil {
		return
	}
	switch r.Verdict {
	case VerdictRedirect:
		n.received(r.Out)
	case VerdictOK:
		n.Receive(r.Out)
	}
}

// received: the pod gets frame; its recorder (container side) and the
// stand-in (host-side veth egress) see it.
func (n *Node) received(frame []byte) {
	if err := n.Rec.RunFrame(false, frame); err != nil {
		n.t.Fatal(err)
	}
	if err := n.SI.RunToPod(frame); err != nil {
		n.t.Fatal(err)
	}
}

// Miss is a Cilium CT entry holding a pod IP that the IP's index does not
// cover while the index calls the IP complete.
type Miss struct {
	IP  netip.Addr
	Key string
	Map string
}

func (m Miss) String() string { return fmt.Sprintf("%s: %s in %s", m.IP, m.Key, m.Map) }

// Check drains the recorder into the index and compares it with Cilium's
// CT maps: every entry holding an address of one of pods must be among the
// keys a scrub of that address deletes (index.ScrubKeys), unless the index
// marks the address incomplete; then the reason must be one of reasons.
// It returns the misses and the incomplete IPs with a wrong reason.
func (n *Node) Check(pods []*Pod, reasons ...string) (misses []Miss, wrong []string, entries int) {
	n.t.Helper()
	if _, err := n.Rec.Drain(n.Ix); err != nil {
		n.t.Fatal(err)
	}
	// What a scrub does first (index.Hooks.Resolve, installed by the
	// recorder's Run): learn the backends of the IPs' service flows.
	for _, p := range pods {
		for _, ip := range []netip.Addr{p.IP4, p.IP6} {
			n.Rec.Resolve(n.Ix, ip, true)
		}
	}
	// What a scrub does first (cilium.Backend.Scrub): a Cilium feature that
	// puts the IP's entries out of the index's reach marks it incomplete.
	for _, p := range pods {
		for _, ip := range []netip.Addr{p.IP4, p.IP6} {
			if r := n.Feat.Reason(ip); r != "" {
				n.Ix.MarkIncomplete(ip, r)
			}
		}
	}
	mine := map[netip.Addr]bool{}
	for _, p := range pods {
		mine[p.IP4], mine[p.IP6] = true, true
	}
	cover4 := map[netip.Addr]map[ctmap.CTKey4]bool{}
	cover6 := map[netip.Addr]map[ctmap.CTKey6]bool{}
	checked := map[netip.Addr]bool{}
	state := func(ip netip.Addr) index.State {
		st := n.Ix.State(ip)
		if !st.Complete && !checked[ip] {
			checked[ip] = true
			ok := false
			for _, r := range reasons {
				ok = ok || st.Incomplete == r
			}
			if !ok {
				wrong = append(wrong, fmt.Sprintf("%s: incomplete (%s)", ip, st.Incomplete))
			}
		}
		return st
	}
	for _, kind := range ctmap.Kinds {
		it := n.CT.Map(kind).Iterate()
		if kind.IPv6() {
			var k ctmap.CTKey6
			var v ctmap.Entry
			for it.Next(&k, &v) {
				for _, ip := range []netip.Addr{k.DAddr(), k.SAddr()} {
					if !mine[ip] {
						continue
					}
					entries++
					if !state(ip).Complete {
						continue
					}
					if cover6[ip] == nil {
						_, k6, _ := n.Ix.ScrubKeys(ip)
						cover6[ip] = map[ctmap.CTKey6]bool{}
						for _, c := range k6 {
							cover6[ip][c] = true
						}
					}
					if !cover6[ip][k] {
						misses = append(misses, Miss{ip, k.String(), kind.Name()})
					}
				}
			}
		} else {
			var k ctmap.CTKey4
			var v ctmap.Entry
			for it.Next(&k, &v) {
				for _, ip := range []netip.Addr{k.DAddr(), k.SAddr()} {
					if !mine[ip] {
						continue
					}
					entries++
					if !state(ip).Complete {
						continue
					}
					if cover4[ip] == nil {
						k4, _, _ := n.Ix.ScrubKeys(ip)
						cover4[ip] = map[ctmap.CTKey4]bool{}
						for _, c := range k4 {
							cover4[ip][c] = true
						}
					}
					if !cover4[ip][k] {
						misses = append(misses, Miss{ip, k.String(), kind.Name()})
					}
				}
			}
		}
		if err := it.Err(); err != nil {
			n.t.Fatal(err)
		}
	}
	return misses, wrong, entries
}

// Dump lists the CT entries holding one of the addresses (for logs).
func (n *Node) Dump(ips ...netip.Addr) []string {
	var out []string
	want := map[netip.Addr]bool{}
	for _, ip := range ips {
		want[ip] = true
	}
	for _, kind := range ctmap.Kinds {
		it := n.CT.Map(kind).Iterate()
		if kind.IPv6() {
			var k ctmap.CTKey6
			var v ctmap.Entry
			for it.Next(&k, &v) {
				if want[k.DAddr()] || want[k.SAddr()] {
					out = append(out, k.String())
				}
			}
		} else {
			var k ctmap.CTKey4
			var v ctmap.Entry
			for it.Next(&k, &v) {
				if want[k.DAddr()] || want[k.SAddr()] {
					out = append(out, k.String())
				}
			}
		}
	}
	return out
}

// Drops lists Cilium's drop counters (metrics map: reason, direction) for
// logs: why the datapath dropped a packet the case expected through.
func (n *Node) Drops() []string {
	var out []string
	for name, m := range n.LXC.Maps {
		if name != "cilium_metrics" && name != "test_cilium_metrics" {
			continue
		}
		it := m.Iterate()
		k := make([]byte, m.KeySize())
		var v [][16]byte // per CPU: count, bytes
		for it.Next(&k, &v) {
			if k[0] != 0 && k[0] != 1 && k[0] != 3 { // forwarded, plain, trace reasons
				out = append(out, fmt.Sprintf("reason %d dir %d", k[0], k[1]))
			}
		}
	}
	return out
}

// keysOf lists the keys of the CT maps holding one of ips.
func keysOf(t testing.TB, m *ctmap.Maps, ips map[netip.Addr]bool) map[string]bool {
	out := map[string]bool{}
	for _, kind := range ctmap.Kinds {
		it := m.Map(kind).Iterate()
		if kind.IPv6() {
			var k ctmap.CTKey6
			var v ctmap.Entry
			for it.Next(&k, &v) {
				if ips[k.DAddr()] || ips[k.SAddr()] {
					out[k.String()] = true
				}
			}
		} else {
			var k ctmap.CTKey4
			var v ctmap.Entry
			for it.Next(&k, &v) {
				if ips[k.DAddr()] || ips[k.SAddr()] {
					out[k.String()] = true
				}
			}
		}
		if err := it.Err(); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// CompareStandin returns the CT keys holding one of the pods' addresses
// that only Cilium created (onlyCilium) or only the stand-in did.
func (n *Node) CompareStandin(pods []*Pod) (onlyCilium, onlyStandin []string) {
	ips := map[netip.Addr]bool{}
	for _, p := range pods {
		ips[p.IP4], ips[p.IP6] = true, true
	}
	c, s := keysOf(n.t, n.CT, ips), keysOf(n.t, n.SICT, ips)
	for k := range c {
		if !s[k] {
			onlyCilium = append(onlyCilium, k)
		}
	}
	for k := range s {
		if !c[k] {
			onlyStandin = append(onlyStandin, k)
		}
	}
	sort.Strings(onlyCilium)
	sort.Strings(onlyStandin)
	return onlyCilium, onlyStandin
}
