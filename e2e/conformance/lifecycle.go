package conformance

import (
	"encoding/binary"
	"net/netip"
	"os"
	"path/filepath"
	"strings"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// What happens to a pod and to the node's configuration around it: the
// pod deleted while traffic still comes, the node_config.h scrubd reads,
// the daemon's coverage pass, a deny rule.

// DeletePod removes p from Cilium's datapath as the agent does when the
// pod's endpoint is deleted: its cilium_lxc entries (bpf_host's
// backend_local and local delivery look there) and its ingress policy
// program in cilium_call_policy. Its ipcache entries stay (they go with
// the CiliumEndpoint, later), and so do the services that list it as a
// backend (the EndpointSlice update lags). Frames for its addresses are
// no longer delivered to its recorder: its interface is gone.
func (n *Node) DeletePod(p *Pod) {
	n.t.Helper()
	var lxc = n.LXC.Maps["cilium_lxc"]
	if lxc == nil {
		lxc = n.LXC.Maps["test_cilium_lxc"]
	}
	if lxc == nil {
		n.t.Fatalf("no cilium_lxc in bpf_lxc of %s", n.O.Version)
	}
	for _, ip := range []netip.Addr{p.IP4, p.IP6} {
		k := endpointKey(ip)
		if err := lxc.Delete(k[:]); err != nil {
			n.t.Fatalf("delete endpoint %s from cilium_lxc: %v", ip, err)
		}
	}
	if err := n.LXC.Maps[policyCallMapName(n.LXC)].Delete(uint32(p.ID)); err != nil {
		n.t.Fatalf("delete policy program of endpoint %d: %v", p.ID, err)
	}
	n.mu.Lock()
	delete(n.pods, p.IP4)
	delete(n.pods, p.IP6)
	n.mu.Unlock()
}

// endpointKey is struct endpoint_key (1.16-1.20): the address in 16 bytes,
// its family (1 IPv4, 2 IPv6), key 0, cluster ID 0.
func endpointKey(ip netip.Addr) [20]byte {
	var k [20]byte
	if ip.Is4() {
		a := ip.As4()
		copy(k[:], a[:])
		k[16] = 1
	} else {
		a := ip.As16()
		copy(k[:], a[:])
		k[16] = 2
	}
	return k
}

// SetNodeConfig writes the node_config.h scrubd's feature detection reads
// (cilium.Features.NodeConfig) with defines, as the agent writes them for
// this node's build; none: no file, as on a node without the agent.
func (n *Node) SetNodeConfig(defines []string) {
	n.t.Helper()
	path := filepath.Join(n.cfgDir, "node_config.h")
	if len(defines) == 0 {
		os.Remove(path)
		n.Feat.SetNodeConfig(filepath.Join(n.cfgDir, "absent.h"))
		return
	}
	var b strings.Builder
	for _, d := range defines {
		b.WriteString("#define " + d + " 1\n")
	}
	if err := os.WriteFile(path, []byte(b.String()), 0o600); err != nil {
		n.t.Fatal(err)
	}
	n.Feat.SetNodeConfig(path)
}

// CoveragePass is what scrubd's daemon runs every second
// (cilium.Features.MarkUncovered): every IP a Cilium feature on now can
// reach is marked incomplete, and stays so until its next complete sweep.
func (n *Node) CoveragePass() int { return n.Feat.MarkUncovered(n.Ix) }

// DenyIngress writes a deny entry for identity's packets of proto to port
// into the (shared) policy map, as the agent does for a deny rule: the
// pod's ingress policy drops them before bpf_lxc creates any CT entry.
func (n *Node) DenyIngress(identity uint32, proto uint8, port uint16) {
	n.t.Helper()
	a := confArgs{Op: 5, SecID: identity, Proto: proto}
	binary.BigEndian.PutUint16(a.VPort[:], port)
	n.setup(a, "conf_setup")
}

// Scrub is a scrub by the index at the pod's DEL: Take (with the
// recorder's hooks, as scrubd installs them) of a complete IP, and the
// taken keys and their covered forms deleted from Cilium's CT maps. It
// fails the case unless the IP is complete.
func (e *Env) Scrub(ip netip.Addr) {
	n := e.N
	if _, err := n.Rec.Drain(n.Ix); err != nil {
		e.Fail("drain: %v", err)
	}
	n.Ix.SetHooks(n.Rec.Hooks(n.Ix))
	k4, k6, st := n.Ix.Take(ip)
	n.Ix.SetHooks(nil)
	if !st.Complete {
		e.Fail("scrub of %s: %+v, want complete (on the index)", ip, st)
		return
	}
	c4, c6 := index.Covered(k4, k6)
	for _, k := range c4 {
		n.CT.Map(k.Kind()).Delete(k)
	}
	for _, k := range c6 {
		n.CT.Map(k.Kind()).Delete(k)
	}
}

// Entries counts the entries of Cilium's CT maps (the case's family)
// holding both a and b.
func (e *Env) Entries(a, b netip.Addr) int {
	c := 0
	for _, kind := range ctmap.Kinds {
		if kind.IPv6() != e.V6 {
			continue
		}
		it := e.N.CT.Map(kind).Iterate()
		var v ctmap.Entry
		if e.V6 {
			var k ctmap.CTKey6
			for it.Next(&k, &v) {
				if k.Has(a) && k.Has(b) {
					c++
				}
			}
		} else {
			var k ctmap.CTKey4
			for it.Next(&k, &v) {
				if k.Has(a) && k.Has(b) {
					c++
				}
			}
		}
		if err := it.Err(); err != nil {
			e.Fail("read CT: %v", err)
		}
	}
	return c
}

// Sweep is what scrubd's scrub does with an IP it does not vouch for
// (cilium's scrubRun: markFeatures, then sweep): the features' reason read
// now marks the IP, its keys are taken, it is tracked, every entry holding
// it is deleted from Cilium's maps (the sweep's walk), and the IP is marked
// again with that reason, if any.
func (e *Env) Sweep(ip netip.Addr) {
	n := e.N
	if _, err := n.Rec.Drain(n.Ix); err != nil {
		e.Fail("drain: %v", err)
	}
	r := n.Feat.Reason(ip)
	if r != "" {
		n.Ix.MarkIncomplete(ip, r)
	}
	n.Ix.Take(ip)
	n.Ix.TrackAll([]netip.Addr{ip})
	if r != "" {
		n.Ix.MarkIncomplete(ip, r)
	}
	for _, kind := range ctmap.Kinds {
		m := n.CT.Map(kind)
		it := m.Iterate()
		var v ctmap.Entry
		if kind.IPv6() {
			var k ctmap.CTKey6
			var del []ctmap.CTKey6
			for it.Next(&k, &v) {
				if k.Has(ip) {
					del = append(del, k)
				}
			}
			for _, k := range del {
				m.Delete(k)
			}
		} else {
			var k ctmap.CTKey4
			var del []ctmap.CTKey4
			for it.Next(&k, &v) {
				if k.Has(ip) {
					del = append(del, k)
				}
			}
			for _, k := range del {
				m.Delete(k)
			}
		}
		if err := it.Err(); err != nil {
			e.Fail("sweep %s: %v", kind.Name(), err)
		}
	}
}
