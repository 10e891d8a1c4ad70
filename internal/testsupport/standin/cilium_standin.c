//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* TEST SUPPORT ONLY. A stand-in for Cilium's datapath on machines without
 * Cilium: it creates CT entries in Cilium's layout and with Cilium's key
 * conventions from real packets, so ctscrub's tests and demo have real
 * entries to index and scrub. scrubd never loads it.
 *
 * Attached with tcx on the HOST-side veth of a pod:
 *   ingress (the pod sends)    = cil_from_container: a reply of an existing
 *                                IN entry refreshes it; anything else
 *                                creates or refreshes the OUT entry (and
 *                                its related ICMP entry); a packet to a
 *                                service VIP creates a SERVICE entry and an
 *                                OUT entry towards a backend.
 *   egress (the pod receives)  = the ingress policy path: a reply of an
 *                                existing OUT entry refreshes it; anything
 *                                else creates or refreshes an IN entry (and
 *                                its related entry).
 * Packets are never rewritten (no DNAT towards the backend): the entries are
 * what matters. Every program returns TCX_NEXT. */
#include "ctscrub_flow.h"

char __license[] SEC("license") = "Dual BSD/GPL";

/* Lifetimes in seconds of Cilium's clock (ktime seconds), Cilium's
 * defaults; tests may shorten them. */
volatile const __u32 lifetime_tcp = 21600;
volatile const __u32 lifetime_syn = 60;
volatile const __u32 lifetime_nontcp = 60;
/* Cilium's close timeout (CT_CLOSE_TIMEOUT, 10 s by default): once a TCP
 * entry has seen a FIN or an RST, each packet sets its lifetime to this
 * instead of lifetime_tcp. 0: off, closed connections keep lifetime_tcp. */
volatile const __u32 lifetime_close = 0;

#define TCPF_FIN 0x01
#define TCPF_RST 0x04

/* Cilium's IPv4 service loopback address (network order; 0: none): a pod
 * reaching itself through a service VIP (hairpin) is SNATed to it, so the
 * OUT entry's initiator is this address. Cilium's default is 169.254.42.1. */
volatile const __u32 service_loopback4 = 0;
/* The same for IPv6 (1.19+ SNATs IPv6 hairpins; default fe80::1); all
 * zero: not SNATed. */
volatile const __u64 service_loopback6[2] = {};

/* Cilium's global CT maps; replaced at load with the test's maps. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct ct_key4);
	__type(value, struct ct_entry);
	__uint(max_entries, 1);
} cilium_ct4_global SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct ct_key4);
	__type(value, struct ct_entry);
	__uint(max_entries, 1);
} cilium_ct_any4_global SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct ct_key6);
	__type(value, struct ct_entry);
	__uint(max_entries, 1);
} cilium_ct6_global SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct ct_key6);
	__type(value, struct ct_entry);
	__uint(max_entries, 1);
} cilium_ct_any6_global SEC(".maps");

/* cilium_lb4_services_v2 / cilium_lb6_services_v2: ctscrub_flow.h. */

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, struct lb4_backend);
	__uint(max_entries, 1);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} cilium_lb4_backends_v3 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, struct lb6_backend);
	__uint(max_entries, 1);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} cilium_lb6_backends_v3 SEC(".maps");

static __always_inline __u32 now_sec(void)
{
	return bpf_ktime_get_ns() / 1000000000ULL;
}

static __always_inline __u32 lifetime(const struct flow *f)
{
	if (f->proto != PROTO_TCP)
		return lifetime_nontcp;
	if ((f->tcp_flags & (TCPF_SYN | TCPF_ACK)) == TCPF_SYN)
		return lifetime_syn;
	return lifetime_tcp;
}

/* entry_lifetime: lifetime(f), or the close timeout for a TCP entry that
 * has seen a FIN or an RST (flags_seen holds every packet's flags). */
static __always_inline __u32 entry_lifetime(const struct flow *f, __u8 flags_seen)
{
	if (lifetime_close && f->proto == PROTO_TCP && (flags_seen & (TCPF_FIN | TCPF_RST)))
		return lifetime_close;
	return lifetime(f);
}

static __always_inline void refresh(struct ct_entry *e, struct __sk_buff *skb, const struct flow *f)
{
	e->packets++;
	e->bytes += skb->len;
	e->tx_flags_seen |= f->tcp_flags;
	e->lifetime = now_sec() + entry_lifetime(f, e->tx_flags_seen);
}

static __always_inline void fill(struct ct_entry *e, struct __sk_buff *skb, const struct flow *f,
				 __u16 rev_nat)
{
	__builtin_memset(e, 0, sizeof(*e));
	e->lifetime = now_sec() + entry_lifetime(f, f->tcp_flags);
	e->packets = 1;
	e->bytes = skb->len;
	e->tx_flags_seen = f->tcp_flags;
	e->rev_nat_index = rev_nat;
	e->ifindex = skb->ifindex;
}

/* ---- IPv4 ---- */

static __always_inline void *ct_map4(__u8 proto)
{
	if (proto == PROTO_TCP)
		return &cilium_ct4_global;
	return &cilium_ct_any4_global;
}

static __always_inline int refresh4(struct __sk_buff *skb, const struct flow *f,
				    const struct ct_key4 *k)
{
	struct ct_entry *e = bpf_map_lookup_elem(ct_map4(k->nexthdr), k);

	if (!e)
		return 0;
	refresh(e, skb, f);
	return 1;
}

/* ct_create4: the entry and its related ICMP entry. */
static __always_inline void create4(struct __sk_buff *skb, const struct flow *f,
				    const struct ct_key4 *k, __u16 rev_nat)
{
	struct ct_entry e;
	struct ct_key4 rel = *k;

	if (refresh4(skb, f, k))
		return;
	fill(&e, skb, f, rev_nat);
	bpf_map_update_elem(ct_map4(k->nexthdr), k, &e, BPF_ANY);

	rel.dport = 0;
	rel.sport = 0;
	rel.nexthdr = PROTO_ICMP;
	rel.flags = k->flags | CT_F_RELATED;
	bpf_map_update_elem(&cilium_ct_any4_global, &rel, &e, BPF_ANY);
}

static __always_inline int service4(struct __sk_buff *skb, const struct flow *f)
{
	struct lb4_key sk = {.address = f->dst[3], .dport = f->dport};
	struct lb_service *svc, *slot;
	struct lb4_backend *be;
	struct ct_key4 k;
	struct ct_entry e;
	__u32 backend_id = 0;

	if (!flow_has_ports(f))
		return 0;
	svc = SERVICE_LOOKUP(&cilium_lb4_services_v2, &sk, f->proto);
	/* An L7 load-balancer VIP with its proxy port: Cilium with
	 * ENABLE_L7_LB keeps the plain flow to the VIP (its OUT entry) and
	 * redirects it to Envoy (1.19+ as here; 1.16-1.18 also without a
	 * port, which the agent never writes). */
	if (!svc || ((svc->flags2 & SVC_FLAG_L7_LOADBALANCER) && svc->backend_id))
		return 0;

	/* Backend slot 1: the stand-in does not balance, it only needs an
	 * address for the OUT entry. */
	if (svc->count > 0) {
		sk.backend_slot = 1;
		slot = bpf_map_lookup_elem(&cilium_lb4_services_v2, &sk);
		if (slot)
			backend_id = slot->backend_id;
	}

	/* SERVICE entry: the extracted tuple as it is, not reversed:
	 * daddr = VIP, saddr = pod, dport = pod's port, sport = VIP port. */
	k.daddr = f->dst[3];
	k.saddr = f->src[3];
	k.dport = f->sport;
	k.sport = f->dport;
	k.nexthdr = f->proto;
	k.flags = CT_F_SERVICE;
	if (!refresh4(skb, f, &k)) {
		fill(&e, skb, f, svc->rev_nat_index);
		e.backend_id = backend_id;
		bpf_map_update_elem(ct_map4(k.nexthdr), &k, &e, BPF_ANY);
	}

	be = backend_id ? bpf_map_lookup_elem(&cilium_lb4_backends_v3, &backend_id) : 0;
	if (be) {
		/* OUT entry as after DNAT: pod -> backend; a hairpin (the
		 * backend is the pod) is SNATed to the loopback address. */
		k.daddr = f->src[3];
		if (be->address == f->src[3] && service_loopback4)
			k.daddr = service_loopback4;
		k.saddr = be->address;
		k.sport = f->sport;
		k.dport = be->port;
		k.flags = CT_F_OUT;
		create4(skb, f, &k, svc->rev_nat_index);
	}
	return 1;
}

static __always_inline int is_frontend4(const struct flow *f)
{
	struct lb4_key sk = {.address = f->src[3], .dport = f->sport};

	return flow_has_ports(f) && SERVICE_LOOKUP(&cilium_lb4_services_v2, &sk, f->proto) != 0;
}

/* ---- IPv6 ---- */

static __always_inline void *ct_map6(__u8 proto)
{
	if (proto == PROTO_TCP)
		return &cilium_ct6_global;
	return &cilium_ct_any6_global;
}

static __always_inline int refresh6(struct __sk_buff *skb, const struct flow *f,
				    const struct ct_key6 *k)
{
	struct ct_entry *e = bpf_map_lookup_elem(ct_map6(k->nexthdr), k);

	if (!e)
		return 0;
	refresh(e, skb, f);
	return 1;
}

static __always_inline void create6(struct __sk_buff *skb, const struct flow *f,
				    const struct ct_key6 *k, __u16 rev_nat)
{
	struct ct_entry e;
	struct ct_key6 rel = *k;

	if (refresh6(skb, f, k))
		return;
	fill(&e, skb, f, rev_nat);
	bpf_map_update_elem(ct_map6(k->nexthdr), k, &e, BPF_ANY);

	rel.dport = 0;
	rel.sport = 0;
	rel.nexthdr = PROTO_ICMPV6;
	rel.flags = k->flags | CT_F_RELATED;
	bpf_map_update_elem(&cilium_ct_any6_global, &rel, &e, BPF_ANY);
}

static __always_inline int service6(struct __sk_buff *skb, const struct flow *f)
{
	struct lb6_key sk = {.dport = f->dport};
	struct lb_service *svc, *slot;
	struct lb6_backend *be;
	struct ct_key6 k;
	struct ct_entry e;
	__u32 backend_id = 0;

	if (!flow_has_ports(f))
		return 0;
	__builtin_memcpy(sk.address, f->dst, 16);
	svc = SERVICE_LOOKUP(&cilium_lb6_services_v2, &sk, f->proto);
	/* An L7 load-balancer VIP with its proxy port: Cilium with
	 * ENABLE_L7_LB keeps the plain flow to the VIP (its OUT entry) and
	 * redirects it to Envoy (1.19+ as here; 1.16-1.18 also without a
	 * port, which the agent never writes). */
	if (!svc || ((svc->flags2 & SVC_FLAG_L7_LOADBALANCER) && svc->backend_id))
		return 0;
	if (svc->count > 0) {
		sk.backend_slot = 1;
		slot = bpf_map_lookup_elem(&cilium_lb6_services_v2, &sk);
		if (slot)
			backend_id = slot->backend_id;
	}

	__builtin_memcpy(k.daddr, f->dst, 16);
	__builtin_memcpy(k.saddr, f->src, 16);
	k.dport = f->sport;
	k.sport = f->dport;
	k.nexthdr = f->proto;
	k.flags = CT_F_SERVICE;
	if (!refresh6(skb, f, &k)) {
		fill(&e, skb, f, svc->rev_nat_index);
		e.backend_id = backend_id;
		bpf_map_update_elem(ct_map6(k.nexthdr), &k, &e, BPF_ANY);
	}

	be = backend_id ? bpf_map_lookup_elem(&cilium_lb6_backends_v3, &backend_id) : 0;
	if (be) {
		__builtin_memcpy(k.daddr, f->src, 16);
		if (!__builtin_memcmp(be->address, f->src, 16)) {
			/* volatile reads: the loader sets them after compilation */
			__u64 lo0 = service_loopback6[0], lo1 = service_loopback6[1];

			if (lo0 | lo1) {
				__builtin_memcpy(k.daddr, &lo0, 8);
				__builtin_memcpy(k.daddr + 8, &lo1, 8);
			}
		}
		__builtin_memcpy(k.saddr, be->address, 16);
		k.sport = f->sport;
		k.dport = be->port;
		k.flags = CT_F_OUT;
		create6(skb, f, &k, svc->rev_nat_index);
	}
	return 1;
}

static __always_inline int is_frontend6(const struct flow *f)
{
	struct lb6_key sk = {.dport = f->sport};

	if (!flow_has_ports(f))
		return 0;
	__builtin_memcpy(sk.address, f->src, 16);
	return SERVICE_LOOKUP(&cilium_lb6_services_v2, &sk, f->proto) != 0;
}

/* ---- programs ---- */

SEC("tcx/ingress")
int standin_from_pod(struct __sk_buff *skb)
{
	struct flow f = {};

	if (flow_parse(skb, &f) < 0)
		return TCX_NEXT;
	if (f.family == 4) {
		struct ct_key4 k;

		flow_reply_key4(&f, &k, CT_F_IN);
		if (refresh4(skb, &f, &k))
			return TCX_NEXT;
		if (service4(skb, &f))
			return TCX_NEXT;
		flow_key4(&f, &k, CT_F_OUT);
		create4(skb, &f, &k, 0);
	} else {
		struct ct_key6 k;

		flow_reply_key6(&f, &k, CT_F_IN);
		if (refresh6(skb, &f, &k))
			return TCX_NEXT;
		if (service6(skb, &f))
			return TCX_NEXT;
		flow_key6(&f, &k, CT_F_OUT);
		create6(skb, &f, &k, 0);
	}
	return TCX_NEXT;
}

SEC("tcx/egress")
int standin_to_pod(struct __sk_buff *skb)
{
	struct flow f = {};

	if (flow_parse(skb, &f) < 0)
		return TCX_NEXT;
	if (f.family == 4) {
		struct ct_key4 k;

		flow_reply_key4(&f, &k, CT_F_OUT);
		if (refresh4(skb, &f, &k))
			return TCX_NEXT;
		/* A reply from a VIP: Cilium would have matched the OUT entry
		 * towards the backend and reverse-NATed it. */
		if (is_frontend4(&f))
			return TCX_NEXT;
		flow_key4(&f, &k, CT_F_IN);
		create4(skb, &f, &k, 0);
	} else {
		struct ct_key6 k;

		flow_reply_key6(&f, &k, CT_F_OUT);
		if (refresh6(skb, &f, &k))
			return TCX_NEXT;
		if (is_frontend6(&f))
			return TCX_NEXT;
		flow_key6(&f, &k, CT_F_IN);
		create6(skb, &f, &k, 0);
	}
	return TCX_NEXT;
}
