//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* The expiry pass: one in-kernel pass over one of Cilium's CT maps that counts
 * live and expired entries (and the oldest expired one) and, when asked,
 * deletes the expired ones in the same pass. Run with BPF_PROG_TEST_RUN;
 * loaded once per CT map with the real map given as a replacement for
 * ct4/ct6. scrubd/expiry drives it.
 *
 * ct_entry.lifetime is in Cilium's BPF clock: seconds of ktime by default, or
 * jiffies >> 8 when the agent chose jiffies. The program reads both clocks and
 * judges every entry under both, so user space can tell from the entries which
 * clock Cilium uses; it deletes only under the clock user space names. */
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

/* Set from user space (mmapped .bss) on shutdown or when the pass's deadline
 * passes; read on every element so the pass ends within microseconds. */
volatile __u32 stop;

/* The audit (scrubd/expiry/audit.go): the pass also copies out the keys of a
 * sample of IPs (audit_ips4/6, filled from user space), which user space then
 * compares with its index. A bit per hashed address (audit_filter4/6, like
 * bpf/sweep.c's filter) rejects most entries with two plain memory reads. Keys go to
 * audit_keys4/6 in the order found; past AUDIT_MAX_KEYS they are counted as
 * overflow and not copied. */
#define AUDIT_MAX_IPS 4096
#define AUDIT_MAX_KEYS 32768
#define AUDIT_FILTER_WORDS 1024

struct audit_ip6 {
	__u8 addr[16];
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, AUDIT_MAX_IPS);
	__type(key, __be32);
	__type(value, __u32);
} audit_ips4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, AUDIT_MAX_IPS);
	__type(key, struct audit_ip6);
	__type(value, __u32);
} audit_ips6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, AUDIT_MAX_KEYS);
	__type(key, __u32);
	__type(value, struct ct_key4);
} audit_keys4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, AUDIT_MAX_KEYS);
	__type(key, __u32);
	__type(value, struct ct_key6);
} audit_keys6 SEC(".maps");

__u64 audit_filter4[AUDIT_FILTER_WORDS];
__u64 audit_filter6[AUDIT_FILTER_WORDS];

#define CLOCK_KTIME 0
#define CLOCK_JIFFIES 1
#define NUM_CLOCKS 2

#define EXPIRY_F_SWEEP 1 /* delete expired entries (under args->clock) */

/* Per clock: how the map's entries look if lifetime were in that clock. */
struct clock_stats {
	__u64 live;          /* lifetime >= now */
	__u64 expired;       /* lifetime < now */
	__u64 plausible;     /* live within max_future, or expired and >= floor */
	__u64 implausible;   /* further in the future than any CT timeout, or below the clock's floor */
	__u32 min_expired;   /* smallest plausible expired lifetime (oldest); ~0 if none */
	__u32 pad;
};

/* The BPF_PROG_TEST_RUN context: parameters in, counters out.
 * Mirrors scrubd/expiry.passArgs. */
struct expiry_args {
	/* in */
	__u32 flags;
	__u32 clock;                   /* clock to delete by (EXPIRY_F_SWEEP) */
	__u32 max_future[NUM_CLOCKS];  /* longest CT timeout, in each clock's units */
	__u32 floor[NUM_CLOCKS];       /* smallest lifetime the clock can produce */
	/* out */
	__u64 now_ktime_ns;
	__u64 now_jiffies64;
	__u32 now[NUM_CLOCKS];
	__u32 stopped;
	__u32 pad;
	__u64 visited;
	__u64 deleted;
	__u64 refreshed; /* expired when counted, live (or gone) when re-read before delete */
	__u64 guarded;   /* expired under args->clock but implausible in it: kept */
	struct clock_stats c[NUM_CLOCKS];
	/* the audit: in */
	__u32 audit;          /* copy out the keys of the IPs in audit_ips4/6 */
	__u32 audit_pad;
	/* the audit: out */
	__u64 audit_found;    /* keys of audited IPs seen (copied or not) */
	__u64 audit_overflow; /* of those, not copied: audit_keys4/6 full */
	/* out */
	__u64 nat_deleted;    /* SNAT mappings deleted with expired entries */
};

/* The walk's state, on the stack (the context pointer cannot be offset, so the
 * arguments are copied in and out). An expired entry is deleted one step
 * later, once the walk has moved past it: the kernel walks a bucket with
 * hlist_nulls_for_each_entry_rcu and reads the current element's next pointer
 * after the callback; an LRU element deleted in the callback goes back to the
 * free list at once, and a concurrent insert may relink it elsewhere. */
struct state {
	struct expiry_args a;
	__u32 sel_now;   /* now in the clock to delete by */
	__u32 sel_floor; /* floor of that clock */
	__u32 have_pending;
	__u16 pending_flags; /* the pending entry's flag bits, as visited */
	__u16 pad;
	union {
		struct ct_key4 k4;
		struct ct_key6 k6;
	} pending;
	union { /* nat_purge4/6's keys (ctscrub_nat.h says why here) */
		struct nat_keys4 k4;
		struct nat_keys6 k6;
	} nat;
};

static __always_inline void judge(struct clock_stats *s, __u32 now, __u32 max_future, __u32 floor, __u32 lt)
{
	if (lt >= now) {
		s->live++;
		if ((__u64)lt <= (__u64)now + max_future)
			s->plausible++;
		else
			s->implausible++;
		return;
	}
	s->expired++;
	if (lt < floor) {
		s->implausible++;
		return;
	}
	s->plausible++;
	if (lt < s->min_expired)
		s->min_expired = lt;
}

/* Whether the entry is to be deleted under the clock user space named: expired
 * in it, and a lifetime that clock can produce (so a wrong clock deletes
 * nothing: seconds of ktime read as jiffies >> 8 lie below jiffies' floor). */
static __always_inline int doomed(struct state *st, __u32 lt)
{
	return lt < st->sel_now && lt >= st->sel_floor;
}

#ifdef CTSCRUB_TEST_REFRESH
/* Test builds only (internal/testsupport/standin compiles this file with
 * CTSCRUB_TEST_REFRESH; the shipped object has no such code, so no holder of
 * its fd can make it write an entry): stands in for Cilium's datapath
 * refreshing an entry whose bytes are test_refresh_marker between the moment
 * the pass judged it expired and the moment it deletes it. The datapath does
 * this for real from another CPU (ct_update_timeout writes lifetime in place
 * through its own lookup); that window cannot be hit on demand from a test,
 * so the program writes the refresh itself, the same way, at the worst
 * moment. */
volatile __u64 test_refresh_marker;

static __always_inline void refresh_hook(struct state *st, void *map, void *key)
{
	struct ct_entry *e;

	if (!test_refresh_marker)
		return;
	e = bpf_map_lookup_elem(map, key);
	if (e && e->bytes == test_refresh_marker)
		*(volatile __u32 *)&e->lifetime = st->sel_now + 60; /* WRITE_ONCE, as Cilium */
}
#else
static __always_inline void refresh_hook(struct state *st, void *map, void *key)
{
}
#endif

/* Delete the pending entry only if it is still expired now: re-read it through
 * a fresh lookup (the datapath may have refreshed it in place, or replaced it
 * with a new element for the same key) right before the delete. */
static __always_inline void flush(struct state *st, void *map, const int v6)
{
	struct ct_entry *e;

	if (!st->have_pending)
		return;
	st->have_pending = 0;
	refresh_hook(st, map, &st->pending);
	e = bpf_map_lookup_elem(map, &st->pending);
	if (!e || !doomed(st, *(volatile __u32 *)&e->lifetime)) {
		st->a.refreshed++;
		return;
	}
	/* A failed delete means the entry went meanwhile (Cilium's GC, LRU).
	 * One that went deletes its SNAT mappings (keyed by the flag bits read
	 * when it was visited, as Cilium's GC reads them in its walk), as Cilium's GC would: left,
	 * only Cilium's orphan purge would take them, and it runs only when the
	 * datapath ran out of mappings. */
	if (bpf_map_delete_elem(map, &st->pending) != 0)
		return;
	st->a.deleted++;
	if (v6)
		st->a.nat_deleted += nat_purge6(&st->pending.k6, st->pending_flags, &st->nat.k6);
	else
		st->a.nat_deleted += nat_purge4(&st->pending.k4, st->pending_flags, &st->nat.k4);
}

/* Counts the entry under both clocks; returns 1 when it is to be deleted. */
static __always_inline int visit(struct state *st, struct ct_entry *val)
{
	struct expiry_args *a = &st->a;
	__u32 lt = *(volatile __u32 *)&val->lifetime;

	a->visited++;
	judge(&a->c[CLOCK_KTIME], a->now[CLOCK_KTIME], a->max_future[CLOCK_KTIME], a->floor[CLOCK_KTIME], lt);
	judge(&a->c[CLOCK_JIFFIES], a->now[CLOCK_JIFFIES], a->max_future[CLOCK_JIFFIES], a->floor[CLOCK_JIFFIES], lt);
	if (!(a->flags & EXPIRY_F_SWEEP))
		return 0;
	if (doomed(st, lt))
		return 1;
	if (lt < st->sel_now)
		a->guarded++;
	return 0;
}

/* A multiplicative hash of the address word, top 16 bits: unlike an xor fold,
 * addresses that differ only in a few bytes (a node's peers in one subnet)
 * spread over the whole filter, so few entries pass it by collision. */
static __always_inline __u32 audit_fold(__u32 a)
{
	return (a * 2654435761U) >> 16;
}

static __always_inline int audit_maybe(__u64 *filter, __u32 a)
{
	__u32 bit = audit_fold(a);

	return (filter[(bit >> 6) & (AUDIT_FILTER_WORDS - 1)] >> (bit & 63)) & 1;
}

/* Copies key out when it holds an audited IP. Entries this pass deletes are
 * not audited (they are gone when user space looks). */
static __always_inline void audit4(struct state *st, struct ct_key4 *key)
{
	struct ct_key4 *slot;
	__u32 i;

	if (!audit_maybe(audit_filter4, key->daddr) && !audit_maybe(audit_filter4, key->saddr))
		return;
	if (!bpf_map_lookup_elem(&audit_ips4, &key->daddr) && !bpf_map_lookup_elem(&audit_ips4, &key->saddr))
		return;
	i = st->a.audit_found++;
	slot = bpf_map_lookup_elem(&audit_keys4, &i);
	if (!slot) {
		st->a.audit_overflow++;
		return;
	}
	__builtin_memcpy(slot, key, sizeof(*slot));
}

static __always_inline void audit6(struct state *st, struct ct_key6 *key)
{
	struct ct_key6 *slot;
	__u32 i;

	if (!audit_maybe(audit_filter6, *(__u32 *)&key->daddr[12]) && !audit_maybe(audit_filter6, *(__u32 *)&key->saddr[12]))
		return;
	if (!bpf_map_lookup_elem(&audit_ips6, &key->daddr) && !bpf_map_lookup_elem(&audit_ips6, &key->saddr))
		return;
	i = st->a.audit_found++;
	slot = bpf_map_lookup_elem(&audit_keys6, &i);
	if (!slot) {
		st->a.audit_overflow++;
		return;
	}
	__builtin_memcpy(slot, key, sizeof(*slot));
}

static long expiry4_cb(void *map, struct ct_key4 *key, struct ct_entry *val, struct state *st)
{
	if (stop) {
		st->a.stopped = 1;
		return 1;
	}
	flush(st, map, 0);
	if (visit(st, val)) {
		__builtin_memcpy(&st->pending.k4, key, sizeof(st->pending.k4));
		st->pending_flags = val->flag_bits;
		st->have_pending = 1;
	} else if (st->a.audit) {
		audit4(st, key);
	}
	return 0;
}

static long expiry6_cb(void *map, struct ct_key6 *key, struct ct_entry *val, struct state *st)
{
	if (stop) {
		st->a.stopped = 1;
		return 1;
	}
	flush(st, map, 1);
	if (visit(st, val)) {
		__builtin_memcpy(&st->pending.k6, key, sizeof(st->pending.k6));
		st->pending_flags = val->flag_bits;
		st->have_pending = 1;
	} else if (st->a.audit) {
		audit6(st, key);
	}
	return 0;
}

static __always_inline void begin(struct state *st, struct expiry_args *args)
{
	struct expiry_args *a = &st->a;

	__builtin_memcpy(a, args, sizeof(*a));
	a->now_ktime_ns = bpf_ktime_get_ns();
	a->now_jiffies64 = bpf_jiffies64();
	/* Cilium's bpf_mono_now(): ktime in seconds, or jiffies >> 8. */
	a->now[CLOCK_KTIME] = a->now_ktime_ns / 1000000000ULL;
	a->now[CLOCK_JIFFIES] = a->now_jiffies64 >> 8;
	if (a->clock == CLOCK_JIFFIES) {
		st->sel_now = a->now[CLOCK_JIFFIES];
		st->sel_floor = a->floor[CLOCK_JIFFIES];
	} else {
		st->sel_now = a->now[CLOCK_KTIME];
		st->sel_floor = a->floor[CLOCK_KTIME];
	}
	a->stopped = 0;
	a->visited = a->deleted = a->refreshed = a->guarded = 0;
	a->audit_found = a->audit_overflow = 0;
	a->nat_deleted = 0;
	a->c[CLOCK_KTIME] = (struct clock_stats){.min_expired = ~0U};
	a->c[CLOCK_JIFFIES] = (struct clock_stats){.min_expired = ~0U};
}

SEC("syscall")
int expiry4(struct expiry_args *args)
{
	struct state st = {};

	begin(&st, args);
	bpf_for_each_map_elem(&ct4, expiry4_cb, &st, 0);
	flush(&st, &ct4, 0);
	__builtin_memcpy(args, &st.a, sizeof(st.a));
	return 0;
}

SEC("syscall")
int expiry6(struct expiry_args *args)
{
	struct state st = {};

	begin(&st, args);
	bpf_for_each_map_elem(&ct6, expiry6_cb, &st, 0);
	flush(&st, &ct6, 1);
	__builtin_memcpy(args, &st.a, sizeof(st.a));
	return 0;
}
