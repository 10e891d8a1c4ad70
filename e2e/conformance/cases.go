package conformance

import (
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/cilium"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// Env is what a case gets: the node, the family, fresh addresses.
type Env struct {
	N  *Node
	V6 bool
	// Fail records a harness failure (a packet Cilium dropped where the
	// case expects it delivered, a setup that did not take).
	Fail func(format string, args ...any)
	seq  *int
}

func (e *Env) next() int { *e.seq++; return *e.seq }

// Pod adds a fresh local pod.
func (e *Env) Pod(name string) *Pod {
	i := e.next()
	ip4 := netip.AddrFrom4([4]byte{10, 244, byte(i >> 8), byte(i)})
	ip6 := netip.MustParseAddr(fmt.Sprintf("fd00:244::%x", i))
	return e.N.AddPod(name, ip4, ip6)
}

// World is a fresh address outside the cluster (ipcache: world).
func (e *Env) World() netip.Addr {
	i := e.next()
	if e.V6 {
		return netip.MustParseAddr(fmt.Sprintf("2001:db8:100::%x", i))
	}
	return netip.AddrFrom4([4]byte{198, 51, byte(100 + i>>8), byte(i)})
}

// Remote is a fresh pod address of another node (in the ipcache with a
// cluster identity; native routing).
func (e *Env) Remote() netip.Addr {
	i := e.next()
	var a netip.Addr
	if e.V6 {
		a = netip.MustParseAddr(fmt.Sprintf("fd00:244:1::%x", i))
	} else {
		a = netip.AddrFrom4([4]byte{10, 245, byte(i >> 8), byte(i)})
	}
	e.N.AddRemote(a, remotePodID)
	return a
}

// VIP is a fresh service address.
func (e *Env) VIP() netip.Addr {
	i := e.next()
	if e.V6 {
		return netip.MustParseAddr(fmt.Sprintf("fd00:96::%x", i))
	}
	return netip.AddrFrom4([4]byte{10, 96, byte(i >> 8), byte(i)})
}

// NodeIP is the node's address for NodePort frontends.
func (e *Env) NodeIP() netip.Addr {
	if e.V6 {
		return netip.MustParseAddr("2001:db8:1::10")
	}
	return netip.MustParseAddr("192.0.2.10")
}

// IP is p's address of the case's family.
func (e *Env) IP(p *Pod) netip.Addr { return p.IP(e.V6) }

// AP joins an address and a port.
func AP(a netip.Addr, port uint16) netip.AddrPort { return netip.AddrPortFrom(a, port) }

// Expect fails the case unless Cilium's verdict is one of want.
func (e *Env) Expect(what string, r Result, want ...uint32) {
	if len(want) == 0 {
		want = []uint32{VerdictOK, VerdictRedirect}
	}
	for _, w := range want {
		if r.Verdict == w {
			return
		}
	}
	e.Fail("%s: Cilium returned %d, want one of %v", what, r.Verdict, want)
}

// Echo builds an echo of the case's family.
func (e *Env) Echo(src, dst netip.Addr, request bool, id uint16) []byte {
	return EchoFrame(src, dst, request, id)
}

// DeleteCT deletes a key from Cilium's CT map, as the LRU does when it
// evicts the entry, or GC when it expired.
func (e *Env) DeleteCT(k4 ctmap.CTKey4, k6 ctmap.CTKey6) {
	var err error
	if e.V6 {
		err = e.N.CT.Map(k6.Kind()).Delete(k6)
	} else {
		err = e.N.CT.Map(k4.Kind()).Delete(k4)
	}
	if err != nil {
		e.Fail("delete CT entry: %v", err)
	}
	// The same in the stand-in's maps, which the suite compares with
	// Cilium's (absent there is fine: the comparison reports it).
	if e.V6 {
		e.N.SICT.Map(k6.Kind()).Delete(k6)
	} else {
		e.N.SICT.Map(k4.Kind()).Delete(k4)
	}
}

// RequireServiceEntry fails the case unless Cilium's CT maps hold a
// SERVICE entry of a flow p sent to vip: bpf_lxc load-balanced it per
// packet (without that the case would pass on a plain flow to the VIP).
func (e *Env) RequireServiceEntry(p *Pod, vip netip.Addr) {
	for _, kind := range ctmap.Kinds {
		if kind.IPv6() != e.V6 {
			continue
		}
		it := e.N.CT.Map(kind).Iterate()
		var v ctmap.Entry
		if e.V6 {
			var k ctmap.CTKey6
			for it.Next(&k, &v) {
				if k.Flags() == ctmap.FlagService && k.SAddr() == e.IP(p) && k.DAddr() == vip {
					return
				}
			}
		} else {
			var k ctmap.CTKey4
			for it.Next(&k, &v) {
				if k.Flags() == ctmap.FlagService && k.SAddr() == e.IP(p) && k.DAddr() == vip {
					return
				}
			}
		}
		if err := it.Err(); err != nil {
			e.Fail("read CT: %v", err)
		}
	}
	e.Fail("no SERVICE entry for %s -> %s: this build did not load-balance per packet", e.IP(p), vip)
}

// proxyRedirect is struct ct_entry's proxy_redirect flag bit (1.16-1.20).
const proxyRedirect = 1 << 6

// Redirected counts the TCP entries holding ip that Cilium flagged as
// redirected to the L7 proxy, and all TCP entries holding ip.
func (e *Env) Redirected(ip netip.Addr) (redirected, all int) {
	m := e.N.CT.Map(ctmap.TCP4)
	if e.V6 {
		m = e.N.CT.Map(ctmap.TCP6)
	}
	it := m.Iterate()
	var v ctmap.Entry
	if e.V6 {
		var k ctmap.CTKey6
		for it.Next(&k, &v) {
			if k.DAddr() == ip || k.SAddr() == ip {
				all++
				if v.Decode().Flags&proxyRedirect != 0 {
					redirected++
				}
			}
		}
	} else {
		var k ctmap.CTKey4
		for it.Next(&k, &v) {
			if k.DAddr() == ip || k.SAddr() == ip {
				all++
				if v.Decode().Flags&proxyRedirect != 0 {
					redirected++
				}
			}
		}
	}
	if err := it.Err(); err != nil {
		e.Fail("read CT: %v", err)
	}
	return redirected, all
}

// Key builds a CT key of the case's family.
func (e *Env) Key(daddr, saddr netip.Addr, dport, sport uint16, proto, flags uint8) (ctmap.CTKey4, ctmap.CTKey6) {
	if e.V6 {
		return ctmap.CTKey4{}, ctmap.NewKey6(daddr, saddr, dport, sport, proto, flags)
	}
	return ctmap.NewKey4(daddr, saddr, dport, sport, proto, flags), ctmap.CTKey6{}
}

// Case is one conformance scenario. Run drives packets and returns the
// local pods whose addresses are checked and the incomplete reasons the
// check accepts for them.
type Case struct {
	Name string
	// Node: the node configuration the case runs on (NodeDefault unless
	// it needs another datapath build).
	Node NodeConfig
	// NotStandin says why the stand-in (which models only the pod's veth,
	// not bpf_host) is not compared with Cilium on this case.
	NotStandin string
	// Marks: the case's pods must end incomplete with this reason (a
	// feature the daemon detects because the harness cannot run its path).
	Marks string
	// Defines: the node_config.h scrubd reads during the case (its
	// feature detection, cilium.Features.NodeConfig); none: no file.
	Defines []string
	// NoEntries says why Cilium creates no CT entry at all in the case:
	// it must then hold none of the pods' addresses, and the pods must
	// end complete.
	NoEntries string
	Run       func(e *Env) (pods []*Pod, reasons []string)
	// After runs once the case is checked, with the case's pods (a scrub
	// of them, or undoing what must not reach the next cases).
	After func(e *Env, pods []*Pod)
}

// ScrubByIndex takes ip's keys as a scrub does (index.Take, with the
// recorder's hooks as scrubd installs them, so service flows are resolved
// and confirmed) and fails the case unless ip stays complete and every CT
// entry holding it is among the keys taken or their covered forms.
func (e *Env) ScrubByIndex(ip netip.Addr) {
	n := e.N
	n.Ix.SetHooks(n.Rec.Hooks(n.Ix))
	k4, k6, st := n.Ix.Take(ip)
	n.Ix.SetHooks(nil)
	if !st.Complete {
		e.Fail("scrub of %s: %+v, want complete (on the index)", ip, st)
		return
	}
	c4, c6 := index.Covered(k4, k6)
	for _, kind := range ctmap.Kinds {
		it := n.CT.Map(kind).Iterate()
		var v ctmap.Entry
		if kind.IPv6() {
			var k ctmap.CTKey6
			for it.Next(&k, &v) {
				if k.Has(ip) && !slices.Contains(c6, k) {
					e.Fail("scrub of %s on the index leaves %s in %s", ip, k, kind.Name())
				}
			}
		} else {
			var k ctmap.CTKey4
			for it.Next(&k, &v) {
				if k.Has(ip) && !slices.Contains(c4, k) {
					e.Fail("scrub of %s on the index leaves %s in %s", ip, k, kind.Name())
				}
			}
		}
		if err := it.Err(); err != nil {
			e.Fail("iterate %s: %v", kind.Name(), err)
		}
	}
}

func (e *Env) icmpProto() uint8 {
	if e.V6 {
		return ProtoICMPv6
	}
	return ProtoICMP
}

const (
	notHost      = "bpf_host's NodePort entries: the stand-in models the pod's veth only"
	notHostFW    = "bpf_host's host-firewall entries: the stand-in models the pod's veth only"
	notICMPVIP   = "the stand-in creates an IPv6 RELATED entry for the error with the VIP, Cilium none"
	notRepick    = "the stand-in always sends a service's flows to its first backend"
	notNoBackend = "the stand-in has no service without backends (it sees a plain flow to the VIP)"
	notGone      = "the stand-in has no endpoint deletion (it models the pod's veth only)"
	notProxy     = "the stand-in takes no source identity from the packet's mark"
	notOverlay   = "the stand-in has no tunnel device"
)

// hostFWDefines: the node_config.h of the host-firewall node, as its
// objects are built.
var hostFWDefines = []string{"ENABLE_HOST_FIREWALL", "ENABLE_NODEPORT", "ENABLE_DSR"}

// deleteScrubbed is a pod's DEL when scrubd answers complete: the scrub by
// the index deletes its entries, its IPs are released (index.Release: the
// complete slots stay for the IPs' next ADD), and its endpoint is deleted.
func (e *Env) deleteScrubbed(p *Pod) {
	e.Scrub(e.IP(p))
	e.N.Ix.Release(p.IP4)
	e.N.Ix.Release(p.IP6)
	e.N.DeletePod(p)
}

// SettleAfterDatapath is the daemon's early resolution once Cilium has
// surely handled the pods' packets: it waits as the daemon does (the
// recorder settles a flow to a service without backends only when its
// latest packet is older than its settle delay).
func (e *Env) SettleAfterDatapath(pods ...*Pod) {
	time.Sleep(150 * time.Millisecond)
	e.N.Settle(pods...)
}

// Cases is the suite. Each uses fresh pods and addresses, so cases share a
// node without seeing each other's entries.
var Cases = []Case{
	{Name: "pod-to-world", Run: func(e *Env) ([]*Pod, []string) {
		a, w := e.Pod("a"), e.World()
		e.N.AddRemote(w, worldID)
		e.Expect("SYN", e.N.Send(a, TCPFrame(AP(e.IP(a), 40001), AP(w, 443), SYN)))
		e.Expect("SYN-ACK", e.N.FromNetdev(TCPFrame(AP(w, 443), AP(e.IP(a), 40001), SYN|ACK)))
		e.Expect("ACK", e.N.Send(a, TCPFrame(AP(e.IP(a), 40001), AP(w, 443), ACK)))
		e.Expect("UDP", e.N.Send(a, UDPFrame(AP(e.IP(a), 40002), AP(w, 53))))
		e.Expect("UDP reply", e.N.FromNetdev(UDPFrame(AP(w, 53), AP(e.IP(a), 40002))))
		e.Expect("SCTP", e.N.Send(a, SCTPFrame(AP(e.IP(a), 40003), AP(w, 3868))))
		return []*Pod{a}, nil
	}},
	// A sender that skips its eth0's tc egress (PACKET_QDISC_BYPASS): only
	// the recorder's host-side link sees its frames (issue 35 item 2).
	{Name: "qdisc-bypass-sender", Run: func(e *Env) ([]*Pod, []string) {
		a, w := e.Pod("a"), e.World()
		e.N.AddRemote(w, worldID)
		e.Expect("UDP", e.N.SendBypassed(a, UDPFrame(AP(e.IP(a), 40101), AP(w, 53))))
		e.Expect("SYN", e.N.SendBypassed(a, TCPFrame(AP(e.IP(a), 40102), AP(w, 443), SYN)))
		e.Expect("SYN-ACK", e.N.FromNetdev(TCPFrame(AP(w, 443), AP(e.IP(a), 40102), SYN|ACK)))
		e.Expect("ACK", e.N.SendBypassed(a, TCPFrame(AP(e.IP(a), 40102), AP(w, 443), ACK)))
		return []*Pod{a}, nil
	}},
	{Name: "world-to-pod", Run: func(e *Env) ([]*Pod, []string) {
		a, w := e.Pod("a"), e.World()
		e.Expect("SYN", e.N.FromNetdev(TCPFrame(AP(w, 50001), AP(e.IP(a), 8080), SYN)))
		e.Expect("SYN-ACK", e.N.Send(a, TCPFrame(AP(e.IP(a), 8080), AP(w, 50001), SYN|ACK)))
		e.Expect("UDP", e.N.FromNetdev(UDPFrame(AP(w, 50002), AP(e.IP(a), 5353))))
		e.Expect("UDP reply", e.N.Send(a, UDPFrame(AP(e.IP(a), 5353), AP(w, 50002))))
		return []*Pod{a}, nil
	}},
	{Name: "pod-to-remote-pod", Run: func(e *Env) ([]*Pod, []string) {
		a, r := e.Pod("a"), e.Remote()
		e.Expect("SYN", e.N.Send(a, TCPFrame(AP(e.IP(a), 40001), AP(r, 8080), SYN)))
		e.Expect("SYN-ACK", e.N.FromNetdev(TCPFrame(AP(r, 8080), AP(e.IP(a), 40001), SYN|ACK)))
		e.Expect("remote UDP", e.N.FromNetdev(UDPFrame(AP(r, 40002), AP(e.IP(a), 53))))
		e.Expect("UDP reply", e.N.Send(a, UDPFrame(AP(e.IP(a), 53), AP(r, 40002))))
		return []*Pod{a}, nil
	}},
	{Name: "same-node-pod-to-pod", Run: func(e *Env) ([]*Pod, []string) {
		a, b := e.Pod("a"), e.Pod("b")
		e.Expect("SYN", e.N.Send(a, TCPFrame(AP(e.IP(a), 40001), AP(e.IP(b), 8080), SYN)))
		e.Expect("SYN-ACK", e.N.Send(b, TCPFrame(AP(e.IP(b), 8080), AP(e.IP(a), 40001), SYN|ACK)))
		e.Expect("UDP", e.N.Send(b, UDPFrame(AP(e.IP(b), 40002), AP(e.IP(a), 53))))
		e.Expect("UDP reply", e.N.Send(a, UDPFrame(AP(e.IP(a), 53), AP(e.IP(b), 40002))))
		return []*Pod{a, b}, nil
	}},
	// Per-packet load balancing (bpf_lxc DNATs pod-to-VIP packets): the
	// client's SERVICE, OUT and RELATED entries must be indexed, the
	// client complete (Resolve learns the backend from the SERVICE entry
	// and Cilium's backend map).
	{Name: "service-remote-backend", Run: func(e *Env) ([]*Pod, []string) {
		a, r, vip := e.Pod("a"), e.Remote(), e.VIP()
		e.N.AddService(ProtoTCP, AP(vip, 80), AP(r, 8080), 0)
		e.Expect("SYN to VIP", e.N.Send(a, TCPFrame(AP(e.IP(a), 40001), AP(vip, 80), SYN)))
		e.Expect("SYN-ACK from backend", e.N.FromNetdev(TCPFrame(AP(r, 8080), AP(e.IP(a), 40001), SYN|ACK)))
		e.Expect("ACK to VIP", e.N.Send(a, TCPFrame(AP(e.IP(a), 40001), AP(vip, 80), ACK)))
		return []*Pod{a}, nil
	}},
	{Name: "service-local-backend", Run: func(e *Env) ([]*Pod, []string) {
		a, b, vip := e.Pod("client"), e.Pod("backend"), e.VIP()
		e.N.AddService(ProtoTCP, AP(vip, 80), AP(e.IP(b), 8080), 0)
		e.Expect("SYN to VIP", e.N.Send(a, TCPFrame(AP(e.IP(a), 40001), AP(vip, 80), SYN)))
		e.Expect("SYN-ACK from backend", e.N.Send(b, TCPFrame(AP(e.IP(b), 8080), AP(e.IP(a), 40001), SYN|ACK)))
		return []*Pod{a, b}, nil
	}},
	{Name: "service-udp-remote-backend", Run: func(e *Env) ([]*Pod, []string) {
		a, r, vip := e.Pod("a"), e.Remote(), e.VIP()
		e.N.AddService(ProtoUDP, AP(vip, 9000), AP(r, 9090), 0)
		e.Expect("UDP to VIP", e.N.Send(a, UDPFrame(AP(e.IP(a), 40002), AP(vip, 9000))))
		e.Expect("UDP reply", e.N.FromNetdev(UDPFrame(AP(r, 9090), AP(e.IP(a), 40002))))
		return []*Pod{a}, nil
	}},
	{Name: "service-udp-local-backend", Run: func(e *Env) ([]*Pod, []string) {
		a, b, vip := e.Pod("client"), e.Pod("backend"), e.VIP()
		e.N.AddService(ProtoUDP, AP(vip, 9000), AP(e.IP(b), 9090), 0)
		e.Expect("UDP to VIP", e.N.Send(a, UDPFrame(AP(e.IP(a), 40002), AP(vip, 9000))))
		e.Expect("UDP reply", e.N.Send(b, UDPFrame(AP(e.IP(b), 9090), AP(e.IP(a), 40002))))
		return []*Pod{a, b}, nil
	}},
	// The cluster DNS: two queries (A, AAAA) from one socket back to
	// back, one answered, to a resolver pod on another node.
	{Name: "dns-over-udp", Run: func(e *Env) ([]*Pod, []string) {
		a, dns, vip := e.Pod("a"), e.Remote(), e.VIP()
		e.N.AddService(ProtoUDP, AP(vip, 53), AP(dns, 53), 0)
		e.Expect("query A", e.N.Send(a, UDPFrame(AP(e.IP(a), 41053), AP(vip, 53))))
		e.Expect("query AAAA", e.N.Send(a, UDPFrame(AP(e.IP(a), 41053), AP(vip, 53))))
		e.Expect("answer", e.N.FromNetdev(UDPFrame(AP(dns, 53), AP(e.IP(a), 41053))))
		e.Expect("query from another port", e.N.Send(a, UDPFrame(AP(e.IP(a), 41054), AP(vip, 53))))
		return []*Pod{a}, nil
	}},
	// The backend's node answers a datagram of a VIP flow with an ICMP
	// error about the packet as Cilium sent it (DNATed to the backend).
	{Name: "icmp-error-on-vip-flow", NotStandin: notICMPVIP, Run: func(e *Env) ([]*Pod, []string) {
		a, r, vip := e.Pod("a"), e.Remote(), e.VIP()
		e.N.AddService(ProtoUDP, AP(vip, 9000), AP(r, 9090), 0)
		out := e.N.Send(a, UDPFrame(AP(e.IP(a), 40003), AP(vip, 9000)))
		e.Expect("UDP to VIP", out)
		e.N.FromNetdev(ErrorFrame(r, e.IP(a), IPOf(out.Out)))
		return []*Pod{a}, nil
	}},
	// The other half of an L7 load-balancer service: Envoy's upstream
	// connection from the node to a local backend (source the node, the
	// mark MARK_MAGIC_PROXY_EGRESS with the ingress identity, 8), through
	// cil_from_host to the backend's ingress policy, which makes the IN
	// entry on delivery: the backend complete, its scrub by the index
	// leaving nothing.
	{Name: "l7-lb-proxy-upstream-to-backend", Node: NodeL7LB, Defines: []string{"ENABLE_NODEPORT", "ENABLE_L7_LB"}, NotStandin: notProxy, Run: func(e *Env) ([]*Pod, []string) {
		b, node, vip := e.Pod("backend"), e.NodeIP(), e.VIP()
		e.N.AddRemote(node, HostID)
		e.N.AddServiceL7(ProtoTCP, AP(vip, 443), AP(e.IP(b), 8443))
		e.Expect("Envoy's upstream SYN", e.N.FromProxy(TCPFrame(AP(node, 41000), AP(e.IP(b), 8443), SYN), ingressID))
		e.Expect("backend's SYN-ACK", e.N.Send(b, TCPFrame(AP(e.IP(b), 8443), AP(node, 41000), SYN|ACK)))
		e.Expect("Envoy's ACK", e.N.FromProxy(TCPFrame(AP(node, 41000), AP(e.IP(b), 8443), ACK), ingressID))
		// A second connection, not answered yet when the scrub comes: its
		// IN entry is the backend's recorder's from the SYN alone.
		e.Expect("Envoy's second SYN", e.N.FromProxy(TCPFrame(AP(node, 41001), AP(e.IP(b), 8443), SYN), ingressID))
		return []*Pod{b}, nil
	}, After: func(e *Env, pods []*Pod) { e.ScrubByIndex(e.IP(pods[0])) }},
	// A client of an L7 load-balancer service (Cilium Ingress, Gateway
	// API): bpf_lxc with ENABLE_L7_LB keeps the plain flow to the VIP (OUT
	// and RELATED entries, no SERVICE entry, no DNAT) and redirects it to
	// Envoy. The client must be complete with those entries indexed
	// (issue 35 B: they were in no index, the flow settled as "no entry").
	{Name: "l7-lb-service-client", Node: NodeL7LB, Run: func(e *Env) ([]*Pod, []string) {
		a, r, vip := e.Pod("a"), e.Remote(), e.VIP()
		e.N.AddServiceL7(ProtoTCP, AP(vip, 443), AP(r, 8443))
		e.N.Send(a, TCPFrame(AP(e.IP(a), 40001), AP(vip, 443), SYN))
		e.N.Send(a, TCPFrame(AP(e.IP(a), 40001), AP(vip, 443), ACK))
		return []*Pod{a}, nil
	}, After: func(e *Env, pods []*Pod) { e.ScrubByIndex(e.IP(pods[0])) }},
	// Cilium source-NATs an IPv4 hairpin to the service loopback address;
	// IPv6 is not NATed before 1.19, 1.19+ NAT it to the IPv6 service
	// loopback. Either way the client's scrub must take the index path
	// and leave nothing (issue 35 item 5: at 1.19 and 1.20 the IPv6
	// client was marked, the hairpin exception being IPv4-only).
	{Name: "hairpin", Run: func(e *Env) ([]*Pod, []string) {
		a, vip := e.Pod("a"), e.VIP()
		e.N.AddService(ProtoTCP, AP(vip, 80), AP(e.IP(a), 8080), 0)
		e.Expect("SYN to own VIP", e.N.Send(a, TCPFrame(AP(e.IP(a), 40001), AP(vip, 80), SYN)))
		return []*Pod{a}, nil
	}, After: func(e *Env, pods []*Pod) { e.ScrubByIndex(e.IP(pods[0])) }},
	// The backend is removed after the flow's first packets (its address
	// read by the early resolution) and another put in its slot: the
	// flow's next packet makes Cilium pick it (ct_update_svc_entry), and
	// the flow now has OUT entries towards both.
	{Name: "service-backend-removed-repicked", NotStandin: notRepick, Run: func(e *Env) ([]*Pod, []string) {
		a, r1, r2, vip := e.Pod("a"), e.Remote(), e.Remote(), e.VIP()
		id := e.N.AddService(ProtoUDP, AP(vip, 9000), AP(r1, 9090), 0)
		e.Expect("UDP to VIP", e.N.Send(a, UDPFrame(AP(e.IP(a), 40004), AP(vip, 9000))))
		e.Expect("UDP reply", e.N.FromNetdev(UDPFrame(AP(r1, 9090), AP(e.IP(a), 40004))))
		e.N.Settle(a)
		e.N.RemoveBackend(e.V6, id)
		e.N.AddService(ProtoUDP, AP(vip, 9000), AP(r2, 9090), 0)
		e.Expect("UDP to VIP, re-picked", e.N.Send(a, UDPFrame(AP(e.IP(a), 40004), AP(vip, 9000))))
		e.Expect("UDP reply from the new backend", e.N.FromNetdev(UDPFrame(AP(r2, 9090), AP(e.IP(a), 40004))))
		return []*Pod{a}, nil
	}},
	// The same twice over: the first re-pick's backend is read by the
	// recorder at the flow's next packet (no resolution reads the entry
	// in between), the second's by the scrub's resolution.
	{Name: "service-backend-repicked-twice", NotStandin: notRepick, Run: func(e *Env) ([]*Pod, []string) {
		a, r1, r2, r3, vip := e.Pod("a"), e.Remote(), e.Remote(), e.Remote(), e.VIP()
		id1 := e.N.AddService(ProtoTCP, AP(vip, 80), AP(r1, 8080), 0)
		e.Expect("SYN", e.N.Send(a, TCPFrame(AP(e.IP(a), 40005), AP(vip, 80), SYN)))
		e.Expect("ACK", e.N.Send(a, TCPFrame(AP(e.IP(a), 40005), AP(vip, 80), ACK)))
		e.N.Settle(a)
		e.N.RemoveBackend(e.V6, id1)
		id2 := e.N.AddService(ProtoTCP, AP(vip, 80), AP(r2, 8080), 0)
		e.Expect("re-picked once", e.N.Send(a, TCPFrame(AP(e.IP(a), 40005), AP(vip, 80), ACK)))
		e.Expect("read by the recorder", e.N.Send(a, TCPFrame(AP(e.IP(a), 40005), AP(vip, 80), ACK)))
		// The early resolution reads the re-picked backend's address
		// (without it, the removal below comes first and the client is
		// marked: service-backend-removed-unread).
		e.N.Settle(a)
		e.N.RemoveBackend(e.V6, id2)
		e.N.AddService(ProtoTCP, AP(vip, 80), AP(r3, 8080), 0)
		e.Expect("re-picked twice", e.N.Send(a, TCPFrame(AP(e.IP(a), 40005), AP(vip, 80), ACK)))
		return []*Pod{a}, nil
	}},
	// Backends removed after the early resolution read them, before the
	// client's scrub (a Deployment's pods deleted with their clients: the
	// kind churn on the default install). The scrub's resolution reads
	// the SERVICE entries still naming them; every pick is known, so the
	// scrub itself (Take, with the recorder's hooks as scrubd installs
	// them) must stay on the index and take every entry of the client's.
	{Name: "service-backend-removed-before-scrub", NotStandin: notRepick, Run: func(e *Env) ([]*Pod, []string) {
		a, r1, r2, vip := e.Pod("a"), e.Remote(), e.Remote(), e.VIP()
		tcp := e.N.AddService(ProtoTCP, AP(vip, 80), AP(r1, 8080), 0)
		udp := e.N.AddService(ProtoUDP, AP(vip, 53), AP(r2, 5353), 0)
		e.Expect("SYN to VIP", e.N.Send(a, TCPFrame(AP(e.IP(a), 40009), AP(vip, 80), SYN)))
		e.Expect("SYN-ACK", e.N.FromNetdev(TCPFrame(AP(r1, 8080), AP(e.IP(a), 40009), SYN|ACK)))
		e.Expect("UDP to VIP", e.N.Send(a, UDPFrame(AP(e.IP(a), 40010), AP(vip, 53))))
		e.N.Settle(a)
		e.N.RemoveBackend(e.V6, tcp)
		e.N.RemoveBackend(e.V6, udp)
		return []*Pod{a}, nil
	}, After: func(e *Env, pods []*Pod) { e.ScrubByIndex(e.IP(pods[0])) }},
	// A backend removed before anything read its address, with the
	// flow's OUT entry towards it left: that cannot be learnt, so the
	// client must come out incomplete with the new reason.
	{Name: "service-backend-removed-unread", Marks: index.ReasonServiceUnresolved, NotStandin: notRepick, Run: func(e *Env) ([]*Pod, []string) {
		a, r1, r2, vip := e.Pod("a"), e.Remote(), e.Remote(), e.VIP()
		id := e.N.AddService(ProtoUDP, AP(vip, 9000), AP(r1, 9090), 0)
		e.Expect("UDP to VIP", e.N.Send(a, UDPFrame(AP(e.IP(a), 40006), AP(vip, 9000))))
		e.N.RemoveBackend(e.V6, id)
		e.N.AddService(ProtoUDP, AP(vip, 9000), AP(r2, 9090), 0)
		e.Expect("UDP to VIP, re-picked", e.N.Send(a, UDPFrame(AP(e.IP(a), 40006), AP(vip, 9000))))
		return []*Pod{a}, []string{index.ReasonServiceUnresolved}
	}},
	// A ClusterIP whose service has no backend (between one rollout
	// wave's pods going and the next's becoming ready, or no endpoints at
	// all): bpf_lxc drops the client's packets (DROP_NO_SERVICE) before
	// any CT entry. The recorder saw them go to the VIP; the client stays
	// complete (settled as "no entry"), also after a later packet that
	// again finds no backend.
	{Name: "service-no-backends", NoEntries: "a service without backends: Cilium drops before any CT entry", NotStandin: notNoBackend, Run: func(e *Env) ([]*Pod, []string) {
		a, vip := e.Pod("a"), e.VIP()
		e.N.AddServiceNoBackends(ProtoTCP, AP(vip, 80))
		e.N.AddServiceNoBackends(ProtoUDP, AP(vip, 53))
		drops := e.N.NoServiceDrops()
		e.Expect("SYN to VIP without backends", e.N.Send(a, TCPFrame(AP(e.IP(a), 40007), AP(vip, 80), SYN)), VerdictShot, VerdictRedirect)
		e.Expect("UDP to VIP without backends", e.N.Send(a, UDPFrame(AP(e.IP(a), 40008), AP(vip, 53))), VerdictShot, VerdictRedirect)
		e.SettleAfterDatapath(a)
		e.Expect("UDP again, still without backends", e.N.Send(a, UDPFrame(AP(e.IP(a), 40008), AP(vip, 53))), VerdictShot, VerdictRedirect)
		e.Expect("SYN retransmitted", e.N.Send(a, TCPFrame(AP(e.IP(a), 40007), AP(vip, 80), SYN)), VerdictShot, VerdictRedirect)
		if got := e.N.NoServiceDrops() - drops; got != 4 {
			e.Fail("Cilium dropped %d packets as DROP_NO_SERVICE, want 4", got)
		}
		return []*Pod{a}, nil
	}},
	// The same flows' first packets find no backend; a backend is added
	// and each flow's next packet makes Cilium pick it (SERVICE and OUT
	// entries). The recorder read no entry at either packet: the
	// settled "no entry" must give way to the scrub's reading of the
	// SERVICE entry, and every entry be among the client's keys.
	{Name: "service-backend-added-after-drop", NotStandin: notNoBackend, Run: func(e *Env) ([]*Pod, []string) {
		a, r, vip := e.Pod("a"), e.Remote(), e.VIP()
		e.N.AddServiceNoBackends(ProtoTCP, AP(vip, 80))
		e.N.AddServiceNoBackends(ProtoUDP, AP(vip, 9000))
		e.Expect("SYN, no backend", e.N.Send(a, TCPFrame(AP(e.IP(a), 40009), AP(vip, 80), SYN)), VerdictShot, VerdictRedirect)
		e.Expect("UDP, no backend", e.N.Send(a, UDPFrame(AP(e.IP(a), 40010), AP(vip, 9000))), VerdictShot, VerdictRedirect)
		e.SettleAfterDatapath(a)
		e.N.AddService(ProtoTCP, AP(vip, 80), AP(r, 8080), 0)
		e.N.AddService(ProtoUDP, AP(vip, 9000), AP(r, 9090), 0)
		e.Expect("SYN retransmitted, a backend now", e.N.Send(a, TCPFrame(AP(e.IP(a), 40009), AP(vip, 80), SYN)))
		e.Expect("SYN-ACK from backend", e.N.FromNetdev(TCPFrame(AP(r, 8080), AP(e.IP(a), 40009), SYN|ACK)))
		e.Expect("UDP again, a backend now", e.N.Send(a, UDPFrame(AP(e.IP(a), 40010), AP(vip, 9000))))
		e.Expect("UDP reply", e.N.FromNetdev(UDPFrame(AP(r, 9090), AP(e.IP(a), 40010))))
		e.RequireServiceEntry(a, vip)
		return []*Pod{a}, nil
	}},
	// Socket LB in host-namespace-only mode (service meshes): bpf_lxc
	// load-balances the pod's packets itself, as with the default values.
	// Each case first checks that Cilium made the SERVICE entry (the
	// per-packet path ran on this build), then that the client is complete.
	{Name: "hostns-service-tcp-local-backend", Node: NodeSocketLBHostNS, Run: func(e *Env) ([]*Pod, []string) {
		a, b, vip := e.Pod("client"), e.Pod("backend"), e.VIP()
		e.N.AddService(ProtoTCP, AP(vip, 80), AP(e.IP(b), 8080), 0)
		e.Expect("SYN to VIP", e.N.Send(a, TCPFrame(AP(e.IP(a), 40001), AP(vip, 80), SYN)))
		e.Expect("SYN-ACK from backend", e.N.Send(b, TCPFrame(AP(e.IP(b), 8080), AP(e.IP(a), 40001), SYN|ACK)))
		e.Expect("ACK to VIP", e.N.Send(a, TCPFrame(AP(e.IP(a), 40001), AP(vip, 80), ACK)))
		e.RequireServiceEntry(a, vip)
		return []*Pod{a, b}, nil
	}},
	{Name: "hostns-dns-over-udp-remote-backend", Node: NodeSocketLBHostNS, Run: func(e *Env) ([]*Pod, []string) {
		a, dns, vip := e.Pod("a"), e.Remote(), e.VIP()
		e.N.AddService(ProtoUDP, AP(vip, 53), AP(dns, 53), 0)
		e.Expect("query", e.N.Send(a, UDPFrame(AP(e.IP(a), 41053), AP(vip, 53))))
		e.Expect("answer", e.N.FromNetdev(UDPFrame(AP(dns, 53), AP(e.IP(a), 41053))))
		e.Expect("second query", e.N.Send(a, UDPFrame(AP(e.IP(a), 41053), AP(vip, 53))))
		e.RequireServiceEntry(a, vip)
		return []*Pod{a}, nil
	}},
	{Name: "icmp-echo", Run: func(e *Env) ([]*Pod, []string) {
		a, b, w := e.Pod("a"), e.Pod("b"), e.World()
		e.Expect("echo out", e.N.Send(a, e.Echo(e.IP(a), w, true, 7)))
		e.Expect("echo reply in", e.N.FromNetdev(e.Echo(w, e.IP(a), false, 7)))
		e.Expect("echo in", e.N.FromNetdev(e.Echo(w, e.IP(a), true, 8)))
		e.Expect("echo reply out", e.N.Send(a, e.Echo(e.IP(a), w, false, 8)))
		e.Expect("echo to pod", e.N.Send(a, e.Echo(e.IP(a), e.IP(b), true, 9)))
		e.Expect("echo reply from pod", e.N.Send(b, e.Echo(e.IP(b), e.IP(a), false, 9)))
		return []*Pod{a, b}, nil
	}},
	{Name: "icmp-error-live-flow", Run: func(e *Env) ([]*Pod, []string) {
		a, w, router := e.Pod("a"), e.World(), e.World()
		syn := TCPFrame(AP(e.IP(a), 40001), AP(w, 443), SYN)
		e.Expect("SYN", e.N.Send(a, syn))
		e.Expect("SYN-ACK", e.N.FromNetdev(TCPFrame(AP(w, 443), AP(e.IP(a), 40001), SYN|ACK)))
		// Path MTU: a router on the way answers the pod's segment, and
		// the peer itself too.
		e.N.FromNetdev(ErrorFrame(router, e.IP(a), IPOf(syn)))
		e.N.FromNetdev(ErrorFrame(w, e.IP(a), IPOf(syn)))
		// The pod answers a peer's datagram with an error.
		in := UDPFrame(AP(w, 5000), AP(e.IP(a), 9999))
		e.N.FromNetdev(in)
		e.N.Send(a, ErrorFrame(e.IP(a), w, IPOf(in)))
		return []*Pod{a}, nil
	}},
	{Name: "icmp-error-unsolicited", Run: func(e *Env) ([]*Pod, []string) {
		a, b, w := e.Pod("a"), e.Pod("b"), e.World()
		never := TCPFrame(AP(e.IP(a), 40009), AP(w, 443), SYN)
		e.N.FromNetdev(ErrorFrame(w, e.IP(a), IPOf(never)))
		// Same node: b reports an error about a datagram a never sent.
		e.N.Send(b, ErrorFrame(e.IP(b), e.IP(a), IPOf(UDPFrame(AP(e.IP(a), 1234), AP(e.IP(b), 4321)))))
		return []*Pod{a, b}, nil
	}},
	{Name: "icmp-error-related-expired", Run: func(e *Env) ([]*Pod, []string) {
		a, w := e.Pod("a"), e.World()
		syn := TCPFrame(AP(e.IP(a), 40001), AP(w, 443), SYN)
		e.Expect("SYN", e.N.Send(a, syn))
		e.Expect("SYN-ACK", e.N.FromNetdev(TCPFrame(AP(w, 443), AP(e.IP(a), 40001), SYN|ACK)))
		// The flow's related entry lives 60 s and TCP packets do not
		// refresh it; GC removed it while the TCP entry lives on.
		k4, k6 := e.Key(e.IP(a), w, 0, 0, e.icmpProto(), ctmap.FlagRelated)
		e.DeleteCT(k4, k6)
		e.N.FromNetdev(ErrorFrame(w, e.IP(a), IPOf(syn)))
		return []*Pod{a}, nil
	}},
	{Name: "first-packet-not-initiator", Run: func(e *Env) ([]*Pod, []string) {
		a, b, w := e.Pod("a"), e.Pod("b"), e.World()
		ip := e.IP(a)
		e.N.FromNetdev(TCPFrame(AP(w, 443), AP(ip, 40001), SYN|ACK)) // reply first
		e.N.FromNetdev(TCPFrame(AP(w, 443), AP(ip, 40002), ACK))     // mid-stream ACK
		e.N.FromNetdev(TCPFrame(AP(w, 443), AP(ip, 40003), RST))
		e.N.FromNetdev(TCPFrame(AP(w, 443), AP(ip, 40004), FIN|ACK))
		e.N.Send(a, TCPFrame(AP(ip, 8080), AP(w, 50001), ACK)) // the pod's reply first
		e.N.Send(a, TCPFrame(AP(ip, 8080), AP(w, 50002), RST|ACK))
		e.N.Send(a, TCPFrame(AP(ip, 8080), AP(w, 50003), FIN|ACK))
		e.N.Send(a, UDPFrame(AP(ip, 53), AP(w, 50004))) // a UDP reply first
		e.N.Send(b, TCPFrame(AP(e.IP(b), 8080), AP(ip, 40005), SYN|ACK))
		return []*Pod{a, b}, nil
	}},
	{Name: "lru-evicted-other-side-recreates", Run: func(e *Env) ([]*Pod, []string) {
		a, w := e.Pod("a"), e.World()
		e.Expect("SYN", e.N.Send(a, TCPFrame(AP(e.IP(a), 40001), AP(w, 443), SYN)))
		e.Expect("SYN-ACK", e.N.FromNetdev(TCPFrame(AP(w, 443), AP(e.IP(a), 40001), SYN|ACK)))
		e.Expect("ACK", e.N.Send(a, TCPFrame(AP(e.IP(a), 40001), AP(w, 443), ACK)))
		// The CT map is full and the LRU evicts the live flow's entry;
		// the peer's next segment comes first and re-creates it.
		k4, k6 := e.Key(e.IP(a), w, 443, 40001, ProtoTCP, ctmap.FlagOut)
		e.DeleteCT(k4, k6)
		e.N.FromNetdev(TCPFrame(AP(w, 443), AP(e.IP(a), 40001), ACK|PSH))
		return []*Pod{a}, nil
	}},
	{Name: "nodeport-local-backend", NotStandin: notHost, Run: func(e *Env) ([]*Pod, []string) {
		b, w := e.Pod("backend"), e.World()
		e.N.AddService(ProtoTCP, AP(e.NodeIP(), 30080), AP(e.IP(b), 8080), SvcNodePort|SvcRoutable)
		e.Expect("SYN to NodePort", e.N.FromNetdev(TCPFrame(AP(w, 50001), AP(e.NodeIP(), 30080), SYN)))
		e.Expect("SYN-ACK", e.N.Send(b, TCPFrame(AP(e.IP(b), 8080), AP(w, 50001), SYN|ACK)))
		return []*Pod{b}, nil
	}},
	{Name: "nodeport-dsr-backend", Node: NodeHostFWDSR, NotStandin: notHost, Run: func(e *Env) ([]*Pod, []string) {
		b, w := e.Pod("backend"), e.World()
		svc := AP(e.VIP(), 30080)
		e.Expect("DSR SYN", e.N.FromNetdev(DSRFrame(AP(w, 50001), AP(e.IP(b), 8080), svc, SYN)))
		e.Expect("SYN-ACK", e.N.Send(b, TCPFrame(AP(e.IP(b), 8080), AP(w, 50001), SYN|ACK)))
		return []*Pod{b}, nil
	}},
	{Name: "host-firewall-pod-node", Node: NodeHostFWDSR, NotStandin: notHostFW, Run: func(e *Env) ([]*Pod, []string) {
		a, node := e.Pod("a"), e.NodeIP()
		e.N.AddRemote(node, HostID)
		// The pod connects to the node: bpf_lxc, then the host firewall's
		// ingress policy on cilium_host.
		syn := e.N.Send(a, TCPFrame(AP(e.IP(a), 40001), AP(node, 22), SYN))
		e.Expect("pod to node", syn)
		e.Expect("host firewall ingress", e.N.ToHost(syn.Out))
		e.Expect("node's SYN-ACK", e.N.FromHost(TCPFrame(AP(node, 22), AP(e.IP(a), 40001), SYN|ACK)))
		// The node connects to the pod (kubelet probes do).
		e.Expect("node to pod", e.N.FromHost(TCPFrame(AP(node, 50000), AP(e.IP(a), 8080), SYN)))
		ack := e.N.Send(a, TCPFrame(AP(e.IP(a), 8080), AP(node, 50000), SYN|ACK))
		e.Expect("pod's SYN-ACK", ack)
		e.Expect("host firewall ingress of the reply", e.N.ToHost(ack.Out))
		return []*Pod{a}, nil
	}},
	// NodePort to a local backend whose pod is deleted between the packets
	// (the EndpointSlice update lags, so the service still lists it):
	// bpf_host's nodeport_svc_lb4/6 makes the new flow's OUT entry with
	// the backend's address before its backend_local check, the endpoint
	// is gone, the packet takes the remote path and no recorder sees it.
	// scrubd must mark the backend (nodeport_backends) or no key may stay.
	{Name: "nodeport-backend-pod-deleted", NotStandin: notGone, Defines: []string{"ENABLE_NODEPORT"}, Marks: cilium.ReasonNodePortBackend, Run: func(e *Env) ([]*Pod, []string) {
		b, w1, w2 := e.Pod("backend"), e.World(), e.World()
		front := AP(e.NodeIP(), uint16(31000+e.next()))
		e.N.AddService(ProtoTCP, front, AP(e.IP(b), 8080), SvcNodePort|SvcRoutable)
		e.Expect("SYN to NodePort", e.N.FromNetdev(TCPFrame(AP(w1, 50001), front, SYN)))
		e.Expect("SYN-ACK", e.N.Send(b, TCPFrame(AP(e.IP(b), 8080), AP(w1, 50001), SYN|ACK)))
		e.N.CoveragePass()
		e.N.DeletePod(b)
		e.N.FromNetdev(TCPFrame(AP(w2, 50002), front, SYN))
		if e.Entries(e.IP(b), w2) == 0 {
			e.Fail("Cilium made no entry for the deleted backend's new flow: the case tests nothing of it")
		}
		return []*Pod{b}, []string{cilium.ReasonNodePortBackend}
	}},
	// The same, and the service drops the backend before the scrub (the
	// EndpointSlice caught up): at the scrub the IP is no routable
	// backend any more; the daemon's pass while it was one must have
	// marked it, and the mark must last until a sweep.
	{Name: "nodeport-backend-pod-deleted-unlisted", NotStandin: notGone, Defines: []string{"ENABLE_NODEPORT"}, Marks: cilium.ReasonNodePortBackend, Run: func(e *Env) ([]*Pod, []string) {
		b, w1, w2 := e.Pod("backend"), e.World(), e.World()
		front := AP(e.NodeIP(), uint16(31000+e.next()))
		id := e.N.AddService(ProtoTCP, front, AP(e.IP(b), 8080), SvcNodePort|SvcRoutable)
		e.Expect("SYN to NodePort", e.N.FromNetdev(TCPFrame(AP(w1, 50001), front, SYN)))
		e.Expect("SYN-ACK", e.N.Send(b, TCPFrame(AP(e.IP(b), 8080), AP(w1, 50001), SYN|ACK)))
		e.N.CoveragePass()
		e.N.DeletePod(b)
		e.N.FromNetdev(TCPFrame(AP(w2, 50002), front, SYN))
		if e.Entries(e.IP(b), w2) == 0 {
			e.Fail("Cilium made no entry for the deleted backend's new flow: the case tests nothing of it")
		}
		e.N.RemoveBackend(e.V6, id)
		if r := e.N.Feat.Reason(e.IP(b)); r != "" {
			e.Fail("%s still found a reason (%s) after the backend left the service: the case would not test the mark's persistence", e.IP(b), r)
		}
		return []*Pod{b}, []string{cilium.ReasonNodePortBackend}
	}},
	// DSR on the backend's node, the backend's pod deleted between the
	// packets: nodeport_dsr_ingress_ipv4/6 makes the OUT entry before
	// delivery. The service is in this node's maps too (services are
	// cluster-wide). The node_config.h given to scrubd says NodePort and
	// DSR but not the host firewall this node's objects are built with:
	// the host firewall's mark (every IP) would answer first and hide the
	// one under test.
	{Name: "nodeport-dsr-backend-pod-deleted", Node: NodeHostFWDSR, NotStandin: notGone, Defines: []string{"ENABLE_NODEPORT", "ENABLE_DSR"}, Marks: cilium.ReasonNodePortBackend, Run: func(e *Env) ([]*Pod, []string) {
		b, w1, w2 := e.Pod("backend"), e.World(), e.World()
		svc := AP(e.VIP(), 30080)
		e.N.AddService(ProtoTCP, svc, AP(e.IP(b), 8080), SvcExternalIP|SvcRoutable)
		e.Expect("DSR SYN", e.N.FromNetdev(DSRFrame(AP(w1, 50001), AP(e.IP(b), 8080), svc, SYN)))
		e.Expect("SYN-ACK", e.N.Send(b, TCPFrame(AP(e.IP(b), 8080), AP(w1, 50001), SYN|ACK)))
		e.N.CoveragePass()
		e.N.DeletePod(b)
		e.N.FromNetdev(DSRFrame(AP(w2, 50002), AP(e.IP(b), 8080), svc, SYN))
		if e.Entries(e.IP(b), w2) == 0 {
			e.Fail("Cilium made no entry for the deleted backend's new flow: the case tests nothing of it")
		}
		return []*Pod{b}, []string{cilium.ReasonNodePortBackend}
	}},
	// DSR: nodeport_dsr_ingress_ipv4/6 makes its OUT entry for whatever
	// local address a packet's DSR option comes with, without looking at
	// this node's services or endpoints. A backend unlisted here (the
	// EndpointSlice update reached this node), then its pod's DEL (scrubd
	// sweeps the IP its pass had marked, and releases it), while the load
	// balancer's node still sends it new clients: the entry holds a
	// released IP. Its next ADD must not be answered from the index: the
	// IP must have lost its slot (index.ReasonUnknown: the ADD sweeps).
	{Name: "nodeport-dsr-backend-unlisted-then-deleted", Node: NodeHostFWDSR, NotStandin: notGone, Defines: []string{"ENABLE_NODEPORT", "ENABLE_DSR"}, Marks: index.ReasonUnknown, Run: func(e *Env) ([]*Pod, []string) {
		b, w1, w2 := e.Pod("backend"), e.World(), e.World()
		svc := AP(e.VIP(), 30080)
		id := e.N.AddService(ProtoTCP, svc, AP(e.IP(b), 8080), SvcExternalIP|SvcRoutable)
		e.Expect("DSR SYN", e.N.FromNetdev(DSRFrame(AP(w1, 50001), AP(e.IP(b), 8080), svc, SYN)))
		e.Expect("SYN-ACK", e.N.Send(b, TCPFrame(AP(e.IP(b), 8080), AP(w1, 50001), SYN|ACK)))
		e.N.CoveragePass()
		e.N.RemoveBackend(e.V6, id)
		e.Sweep(e.IP(b))
		e.N.Ix.Release(b.IP4)
		e.N.Ix.Release(b.IP6)
		e.N.DeletePod(b)
		e.N.FromNetdev(DSRFrame(AP(w2, 50002), AP(e.IP(b), 8080), svc, SYN))
		if e.Entries(e.IP(b), w2) == 0 {
			e.Fail("Cilium made no DSR entry for the released address: the case tests nothing")
		}
		return []*Pod{b}, []string{index.ReasonUnknown}
	}},
	// The node and a pod talking through cilium_host without the host
	// firewall (kubelet's probes, a pod reaching the node): bpf_host's
	// cil_from_host delivers to the pod's ingress policy, which makes the
	// IN entry; the pod's recorder sees the packet arrive.
	{Name: "host-to-pod", Defines: []string{"ENABLE_NODEPORT"}, Run: func(e *Env) ([]*Pod, []string) {
		a, node := e.Pod("a"), e.NodeIP()
		e.N.AddRemote(node, HostID)
		e.Expect("node to pod", e.N.FromHost(TCPFrame(AP(node, 50000), AP(e.IP(a), 8080), SYN)))
		e.Expect("pod's SYN-ACK", e.N.Send(a, TCPFrame(AP(e.IP(a), 8080), AP(node, 50000), SYN|ACK)))
		e.Expect("node's UDP to pod", e.N.FromHost(UDPFrame(AP(node, 50001), AP(e.IP(a), 5353))))
		e.Expect("pod's UDP reply", e.N.Send(a, UDPFrame(AP(e.IP(a), 5353), AP(node, 50001))))
		syn := e.N.Send(a, TCPFrame(AP(e.IP(a), 40001), AP(node, 10250), SYN))
		e.Expect("pod to node", syn)
		e.Expect("to the host", e.N.ToHost(syn.Out))
		e.Expect("node's SYN-ACK", e.N.FromHost(TCPFrame(AP(node, 10250), AP(e.IP(a), 40001), SYN|ACK)))
		return []*Pod{a}, nil
	}, After: func(e *Env, pods []*Pod) { e.ScrubByIndex(e.IP(pods[0])) }},
	// The node keeps probing a pod after its DEL (scrub by the index, IP
	// released: its complete slot stays, so the IP's next ADD needs no
	// sweep) and its endpoint's deletion: without the host firewall no
	// bpf_host program makes an entry for it.
	{Name: "host-to-deleted-pod", NotStandin: notGone, Defines: []string{"ENABLE_NODEPORT"}, NoEntries: "after the pod's scrub, cil_from_host without the host firewall makes no entry for an address no endpoint holds", Run: func(e *Env) ([]*Pod, []string) {
		a, node := e.Pod("a"), e.NodeIP()
		e.N.AddRemote(node, HostID)
		e.Expect("node to pod", e.N.FromHost(TCPFrame(AP(node, 50000), AP(e.IP(a), 8080), SYN)))
		e.Expect("pod's SYN-ACK", e.N.Send(a, TCPFrame(AP(e.IP(a), 8080), AP(node, 50000), SYN|ACK)))
		e.deleteScrubbed(a)
		e.N.FromHost(TCPFrame(AP(node, 50000), AP(e.IP(a), 8080), ACK))
		e.N.FromHost(TCPFrame(AP(node, 50002), AP(e.IP(a), 8080), SYN))
		e.N.FromHost(UDPFrame(AP(node, 50003), AP(e.IP(a), 5353)))
		e.N.FromHost(e.Echo(node, e.IP(a), true, 11))
		return []*Pod{a}, nil
	}},
	// A remote client (another node's pod, the world) keeps sending to an
	// IP after its pod's DEL: its live flow's next segments, new flows,
	// datagrams, echoes, on the native device. No bpf_host program makes
	// an entry for them (nodeport_lb4/6 finds no service, the host
	// firewall is off): the released IP's complete slot stays right.
	{Name: "remote-client-after-pod-deleted", NotStandin: notGone, Defines: []string{"ENABLE_NODEPORT"}, NoEntries: "after the pod's scrub, bpf_host makes no entry for packets to an address no endpoint holds (no service, no host firewall)", Run: func(e *Env) ([]*Pod, []string) {
		a, r, w := e.Pod("a"), e.Remote(), e.World()
		e.Expect("remote SYN", e.N.FromNetdev(TCPFrame(AP(r, 40001), AP(e.IP(a), 8080), SYN)))
		e.Expect("pod's SYN-ACK", e.N.Send(a, TCPFrame(AP(e.IP(a), 8080), AP(r, 40001), SYN|ACK)))
		e.Expect("world UDP", e.N.FromNetdev(UDPFrame(AP(w, 40002), AP(e.IP(a), 5353))))
		e.Expect("pod's reply", e.N.Send(a, UDPFrame(AP(e.IP(a), 5353), AP(w, 40002))))
		e.deleteScrubbed(a)
		e.N.FromNetdev(TCPFrame(AP(r, 40001), AP(e.IP(a), 8080), ACK|PSH))
		e.N.FromNetdev(TCPFrame(AP(r, 40003), AP(e.IP(a), 8080), SYN))
		e.N.FromNetdev(UDPFrame(AP(r, 40004), AP(e.IP(a), 53)))
		e.N.FromNetdev(UDPFrame(AP(w, 40002), AP(e.IP(a), 5353)))
		e.N.FromNetdev(e.Echo(w, e.IP(a), true, 12))
		return []*Pod{a}, nil
	}},
	// Tunnel mode: another node's pod reaches a local pod over the overlay
	// (bpf_overlay's cil_from_overlay, then the pod's ingress policy by
	// tail call): the pod's entries as from the native device, recorded on
	// delivery.
	{Name: "overlay-remote-pod-to-pod", NotStandin: notOverlay, Defines: []string{"ENABLE_NODEPORT"}, Run: func(e *Env) ([]*Pod, []string) {
		a, r := e.Pod("a"), e.Remote()
		e.Expect("SYN over the tunnel", e.N.FromOverlay(TCPFrame(AP(r, 40001), AP(e.IP(a), 8080), SYN)))
		e.Expect("pod's SYN-ACK", e.N.Send(a, TCPFrame(AP(e.IP(a), 8080), AP(r, 40001), SYN|ACK)))
		e.Expect("UDP over the tunnel", e.N.FromOverlay(UDPFrame(AP(r, 40002), AP(e.IP(a), 5353))))
		e.Expect("SYN over the tunnel, unanswered", e.N.FromOverlay(TCPFrame(AP(r, 40003), AP(e.IP(a), 8081), SYN)))
		return []*Pod{a}, nil
	}, After: func(e *Env, pods []*Pod) { e.ScrubByIndex(e.IP(pods[0])) }},
	// The remote client keeps sending over the tunnel after the pod's DEL:
	// bpf_overlay has no ct_create of its own and nodeport_lb4/6 finds no
	// service: no entry.
	{Name: "overlay-remote-client-after-pod-deleted", NotStandin: notGone, Defines: []string{"ENABLE_NODEPORT"}, NoEntries: "after the pod's scrub, bpf_overlay makes no entry for packets to an address no endpoint holds (no service)", Run: func(e *Env) ([]*Pod, []string) {
		a, r := e.Pod("a"), e.Remote()
		e.Expect("SYN over the tunnel", e.N.FromOverlay(TCPFrame(AP(r, 40001), AP(e.IP(a), 8080), SYN)))
		e.Expect("pod's SYN-ACK", e.N.Send(a, TCPFrame(AP(e.IP(a), 8080), AP(r, 40001), SYN|ACK)))
		e.deleteScrubbed(a)
		e.N.FromOverlay(TCPFrame(AP(r, 40001), AP(e.IP(a), 8080), ACK|PSH))
		e.N.FromOverlay(TCPFrame(AP(r, 40003), AP(e.IP(a), 8080), SYN))
		e.N.FromOverlay(UDPFrame(AP(r, 40004), AP(e.IP(a), 53)))
		e.N.FromOverlay(e.Echo(r, e.IP(a), true, 13))
		return []*Pod{a}, nil
	}},
	// With the host firewall: the node probes a pod whose endpoint is
	// gone. The host's egress policy on cilium_host (cil_from_host) makes
	// the OUT entry before anything is delivered; scrubd must have
	// marked the IP (host_firewall).
	{Name: "host-firewall-to-deleted-pod", Node: NodeHostFWDSR, NotStandin: notGone, Defines: hostFWDefines, Marks: cilium.ReasonHostFirewall, Run: func(e *Env) ([]*Pod, []string) {
		a, node := e.Pod("a"), e.NodeIP()
		e.N.AddRemote(node, HostID)
		e.Expect("node to pod", e.N.FromHost(TCPFrame(AP(node, 50000), AP(e.IP(a), 8080), SYN)))
		e.Expect("pod's SYN-ACK", e.N.Send(a, TCPFrame(AP(e.IP(a), 8080), AP(node, 50000), SYN|ACK)))
		e.N.CoveragePass()
		e.N.DeletePod(a)
		before := e.Entries(e.IP(a), node)
		e.N.FromHost(TCPFrame(AP(node, 50001), AP(e.IP(a), 8080), SYN))
		if e.Entries(e.IP(a), node) <= before {
			e.Fail("the host firewall made no entry for the probe of the deleted pod: the case tests nothing of it")
		}
		return []*Pod{a}, []string{cilium.ReasonHostFirewall}
	}},
	// With the host firewall: the pod's policy denies the node's packet
	// (a deny rule for the host identity on one port). The host's egress
	// policy made the OUT entry first; the pod's ingress policy drops the
	// packet before bpf_lxc's entry and the pod's recorder.
	{Name: "host-firewall-policy-drop", Node: NodeHostFWDSR, NotStandin: notHostFW, Defines: hostFWDefines, Marks: cilium.ReasonHostFirewall, Run: func(e *Env) ([]*Pod, []string) {
		a, node := e.Pod("a"), e.NodeIP()
		e.N.AddRemote(node, HostID)
		e.N.DenyIngress(HostID, ProtoTCP, 9)
		e.Expect("node to pod, denied", e.N.FromHost(TCPFrame(AP(node, 50000), AP(e.IP(a), 9), SYN)), VerdictShot)
		if e.Entries(e.IP(a), node) == 0 {
			e.Fail("the host firewall made no entry for the denied packet: the case tests nothing")
		}
		return []*Pod{a}, []string{cilium.ReasonHostFirewall}
	}},
	// The L7 proxy (Envoy) cannot run here: its own connections to and from
	// the pod are what the recorder never sees. The case runs Cilium's real
	// redirect (a policy entry with a proxy port, as the agent writes for
	// an L7 rule) and checks that the daemon marks the pod incomplete.
	{Name: "l7-proxy-redirect", Marks: cilium.ReasonL7Proxy, Run: func(e *Env) ([]*Pod, []string) {
		a, w := e.Pod("a"), e.World()
		id := l7ID + uint32(e.next()) // the entries match this case's peer only
		e.N.AddRemote(w, id)
		e.N.AddL7(false, id, ProtoTCP, 80, 15001)  // ingress TCP/80 from w
		e.N.AddL7(true, id, ProtoTCP, 8080, 15002) // egress TCP/8080 to w
		e.N.PinPolicy(a)
		e.Expect("SYN to the L7 port", e.N.FromNetdev(TCPFrame(AP(w, 50001), AP(e.IP(a), 80), SYN)))
		e.Expect("SYN out to the L7 port", e.N.Send(a, TCPFrame(AP(e.IP(a), 40001), AP(w, 8080), SYN)))
		if r, all := e.Redirected(e.IP(a)); r != 2 || all != 2 {
			e.Fail("Cilium flagged %d of %d TCP entries proxy_redirect, want 2 of 2 (the L7 rules did not take)", r, all)
		}
		return []*Pod{a}, []string{cilium.ReasonL7Proxy}
	}},
	// Per-endpoint CT maps (ConntrackLocal, 1.16-1.17): the pod's own CT
	// map beside the global ones. The harness's bpf_lxc uses the global
	// maps (the agent's per-endpoint CT_MAP_* defines would need another
	// object per version); the map is made with the spec of the object's
	// own global CT map and pinned under the agent's name for the pod's
	// endpoint ID. Every IP a scrub names is marked while it is pinned.
	{Name: "per-endpoint-ct-maps", Marks: cilium.ReasonLocalCT, Run: func(e *Env) ([]*Pod, []string) {
		a, w := e.Pod("a"), e.World()
		e.N.AddRemote(w, worldID)
		e.N.PinExtraCT(fmt.Sprintf("cilium_ct4_%05d", a.ID), e.N.LXC.CT[ctmap.TCP4])
		e.Expect("SYN", e.N.Send(a, TCPFrame(AP(e.IP(a), 40001), AP(w, 443), SYN)))
		return []*Pod{a}, []string{cilium.ReasonLocalCT}
	}, After: func(e *Env, _ []*Pod) { e.N.UnpinExtraCT() }},
	// Per-cluster CT maps (cluster-aware addressing): the outer
	// array-of-maps and cluster 1's inner map pinned under the agent's
	// names. From 1.19 Cilium's bpf_lxc (test build) carries both, inner
	// map in slot 1; before, they are made with the agent's spec (outer:
	// 256 slots; inner: the object's global CT map spec).
	{Name: "per-cluster-ct-maps", Marks: cilium.ReasonPerClusterCT, Run: func(e *Env) ([]*Pod, []string) {
		a, w := e.Pod("a"), e.World()
		e.N.AddRemote(w, worldID)
		e.N.PinPerClusterCT()
		e.Expect("SYN", e.N.Send(a, TCPFrame(AP(e.IP(a), 40001), AP(w, 443), SYN)))
		return []*Pod{a}, []string{cilium.ReasonPerClusterCT}
	}, After: func(e *Env, _ []*Pod) { e.N.UnpinExtraCT() }},
}

// ingressID is Cilium's reserved identity of the L7 load balancer's
// upstream traffic (reserved:ingress).
const ingressID = 8

// l7ID is the first identity of the L7 case's peers.
const l7ID = 70000
