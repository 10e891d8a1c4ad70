package cilium

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// Node-wide features of Cilium's datapath whose CT entries hold a pod IP the
// pod's recorder does not see (docs/recorder.md, "What the recorder cannot
// see", and "Features the recorder does not cover"). Read from the agent's
// node_config.h, which every Cilium 1.16 to 1.20 writes with these defines
// (pkg/datapath/linux/config/config.go, WriteNodeConfig's cDefinesMap).
const (
	// ReasonHostFirewall: with the host firewall bpf_host tracks the node's
	// own flows (lib/host_firewall.h: ct_create4/6 on the global maps in
	// the host's egress and ingress policy). A node-to-pod flow gets an OUT
	// entry there before the packet reaches the pod; the pod's recorder
	// records the IN twin (index.Covered deletes the OUT one) only when the
	// packet arrives, not when the pod's policy drops it or the pod is gone
	// (kubelet's probes to a dying pod). Every pod IP is within the host's
	// reach, so every IP is marked while it is on.
	ReasonHostFirewall = "Cilium host firewall on (ENABLE_HOST_FIREWALL): bpf_host tracks node-to-pod flows before delivery; entries of packets the pod never received are outside the index"
	// ReasonNodePortBackend: the IP is a backend of a service bpf_host
	// load-balances from outside the node (NodePort, LoadBalancer,
	// externalIPs, hostPort: SVC_FLAG_ROUTABLE) while NodePort is on
	// (ENABLE_NODEPORT: kube-proxy replacement or BPF masquerade).
	// nodeport_svc_lb4/6 (lib/nodeport.h) creates the flow's OUT entry
	// with the backend's address before its backend_local check and before
	// delivery (and nodeport_dsr_ingress_ipv4/6 on a DSR backend's node):
	// the recorder sees the same packet only when it reaches the pod, not
	// when the pod's policy drops it or the pod is gone or terminating.
	ReasonNodePortBackend = "backend of a NodePort/LoadBalancer/externalIP/hostPort service with Cilium's NodePort on: bpf_host creates its entry before delivery; entries of packets the pod never received are outside the index"
	// ReasonDSR: NodePort DSR is on (ENABLE_DSR). nodeport_lb4/6 hands any
	// packet that carries DSR information (IP option / IPv6 extension
	// header in bpf_host, Geneve option in bpf_overlay) to
	// nodeport_dsr_ingress_ipv4/6, which creates the DSR-internal OUT entry
	// {client, destination} for whatever address the packet is sent to,
	// without looking at this node's services or endpoints (1.16.5-1.20.2
	// lib/nodeport.h). A load balancer's node that still sends new clients
	// to a backend this node already unlisted, and whose pod is gone or
	// drops the packet, leaves such an entry for an IP that is no routable
	// backend here: every IP is within reach (conformance
	// nodeport-dsr-backend-unlisted-then-deleted: the released IP kept a
	// complete slot with that entry in Cilium's map).
	ReasonDSR = "Cilium NodePort DSR on (ENABLE_DSR): bpf_host (bpf_overlay with Geneve) creates an entry for any local address a packet's DSR information names, before delivery and whatever this node's services say; entries of packets the pod never received are outside the index"
)

// NodeConfig is what scrubd reads from Cilium's node_config.h.
type NodeConfig struct {
	Read         bool // the file was read: the other fields are known
	HostFirewall bool // ENABLE_HOST_FIREWALL
	NodePort     bool // ENABLE_NODEPORT
	DSR          bool // ENABLE_DSR
	L7LB         bool // ENABLE_L7_LB (--enable-envoy-config)
}

// ParseNodeConfig reads the defines of NodeConfig from a node_config.h.
func ParseNodeConfig(b []byte) NodeConfig {
	c := NodeConfig{Read: true}
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 2 || f[0] != "#define" {
			continue
		}
		on := len(f) < 3 || f[2] != "0"
		switch f[1] {
		case "ENABLE_HOST_FIREWALL":
			c.HostFirewall = on
		case "ENABLE_NODEPORT":
			c.NodePort = on
		case "ENABLE_DSR":
			c.DSR = on
		case "ENABLE_L7_LB":
			c.L7LB = on
		}
	}
	return c
}

// DefaultNodeConfig is where the agent writes node_config.h
// (option.Config.GetNodeConfigPath, 1.16 to 1.20).
const DefaultNodeConfig = "/var/run/cilium/state/globals/node_config.h"

// SetNodeConfig sets the node_config.h Features reads ("" : the default).
func (f *Features) SetNodeConfig(path string) {
	if path == "" {
		path = DefaultNodeConfig
	}
	f.mu.Lock()
	f.cfgPath, f.cfgStamp = path, time.Time{}
	f.mu.Unlock()
}

// NodeConfig returns the node's Cilium configuration, re-read when the
// file changed. A file that cannot be read reports Read false (no Cilium
// agent wrote it: nothing is marked for these features; the features
// scrubd can see in the maps still are).
func (f *Features) NodeConfig() NodeConfig {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.cfgPath == "" {
		f.cfgPath = DefaultNodeConfig
	}
	st, err := os.Stat(f.cfgPath)
	if err != nil {
		f.cfg, f.cfgStamp = NodeConfig{}, time.Time{}
		return f.cfg
	}
	if !f.cfgStamp.IsZero() && st.ModTime().Equal(f.cfgStamp) && st.Size() == f.cfgSize {
		return f.cfg
	}
	b, err := os.ReadFile(f.cfgPath)
	if err != nil {
		f.cfg, f.cfgStamp = NodeConfig{}, time.Time{}
		return f.cfg
	}
	f.cfg = ParseNodeConfig(b)
	f.cfgSize = st.Size()
	if time.Since(st.ModTime()) > racyWindow {
		f.cfgStamp = st.ModTime()
	} else {
		f.cfgStamp = time.Time{}
	}
	return f.cfg
}

// Cilium's service map names and layout (1.16 to 1.20, as the recorder
// reads them: scrubd/recorder, bpf/include/ctscrub_flow.h).
const (
	serviceMap4 = "cilium_lb4_services_v2"
	serviceMap6 = "cilium_lb6_services_v2"
	// svcFlagRoutable: lb4_service.flags bit 6, "not a surrogate/ClusterIP
	// entry" (bpf/lib/common.h 1.16.5, 1.18.8; bpf/lib/lb.h 1.20.2): what
	// nodeport_svc_lb4/6 requires (lb4_svc_is_routable).
	svcFlagRoutable = 1 << 6
)

// RoutableTTL bounds how long a computed set of routable backends is
// reused by scrubs between two coverage passes.
var RoutableTTL = time.Second

// RoutableBackends returns the addresses of every backend of a routable
// service (NodePort, LoadBalancer, externalIPs, hostPort) in Cilium's
// service and backend maps. Missing maps give an empty set; a map of an
// unknown layout or a read error is an error (the caller fails closed).
// Cost: one walk of the service maps (a frontend per service and port plus
// a slot per backend) and a backend lookup per routable backend slot.
func RoutableBackends(root string) (map[netip.Addr]bool, error) {
	out := map[netip.Addr]bool{}
	bes, err := ctmap.OpenBackends(root)
	if err != nil {
		return nil, err
	}
	defer bes.Close()
	for i, name := range []string{serviceMap4, serviceMap6} {
		v6 := i == 1
		m, err := ebpf.LoadPinnedMap(filepath.Join(root, name), &ebpf.LoadPinOptions{ReadOnly: true})
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("open %s: %w", name, err)
		}
		alen := 4
		if v6 {
			alen = 16
		}
		if int(m.KeySize()) != alen+8 || m.ValueSize() != 12 {
			m.Close()
			return nil, fmt.Errorf("%s: key %d value %d bytes, expected %d and 12", name, m.KeySize(), m.ValueSize(), alen+8)
		}
		routable := map[string]bool{} // frontend key with slot 0
		type slot struct {
			front string
			id    uint32
		}
		var slots []slot
		key := make([]byte, m.KeySize())
		val := make([]byte, 12)
		it := m.Iterate()
		for it.Next(key, val) {
			s := binary.NativeEndian.Uint16(key[alen+2:])
			front := make([]byte, len(key))
			copy(front, key)
			front[alen+2], front[alen+3] = 0, 0
			if s == 0 {
				if val[8]&svcFlagRoutable != 0 {
					routable[string(front)] = true
				}
				continue
			}
			slots = append(slots, slot{string(front), binary.NativeEndian.Uint32(val[0:4])})
		}
		err = it.Err()
		m.Close()
		if err != nil {
			return nil, fmt.Errorf("walk %s: %w", name, err)
		}
		for _, s := range slots {
			if !routable[s.front] || s.id == 0 {
				continue
			}
			be, ok, err := bes.Lookup(v6, s.id)
			if err != nil {
				return nil, err
			}
			if ok {
				out[be.Addr.Unmap()] = true
			}
		}
	}
	return out, nil
}

// routable returns the routable backends, recomputed when older than
// RoutableTTL; nil with an error when they cannot be read.
func (f *Features) routable() (map[netip.Addr]bool, error) {
	f.mu.Lock()
	if !f.rtAt.IsZero() && time.Since(f.rtAt) < RoutableTTL {
		set, err := f.rtSet, f.rtErr
		f.mu.Unlock()
		return set, err
	}
	f.mu.Unlock()
	set, err := RoutableBackends(f.root)
	f.mu.Lock()
	f.rtSet, f.rtErr, f.rtAt = set, err, time.Now()
	f.mu.Unlock()
	return set, err
}

// nodeReasonFor is the reason a node-wide Cilium setting keeps ip's entries
// out of the index's reach ("" when none): the host firewall, NodePort with
// ip a backend of a routable service, or DSR (any IP; the routable backends
// keep the NodePort reason, which names the service path).
func (f *Features) nodeReasonFor(ip netip.Addr, cfg NodeConfig) string {
	if cfg.HostFirewall {
		return ReasonHostFirewall
	}
	if cfg.NodePort {
		set, err := f.routable()
		if err != nil || set[ip.Unmap()] {
			return ReasonNodePortBackend
		}
	}
	if cfg.DSR {
		return ReasonDSR
	}
	return ""
}

// Uncovered is one Cilium feature whose CT entries the index does not
// cover, as scrubd status and ctscrub_uncovered_feature list them.
type Uncovered struct {
	Label  string `json:"feature"`
	On     bool   `json:"on"`
	Reason string `json:"reason"`
}

// UncoveredFeatures lists every feature scrubd knows it cannot cover and
// whether it is on now (l7_proxy: on while the last pass found an
// endpoint with a proxy port, or an IP still marked for one).
func (f *Features) UncoveredFeatures() []Uncovered {
	cfg := f.NodeConfig()
	node := f.NodeReason()
	f.mu.Lock()
	proxy := f.proxySeen
	f.mu.Unlock()
	return []Uncovered{
		{"l7_proxy", proxy, ReasonL7Proxy},
		{"host_firewall", cfg.HostFirewall, ReasonHostFirewall},
		{"nodeport_backends", cfg.NodePort, ReasonNodePortBackend},
		{"nodeport_dsr", cfg.DSR, ReasonDSR},
		{"endpoint_ct_maps", node == ReasonLocalCT, ReasonLocalCT},
		{"per_cluster_ct_maps", node == ReasonPerClusterCT, ReasonPerClusterCT},
	}
}

// IsFeatureReason reports whether reason is one of Features' reasons.
func IsFeatureReason(reason string) bool {
	for _, r := range FeatureReasons {
		if r.Reason == reason {
			return true
		}
	}
	return false
}

// MarkUncovered is the continuous check: it marks every IP of ix that a
// Cilium feature on now can reach incomplete with the feature's reason
// (index.MarkIncomplete: the mark stays until the IP's next complete sweep,
// so a feature on at any pass since then keeps the IP incomplete, e.g. an
// L7 rule removed before the pod's DEL). The daemon runs it every second
// and after its CT maps watch fires; scrubs check the same at their start
// (markFeatures). It returns how many IPs it marked.
func (f *Features) MarkUncovered(ix *index.Index) int {
	cfg := f.NodeConfig()
	node := f.NodeReason()
	proxy := false
	n := 0
	for _, ip := range ix.IPs() {
		if !ix.Owns(ip) {
			continue
		}
		// An IP already incomplete keeps its mark until a sweep: it is
		// not checked again (each check may walk the endpoint's policy
		// map), and a proxy mark still in effect keeps l7_proxy listed.
		if st := ix.State(ip); !st.Complete {
			if st.Incomplete == ReasonL7Proxy {
				proxy = true
			}
			continue
		}
		r := node
		if r == "" {
			r = f.nodeReasonFor(ip, cfg)
		}
		if r == "" {
			if r = f.ProxyReason(ip); r != "" {
				proxy = true
			}
		}
		if r == "" {
			continue
		}
		ix.MarkIncomplete(ip, r)
		f.counted(r)
		n++
	}
	f.mu.Lock()
	f.proxySeen = proxy
	f.mu.Unlock()
	return n
}
