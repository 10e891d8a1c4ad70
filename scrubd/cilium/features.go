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
// directory's mtime on every pin and unpin), one cilium_lxc lookup and a walk
// of that one endpoint's policy map (its entries, typically tens to
// hundreds; stops at the first proxy port). Nothing here is proportional to
// the CT maps.
type Features struct {
	root string

	mu    sync.Mutex
	stamp time.Time // mtime of root when node was computed; zero: never
	node  string    // node-wide reason at stamp

	marks [len(FeatureReasons)]atomic.Uint64 // IPs a scrub marked, per reason
}

// FeatureReasons are the reasons Features reports, with their metric labels.
var FeatureReasons = [...]struct{ Reason, Label string }{
	{ReasonL7Proxy, "l7_proxy"},
	{ReasonLocalCT, "endpoint_ct_maps"},
	{ReasonPerClusterCT, "per_cluster_ct_maps"},
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
// yet) reports "".
func (f *Features) ProxyReason(ip netip.Addr) string {
	id, ok := f.endpointID(ip)
	if !ok {
		return ""
	}
	for _, p := range policyMapPrefixes {
		m, err := ebpf.LoadPinnedMap(filepath.Join(f.root, fmt.Sprintf("%s%05d", p, id)), &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			continue
		}
		redirect := hasProxyPort(m)
		m.Close()
		if redirect {
			return ReasonL7Proxy
		}
		return ""
	}
	return ""
}

// endpointID looks ip up in cilium_lxc (struct endpoint_key: 16 bytes of
// address, family 1 = IPv4 / 2 = IPv6, key 0, cluster_id 0) and returns the
// endpoint's lxc_id (struct endpoint_info, bytes 6-7).
func (f *Features) endpointID(ip netip.Addr) (uint16, bool) {
	// Opened per call (one open, one lookup): a map the agent re-created
	// under a cached descriptor would answer from the old copy.
	m, err := ebpf.LoadPinnedMap(filepath.Join(f.root, lxcMapName), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return 0, false
	}
	defer m.Close()
	if m.KeySize() != 20 || m.ValueSize() < 8 {
		return 0, false
	}
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
	val := make([]byte, m.ValueSize())
	if err := m.Lookup(key[:], val); err != nil {
		return 0, false
	}
	return binary.NativeEndian.Uint16(val[6:8]), true
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
