//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* The sweep: one in-kernel pass over one of Cilium's CT maps that deletes
 * every entry whose daddr or saddr is in a set of IPs (ips4/ips6, filled from
 * user space). Run with BPF_PROG_TEST_RUN; loaded once per CT map with the
 * real map given as a replacement for ct4/ct6. scrubd/cilium's Sweeper drives it. */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "ctscrub.h"
#include "ctscrub_nat.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* Placeholders: user space replaces them with Cilium's map, after copying its
 * type, max_entries and flags into the spec. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1);
	__type(key, struct ct_key4);
	__type(value, struct ct_entry);
} ct4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1);
	__type(key, struct ct_key6);
	__type(value, struct ct_entry);
} ct6 SEC(".maps");

struct ip6 {
	__u8 addr[16];
};

/* The IP set of one pass. The value counts the entries of that IP the pass
 * deleted (or, in a dry run, matched), and the SNAT mappings deleted with
 * them, so every caller sharing a pass gets its own counts. An entry holding
 * two IPs of the set counts for both. Shared by
 * every pass: user space takes a pass's IPs out however it ends, and runs no
 * pass while one is left (scrubd/cilium Sweeper.left). */
#define SWEEP_MAX_IPS 65536

/* Mirrors scrubd/cilium.ipCount. */
struct ip_count {
	__u64 ct;
	__u64 nat;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, SWEEP_MAX_IPS);
	__type(key, __be32);
	__type(value, struct ip_count);
} ips4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, SWEEP_MAX_IPS);
	__type(key, struct ip6);
	__type(value, struct ip_count);
} ips6 SEC(".maps");

/* Set from user space (mmapped .bss) when no caller of the running pass is
 * left; read on every element so a cancelled pass ends within microseconds of
 * the write. */
volatile __u32 stop;

/* A bit per (folded) address of the IP set, set from user space before each
 * pass: most entries hold no IP of the set, and two reads of this 8 KiB
 * array (plain memory, no helper call) reject them before the hash lookups.
 * scrubd/cilium.addrFilter computes the same fold. */
#define FILTER_WORDS 1024
__u64 filter4[FILTER_WORDS];
__u64 filter6[FILTER_WORDS];

static __always_inline __u32 fold(__u32 a)
{
	return (a ^ (a >> 16)) & 0xffff;
}

static __always_inline int maybe(__u64 *filter, __u32 a)
{
	__u32 bit = fold(a);

	return (filter[(bit >> 6) & (FILTER_WORDS - 1)] >> (bit & 63)) & 1;
}

#define SWEEP_F_DRY_RUN 1 /* count matches, delete nothing */
#define SWEEP_F_COUNT 2   /* only count the map's entries (no IP set) */

/* The BPF_PROG_TEST_RUN context: flags in, counters out. Mirrors
 * scrubd/cilium.sweepArgs. */
struct sweep_args {
	__u32 flags;
	__u32 stopped; /* the pass saw the stop flag and ended early */
	__u64 visited;
	__u64 matched;
	__u64 deleted;
	__u64 nat_deleted; /* SNAT mappings deleted with the entries */
};

/* The kernel walks a bucket with hlist_nulls_for_each_entry_rcu and reads the
 * current element's next pointer after the callback returns. An LRU element
 * deleted in the callback goes back to the free list at once and a concurrent
 * insert may relink it into another bucket, so the walk would skip the rest
 * of this bucket. Hence a matched entry is deleted one step later, once the
 * walk has moved past it. */
struct state4 {
	__u32 flags;
	__u32 stopped;
	__u32 have_pending;
	__u16 pending_flags; /* the pending entry's ct_entry flag bits */
	__u16 pad;
	__u64 visited;
	__u64 matched;
	__u64 deleted;
	__u64 nat_deleted;
	struct ct_key4 pending;
};

struct state6 {
	__u32 flags;
	__u32 stopped;
	__u32 have_pending;
	__u16 pending_flags; /* the pending entry's ct_entry flag bits */
	__u16 pad;
	__u64 visited;
	__u64 matched;
	__u64 deleted;
	__u64 nat_deleted;
	struct ct_key6 pending;
};

static __always_inline void bump4(struct ct_key4 *k, __u32 nat)
{
	struct ip_count *d = bpf_map_lookup_elem(&ips4, &k->daddr);
	struct ip_count *s = bpf_map_lookup_elem(&ips4, &k->saddr);

	if (d) {
		__sync_fetch_and_add(&d->ct, 1);
		__sync_fetch_and_add(&d->nat, nat);
	}
	if (s && s != d) {
		__sync_fetch_and_add(&s->ct, 1);
		__sync_fetch_and_add(&s->nat, nat);
	}
}

static __always_inline void bump6(struct ct_key6 *k, __u32 nat)
{
	struct ip_count *d = bpf_map_lookup_elem(&ips6, &k->daddr);
	struct ip_count *s = bpf_map_lookup_elem(&ips6, &k->saddr);

	if (d) {
		__sync_fetch_and_add(&d->ct, 1);
		__sync_fetch_and_add(&d->nat, nat);
	}
	if (s && s != d) {
		__sync_fetch_and_add(&s->ct, 1);
		__sync_fetch_and_add(&s->nat, nat);
	}
}

static __always_inline void flush4(void *map, struct state4 *st)
{
	if (!st->have_pending)
		return;
	st->have_pending = 0;
	/* A failed delete means the entry went meanwhile (GC, LRU): not ours,
	 * and neither are its SNAT mappings (Cilium's scrub skips them too). */
	if (bpf_map_delete_elem(map, &st->pending) == 0) {
		struct nat_keys4 nk;
		__u32 nat = nat_purge4(&st->pending, st->pending_flags, &nk);

		st->deleted++;
		st->nat_deleted += nat;
		bump4(&st->pending, nat);
	}
}

static __always_inline void flush6(void *map, struct state6 *st)
{
	if (!st->have_pending)
		return;
	st->have_pending = 0;
	if (bpf_map_delete_elem(map, &st->pending) == 0) {
		struct nat_keys6 nk;
		__u32 nat = nat_purge6(&st->pending, st->pending_flags, &nk);

		st->deleted++;
		st->nat_deleted += nat;
		bump6(&st->pending, nat);
	}
}

static long sweep4_cb(void *map, struct ct_key4 *key, struct ct_entry *val, struct state4 *st)
{
	if (stop) {
		st->stopped = 1;
		return 1;
	}
	flush4(map, st);
	st->visited++;
	if (st->flags & SWEEP_F_COUNT)
		return 0;
	if (!maybe(filter4, key->daddr) && !maybe(filter4, key->saddr))
		return 0;
	if (!bpf_map_lookup_elem(&ips4, &key->daddr) && !bpf_map_lookup_elem(&ips4, &key->saddr))
		return 0;
	st->matched++;
	if (st->flags & SWEEP_F_DRY_RUN) {
		bump4(key, 0);
		return 0;
	}
	__builtin_memcpy(&st->pending, key, sizeof(st->pending));
	st->pending_flags = val->flag_bits;
	st->have_pending = 1;
	return 0;
}

static long sweep6_cb(void *map, struct ct_key6 *key, struct ct_entry *val, struct state6 *st)
{
	if (stop) {
		st->stopped = 1;
		return 1;
	}
	flush6(map, st);
	st->visited++;
	if (st->flags & SWEEP_F_COUNT)
		return 0;
	if (!maybe(filter6, *(__u32 *)&key->daddr[12]) && !maybe(filter6, *(__u32 *)&key->saddr[12]))
		return 0;
	if (!bpf_map_lookup_elem(&ips6, &key->daddr) && !bpf_map_lookup_elem(&ips6, &key->saddr))
		return 0;
	st->matched++;
	if (st->flags & SWEEP_F_DRY_RUN) {
		bump6(key, 0);
		return 0;
	}
	__builtin_memcpy(&st->pending, key, sizeof(st->pending));
	st->pending_flags = val->flag_bits;
	st->have_pending = 1;
	return 0;
}

SEC("syscall")
int sweep4(struct sweep_args *args)
{
	struct state4 st = {};

	st.flags = args->flags;
	bpf_for_each_map_elem(&ct4, sweep4_cb, &st, 0);
	flush4(&ct4, &st);
	args->stopped = st.stopped;
	args->visited = st.visited;
	args->matched = st.matched;
	args->deleted = st.deleted;
	args->nat_deleted = st.nat_deleted;
	return 0;
}

SEC("syscall")
int sweep6(struct sweep_args *args)
{
	struct state6 st = {};

	st.flags = args->flags;
	bpf_for_each_map_elem(&ct6, sweep6_cb, &st, 0);
	flush6(&ct6, &st);
	args->stopped = st.stopped;
	args->visited = st.visited;
	args->matched = st.matched;
	args->deleted = st.deleted;
	args->nat_deleted = st.nat_deleted;
	return 0;
}

/* Entry count for metrics without a walk: the kernel keeps a per-CPU element
 * counter for hash maps (6.6+); summing it costs O(CPUs). */
struct bpf_map {
} __attribute__((preserve_access_index));
extern __s64 bpf_map_sum_elem_count(const struct bpf_map *map) __ksym __weak;

struct count_args {
	__s64 count;
};

SEC("syscall")
int count_ct4(struct count_args *args)
{
	args->count = bpf_map_sum_elem_count((const struct bpf_map *)&ct4);
	return 0;
}

SEC("syscall")
int count_ct6(struct count_args *args)
{
	args->count = bpf_map_sum_elem_count((const struct bpf_map *)&ct6);
	return 0;
}

/* ---- Deleting a list of keys (the index path) ----
 *
 * BPF_MAP_DELETE_BATCH stops at the first key that is not in the map, so
 * every absent key costs user space one more syscall; a scrub tries many
 * keys that are usually absent (each flow's other-initiator forms,
 * index.Covered). This program deletes a chunk of keys and skips absent
 * ones in the kernel: two syscalls per chunk (fill the slot, run) whatever
 * the share of absent keys. User space writes a chunk of keys into its own
 * slot of del_keys4/6 (one slot per concurrent caller), then runs it. */
#define DEL_CHUNK 1024
#define DEL_SLOTS 16

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, DEL_CHUNK * DEL_SLOTS);
	__type(key, __u32);
	__type(value, struct ct_key4);
} del_keys4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, DEL_CHUNK * DEL_SLOTS);
	__type(key, __u32);
	__type(value, struct ct_key6);
} del_keys6 SEC(".maps");

/* BPF_PROG_TEST_RUN context; mirrors scrubd/cilium.delArgs. */
struct del_args {
	__u32 base;        /* first index of the caller's slot */
	__u32 n;           /* keys in the slot */
	__u32 deleted;     /* out: keys that were present and deleted */
	__u32 nat_deleted; /* out: SNAT mappings deleted with them */
};

/* Two passes over the chunk. The first only looks each key up: a lookup
 * takes no lock, so the CPU runs the next keys' hash and bucket loads while
 * a cache miss of the current one is outstanding, and most keys a scrub
 * tries are absent. The second deletes the keys found, whose buckets and
 * entries the first pass brought into the cache. A delete takes the
 * bucket's lock and the LRU's, and a locked instruction lets no later load
 * start before it: deleting every key in turn paid each absent key's misses
 * one after the other. An entry found and gone by the second pass (Cilium's
 * GC) fails its delete and is not counted; one created between the passes
 * was created after the scrub went by, as with a single pass. At 16 M
 * entries the delete step went from 2.67 to 2.06 times the kernel's floor
 * (docs/bench.md).
 *
 * del_found[i] of the caller's slot is the first pass's answer for key i:
 * 0 when absent, else DEL_FOUND with the entry's flag bits, which say how
 * its SNAT mappings are keyed (ctscrub_nat.h).
 * In a map, not on the stack: the verifier follows a loop's iterations
 * until their states repeat, and a bitmap on the stack never repeats. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, DEL_CHUNK * DEL_SLOTS);
	__type(key, __u32);
	__type(value, __u32);
} del_found SEC(".maps");

#define DEL_FOUND 0x10000

/* The second pass runs under bpf_loop: its body (the CT delete and the SNAT
 * deletes, ctscrub_nat.h) is verified once, not once per unrolled state of a
 * bounded loop, which the verifier of some kernels refused with EFAULT. */
struct del_ctx {
	__u32 base;
	__u32 deleted;
	__u32 nat;
};

static __always_inline void find_keys(struct del_args *args, void *ct, void *keys)
{
	__u32 base = args->base, n = args->n, i;

	for (i = 0; i < DEL_CHUNK && i < n; i++) {
		__u32 idx = base + i, *found;
		struct ct_entry *e;
		void *k;

		k = bpf_map_lookup_elem(keys, &idx);
		found = bpf_map_lookup_elem(&del_found, &idx);
		if (!k || !found)
			break;
		e = bpf_map_lookup_elem(ct, k);
		*found = e ? DEL_FOUND | e->flag_bits : 0;
	}
}

static long del_one4(__u32 i, struct del_ctx *c)
{
	__u32 idx = c->base + i, *found;
	struct nat_keys4 nk;
	struct ct_key4 *k;

	found = bpf_map_lookup_elem(&del_found, &idx);
	if (!found)
		return 1;
	if (!*found)
		return 0;
	k = bpf_map_lookup_elem(&del_keys4, &idx);
	if (!k)
		return 1;
	if (bpf_map_delete_elem(&ct4, k) != 0)
		return 0;
	c->deleted++;
	c->nat += nat_purge4(k, *found & 0xffff, &nk);
	return 0;
}

static long del_one6(__u32 i, struct del_ctx *c)
{
	__u32 idx = c->base + i, *found;
	struct nat_keys6 nk;
	struct ct_key6 *k;

	found = bpf_map_lookup_elem(&del_found, &idx);
	if (!found)
		return 1;
	if (!*found)
		return 0;
	k = bpf_map_lookup_elem(&del_keys6, &idx);
	if (!k)
		return 1;
	if (bpf_map_delete_elem(&ct6, k) != 0)
		return 0;
	c->deleted++;
	c->nat += nat_purge6(k, *found & 0xffff, &nk);
	return 0;
}

SEC("syscall")
int delete4(struct del_args *args)
{
	struct del_ctx c = {.base = args->base};

	find_keys(args, &ct4, &del_keys4);
	bpf_loop(args->n < DEL_CHUNK ? args->n : DEL_CHUNK, del_one4, &c, 0);
	args->deleted = c.deleted;
	args->nat_deleted = c.nat;
	return 0;
}

SEC("syscall")
int delete6(struct del_args *args)
{
	struct del_ctx c = {.base = args->base};

	find_keys(args, &ct6, &del_keys6);
	bpf_loop(args->n < DEL_CHUNK ? args->n : DEL_CHUNK, del_one6, &c, 0);
	args->deleted = c.deleted;
	args->nat_deleted = c.nat;
	return 0;
}
