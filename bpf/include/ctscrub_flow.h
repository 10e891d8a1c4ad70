/* Packet parsing shared by the recorder (bpf/recorder.c) and the test-only
 * Cilium stand-in (internal/testsupport/standin/cilium_standin.c): both must derive the same CT key
 * from the same packet, or the tests that compare them prove nothing. */
#ifndef CTSCRUB_FLOW_H
#define CTSCRUB_FLOW_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "ctscrub.h"

/* -1: run the next filter (TC_ACT_UNSPEC for cls_bpf, TCX_NEXT for tcx). */
#ifndef TCX_NEXT
#define TCX_NEXT -1
#endif

#define PROTO_ICMP 1
#define PROTO_TCP 6
#define PROTO_UDP 17
#define PROTO_ICMPV6 58
#define PROTO_SCTP 132

#define NH_HOPOPTS 0
#define NH_ROUTING 43
#define NH_FRAGMENT 44
#define NH_AUTH 51
#define NH_NONE 59
#define NH_DSTOPTS 60

/* Cilium's ipv6_hdrlen walks at most this many extension headers. */
#define MAX_IPV6_EXTHDRS 4

#define TCPF_SYN 0x02
#define TCPF_ACK 0x10

/* One packet's flow as Cilium's CT sees it. Addresses are kept as four
 * 32-bit words in network order; IPv4 is v4-mapped (::ffff:a.b.c.d) so both
 * families share one layout, and the IPv4 address is word 3. */
struct flow {
	__u32 src[4];
	__u32 dst[4];
	__be16 sport; /* the sender's "port" (ICMP echo: identifier of a request) */
	__be16 dport; /* the receiver's "port" */
	__u8 family;  /* 4 or 6 */
	__u8 proto;
	__u8 tcp_flags;
	__u8 related; /* CT_F_RELATED for an ICMP error, else 0 */
};

/* Loads n (8 or 16) bytes of the L4 header at off: direct packet access on
 * the fast path, bpf_skb_load_bytes when the header is not in the linear
 * part. */
static __always_inline int load_l4(struct __sk_buff *skb, __u32 off, void *buf, int n)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;

	if (off > 2048)
		return -1;
	if (n == 16) {
		if (data + off + 16 <= end) {
			__builtin_memcpy(buf, data + off, 16);
			return 0;
		}
		return bpf_skb_load_bytes(skb, off, buf, 16);
	}
	if (data + off + 8 <= end) {
		__builtin_memcpy(buf, data + off, 8);
		return 0;
	}
	return bpf_skb_load_bytes(skb, off, buf, 8);
}

/* Fills f from the L4 header at off. Returns 0 when Cilium would create (or
 * match) a CT entry for the packet, -1 when it would not: IPv6 neighbour
 * discovery (Cilium answers it without CT), protocols Cilium's CT does not
 * handle, truncated headers. An ICMP error is a flow of its own with ports
 * 0 and f->related set: when it matches no related entry (unsolicited, from
 * a router on the path, or after the flow's related entry expired) Cilium
 * creates one, keyed sender -> receiver, ports 0, direction | RELATED
 * (e2e/conformance: icmp-error-*). */
static __always_inline int flow_l4(struct __sk_buff *skb, __u32 off, struct flow *f)
{
	__u8 l4[16];

	switch (f->proto) {
	case PROTO_TCP:
		if (load_l4(skb, off, l4, 16) < 0)
			return -1;
		f->tcp_flags = l4[13];
		break;
	case PROTO_UDP:
	case PROTO_SCTP:
	case PROTO_ICMP:
	case PROTO_ICMPV6:
		if (load_l4(skb, off, l4, 8) < 0)
			return -1;
		break;
	default:
		return -1;
	}

	if (f->proto == PROTO_ICMP || f->proto == PROTO_ICMPV6) {
		__u8 type = l4[0];
		__be16 id = *(__be16 *)&l4[4];
		__u8 echo_req = f->proto == PROTO_ICMP ? 8 : 128;
		__u8 echo_rep = f->proto == PROTO_ICMP ? 0 : 129;

		/* Ports: the echo identifier is the initiator's "port" (Cilium
		 * stores sport = id, dport = 0 for a request's flow). */
		f->sport = 0;
		f->dport = 0;
		if (type == echo_req) {
			f->sport = id;
		} else if (type == echo_rep) {
			f->dport = id;
		} else if (f->proto == PROTO_ICMP) {
			/* dest unreachable, time exceeded, parameter problem */
			if (type == 3 || type == 11 || type == 12)
				f->related = CT_F_RELATED;
		} else {
			/* unreachable, too big, time exceeded, param problem */
			if (type >= 1 && type <= 4)
				f->related = CT_F_RELATED;
			/* router/neighbour solicitation/advertisement, redirect */
			if (type >= 133 && type <= 137)
				return -1;
		}
		return 0;
	}
	f->sport = *(__be16 *)&l4[0];
	f->dport = *(__be16 *)&l4[2];
	return 0;
}

/* Parses an Ethernet frame into f. Returns -1 for anything Cilium's CT
 * would not create an entry for, including non-first fragments (their L4
 * header is in the first fragment). */
static __always_inline int flow_parse(struct __sk_buff *skb, struct flow *f)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;

	if ((void *)(eth + 1) > end)
		return -1;

	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);
		__u32 ihl;

		if ((void *)(ip + 1) > end)
			return -1;
		if (ip->frag_off & bpf_htons(0x1fff))
			return -1;
		ihl = ip->ihl * 4;
		if (ihl < sizeof(*ip))
			return -1;
		f->family = 4;
		f->proto = ip->protocol;
		f->src[0] = 0;
		f->src[1] = 0;
		f->src[2] = bpf_htonl(0xffff);
		f->src[3] = ip->saddr;
		f->dst[0] = 0;
		f->dst[1] = 0;
		f->dst[2] = bpf_htonl(0xffff);
		f->dst[3] = ip->daddr;
		return flow_l4(skb, sizeof(*eth) + ihl, f);
	}

	if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);
		__u32 off = sizeof(*eth) + sizeof(*ip6);
		__u8 nh;
		int i;

		if ((void *)(ip6 + 1) > end)
			return -1;
		f->family = 6;
		__builtin_memcpy(f->src, &ip6->saddr, 16);
		__builtin_memcpy(f->dst, &ip6->daddr, 16);
		nh = ip6->nexthdr;

		/* Extension headers are rare: read them with load_bytes and
		 * keep the common path free of variable offsets. */
#pragma unroll
		for (i = 0; i < MAX_IPV6_EXTHDRS; i++) {
			__u8 opt[4];

			switch (nh) {
			case NH_HOPOPTS:
			case NH_ROUTING:
			case NH_DSTOPTS:
			case NH_AUTH:
			case NH_FRAGMENT:
				break;
			case NH_NONE:
				return -1;
			default:
				goto l4;
			}
			if (bpf_skb_load_bytes(skb, off, opt, 4) < 0)
				return -1;
			if (nh == NH_FRAGMENT) {
				/* frag offset: 13 bits of bytes 2-3 */
				if ((opt[2] << 5 | opt[3] >> 3) != 0)
					return -1;
				off += 8;
			} else if (nh == NH_AUTH) {
				off += (opt[1] + 2) * 4;
			} else {
				off += (opt[1] + 1) * 8;
			}
			nh = opt[0];
		}
		switch (nh) {
		case NH_HOPOPTS:
		case NH_ROUTING:
		case NH_DSTOPTS:
		case NH_AUTH:
		case NH_FRAGMENT:
		case NH_NONE:
			/* more extension headers than Cilium walks: it drops */
			return -1;
		}
l4:
		f->proto = nh;
		return flow_l4(skb, off, f);
	}
	return -1;
}

/* The CT key Cilium creates for the flow when this packet is the first one
 * it sees: the sender is the initiator (daddr, sport), the receiver the
 * responder (saddr, dport). flags says who the pod is: CT_F_OUT when the
 * sender is the pod, CT_F_IN when the receiver is. */
static __always_inline void flow_key4(const struct flow *f, struct ct_key4 *k, __u8 flags)
{
	k->daddr = f->src[3];
	k->saddr = f->dst[3];
	k->sport = f->sport;
	k->dport = f->dport;
	k->nexthdr = f->proto;
	k->flags = flags | f->related;
}

static __always_inline void flow_key6(const struct flow *f, struct ct_key6 *k, __u8 flags)
{
	__builtin_memcpy(k->daddr, f->src, 16);
	__builtin_memcpy(k->saddr, f->dst, 16);
	k->sport = f->sport;
	k->dport = f->dport;
	k->nexthdr = f->proto;
	k->flags = flags | f->related;
}

/* The key of the same flow when the receiver of this packet initiated it
 * (this packet is a reply). */
static __always_inline void flow_reply_key4(const struct flow *f, struct ct_key4 *k, __u8 flags)
{
	k->daddr = f->dst[3];
	k->saddr = f->src[3];
	k->sport = f->dport;
	k->dport = f->sport;
	k->nexthdr = f->proto;
	k->flags = flags | f->related;
}

static __always_inline void flow_reply_key6(const struct flow *f, struct ct_key6 *k, __u8 flags)
{
	__builtin_memcpy(k->daddr, f->dst, 16);
	__builtin_memcpy(k->saddr, f->src, 16);
	k->sport = f->dport;
	k->dport = f->sport;
	k->nexthdr = f->proto;
	k->flags = flags | f->related;
}

/* Cilium's service map layout (v1.16 bpf/lib/common.h, unchanged since). */
#define LB_LOOKUP_SCOPE_EXT 0

/* lb_service.flags2 bit 2: an L7 load-balancer service (Cilium Ingress,
 * Gateway API, CiliumEnvoyConfig; SVC_FLAG_L7LOADBALANCER in 1.16.5's
 * bpf/lib/common.h, SVC_FLAG_L7_LOADBALANCER in 1.18.8's and in 1.20.2's
 * bpf/lib/lb.h, the same bit). bpf_lxc, built with ENABLE_L7_LB, neither
 * load-balances nor DNATs a flow to such a VIP: it keeps the VIP in the
 * flow's OUT entry and redirects it to Envoy (__per_packet_lb_svc_xlate_4/6:
 * goto skip_service_lookup); 1.19 and 1.20 only when the frontend's
 * l7_lb_proxy_port (lb_service.backend_id) is non-zero. */
#define SVC_FLAG_L7_LOADBALANCER (1 << 2)
/* lb_service.flags2 bit 3 without flags' SVC_FLAG_HOSTPORT (bit 3): an L7
 * "punt to proxy" service (SVC_FLAG_L7_DELEGATE; 1.16.5 sets flags2 bit 3
 * only with hostPort). 1.20.2's bpf_lxc with ENABLE_L7_LB skips its load
 * balancing (lb4_svc_is_l7_punt_proxy), 1.18.8's does not look at it. */
#define SVC_FLAG_L7_DELEGATE (1 << 3)
#define SVC_FLAG_HOSTPORT (1 << 3)

struct lb4_key {
	__be32 address;
	__be16 dport;
	__u16 backend_slot; /* 0: the service frontend */
	__u8 proto;         /* v1.16: always 0; 1.17+: the L4 protocol, 0 = any */
	__u8 scope;
	__u8 pad[2];
};

struct lb6_key {
	__u8 address[16];
	__be16 dport;
	__u16 backend_slot;
	__u8 proto;
	__u8 scope;
	__u8 pad[2];
};

struct lb_service {
	__u32 backend_id; /* frontend: affinity timeout / L7 proxy port */
	__u16 count;      /* frontend: number of backend slots */
	__u16 rev_nat_index;
	__u8 flags;
	__u8 flags2;
	__u8 pad[2];
};

/* Cilium's service maps, as placeholders: user space replaces them at load
 * with the pinned maps (Cilium's for the recorder, the test stand-in's copies
 * for the stand-in). Empty, they find no VIP. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct lb4_key);
	__type(value, struct lb_service);
	__uint(max_entries, 1);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} cilium_lb4_services_v2 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct lb6_key);
	__type(value, struct lb_service);
	__uint(max_entries, 1);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} cilium_lb6_services_v2 SEC(".maps");

struct lb4_backend {
	__be32 address;
	__be16 port;
	__u8 proto;
	__u8 flags;
	__u8 cluster_id;
	__u8 pad[3];
};

struct lb6_backend {
	__u8 address[16];
	__be16 port;
	__u8 proto;
	__u8 flags;
	__u8 cluster_id;
	__u8 pad[3];
};

/* A service frontend lookup as the datapath does it: protocol 0 (v1.16 never
 * sets it), then the packet's protocol (1.17+ keys by protocol). */
#define SERVICE_LOOKUP(map, key, proto_)                                   \
	({                                                                 \
		struct lb_service *__s;                                    \
		(key)->proto = 0;                                          \
		__s = bpf_map_lookup_elem(map, key);                       \
		if (!__s) {                                                \
			(key)->proto = (proto_);                           \
			__s = bpf_map_lookup_elem(map, key);               \
		}                                                          \
		__s;                                                       \
	})

static __always_inline int flow_has_ports(const struct flow *f)
{
	return f->proto == PROTO_TCP || f->proto == PROTO_UDP || f->proto == PROTO_SCTP;
}

#endif
