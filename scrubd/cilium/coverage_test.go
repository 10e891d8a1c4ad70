package cilium

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// writeNodeConfig writes a node_config.h with defines and points c at it.
func writeNodeConfig(t *testing.T, c *Backend, defines ...string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "node_config.h")
	body := "/* node_config.h as the agent writes it */\n#define CT_MAP_SIZE_TCP 524288\n"
	for _, d := range defines {
		body += "#define " + d + " 1\n"
	}
	if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	c.features.SetNodeConfig(p)
	return p
}

func TestParseNodeConfig(t *testing.T) {
	got := ParseNodeConfig([]byte("#define ENABLE_IPV4 1\n#define ENABLE_NODEPORT 1\n#define ENABLE_DSR 1\n#define ENABLE_HOST_FIREWALL 0\n#define ENABLE_L7_LB 1\n"))
	want := NodeConfig{Read: true, NodePort: true, DSR: true, L7LB: true}
	if got != want {
		t.Fatalf("%+v, want %+v", got, want)
	}
}

// svcMaps creates Cilium's service and backend maps (1.16-1.20 layout,
// as the recorder reads them) under dir.
type svcMaps struct {
	svc, be *ebpf.Map
	nextID  uint32
}

func newSvcMaps(t *testing.T, dir string) *svcMaps {
	t.Helper()
	s := &svcMaps{nextID: 1}
	var err error
	s.svc, err = ebpf.NewMap(&ebpf.MapSpec{Name: serviceMap4, Type: ebpf.Hash, KeySize: 12, ValueSize: 12, MaxEntries: 1024})
	if err != nil {
		t.Fatal(err)
	}
	s.be, err = ebpf.NewMap(&ebpf.MapSpec{Name: ctmap.BackendMap4, Type: ebpf.Hash, KeySize: 4, ValueSize: 12, MaxEntries: 1024})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.svc.Close(); s.be.Close() })
	if err := s.svc.Pin(filepath.Join(dir, serviceMap4)); err != nil {
		t.Fatal(err)
	}
	if err := s.be.Pin(filepath.Join(dir, ctmap.BackendMap4)); err != nil {
		t.Fatal(err)
	}
	return s
}

// add puts a frontend with flags and its backends, as the agent does.
func (s *svcMaps) add(t *testing.T, vip netip.AddrPort, flags uint8, backends ...netip.Addr) {
	t.Helper()
	key := func(slot uint16) []byte {
		a := vip.Addr().As4()
		k := append([]byte{}, a[:]...)
		k = binary.BigEndian.AppendUint16(k, vip.Port())
		k = binary.NativeEndian.AppendUint16(k, slot)
		return append(k, 6, 0, 0, 0)
	}
	for i, b := range backends {
		id := s.nextID
		s.nextID++
		a := b.As4()
		bv := append(append([]byte{}, a[:]...), 0x1f, 0x90, 6, 0, 0, 0, 0, 0)
		if err := s.be.Put(id, bv); err != nil {
			t.Fatal(err)
		}
		v := binary.NativeEndian.AppendUint32(nil, id)
		v = append(v, 0, 0, 1, 0, 0, 0, 0, 0)
		if err := s.svc.Put(key(uint16(i+1)), v); err != nil {
			t.Fatal(err)
		}
	}
	v := binary.NativeEndian.AppendUint32(nil, 0)
	v = binary.NativeEndian.AppendUint16(v, uint16(len(backends)))
	v = append(v, 1, 0, flags, 0, 0, 0)
	if err := s.svc.Put(key(0), v); err != nil {
		t.Fatal(err)
	}
}

// With Cilium's NodePort on, a backend of a routable service (NodePort,
// LoadBalancer, ...) is marked by the continuous check and its scrub
// sweeps; a backend of a ClusterIP service only, and every IP while
// NodePort is off, keep the index path. Before this check the scrub of the
// NodePort backend took the index path: bpf_host's entry for a packet the
// pod never received (policy drop, pod gone) was left behind.
func TestNodePortBackendsMarked(t *testing.T) {
	defer func(d time.Duration) { RoutableTTL = d }(RoutableTTL)
	RoutableTTL = 0
	w, c := trackedWorld(t, 1<<14)
	for _, ip := range []netip.Addr{podA, podB} {
		c.ix.Hold(ip)
	}
	s := newSvcMaps(t, w.maps.Root)
	s.add(t, netip.MustParseAddrPort("192.0.2.100:30080"), svcFlagRoutable|1<<1 /* NODEPORT */, podA)
	s.add(t, netip.MustParseAddrPort("10.96.0.10:80"), 0 /* ClusterIP */, podB)

	writeNodeConfig(t, c) // NodePort off
	if n := c.features.MarkUncovered(c.ix); n != 0 {
		t.Fatalf("NodePort off: %d IPs marked", n)
	}
	writeNodeConfig(t, c, "ENABLE_NODEPORT")
	if n := c.features.MarkUncovered(c.ix); n != 1 {
		t.Fatalf("NodePort on: %d IPs marked, want 1 (the NodePort backend)", n)
	}
	if st := c.ix.State(podA); st.Incomplete != ReasonNodePortBackend {
		t.Fatalf("NodePort backend: %+v, want incomplete (%s)", st, ReasonNodePortBackend)
	}
	if st := c.ix.State(podB); !st.Complete {
		t.Fatalf("ClusterIP backend: %+v, want complete", st)
	}
	if r := c.UncoveredReason(podA); r != ReasonNodePortBackend {
		t.Fatalf("UncoveredReason(NodePort backend) = %q", r)
	}
	if m, why := scrubOne(t, c, podA, false); m != scrub.MethodSweep || why != ReasonNodePortBackend {
		t.Fatalf("NodePort backend's scrub: method %s, incomplete %q; want a sweep and %q", m, why, ReasonNodePortBackend)
	}
	w.verify(podA)
	if m, why := scrubOne(t, c, podB, true); m != scrub.MethodIndex || why != "" {
		t.Fatalf("ClusterIP backend's scrub: method %s, incomplete %q; want the index path", m, why)
	}
	on := map[string]bool{}
	for _, u := range c.UncoveredFeatures() {
		on[u.Label] = u.On
	}
	if !on["nodeport_backends"] || on["host_firewall"] || on["l7_proxy"] {
		t.Fatalf("UncoveredFeatures: %v", on)
	}
}

// The host firewall reaches every pod IP from the node: every IP is marked.
func TestHostFirewallMarksEveryIP(t *testing.T) {
	_, c := trackedWorld(t, 1<<14) // podA, podB, podC, podA6, podB6 held and complete
	writeNodeConfig(t, c)
	if n := c.features.MarkUncovered(c.ix); n != 0 {
		t.Fatalf("host firewall off: %d marked", n)
	}
	writeNodeConfig(t, c, "ENABLE_HOST_FIREWALL")
	c.features.MarkUncovered(c.ix)
	ips := []netip.Addr{podA, podB, podC, podA6, podB6}
	for _, ip := range ips {
		if st := c.ix.State(ip); st.Incomplete != ReasonHostFirewall {
			t.Errorf("%s: %+v, want incomplete (%s)", ip, st, ReasonHostFirewall)
		}
	}
	if n := c.features.Marks("host_firewall"); n != uint64(len(ips)) {
		t.Errorf("marks counted: %d, want %d", n, len(ips))
	}
}

// Issue 35 item 4: an L7 (or DNS) rule on for a while and removed before
// the pod's DEL leaves the proxy's entries with the pod's address, which
// the recorder never saw. The continuous check marked the IP while the
// rule was on; the mark stays, so the DEL's scrub sweeps them. With the
// point-in-time check only (markFeatures at the scrub) the scrub found no
// proxy port and took the index path, leaving the proxy's entry.
func TestL7RuleRemovedBeforeScrub(t *testing.T) {
	defer func(d time.Duration) { PolicyTTL = d }(PolicyTTL)
	PolicyTTL = 0
	w, c := trackedWorld(t, 1<<14)
	c.ix.Hold(podA)
	writeNodeConfig(t, c)
	const id = 1234
	lxcMap(t, w.maps.Root, podA, id)
	pm, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.LPMTrie, KeySize: 12, ValueSize: 12, MaxEntries: 16384, Flags: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer pm.Close()
	pin := filepath.Join(w.maps.Root, fmt.Sprintf("cilium_policy_v3_%05d", id))
	if err := pm.Pin(pin); err != nil {
		t.Fatal(err)
	}
	policyPut(t, pm, true, 2, 6, 53, 15053) // a DNS rule: egress UDP/TCP 53 to the DNS proxy
	c.features.MarkUncovered(c.ix)
	if !c.UncoveredFeatures()[0].On {
		t.Fatalf("l7_proxy not listed on: %+v", c.UncoveredFeatures())
	}
	// The proxy's upstream connection, in the pod's name: a key the
	// recorder never saw.
	proxyKey := ctmap.NewKey4(podA, remote4, 53, 41000, ctmap.ProtoTCP, ctmap.FlagOut)
	w.addFlow(flow{key4: &proxyKey}, false)
	// The rule goes before the DEL.
	policyPut(t, pm, true, 2, 6, 53, 0)
	if r := c.features.ProxyReason(podA); r != "" {
		t.Fatalf("rule removed, ProxyReason still %q", r)
	}
	if m, why := scrubOne(t, c, podA, false); m != scrub.MethodSweep {
		t.Fatalf("scrub after the rule went: method %s, incomplete %q; want a sweep (%s)", m, why, ReasonL7Proxy)
	}
	w.verify(podA) // the proxy's entry among them
}

// Issue 35: with DSR on, bpf_host's nodeport_dsr_ingress_ipv4/6 makes an
// entry for whatever local address a packet's DSR option names, whether or
// not it is a routable backend here (conformance
// nodeport-dsr-backend-unlisted-then-deleted: a backend unlisted on this
// node, its pod deleted and released, a load balancer's node still sending
// it a client: the released IP kept a complete slot with that entry left).
// Every IP is marked while ENABLE_DSR is on; a routable backend keeps the
// NodePort reason.
func TestDSRMarksEveryIP(t *testing.T) {
	defer func(d time.Duration) { RoutableTTL = d }(RoutableTTL)
	RoutableTTL = 0
	w, c := trackedWorld(t, 1<<14)
	for _, ip := range []netip.Addr{podA, podB} {
		c.ix.Hold(ip)
	}
	s := newSvcMaps(t, w.maps.Root)
	s.add(t, netip.MustParseAddrPort("192.0.2.100:30080"), svcFlagRoutable|1<<1 /* NODEPORT */, podA)
	// The DSR-internal OUT entry of a client the recorder never saw, for
	// podB, which is no routable backend here.
	dsrKey := ctmap.NewKey4(remote4, podB, 50002, 8080, ctmap.ProtoTCP, ctmap.FlagOut)
	w.addFlow(flow{key4: &dsrKey}, false)

	writeNodeConfig(t, c, "ENABLE_NODEPORT") // NodePort, SNAT mode
	if r := c.features.Reason(podB); r != "" {
		t.Fatalf("SNAT mode: podB reason %q, want none", r)
	}
	writeNodeConfig(t, c, "ENABLE_NODEPORT", "ENABLE_DSR")
	c.features.MarkUncovered(c.ix)
	if st := c.ix.State(podA); st.Incomplete != ReasonNodePortBackend {
		t.Fatalf("routable backend: %+v, want incomplete (%s)", st, ReasonNodePortBackend)
	}
	for _, ip := range []netip.Addr{podB, podC, podA6} {
		if st := c.ix.State(ip); st.Incomplete != ReasonDSR {
			t.Errorf("%s: %+v, want incomplete (%s)", ip, st, ReasonDSR)
		}
	}
	if m, why := scrubOne(t, c, podB, false); m != scrub.MethodSweep || why != ReasonDSR {
		t.Fatalf("podB's scrub: method %s, incomplete %q; want a sweep and %q", m, why, ReasonDSR)
	}
	w.verify(podB) // the DSR entry among them
	on := map[string]bool{}
	for _, u := range c.UncoveredFeatures() {
		on[u.Label] = u.On
	}
	if !on["nodeport_dsr"] || !on["nodeport_backends"] || on["host_firewall"] {
		t.Fatalf("UncoveredFeatures: %v", on)
	}
	if n := c.features.Marks("nodeport_dsr"); n == 0 {
		t.Errorf("no nodeport_dsr mark counted")
	}
}
