//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* The recorder: the kernel side of ctscrub's index.
 *
 * Attached as direct-action cls_bpf filters (clsact ingress and egress) to a
 * pod's container-side interface, inside the pod's network namespace:
 * egress = packets the pod sends, ingress = packets it receives. That
 * interface sees every packet of the pod, including those Cilium delivers
 * with a peer redirect that skips the host-side veth.
 *
 * recorder_host runs as a tcx link at the head of the pod's host-side veth's
 * ingress, ahead of Cilium's cil_from_container: the packets the pod sends,
 * as the egress program sees them, plus those a packet socket sent with
 * PACKET_QDISC_BYPASS, which skip the pod's tc egress. Both share the flow
 * caches, so a flow the egress program recorded is a cache hit here.
 *
 * For each new flow it sends one struct record (the CT key Cilium creates
 * for the flow) through a ring buffer; scrubd indexes it per pod IP. It never
 * changes a verdict: every path returns TC_ACT_UNSPEC (the next filter runs;
 * the same value as TCX_NEXT). */
#include "ctscrub_flow.h"

char __license[] SEC("license") = "Dual BSD/GPL";

#define REC_NEXT -1 /* TC_ACT_UNSPEC == TCX_NEXT */

/* Where a program runs (record's egress argument; non-zero = the pod sends). */
#define AT_POD_INGRESS 0
#define AT_POD_EGRESS 1
#define AT_HOST_INGRESS 2 /* the host-side veth's ingress: what the pod sends */

/* The flow as seen from the pod: local = the pod's side. Direction-free, so
 * a flow's packets both ways hit the same entry. One map per family keeps
 * the IPv4 key at 16 bytes: hashing and comparing it is most of the cost of
 * an established flow's packet. */
struct seen_key4 {
	__be32 local;
	__be32 remote;
	__be16 lport;
	__be16 rport;
	__u8 proto;
	__u8 pad[3];
};

struct seen_key6 {
	__u32 local[4];
	__u32 remote[4];
	__be16 lport;
	__be16 rport;
	__u8 proto;
	__u8 pad[3];
};

/* What the flow caches hold per flow. gen_local/gen_remote: the generations
 * of the local and remote addresses' rec_gen slots when the flow was
 * recorded; an entry whose generations are not the current ones is a miss.
 * Mirrored by scrubd/recorder/nodeentry.go (seenVal). */
struct seen_val {
	__u8 dir; /* CT_F_OUT or CT_F_IN: the direction of the recorded key */
	__u8 svc; /* SVC_FLOW, SVC_FLOW|SVC_NONE, or 0 */
	__u8 pad[2];
	/* non-TCP flows: time of the last packet, in 2^30 ns units; service
	 * flows: the backend_id their SERVICE entry held at the last record,
	 * or, with SVC_NONE, the time of the latest packet the pod sent on the
	 * flow (SVC_TIME_SHIFT units) */
	__u32 last;
	__u32 gen_local;
	__u32 gen_remote;
} __attribute__((aligned(8)));

/* dir, svc and last, the value's first 8 bytes, in one store (set_head), so
 * user space never reads SVC_NONE beside a backend_id or the reverse. */
static __always_inline void set_head(struct seen_val *v, __u64 head)
{
	*(__u64 *)v = head;
}

/* seen_val.svc: a flow the pod sends to a VIP Cilium load-balances per
 * packet (REC_SERVICE_ENTRY) ... */
#define SVC_FLOW 1
/* ... whose SERVICE entry was absent when the pod's latest packet on it
 * passed: last is then that packet's time, not a backend. User space reads
 * it to settle a flow Cilium made no entry for (a service without
 * backends: docs/recorder.md, "Service VIPs"). */
#define SVC_NONE 2
/* last's time unit with SVC_NONE, and struct record's at: 2^20 ns. */
#define SVC_TIME_SHIFT 20

/* A non-TCP flow idle this long (2^30 ns units, about seconds) whose next
 * packet goes the other way is recorded again: Cilium's entry may have
 * expired (non-TCP lifetime: 60 s by default) and the other side then
 * becomes the initiator of a new entry. */
volatile const __u32 reopen_idle = 10;

/* How many units a non-TCP flow's front cache entry stands after it was
 * filled: (reopen_idle - 1) / 2, set by scrubd. Its front hits do not note
 * the flow's time in rec_flows4, which then lags the last packet by up to
 * front_idle units: a packet the other way finds the flow idle that much
 * early, and is recorded again (a key Cilium may not have made: one failed
 * delete later). Never late: a reopening is never missed. */
volatile const __u32 front_idle = 4;

/* Records for user space. Size set by scrubd (Options.RingBytes). */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 22);
} rec_events SEC(".maps");

/* ---- generations: forgetting an IP's cached flows in O(1) ----
 *
 * One u32 per slot, the slot chosen by a hash of the address. Every cached
 * flow carries the generations of its two addresses' slots; scrubd bumps an
 * address's slot (a new pod got the address, the index declared it complete,
 * a scrub took its keys) and every cached flow of that address stops
 * matching: its next packet is recorded again. Two addresses sharing a slot
 * only cost extra records (IPv4 addresses that differ only in their last
 * byte never do). 4096 slots (32 KiB) stay in the CPU's cache; an ARRAY
 * lookup is inlined by the verifier: no helper call on the fast path.
 * Mirrored by scrubd/recorder/forget.go (genSlot). */
#define GEN_SLOTS (1 << 12)

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, __u32);
	__uint(max_entries, GEN_SLOTS);
} rec_gen SEC(".maps");

static __always_inline __u32 gen_slot4(__be32 a)
{
	return ((__u32)a * 0x9e3779b1u) >> 20;
}

static __always_inline __u32 gen_slot6(const __u32 *a)
{
	return ((a[0] ^ a[1] ^ a[2] ^ a[3]) * 0x9e3779b1u) >> 20;
}

static __always_inline __u32 gen_of(__u32 slot)
{
	__u32 *g = bpf_map_lookup_elem(&rec_gen, &slot);

	return g ? *g : 0;
}

/* Flows already recorded (the source of truth). An eviction only re-sends a
 * record; the index dedups. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct seen_key4);
	__type(value, struct seen_val);
	__uint(max_entries, 1 << 18);
} rec_flows4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct seen_key6);
	__type(value, struct seen_val);
	__uint(max_entries, 1 << 18);
} rec_flows6 SEC(".maps");

/* ---- the front cache: established flows without a hash map ----
 *
 * A direct-mapped per-CPU array in front of rec_flows4 for IPv4 packets
 * of a recorded flow. TCP packets that are not a bare SYN need nothing
 * more (an LRU hit ends the program whatever the direction), so a front hit
 * may end it too. Other protocols (UDP, ICMP) need two things of the LRU
 * path (reopened()): a packet in the direction opposite to the recorded one
 * after reopen_idle needs a new record, and the flow's time is noted once a
 * unit. So their front hit also needs an entry filled at most front_idle
 * units ago (last), in either direction: the fill noted the flow's time in
 * rec_flows4 then, so the LRU path would find the flow idle for at most
 * front_idle < reopen_idle units and record nothing. Past front_idle the
 * LRU path runs again, notes the time and refills the entry. Per CPU, so no other CPU can tear an entry while it is read or
 * written (tc programs run with bottom halves off). An entry is filled from
 * rec_flows4 (or when the flow is recorded) with that entry's generations,
 * and matches only with the full key and the current generations: a bumped
 * address invalidates it as it invalidates rec_flows4. scrubd never deletes
 * single flows (it bumps generations), so nothing else can make an entry
 * stale. A collision only sends the packet to rec_flows4. Bare SYNs skip it:
 * they may need a record when rec_flows4 says the flow went the other way. */
struct front4 {
	__u64 key[2]; /* struct seen_key4 */
	__u32 gen_local;
	__u32 gen_remote;
	__u32 last; /* non-TCP: the unit (now_coarse) the entry was filled in */
	__u32 pad;
};

/* Slots per CPU minus one (a power of two minus one; set by scrubd). */
volatile const __u32 front_mask = (1 << 14) - 1;

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct front4);
	__uint(max_entries, 1 << 14);
} rec_front4 SEC(".maps");

static __always_inline __u32 front_slot4(const struct seen_key4 *k)
{
	__u32 h = (__u32)k->local * 0x9e3779b1u ^ (__u32)k->remote * 0x85ebca6bu ^
		  ((__u32)k->lport << 16 | k->rport) * 0xc2b2ae35u ^ k->proto;

	return (h ^ h >> 15) & front_mask;
}

/* ---- losses ----
 *
 * Records that did not fit in the ring buffer, per pod IP (v4-mapped). A
 * plain hash, so nothing is ever evicted: scrubd acts on a count that grew.
 * When it is full, the loss goes to rec_lost_overflow and scrubd
 * marks every IP incomplete. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32[4]);
	__type(value, __u64);
	__uint(max_entries, 16384);
} rec_lost_ip SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, 1);
} rec_lost_total SEC(".maps");

/* Losses rec_lost_ip had no room to count. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, 1);
} rec_lost_overflow SEC(".maps");

/* ---- whose source address: forged sources ----
 *
 * Cilium drops a packet whose source is not its endpoint's own address, but
 * only after the recorder saw it leave the pod. rec_owner holds every
 * attached interface's addresses (key: the address, v4-mapped), written by
 * scrubd at Attach before the filters go live. A new flow a pod sends from
 * an address its interface does not own is recorded as REC_FOREIGN: user
 * space files nothing under the claimed source and marks it incomplete.
 * An LRU: only scrubd inserts; an entry evicted (16,384 attaches later, its
 * pod sending no new flow meanwhile) makes that pod's flows foreign: its
 * IPs sweep, fail closed. */
struct owner {
	__u64 netns;        /* cookie of the interface's network namespace */
	__u32 ifindex;      /* the interface, in that namespace */
	__u32 host_ifindex; /* its host-side peer, in the node's namespace (0: none) */
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, __u32[4]);
	__type(value, struct owner);
	__uint(max_entries, 1 << 14);
} rec_owner SEC(".maps");

/* REC_FOREIGN records put in the ring buffer (Recorder.ForeignSources). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, 1);
} rec_foreign_total SEC(".maps");

/* 1: compare the sending socket's network namespace (bpf_get_netns_cookie)
 * as well as the ifindex. scrubd sets it when the kernel lets tc programs
 * call the helper (a recent addition); at 0 the call is dead code the
 * verifier never sees, so the object loads on older kernels. ifindexes are
 * per namespace: the cookie tells two pods' eth0 apart when their ifindexes
 * are equal. */
volatile const __u8 owner_netns = 0;

/* Sources no pod IP can be, never in the pod CIDRs: unspecified (a DAD-time
 * MLD report from ::, DHCP) and link-local (a pod's fe80:: may be configured
 * after Attach listed its addresses). Recorded as before, not counted. */
static __always_inline int scoped_source(const struct flow *f)
{
	if (f->family == 4)
		return f->src[3] == 0 || (f->src[3] & bpf_htonl(0xffff0000)) == bpf_htonl(0xa9fe0000);
	return (f->src[0] | f->src[1] | f->src[2] | f->src[3]) == 0 ||
	       (f->src[0] & bpf_htonl(0xffc00000)) == bpf_htonl(0xfe800000);
}

/* Whether the interface the packet leaves by owns its source address. A
 * packet without a socket (forwarded inside the pod, which takes
 * CAP_NET_ADMIN there, and with it the power to remove the filters) has
 * only the ifindex to go by: bpf_get_netns_cookie reads the socket's
 * namespace, and would name the initial one. On the host side the packet
 * arrives on the peer (host_ifindex, unique in the node's namespace); a veth
 * keeps the sending socket, so the cookie is still the pod's. */
static __always_inline int own_source(struct __sk_buff *skb, const __u32 *src, int at)
{
	struct owner *o = bpf_map_lookup_elem(&rec_owner, src);

	if (!o || (at == AT_HOST_INGRESS ? o->host_ifindex : o->ifindex) != skb->ifindex)
		return 0;
	if (owner_netns && skb->sk && bpf_get_netns_cookie(skb) != o->netns)
		return 0;
	return 1;
}

/* cilium_lb4_services_v2 / cilium_lb6_services_v2: ctscrub_flow.h. */

static __always_inline void count(void *counter)
{
	__u32 zero = 0;
	__u64 *c = bpf_map_lookup_elem(counter, &zero);

	if (c)
		__sync_fetch_and_add(c, 1);
}

/* The per-IP (or overflow) count first, the total last: scrubd reads the
 * total after its ring barrier and reads the per-IP counts only when the
 * total moved, so a total that moved must imply the per-IP count is already
 * visible. x86 JITs a lock-prefixed add, a full barrier; arm64 JITs -mcpu=v1's
 * non-fetching add as a relaxed STADD, where this order needs a fetching add
 * (-mcpu=v3). */
static __always_inline void count_lost(const __u32 *ip)
{
	__u64 one = 1, *c;

	c = bpf_map_lookup_elem(&rec_lost_ip, ip);
	if (c) {
		__sync_fetch_and_add(c, 1);
	} else if (bpf_map_update_elem(&rec_lost_ip, ip, &one, BPF_NOEXIST) != 0) {
		c = bpf_map_lookup_elem(&rec_lost_ip, ip); /* another CPU inserted it */
		if (c)
			__sync_fetch_and_add(c, 1);
		else
			count(&rec_lost_overflow); /* full: scrubd marks every IP incomplete */
	}
	count(&rec_lost_total);
}

/* Whether the packet goes to a service VIP that Cilium load-balances per
 * packet (it then creates a SERVICE entry and an OUT entry towards a backend
 * the pod never sees): TO_SVC_LB; to an L7 load-balancer VIP (Cilium keeps
 * the plain flow to the VIP): TO_SVC_L7; to a "punt to proxy" VIP, which
 * 1.20 keeps as a plain flow and 1.18 load-balances: TO_SVC_PUNT (both are
 * recorded); 0 otherwise. */
#define TO_SVC_LB 1
#define TO_SVC_L7 2
#define TO_SVC_PUNT 3
static __always_inline int to_service(const struct flow *f)
{
	struct lb_service *s;

	if (!flow_has_ports(f))
		return 0;
	if (f->family == 4) {
		struct lb4_key k = {
			.address = f->dst[3],
			.dport = f->dport,
			.scope = LB_LOOKUP_SCOPE_EXT,
		};
		s = SERVICE_LOOKUP(&cilium_lb4_services_v2, &k, f->proto);
	} else {
		struct lb6_key k = {
			.dport = f->dport,
			.scope = LB_LOOKUP_SCOPE_EXT,
		};
		__builtin_memcpy(k.address, f->dst, 16);
		s = SERVICE_LOOKUP(&cilium_lb6_services_v2, &k, f->proto);
	}
	if (!s)
		return 0;
	/* 1.19+ also require the frontend's l7_lb_proxy_port (the value's
	 * first field) to be non-zero, 1.16 to 1.18 do not: with a port, an
	 * L7 VIP everywhere; without one, load-balanced from 1.19 and not
	 * before, so both records, as for a punt-to-proxy VIP. */
	if (s->flags2 & SVC_FLAG_L7_LOADBALANCER)
		return s->backend_id ? TO_SVC_L7 : TO_SVC_PUNT;
	if ((s->flags2 & SVC_FLAG_L7_DELEGATE) && !(s->flags & SVC_FLAG_HOSTPORT))
		return TO_SVC_PUNT;
	return TO_SVC_LB;
}

/* Cilium's global CT maps, as placeholders: user space replaces them at
 * load with the maps Cilium pinned (empty, a SERVICE entry is never found
 * and its flow's backend stays unknown: user space then resolves it). */
#define CT_PLACEHOLDER(name, key_t)                    \
	struct {                                       \
		__uint(type, BPF_MAP_TYPE_LRU_HASH);   \
		__type(key, key_t);                    \
		__type(value, struct ct_entry);        \
		__uint(max_entries, 1);                \
	} name SEC(".maps")

CT_PLACEHOLDER(cilium_ct4_global, struct ct_key4);
CT_PLACEHOLDER(cilium_ct_any4_global, struct ct_key4);
CT_PLACEHOLDER(cilium_ct6_global, struct ct_key6);
CT_PLACEHOLDER(cilium_ct_any6_global, struct ct_key6);

/* The backend_id of the SERVICE entry of a flow the pod sends to a VIP
 * (key: Cilium's SERVICE key, built from this packet), 0 when there is no
 * entry. Read before Cilium handles the packet: it names the backend the
 * previous packets went to, which is the one this packet goes to unless
 * that backend is gone (Cilium then picks another, read at the next
 * packet or by user space). */
static __always_inline __u32 svc_backend(const struct flow *f, void *key)
{
	struct ct_entry *e;

	if (f->family == 4) {
		flow_reply_key4(f, key, CT_F_SERVICE);
		e = bpf_map_lookup_elem(f->proto == PROTO_TCP ? (void *)&cilium_ct4_global : (void *)&cilium_ct_any4_global, key);
	} else {
		flow_reply_key6(f, key, CT_F_SERVICE);
		e = bpf_map_lookup_elem(f->proto == PROTO_TCP ? (void *)&cilium_ct6_global : (void *)&cilium_ct_any6_global, key);
	}
	return e ? (__u32)e->backend_id : 0;
}

/* Emits a REC_SERVICE_ENTRY record: the flow's SERVICE key, the backend
 * its entry holds now, and the packet's time. Sets *head to what the
 * flow's cache value's first 8 bytes become (set_head): the backend, or
 * SVC_NONE and the time when there is no entry. -1 when the ring was full. */
static __always_inline int emit_service(const struct flow *f, __u32 ifindex, __u64 *head)
{
	struct record *r = bpf_ringbuf_reserve(&rec_events, sizeof(*r), 0);
	__u64 at = bpf_ktime_get_ns() >> SVC_TIME_SHIFT;
	__u32 b;

	if (!r) {
		count_lost(f->src);
		return -1;
	}
	__builtin_memset(r, 0, sizeof(*r));
	r->family = f->family;
	r->kind = REC_SERVICE_ENTRY;
	r->ifindex = ifindex;
	b = svc_backend(f, r->key);
	r->backend = b;
	r->at_hi = at >> 32;
	r->at_lo = at;
	bpf_ringbuf_submit(r, 0);
	if (b)
		*head = (__u64)b << 32 | SVC_FLOW << 8 | CT_F_OUT;
	else
		*head = (at & 0xffffffff) << 32 | (SVC_FLOW | SVC_NONE) << 8 | CT_F_OUT;
	return 0;
}

/* A later packet the pod sends on a service flow: a record when its SERVICE
 * entry names another backend than at the last record (a backend re-picked
 * after the old one was removed, the entry re-created, or gone). One CT
 * lookup, only on service flows. While the entry stays absent (SVC_NONE)
 * nothing is recorded, but the packet's time is kept (one store per flow
 * and 2^20 ns at most): user space settles such a flow only when no packet
 * came too recently for Cilium to have handled it. */
static __always_inline void service_packet(struct __sk_buff *skb, const struct flow *f, struct seen_val *v)
{
	struct ct_key6 k;
	__u32 b = svc_backend(f, &k), t;
	__u64 head;

	if (v->svc & SVC_NONE) {
		if (!b) {
			t = bpf_ktime_get_ns() >> SVC_TIME_SHIFT;
			if (v->last != t)
				v->last = t;
			return;
		}
	} else if (b == v->last) {
		return;
	}
	if (emit_service(f, skb->ifindex, &head) == 0)
		set_head(v, head);
}

/* Emits the record of a new flow. Returns 0 when it is in the ring buffer
 * (the caller then marks the flow seen), -1 when the ring was full (the
 * loss is counted against the pod IP; the flow stays unseen so its next
 * packet tries again). Only new flows get here: the owner lookup costs
 * nothing on a cached flow's path. A foreign flow stays cached like any
 * other: the genuine owner's same 5-tuple then hits the cache, but its
 * address is marked incomplete by the foreign record, and only a sweep
 * (Track: a generation bump that drops the cached flow) makes it complete.
 * A flow the pod sends to a VIP (a foreign source's excepted: marking the
 * claimed source covers its entries) is a service flow: 1 is returned and
 * val's head set. */
static __always_inline int emit(struct __sk_buff *skb, const struct flow *f, int egress, __u8 dir, struct seen_val *val)
{
	struct record *r;
	__u8 flags = dir;
	int foreign = egress && !scoped_source(f) && !own_source(skb, f->src, egress);
	int svc = !foreign && egress ? to_service(f) : 0;
	__u64 head;

	if (svc == TO_SVC_LB) {
		if (emit_service(f, skb->ifindex, &head) < 0)
			return -1;
		set_head(val, head);
		return 1;
	}
	r = bpf_ringbuf_reserve(&rec_events, sizeof(*r), 0);
	if (!r) {
		count_lost(egress ? f->src : f->dst);
		return -1;
	}
	if (foreign)
		count(&rec_foreign_total);
	__builtin_memset(r, 0, sizeof(*r));
	r->family = f->family;
	r->kind = foreign ? REC_FOREIGN : svc == TO_SVC_L7 ? REC_L7LB : REC_FLOW;
	r->ifindex = skb->ifindex;
	if (f->family == 4)
		flow_key4(f, (struct ct_key4 *)r->key, flags);
	else
		flow_key6(f, (struct ct_key6 *)r->key, flags);
	bpf_ringbuf_submit(r, 0);
	if (svc == TO_SVC_PUNT) {
		/* The plain key is filed; now the service flow as for TO_SVC_LB
		 * (a lost record leaves the flow uncached: both again). */
		if (emit_service(f, skb->ifindex, &head) < 0)
			return -1;
		set_head(val, head);
		return 1;
	}
	if (svc == TO_SVC_L7) {
		/* Cached as a service flow whose SERVICE entry is absent: each
		 * later packet the pod sends reads it (service_packet), so an
		 * entry Cilium makes once the flag is gone is recorded. */
		head = (bpf_ktime_get_ns() >> SVC_TIME_SHIFT) & 0xffffffff;
		set_head(val, head << 32 | (SVC_FLOW | SVC_NONE) << 8 | CT_F_OUT);
		return 1;
	}
	return 0;
}

static __always_inline __u32 now_coarse(void)
{
	return bpf_ktime_get_coarse_ns() >> 30;
}

/* Whether a packet of an already recorded flow needs a new record because
 * Cilium may create a key with the other initiator for it:
 *   - TCP: a SYN (without ACK) in the direction opposite to the recorded
 *     one, i.e. the 5-tuple reopened by the other side;
 *   - other protocols: a packet in the opposite direction after the flow
 *     was idle for reopen_idle (Cilium's entry may have expired).
 * For non-TCP flows it also notes the packet's time (one write per flow and
 * second at most). TCP packets touch nothing. */
static __always_inline int reopened(const struct flow *f, struct seen_val *v, __u8 dir)
{
	__u32 now;

	if (f->proto == PROTO_TCP)
		return (f->tcp_flags & (TCPF_SYN | TCPF_ACK)) == TCPF_SYN && v->dir != dir;
	now = now_coarse();
	if (v->dir != dir && now - v->last >= reopen_idle)
		return 1;
	if (v->last != now)
		v->last = now;
	return 0;
}

static __always_inline int bare_syn(const struct flow *f)
{
	return f->proto == PROTO_TCP && (f->tcp_flags & (TCPF_SYN | TCPF_ACK)) == TCPF_SYN;
}

/* Whether a cached flow still stands for its recorded key: present, with the
 * current generations of both addresses, and not reopened by this packet. */
static __always_inline int cached(struct __sk_buff *skb, const struct flow *f, struct seen_val *v, __u8 dir, __u32 gl, __u32 gr)
{
	if (!v || v->gen_local != gl || v->gen_remote != gr)
		return 0;
	if (v->svc) {
		/* Replies come from the VIP: nothing Cilium keys on them. */
		if (dir == CT_F_OUT)
			service_packet(skb, f, v);
		return 1;
	}
	return !reopened(f, v, dir);
}

static __always_inline void record4(struct __sk_buff *skb, const struct flow *f, int egress)
{
	struct seen_key4 k __attribute__((aligned(8))) = {
		.local = egress ? f->src[3] : f->dst[3],
		.remote = egress ? f->dst[3] : f->src[3],
		.lport = egress ? f->sport : f->dport,
		.rport = egress ? f->dport : f->sport,
		.proto = f->proto,
		.pad = {f->related}, /* an ICMP error is not the pair's other ICMP flow */
	};
	struct seen_val val = {.dir = egress ? CT_F_OUT : CT_F_IN};
	__u32 gl = gen_of(gen_slot4(k.local));
	__u32 gr = gen_of(gen_slot4(k.remote));
	struct front4 *fr = NULL;
	const __u64 *kw = (const __u64 *)&k;
	struct seen_val *v;
	__u32 slot;
	int ret;

	if (!bare_syn(f)) {
		slot = front_slot4(&k);
		fr = bpf_map_lookup_elem(&rec_front4, &slot);
		if (fr && fr->key[0] == kw[0] && fr->key[1] == kw[1] &&
		    fr->gen_local == gl && fr->gen_remote == gr &&
		    (f->proto == PROTO_TCP || now_coarse() - fr->last <= front_idle))
			return;
	}
	v = bpf_map_lookup_elem(&rec_flows4, &k);
	if (!cached(skb, f, v, val.dir, gl, gr)) {
		ret = emit(skb, f, egress, val.dir, &val);
		if (ret < 0)
			return; /* lost: not cached, the next packet tries again */
		if (f->proto != PROTO_TCP && !ret)
			val.last = now_coarse();
		val.gen_local = gl;
		val.gen_remote = gr;
		bpf_map_update_elem(&rec_flows4, &k, &val, BPF_ANY);
		v = &val;
	}
	/* A service flow never enters the front cache: each packet the pod
	 * sends on it reads its SERVICE entry. */
	if (fr && !v->svc) {
		fr->key[0] = kw[0];
		fr->key[1] = kw[1];
		fr->gen_local = gl;
		fr->gen_remote = gr;
		fr->last = v->last; /* non-TCP: noted this second by the path above */
	}
}

static __always_inline void record6(struct __sk_buff *skb, const struct flow *f, int egress)
{
	struct seen_key6 k = {
		.lport = egress ? f->sport : f->dport,
		.rport = egress ? f->dport : f->sport,
		.proto = f->proto,
		.pad = {f->related}, /* an ICMP error is not the pair's other ICMP flow */
	};
	struct seen_val val = {.dir = egress ? CT_F_OUT : CT_F_IN};
	__u32 gl, gr;
	int ret;

	if (egress) {
		__builtin_memcpy(k.local, f->src, 16);
		__builtin_memcpy(k.remote, f->dst, 16);
	} else {
		__builtin_memcpy(k.local, f->dst, 16);
		__builtin_memcpy(k.remote, f->src, 16);
	}
	gl = gen_of(gen_slot6(k.local));
	gr = gen_of(gen_slot6(k.remote));
	if (cached(skb, f, bpf_map_lookup_elem(&rec_flows6, &k), val.dir, gl, gr))
		return;
	ret = emit(skb, f, egress, val.dir, &val);
	if (ret < 0)
		return;
	if (f->proto != PROTO_TCP && !ret)
		val.last = now_coarse();
	val.gen_local = gl;
	val.gen_remote = gr;
	bpf_map_update_elem(&rec_flows6, &k, &val, BPF_ANY);
}

/* A packet's path: parse; a flow already recorded under the current
 * generations ends here (IPv4 TCP usually in the front cache); anything else
 * emits the flow's record and caches the flow. */
static __always_inline int record(struct __sk_buff *skb, int egress)
{
	struct flow f = {};

	if (flow_parse(skb, &f) < 0)
		return REC_NEXT;
	if (f.family == 4)
		record4(skb, &f, egress);
	else
		record6(skb, &f, egress);
	return REC_NEXT;
}

SEC("tc")
int recorder_egress(struct __sk_buff *skb)
{
	return record(skb, AT_POD_EGRESS);
}

SEC("tc")
int recorder_ingress(struct __sk_buff *skb)
{
	return record(skb, AT_POD_INGRESS);
}

SEC("tc")
int recorder_host(struct __sk_buff *skb)
{
	return record(skb, AT_HOST_INGRESS);
}
