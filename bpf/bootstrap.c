//go:build ignore

// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* The bootstrap pass's walk: one in-kernel pass over one of Cilium's CT maps
 * that copies out the keys holding an address of the pod CIDRs (and only the
 * keys: Cilium's 56-byte values never leave the kernel). Run with
 * BPF_PROG_TEST_RUN; loaded once per CT map with the real map given as a
 * replacement for ct4/ct6 and an output array sized from that map's
 * max_entries. scrubd/bootstrap drives it and files the keys from the
 * output array in place (mmapped). */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "ctscrub.h"

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

/* The output: one key per array element, padded to a multiple of 8 bytes
 * (the array's element size; 16 and 40 bytes), written at offset 0 (a key
 * packed at a variable offset inside a larger element made this kernel's
 * verifier fail with EFAULT, 6.18). User space sets max_entries (the CT
 * map's max_entries: every entry it can hold). When the walk finds more keys than fit (an entry deleted and made
 * again during the walk can be visited twice), the program stops and says
 * so (full): user space then reads that map again another way, never a
 * truncated list. */
struct out4_elem {
	struct ct_key4 k;
	__u8 pad[2];
};

struct out6_elem {
	struct ct_key6 k;
	__u8 pad[2];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct out4_elem);
} out4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct out6_elem);
} out6 SEC(".maps");

/* The pod CIDRs, set from user space (mmapped .bss) before the run, address
 * and mask in the key's byte order. A key is copied out when its daddr or
 * saddr is inside one of them; all = 1 (no pod CIDRs configured: every
 * address is the index's) copies every key. User space files each key
 * under its addresses itself (index.Filing): this is only the cut. */
#define MAX_PREFIXES 16

struct prefix4 {
	__u32 addr;
	__u32 mask;
};

struct prefix6 {
	__u64 addr[2];
	__u64 mask[2];
};

struct prefix4 prefixes4[MAX_PREFIXES];
struct prefix6 prefixes6[MAX_PREFIXES];
__u32 nprefixes4;
__u32 nprefixes6;
__u32 all;

/* Every PUBLISH_EVERY entries visited the program stores how many keys it
 * wrote and how many entries it visited here (mmapped .bss), with xchg
 * (fully ordered: the keys' stores are visible before the count), so user
 * space files the keys while the walk goes on. In .bss, not in the output
 * array: a second lookup of the output array in the callback made this
 * kernel's verifier fail with EFAULT. */
#define PUBLISH_EVERY 4096

__u64 published_written;
__u64 published_visited;

/* Set from user space (mmapped .bss) when the pass is cancelled; read on
 * every element so the run ends within microseconds of the write. */
volatile __u32 stop;

/* The BPF_PROG_TEST_RUN context, out only. Mirrors scrubd/bootstrap.passArgs. */
struct pass_args {
	__u32 stopped; /* the run saw the stop flag and ended early */
	__u32 full;    /* the output array was full: the run ended early */
	__u64 visited; /* entries visited */
	__u64 written; /* keys copied out */
};

struct state {
	__u32 stopped;
	__u32 full;
	__u64 visited;
	__u64 written;
};

static __always_inline int in4(__u32 a)
{
	__u32 i;

	for (i = 0; i < MAX_PREFIXES; i++) {
		if (i >= nprefixes4)
			return 0;
		if ((a & prefixes4[i].mask) == prefixes4[i].addr)
			return 1;
	}
	return 0;
}

static __always_inline int in6(const __u8 *a)
{
	__u64 hi, lo;
	__u32 i;

	__builtin_memcpy(&hi, a, 8);
	__builtin_memcpy(&lo, a + 8, 8);
	for (i = 0; i < MAX_PREFIXES; i++) {
		if (i >= nprefixes6)
			return 0;
		if ((hi & prefixes6[i].mask[0]) == prefixes6[i].addr[0] &&
		    (lo & prefixes6[i].mask[1]) == prefixes6[i].addr[1])
			return 1;
	}
	return 0;
}

static __always_inline void publish(struct state *st)
{
	__sync_lock_test_and_set(&published_visited, st->visited);
	__sync_lock_test_and_set(&published_written, st->written);
}

static long pass4_cb(void *map, struct ct_key4 *key, void *val, struct state *st)
{
	struct out4_elem *o;
	__u32 slot;

	if (stop) {
		st->stopped = 1;
		return 1;
	}
	if ((++st->visited & (PUBLISH_EVERY - 1)) == 0)
		publish(st);
	if (!all && !in4(key->daddr) && !in4(key->saddr))
		return 0;
	slot = st->written;
	o = bpf_map_lookup_elem(&out4, &slot);
	if (!o) {
		st->full = 1;
		return 1;
	}
	__builtin_memcpy(&o->k, key, sizeof(*key));
	st->written++;
	return 0;
}

static long pass6_cb(void *map, struct ct_key6 *key, void *val, struct state *st)
{
	struct out6_elem *o;
	__u32 slot;

	if (stop) {
		st->stopped = 1;
		return 1;
	}
	if ((++st->visited & (PUBLISH_EVERY - 1)) == 0)
		publish(st);
	if (!all && !in6(key->daddr) && !in6(key->saddr))
		return 0;
	slot = st->written;
	o = bpf_map_lookup_elem(&out6, &slot);
	if (!o) {
		st->full = 1;
		return 1;
	}
	__builtin_memcpy(&o->k, key, sizeof(*key));
	st->written++;
	return 0;
}

SEC("syscall")
int pass4(struct pass_args *args)
{
	/* From the context (zero), not constants: with counters the verifier
	 * knows exactly, its tracking of them across the callback's iterations
	 * failed with EFAULT on this kernel (6.18). */
	struct state st = {.visited = args->visited, .written = args->written};

	bpf_for_each_map_elem(&ct4, pass4_cb, &st, 0);
	publish(&st);
	args->stopped = st.stopped;
	args->full = st.full;
	args->visited = st.visited;
	args->written = st.written;
	return 0;
}

SEC("syscall")
int pass6(struct pass_args *args)
{
	/* From the context (zero), not constants: with counters the verifier
	 * knows exactly, its tracking of them across the callback's iterations
	 * failed with EFAULT on this kernel (6.18). */
	struct state st = {.visited = args->visited, .written = args->written};

	bpf_for_each_map_elem(&ct6, pass6_cb, &st, 0);
	publish(&st);
	args->stopped = st.stopped;
	args->full = st.full;
	args->visited = st.visited;
	args->written = st.written;
	return 0;
}
