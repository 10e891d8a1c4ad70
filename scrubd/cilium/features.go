package cilium

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cilium/ebpf"
)

// Reasons an IP's index cannot prove completeness because a Cilium feature
// puts CT entries of the IP where the recorder or the four global CT maps do
// not reach. Scrub marks the IP incomplete with one of them (its scrub then
// sweeps) while the feature is detected.
const (
	// ReasonL7Proxy: the endpoint's policy map has an entry with a proxy
	// port. Cilium redirects those flows to the L7 proxy (Envoy), whose
	// connections to and from the pod (transparent mode: the pod's address,
	// the proxy's ports) create CT entries the pod's recorder never sees.
	// DNS rules redirect to the DNS proxy the same way (a proxy port in the
	// policy map), and its upstream queries are such connections too.
	ReasonL7Proxy = "Cilium redirects the endpoint's traffic to the L7 proxy (proxy port in its policy map)"
	// ReasonLocalCT: per-endpoint CT maps (cilium_ct4_<endpoint ID> etc.,
	// the ConntrackLocal endpoint option of Cilium 1.16 and 1.17) hold the
	// entries of those endpoints, outside the global maps ctscrub scrubs.
	ReasonLocalCT = "Cilium per-endpoint CT maps in use (cilium_ct*_<endpoint ID>): entries outside the global CT maps"
	// ReasonPerClusterCT: per-cluster CT maps (cluster-aware addressing,
	// cilium_per_cluster_ct_*_<cluster ID>) hold the entries of flows with
	// endpoints of other clusters, outside the global maps.
	ReasonPerClusterCT = "Cilium per-cluster CT maps in use (cluster-aware addressing): entries outside the global CT maps"
)

// Cilium's pinned map names (pkg/maps/ctmap, lxcmap, policymap of 1.16-1.20).
const (
	lxcMapName = "cilium_lxc"
	// perClusterCTPrefix names the per-cluster CT maps: the outer
	// array-of-maps cilium_per_cluster_ct_{tcp,any}{4,6} and, pinned beside
	// it by the agent, one inner map per remote cluster with the cluster ID
	// appended (ctmap.ClusterInnerMapName).
	perClusterCTPrefix = "cilium_per_cluster_ct_"
)

// localCTPrefixes name the per-endpoint CT maps: the prefix, then the
// endpoint ID in five digits (bpf.LocalMapName).
var localCTPrefixes = []string{"cilium_ct4_", "cilium_ct6_", "cilium_ct_any4_", "cilium_ct_any6_"}

// policyMapPrefixes name an endpoint's policy map, newest layout first: 1.20
// cilium_policy_v3_, 1.17-1.19 cilium_policy_v2_, 1.16 cilium_policy_; then
// the endpoint ID in five digits. proxy_port (be16) is the first field of
// the value in every layout.
var policyMapPrefixes = []string{"cilium_policy_v3_", "cilium_policy_v2_", "cilium_policy_"}

// Features detects, under Cilium's map directory, the features of
// ReasonL7Proxy, ReasonLocalCT and ReasonPerClusterCT.
//
// Cost per call of Reason: one stat of the directory (the node-wide scan of
// its names is redone only when the directory changed: bpffs updates a
// directory's mtime on every pin and unpin), a stat and one lookup in
// cilium_lxc, a stat of the endpoint's policy map and, at most once per
// PolicyTTL per endpoint, a walk of that policy map (its entries, typically
// tens to hundreds; stops at the first proxy port). Nothing here is
// proportional to the CT maps.
type Features struct {
	root string

	mu    sync.Mutex
	stamp time.Time // mtime of root when node was computed; zero: never
	node  string    // node-wide reason at stamp

	lxc    *ebpf.Map // cilium_lxc, while its pin keeps lxcIno
	lxcIno uint64
	policy map[uint16]policyAnswer // per endpoint ID

	cfgPath  string     // node_config.h (SetNodeConfig; "" : DefaultNodeConfig)
	cfgStamp time.Time  // its mtime when cfg was read; zero: read again
	cfgSize  int64      // its size then
	cfg      NodeConfig // last read

	rtSet map[netip.Addr]bool // routable services' backends (RoutableBackends)
	rtErr error               // why rtSet could not be read
	rtAt  time.Time           // when rtSet was computed

	proxySeen bool // the last MarkUncovered pass found an endpoint with a proxy port

	marks [len(FeatureReasons)]atomic.Uint64 // IPs a scrub marked, per reason
}

// FeatureReasons are the reasons Features reports, with their metric labels.
var FeatureReasons = [...]struct{ Reason, Label string }{
	{ReasonL7Proxy, "l7_proxy"},
	{ReasonLocalCT, "endpoint_ct_maps"},
	{ReasonPerClusterCT, "per_cluster_ct_maps"},
	{ReasonHostFirewall, "host_firewall"},
	{ReasonNodePortBackend, "nodeport_backends"},
	{ReasonDSR, "nodeport_dsr"},
}

// Marks returns how many times a scrub marked an IP incomplete for the
// reason with metric label label (FeatureReasons).
func (f *Features) Marks(label string) uint64 {
	for i, r := range FeatureReasons {
		if r.Label == label {
			return f.marks[i].Load()
		}
	}
	return 0
}

func (f *Features) counted(reason string) {
	for i, r := range FeatureReasons {
		if r.Reason == reason {
			f.marks[i].Add(1)
		}
	}
}

// NewFeatures watches Cilium's maps under root (ctmap.DefaultRoot in
// production).
func NewFeatures(root string) *Features { return &Features{root: root} }

// Reason returns why ip's index cannot be trusted under Cilium's current
// configuration, or "" when no such feature is on for it.
func (f *Features) Reason(ip netip.Addr) string {
	if r := f.NodeReason(); r != "" {
		return r
	}
	if r := f.nodeReasonFor(ip, f.NodeConfig()); r != "" {
		return r
	}
	return f.ProxyReason(ip)
}

// racyWindow: a directory changed less than this before the scan may change
// again within the same mtime tick (bpffs uses the coarse clock), so such a
// scan is not cached.
const racyWindow = time.Second

// NodeReason reports the node-wide features (per-endpoint or per-cluster CT
// maps pinned under root), rescanning root's names only when root changed.
func (f *Features) NodeReason() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	st, err := os.Stat(f.root)
	if err != nil {
		return ""
	}
	mt := st.ModTime()
	if !f.stamp.IsZero() && mt.Equal(f.stamp) {
		return f.node
	}
	now := time.Now()
	d, err := os.Open(f.root)
	if err != nil {
		return ""
	}
	names, err := d.Readdirnames(-1)
	d.Close()
	if err != nil {
		return ""
	}
	f.node = nodeReason(names)
	if now.Sub(mt) > racyWindow {
		f.stamp = mt
	} else {
		f.stamp = time.Time{}
	}
	return f.node
}

func nodeReason(names []string) string {
	local, cluster := false, false
	for _, n := range names {
		if rest, ok := strings.CutPrefix(n, perClusterCTPrefix); ok {
			// Inner maps only: the agent may create the outer maps
			// without any remote cluster.
			for _, t := range []string{"tcp4_", "tcp6_", "any4_", "any6_"} {
				if id, ok := strings.CutPrefix(rest, t); ok && digits(id, 0) {
					cluster = true
				}
			}
			continue
		}
		for _, p := range localCTPrefixes {
			if id, ok := strings.CutPrefix(n, p); ok && digits(id, 5) {
				local = true
			}
		}
	}
	switch {
	case cluster:
		return ReasonPerClusterCT
	case local:
		return ReasonLocalCT
	}
	return ""
}

// digits reports whether s is a decimal number (of exactly n digits when n >
// 0).
func digits(s string, n int) bool {
	if s == "" || (n > 0 && len(s) != n) {
		return false
	}
	for _, c := range s {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// ProxyReason reports ReasonL7Proxy when ip is a local endpoint (cilium_lxc)
// whose policy map has an entry with a non-zero proxy port. A missing
// cilium_lxc or policy map (not a Cilium node, endpoint not regenerated
// yet) reports "". An endpoint's answer is reused for PolicyTTL while its
// policy map's pin stays the same (walking an LPM trie costs a kernel
// traversal per entry).
func (f *Features) ProxyReason(ip netip.Addr) string {
	id, ok := f.endpointID(ip)
	if !ok {
		return ""
	}
	for _, p := range policyMapPrefixes {
		path := filepath.Join(f.root, fmt.Sprintf("%s%05d", p, id))
		ino, ok := inode(path)
		if !ok {
			continue
		}
		now := time.Now()
		f.mu.Lock()
		c, hit := f.policy[id]
		f.mu.Unlock()
		if hit && c.ino == ino && now.Sub(c.at) < PolicyTTL {
			return c.reason
		}
		m, err := ebpf.LoadPinnedMap(path, &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			continue
		}
		reason := ""
		if hasProxyPort(m) {
			reason = ReasonL7Proxy
		}
		m.Close()
		f.mu.Lock()
		if f.policy == nil || len(f.policy) > 1<<16 {
			f.policy = map[uint16]policyAnswer{}
		}
		f.policy[id] = policyAnswer{ino: ino, at: now, reason: reason}
		f.mu.Unlock()
		return reason
	}
	return ""
}

// PolicyTTL bounds how long an endpoint's L7 answer is reused: an L7 rule
// added to an endpoint is seen by its scrubs at most this late.
var PolicyTTL = time.Second

type policyAnswer struct {
	ino    uint64
	at     time.Time
	reason string
}

// inode returns the inode of a pin (a re-pinned map gets a new one).
func inode(path string) (uint64, bool) {
	fi, err := os.Stat(path)
	if err != nil {
		return 0, false
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return 0, false
	}
	return st.Ino, true
}

// endpointID looks ip up in cilium_lxc (struct endpoint_key: 16 bytes of
// address, family 1 = IPv4 / 2 = IPv6, key 0, cluster_id 0) and returns the
// endpoint's lxc_id (struct endpoint_info, bytes 6-7). The map stays open
// while its pin keeps its inode; a re-created cilium_lxc is opened again.
func (f *Features) endpointID(ip netip.Addr) (uint16, bool) {
	path := filepath.Join(f.root, lxcMapName)
	ino, ok := inode(path)
	if !ok {
		return 0, false
	}
	f.mu.Lock()
	if f.lxc == nil || f.lxcIno != ino {
		if f.lxc != nil {
			f.lxc.Close()
			f.lxc = nil
		}
		m, err := ebpf.LoadPinnedMap(path, &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil || m.KeySize() != 20 || m.ValueSize() < 8 {
			if m != nil {
				m.Close()
			}
			f.mu.Unlock()
			return 0, false
		}
		f.lxc, f.lxcIno = m, ino
	}
	m := f.lxc
	f.mu.Unlock()
	key := lxcKey(ip)
	val := make([]byte, m.ValueSize())
	if err := m.Lookup(key[:], val); err != nil {
		return 0, false
	}
	return binary.NativeEndian.Uint16(val[6:8]), true
}

// Close releases the cilium_lxc descriptor Features holds.
func (f *Features) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.lxc != nil {
		err := f.lxc.Close()
		f.lxc = nil
		return err
	}
	return nil
}

// hasProxyPort walks a policy map and reports whether an entry has a
// proxy port (the value's first two bytes), stopping at the first.
func hasProxyPort(m *ebpf.Map) bool {
	if m.ValueSize() < 2 {
		return false
	}
	key := make([]byte, m.KeySize())
	val := make([]byte, m.ValueSize())
	it := m.Iterate()
	for it.Next(key, val) {
		if val[0] != 0 || val[1] != 0 {
			return true
		}
	}
	return false
}

// lxcKey is cilium_lxc's key for ip (struct endpoint_key): the address in
// 16 bytes, then its family (1 IPv4, 2 IPv6), then padding and cluster ID.
func lxcKey(ip netip.Addr) [20]byte {
	var key [20]byte
	if ip.Is4() {
		a := ip.As4()
		copy(key[:], a[:])
		key[16] = 1
	} else {
		a := ip.As16()
		copy(key[:], a[:])
		key[16] = 2
	}
	return key
}
