package cilium

import (
	"context"
	"encoding/binary"
	"fmt"
	"net/netip"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// The maps below are created with Cilium's exact map specs (type, key and
// value sizes, flags, pinned names) of pkg/maps/lxcmap, policymap and ctmap
// (1.16-1.20); the conformance suite (e2e/conformance, case
// l7-proxy-redirect) runs the L7 detection on the maps Cilium's own bpf_lxc
// creates.

// scrubOne scrubs ip (a dry run when dry) and returns its method and the
// index state afterwards.
func scrubOne(t *testing.T, c *Backend, ip netip.Addr, dry bool) (scrub.Method, string) {
	t.Helper()
	res, err := c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{ip}, Reason: scrub.ReasonDel, DryRun: dry})
	if err != nil || res.Outcome != scrub.Complete {
		t.Fatalf("scrub %s: %+v, %v", ip, res, err)
	}
	return res.PerIP[ip.String()], c.ix.State(ip).Incomplete
}

// lxcMap creates cilium_lxc (struct endpoint_key -> struct endpoint_info)
// under dir with ip as endpoint id.
func lxcMap(t *testing.T, dir string, ip netip.Addr, id uint16) {
	t.Helper()
	m, err := ebpf.NewMap(&ebpf.MapSpec{Name: "cilium_lxc", Type: ebpf.Hash, KeySize: 20, ValueSize: 48, MaxEntries: 65535, Flags: 1 /* BPF_F_NO_PREALLOC */})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.Pin(filepath.Join(dir, "cilium_lxc")); err != nil {
		t.Fatal(err)
	}
	key := lxcKey(ip)
	var val [48]byte
	binary.NativeEndian.PutUint32(val[0:], 7) // ifindex
	binary.NativeEndian.PutUint16(val[6:], id)
	if err := m.Put(key[:], val[:]); err != nil {
		t.Fatal(err)
	}
}

// policyEntry is struct policy_key (LPM trie) with its value: proxy_port
// (be16) first in every layout.
func policyPut(t *testing.T, m *ebpf.Map, egress bool, identity uint32, proto uint8, dport, proxyPort uint16) {
	t.Helper()
	key := make([]byte, 12)
	prefix := uint32(64) // POLICY_FULL_PREFIX
	if proto == 0 {
		prefix -= 24
	}
	binary.NativeEndian.PutUint32(key[0:], prefix)
	binary.NativeEndian.PutUint32(key[4:], identity)
	if egress {
		key[8] = 1
	}
	key[9] = proto
	binary.BigEndian.PutUint16(key[10:], dport)
	val := make([]byte, m.ValueSize())
	binary.BigEndian.PutUint16(val[0:], proxyPort)
	val[2] = 24 << 3 // lpm_prefix_length
	if err := m.Put(key, val); err != nil {
		t.Fatal(err)
	}
}

func TestScrubMarksL7ProxyEndpoint(t *testing.T) {
	for _, layout := range []struct {
		cilium, prefix string
		valueSize      uint32
	}{
		{"1.16", "cilium_policy_", 24},
		{"1.17", "cilium_policy_v2_", 24},
		{"1.18", "cilium_policy_v2_", 8},
		{"1.19", "cilium_policy_v2_", 12},
		{"1.20", "cilium_policy_v3_", 12},
	} {
		t.Run(layout.cilium, func(t *testing.T) {
			// The policy answer is reused for PolicyTTL; this test changes
			// the policy between scrubs.
			defer func(d time.Duration) { PolicyTTL = d }(PolicyTTL)
			PolicyTTL = 0
			w, c := trackedWorld(t, 1<<14)
			dir := w.maps.Root
			const id = 1234
			lxcMap(t, dir, podA, id)
			pm, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.LPMTrie, KeySize: 12, ValueSize: layout.valueSize, MaxEntries: 16384, Flags: 1})
			if err != nil {
				t.Fatal(err)
			}
			defer pm.Close()
			if err := pm.Pin(filepath.Join(dir, fmt.Sprintf("%s%05d", layout.prefix, id))); err != nil {
				t.Fatal(err)
			}
			// Allow-all, no proxy: the index path stays.
			policyPut(t, pm, false, 0, 0, 0, 0)
			policyPut(t, pm, true, 0, 0, 0, 0)
			if m, why := scrubOne(t, c, podA, true); m != scrub.MethodIndex || why != "" {
				t.Fatalf("no L7 policy: method %s, incomplete %q; want the index path", m, why)
			}
			// An L7 rule: ingress TCP/80 from identity 2 to the proxy on 15001.
			policyPut(t, pm, false, 2, 6, 80, 15001)
			if m, why := scrubOne(t, c, podA, false); m != scrub.MethodSweep || why != ReasonL7Proxy {
				t.Fatalf("L7 policy: method %s, incomplete %q; want a sweep and %q", m, why, ReasonL7Proxy)
			}
			w.verify(podA)
			// Other endpoints (not in cilium_lxc here) keep the index path.
			if m, why := scrubOne(t, c, podB, true); m != scrub.MethodIndex || why != "" {
				t.Fatalf("other endpoint: method %s, incomplete %q", m, why)
			}
		})
	}
}

// pinLocalCTMap pins under root endpoint 42's own CT map, as Cilium 1.16
// creates it for ConntrackLocal (mapTypeIPv4TCPLocal: the global layout,
// 64000 entries).
func pinLocalCTMap(t *testing.T, root string) {
	t.Helper()
	spec := ctmap.TCP4.Spec(64000)
	spec.Name = "cilium_ct4_00042"
	m, err := ebpf.NewMap(spec)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.Pin(filepath.Join(root, "cilium_ct4_00042")); err != nil {
		t.Fatal(err)
	}
}

func TestScrubMarksLocalCTMaps(t *testing.T) {
	w, c := trackedWorld(t, 1<<14)
	if m, why := scrubOne(t, c, podA, true); m != scrub.MethodIndex || why != "" {
		t.Fatalf("global maps only: method %s, incomplete %q", m, why)
	}
	pinLocalCTMap(t, w.maps.Root)
	if m, why := scrubOne(t, c, podA, false); m != scrub.MethodSweep || why != ReasonLocalCT {
		t.Fatalf("per-endpoint CT map pinned: method %s, incomplete %q; want a sweep and %q", m, why, ReasonLocalCT)
	}
	w.verify(podA)
}

func TestScrubMarksPerClusterCTMaps(t *testing.T) {
	w, c := trackedWorld(t, 1<<14)
	inner := ctmap.TCP4.Spec(1 << 10)
	inner.Name = ""
	outer, err := ebpf.NewMap(&ebpf.MapSpec{Name: "cilium_per_cluster_ct_tcp4", Type: ebpf.ArrayOfMaps, KeySize: 4, ValueSize: 4, MaxEntries: 256, InnerMap: inner})
	if err != nil {
		t.Fatal(err)
	}
	defer outer.Close()
	if err := outer.Pin(filepath.Join(w.maps.Root, "cilium_per_cluster_ct_tcp4")); err != nil {
		t.Fatal(err)
	}
	// The outer map alone (no remote cluster): nothing outside the globals.
	if m, why := scrubOne(t, c, podA, true); m != scrub.MethodIndex || why != "" {
		t.Fatalf("outer map only: method %s, incomplete %q", m, why)
	}
	// Cluster 7's inner map, pinned by name and put in slot 7 as the agent
	// does (ctmap.perClusterCTMaps.CreateClusterCTMaps).
	im, err := ebpf.NewMap(inner)
	if err != nil {
		t.Fatal(err)
	}
	defer im.Close()
	if err := im.Pin(filepath.Join(w.maps.Root, "cilium_per_cluster_ct_tcp4_7")); err != nil {
		t.Fatal(err)
	}
	if err := outer.Put(uint32(7), im); err != nil {
		t.Fatal(err)
	}
	for _, ip := range []netip.Addr{podA, podA6} {
		if m, why := scrubOne(t, c, ip, false); m != scrub.MethodSweep || why != ReasonPerClusterCT {
			t.Fatalf("%s, per-cluster CT map of cluster 7: method %s, incomplete %q; want a sweep and %q", ip, m, why, ReasonPerClusterCT)
		}
	}
	w.verify(podA, podA6)
}

func TestNodeReasonNames(t *testing.T) {
	for _, c := range []struct {
		names []string
		want  string
	}{
		{[]string{"cilium_ct4_global", "cilium_ct_any6_global", "cilium_policy_v2_00042", "cilium_calls_00042"}, ""},
		{[]string{"cilium_ct4_global", "cilium_ct_any4_00042"}, ReasonLocalCT},
		{[]string{"cilium_ct6_12345"}, ReasonLocalCT},
		{[]string{"cilium_ct4_1234"}, ""}, // not five digits
		{[]string{"cilium_per_cluster_ct_tcp4", "cilium_per_cluster_ct_any6"}, ""},
		{[]string{"cilium_per_cluster_ct_any6_255"}, ReasonPerClusterCT},
		{[]string{"cilium_per_cluster_ct_tcp4_x"}, ""},
	} {
		if got := nodeReason(c.names); got != c.want {
			t.Errorf("nodeReason(%v) = %q, want %q", c.names, got, c.want)
		}
	}
}

// The node-wide scan is cached by the directory's mtime: a pin made after a
// cached scan must still be seen (bpffs updates the directory's mtime on
// every pin and unpin).
func TestNodeReasonRescansOnPin(t *testing.T) {
	needRoot(t)
	maps := pinnedMaps(t, 1<<10, false)
	f := NewFeatures(maps.Root)
	time.Sleep(racyWindow + 100*time.Millisecond) // past the racy window: the next scan is cached
	if r := f.NodeReason(); r != "" {
		t.Fatalf("global maps only: %q", r)
	}
	if f.stamp.IsZero() {
		t.Fatal("scan of a directory unchanged for over a second was not cached")
	}
	spec := ctmap.Any4.Spec(1 << 10)
	spec.Name = "cilium_ct_any4_00007"
	m, err := ebpf.NewMap(spec)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.Pin(filepath.Join(maps.Root, "cilium_ct_any4_00007")); err != nil {
		t.Fatal(err)
	}
	if r := f.NodeReason(); r != ReasonLocalCT {
		t.Fatalf("after pinning a per-endpoint CT map: %q, want %q", r, ReasonLocalCT)
	}
	if err := m.Unpin(); err != nil {
		t.Fatal(err)
	}
	if r := f.NodeReason(); r != "" {
		t.Fatalf("after unpinning it: %q", r)
	}
}

// BenchmarkFeaturesReason: the per-IP cost a scrub pays for the detection
// on a Cilium node: the directory stat (cached scan of 400 pins), the
// cilium_lxc lookup, the policy map's answer (cached for PolicyTTL), and
// the walk of a 100-entry policy map without a proxy port (the worst case:
// no early stop) once per PolicyTTL per endpoint.
func BenchmarkFeaturesReason(b *testing.B) {
	needRoot(b)
	maps := pinnedMaps(b, 1<<10, false)
	dir := maps.Root
	for i := range 400 {
		m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1})
		if err != nil {
			b.Fatal(err)
		}
		if err := m.Pin(filepath.Join(dir, fmt.Sprintf("cilium_calls_%05d", i))); err != nil {
			b.Fatal(err)
		}
		m.Close()
	}
	const id = 77
	ip := netip.MustParseAddr("10.244.0.77")
	lxc, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 20, ValueSize: 48, MaxEntries: 65535, Flags: 1})
	if err != nil {
		b.Fatal(err)
	}
	defer lxc.Close()
	key := lxcKey(ip)
	var val [48]byte
	binary.NativeEndian.PutUint16(val[6:], id)
	if err := lxc.Put(key[:], val[:]); err != nil {
		b.Fatal(err)
	}
	if err := lxc.Pin(filepath.Join(dir, "cilium_lxc")); err != nil {
		b.Fatal(err)
	}
	pm, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.LPMTrie, KeySize: 12, ValueSize: 12, MaxEntries: 16384, Flags: 1})
	if err != nil {
		b.Fatal(err)
	}
	defer pm.Close()
	for i := range 100 {
		k := make([]byte, 12)
		binary.NativeEndian.PutUint32(k[0:], 64)
		binary.NativeEndian.PutUint32(k[4:], uint32(1000+i))
		k[9] = 6
		binary.BigEndian.PutUint16(k[10:], 80)
		if err := pm.Put(k, make([]byte, 12)); err != nil {
			b.Fatal(err)
		}
	}
	if err := pm.Pin(filepath.Join(dir, fmt.Sprintf("cilium_policy_v3_%05d", id))); err != nil {
		b.Fatal(err)
	}
	f := NewFeatures(dir)
	time.Sleep(racyWindow + 100*time.Millisecond)
	if r := f.Reason(ip); r != "" {
		b.Fatalf("reason %q", r)
	}
	b.Run("node", func(b *testing.B) {
		for range b.N {
			f.NodeReason()
		}
	})
	b.Run("lxc", func(b *testing.B) {
		for range b.N {
			f.endpointID(ip)
		}
	})
	b.Run("all", func(b *testing.B) {
		for range b.N {
			f.Reason(ip)
		}
	})
	b.Run("all-policy-walk", func(b *testing.B) {
		defer func(d time.Duration) { PolicyTTL = d }(PolicyTTL)
		PolicyTTL = 0
		for range b.N {
			f.Reason(ip)
		}
	})
}

// A dry run changes nothing: a feature that makes a real scrub of the IP
// sweep makes the dry run report the sweep, but it neither marks the IP
// incomplete (its next real scrub would sweep for a dry run's sake, and the
// IP would count in ctscrub_index_incomplete_ips) nor counts a feature mark.
func TestDryRunMarksNothing(t *testing.T) {
	w, c := trackedWorld(t, 1<<14)
	pinLocalCTMap(t, w.maps.Root)
	want := w.expected(podA)
	res, err := c.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{podA}, Reason: scrub.ReasonDel, DryRun: true})
	if err != nil || res.Outcome != scrub.Complete || res.PerIP[podA.String()] != scrub.MethodSweep {
		t.Fatalf("dry run with a per-endpoint CT map: %+v, %v; want a complete sweep", res, err)
	}
	checkDeleted(t, res, want)
	if st := c.ix.State(podA); !st.Complete || st.Incomplete != "" {
		t.Errorf("the dry run changed the index: %+v", st)
	}
	for _, r := range FeatureReasons {
		if n := c.Features().Marks(r.Label); n != 0 {
			t.Errorf("the dry run counted %d %s marks", n, r.Label)
		}
	}
	w.verify() // nothing deleted
}
