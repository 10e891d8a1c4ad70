//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* The recorder: the kernel side of ctscrub's index.
 *
 * Attached with tcx to a pod's container-side interface, inside the pod's
 * network namespace: egress = packets the pod sends, ingress = packets it
 * receives. That interface sees every packet of the pod, including those
 * Cilium delivers with a peer redirect that skips the host-side veth.
 *
 * For each new flow it sends one struct record (the CT key Cilium creates
 * for the flow) through a ring buffer; scrubd indexes it per pod IP. An
 * established flow costs one parse and one LRU lookup. It never changes a
 * verdict: every path returns TCX_NEXT. */
#include "ctscrub_flow.h"

char __license[] SEC("license") = "Dual BSD/GPL";

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

/* What the seen caches hold per flow. */
struct seen_val {
	__u8 dir;    /* CT_F_OUT or CT_F_IN: the direction of the recorded key */
	__u8 pad[3];
	__u32 last;  /* non-TCP flows: time of the last packet, in 2^30 ns units */
};

/* A non-TCP flow idle this long (2^30 ns units, about seconds) whose next
 * packet goes the other way is recorded again: Cilium's entry may have
 * expired (non-TCP lifetime: 60 s by default) and the other side then
 * becomes the initiator of a new entry. */
volatile const __u32 reopen_idle = 10;

/* Records for user space. Size set by scrubd (Options.RingBytes). */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 22);
} rec_events SEC(".maps");

/* Flows already recorded. An eviction only re-sends a record; the index
 * dedups. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct seen_key4);
	__type(value, struct seen_val);
	__uint(max_entries, 1 << 18);
} rec_seen4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct seen_key6);
	__type(value, struct seen_val);
	__uint(max_entries, 1 << 18);
} rec_seen6 SEC(".maps");

/* Records that did not fit in the ring buffer, per pod IP (v4-mapped). */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, __u32[4]);
	__type(value, __u64);
	__uint(max_entries, 16384);
} rec_lost SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, 1);
} rec_lost_total SEC(".maps");

/* cilium_lb4_services_v2 / cilium_lb6_services_v2: ctscrub_flow.h. */

static __always_inline void count_lost(const __u32 *ip)
{
	__u32 zero = 0;
	__u64 one = 1, *c;

	c = bpf_map_lookup_elem(&rec_lost, ip);
	if (c)
		__sync_fetch_and_add(c, 1);
	else if (bpf_map_update_elem(&rec_lost, ip, &one, BPF_NOEXIST) != 0) {
		c = bpf_map_lookup_elem(&rec_lost, ip);
		if (c)
			__sync_fetch_and_add(c, 1);
	}
	c = bpf_map_lookup_elem(&rec_lost_total, &zero);
	if (c)
		__sync_fetch_and_add(c, 1);
}

/* Whether the packet goes to a service VIP that Cilium load-balances per
 * packet (it then creates a SERVICE entry and an OUT entry towards a backend
 * the pod never sees). */
static __always_inline int to_service(const struct flow *f)
{
	if (!flow_has_ports(f))
		return 0;
	if (f->family == 4) {
		struct lb4_key k = {
			.address = f->dst[3],
			.dport = f->dport,
			.scope = LB_LOOKUP_SCOPE_EXT,
		};
		return SERVICE_LOOKUP(&cilium_lb4_services_v2, &k, f->proto) != 0;
	} else {
		struct lb6_key k = {
			.dport = f->dport,
			.scope = LB_LOOKUP_SCOPE_EXT,
		};
		__builtin_memcpy(k.address, f->dst, 16);
		return SERVICE_LOOKUP(&cilium_lb6_services_v2, &k, f->proto) != 0;
	}
}

/* Emits the record of a new flow. Returns 0 when it is in the ring buffer
 * (the caller then marks the flow seen), -1 when the ring was full (the
 * loss is counted against the pod IP; the flow stays unseen so its next
 * packet tries again). */
static __always_inline int emit(struct __sk_buff *skb, const struct flow *f, int egress, __u8 dir)
{
	struct record *r;
	__u8 flags = dir;

	r = bpf_ringbuf_reserve(&rec_events, sizeof(*r), 0);
	if (!r) {
		count_lost(egress ? f->src : f->dst);
		return -1;
	}
	__builtin_memset(r, 0, sizeof(*r));
	r->family = f->family;
	r->kind = REC_FLOW;
	r->ifindex = skb->ifindex;
	if (egress && to_service(f)) {
		/* The pod IP goes in daddr, as in an OUT key. */
		r->kind = REC_SERVICE;
		flags = CT_F_SERVICE;
	}
	if (f->family == 4)
		flow_key4(f, (struct ct_key4 *)r->key, flags);
	else
		flow_key6(f, (struct ct_key6 *)r->key, flags);
	bpf_ringbuf_submit(r, 0);
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

static __always_inline int record(struct __sk_buff *skb, int egress)
{
	struct flow f = {};
	struct seen_val val = {.dir = egress ? CT_F_OUT : CT_F_IN};
	struct seen_val *seen;

	if (flow_parse(skb, &f) < 0)
		return TCX_NEXT;

	if (f.family == 4) {
		struct seen_key4 k = {
			.local = egress ? f.src[3] : f.dst[3],
			.remote = egress ? f.dst[3] : f.src[3],
			.lport = egress ? f.sport : f.dport,
			.rport = egress ? f.dport : f.sport,
			.proto = f.proto,
			.pad = {f.related}, /* an ICMP error is not the pair's other ICMP flow */
		};

		seen = bpf_map_lookup_elem(&rec_seen4, &k);
		if (seen && !reopened(&f, seen, val.dir))
			return TCX_NEXT;
		if (emit(skb, &f, egress, val.dir) == 0) {
			if (f.proto != PROTO_TCP)
				val.last = now_coarse();
			bpf_map_update_elem(&rec_seen4, &k, &val, BPF_ANY);
		}
	} else {
		struct seen_key6 k = {
			.lport = egress ? f.sport : f.dport,
			.rport = egress ? f.dport : f.sport,
			.proto = f.proto,
			.pad = {f.related}, /* an ICMP error is not the pair's other ICMP flow */
		};

		if (egress) {
			__builtin_memcpy(k.local, f.src, 16);
			__builtin_memcpy(k.remote, f.dst, 16);
		} else {
			__builtin_memcpy(k.local, f.dst, 16);
			__builtin_memcpy(k.remote, f.src, 16);
		}
		seen = bpf_map_lookup_elem(&rec_seen6, &k);
		if (seen && !reopened(&f, seen, val.dir))
			return TCX_NEXT;
		if (emit(skb, &f, egress, val.dir) == 0) {
			if (f.proto != PROTO_TCP)
				val.last = now_coarse();
			bpf_map_update_elem(&rec_seen6, &k, &val, BPF_ANY);
		}
	}
	return TCX_NEXT;
}

SEC("tcx/egress")
int recorder_egress(struct __sk_buff *skb)
{
	return record(skb, 1);
}

SEC("tcx/ingress")
int recorder_ingress(struct __sk_buff *skb)
{
	return record(skb, 0);
}

/* ---- forgetting a pod's flows (SEC("syscall"), run by scrubd) ----
 *
 * When an interface is attached for a new pod, its IPs may have belonged to
 * a pod that is gone; seen-cache entries of that pod (or of live pods
 * towards it) would hide the new pod's flows that happen to reuse a
 * 5-tuple. scrubd runs this program with BPF_PROG_TEST_RUN to drop every
 * cached flow whose local or remote address is one of the given IPs: one
 * in-kernel pass over the cache, milliseconds at the default size. */

#define FORGET_MAX_IPS 8

/* BPF_PROG_TEST_RUN context; mirrors scrubd/recorder.forgetArgs. */
struct forget_args {
	__u32 n4; /* IPs in ips4 */
	__u32 n6; /* IPs in ips6 */
	__u64 visited;
	__u64 deleted;
	__be32 ips4[FORGET_MAX_IPS];
	__u32 ips6[FORGET_MAX_IPS][4];
};

/* As in bpf/sweep.c: a matched element is deleted one step later, once the
 * walk has moved past it, so deleting it cannot derail the bucket walk. */
struct forget4_state {
	__u32 n;
	__u32 have_pending;
	__u64 visited;
	__u64 deleted;
	__be32 ips[FORGET_MAX_IPS];
	struct seen_key4 pending;
};

struct forget6_state {
	__u32 n;
	__u32 have_pending;
	__u64 visited;
	__u64 deleted;
	__u32 ips[FORGET_MAX_IPS][4];
	struct seen_key6 pending;
};

static __always_inline int same6(const __u32 *a, const __u32 *b)
{
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3];
}

static long forget4_cb(void *map, struct seen_key4 *key, struct seen_val *val, struct forget4_state *st)
{
	int i;

	st->visited++;
	if (st->have_pending) {
		st->have_pending = 0;
		if (bpf_map_delete_elem(map, &st->pending) == 0)
			st->deleted++;
	}
	for (i = 0; i < FORGET_MAX_IPS; i++) {
		if (i >= st->n)
			break;
		if (key->local == st->ips[i] || key->remote == st->ips[i]) {
			st->pending = *key;
			st->have_pending = 1;
			break;
		}
	}
	return 0;
}

static long forget6_cb(void *map, struct seen_key6 *key, struct seen_val *val, struct forget6_state *st)
{
	int i;

	st->visited++;
	if (st->have_pending) {
		st->have_pending = 0;
		if (bpf_map_delete_elem(map, &st->pending) == 0)
			st->deleted++;
	}
	for (i = 0; i < FORGET_MAX_IPS; i++) {
		if (i >= st->n)
			break;
		if (same6(key->local, st->ips[i]) || same6(key->remote, st->ips[i])) {
			st->pending = *key;
			st->have_pending = 1;
			break;
		}
	}
	return 0;
}

SEC("syscall")
int forget_ips(struct forget_args *args)
{
	if (args->n4 > 0) {
		struct forget4_state st = {.n = args->n4};

		__builtin_memcpy(st.ips, args->ips4, sizeof(st.ips));
		bpf_for_each_map_elem(&rec_seen4, forget4_cb, &st, 0);
		if (st.have_pending && bpf_map_delete_elem(&rec_seen4, &st.pending) == 0)
			st.deleted++;
		args->visited += st.visited;
		args->deleted += st.deleted;
	}
	if (args->n6 > 0) {
		struct forget6_state st = {.n = args->n6};

		__builtin_memcpy(st.ips, args->ips6, sizeof(st.ips));
		bpf_for_each_map_elem(&rec_seen6, forget6_cb, &st, 0);
		if (st.have_pending && bpf_map_delete_elem(&rec_seen6, &st.pending) == 0)
			st.deleted++;
		args->visited += st.visited;
		args->deleted += st.deleted;
	}
	return 0;
}
