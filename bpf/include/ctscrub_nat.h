/* Cilium's SNAT mappings of a CT entry ctscrub deletes: the deletes Cilium's
 * own scrub makes for it (pkg/maps/ctmap purgeCtEntry -> natMapNext ->
 * pkg/maps/nat DeleteMapping4/6 or DeleteSwappedMapping4/6, the same in
 * v1.18.8 and v1.20.2), done in the kernel from the deleted CT key: no walk of
 * the NAT map. Included by the programs that delete CT entries (sweep.c,
 * expiry.c); user space replaces nat4/nat6 with cilium_snat_v4_external /
 * cilium_snat_v6_external when Cilium pinned them (NodePort, BPF masquerade),
 * else they stay empty placeholders and every lookup misses. */
#ifndef CTSCRUB_NAT_H
#define CTSCRUB_NAT_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "ctscrub.h"

/* struct ct_entry's dsr_internal bit (bit 7 of the flag bits at offset 36;
 * Go's ctmap.DSRInternal). */
#define CT_ENTRY_DSR_INTERNAL (1 << 7)

/* struct ipv4_nat_entry / ipv6_nat_entry: struct nat_entry (created,
 * needs_ct, two pads) then the address and port the flow was translated to. */
struct nat_entry4 {
	__u64 created;
	__u64 needs_ct;
	__u64 pad1;
	__u64 pad2;
	__be32 to_saddr;
	__be16 to_sport;
	__u16 pad3;
};

struct nat_entry6 {
	__u64 created;
	__u64 needs_ct;
	__u64 pad1;
	__u64 pad2;
	__u8 to_saddr[16];
	__be16 to_sport;
	__u8 pad3[6];
};

/* Placeholders, as the CT maps' (user space copies the real map's type, size
 * and flags into the spec before it replaces them). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1);
	__type(key, struct ct_key4);
	__type(value, struct nat_entry4);
} nat4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1);
	__type(key, struct ct_key6);
	__type(value, struct nat_entry6);
} nat6 SEC(".maps");

/* The two keys a purge builds, placed by the caller (expiry.c keeps them
 * in its walk state: on its callback's stack, with the purge inlined, the
 * kernel here refused expiry4 with EFAULT). */
struct nat_keys4 {
	struct ct_key4 fwd, rev;
};

struct nat_keys6 {
	struct ct_key6 fwd, rev;
};

/* Deletes the SNAT mappings of the CT entry key (whose flag bits were
 * ct_flags) that was just deleted; returns how many NAT entries went.
 * Global functions: the verifier checks each once, not once per path of
 * the walk's callback that calls it (inlined, expiry6 went past the
 * verifier's 1 M instructions). Only
 * an entry whose flags are exactly TUPLE_F_OUT has any. A DSR-internal entry
 * has one mapping: the CT key with its ports swapped. Any other has the CT
 * key with its addresses swapped (the forward mapping) and, when that is
 * found, the reverse mapping its value names: saddr and sport of the CT key's
 * saddr and dport, daddr and dport the translated address and port, flags
 * TUPLE_F_IN. */
__attribute__((noinline)) int nat_purge4(const struct ct_key4 *k, __u32 ct_flags, struct nat_keys4 *nk)
{
	struct ct_key4 *fwd, *rev;
	struct nat_entry4 *ne;
	int n = 0;

	if (!k || !nk || k->flags != CT_F_OUT)
		return 0;
	fwd = &nk->fwd;
	rev = &nk->rev;
	__builtin_memcpy(fwd, k, sizeof(*fwd));
	if (ct_flags & CT_ENTRY_DSR_INTERNAL) {
		fwd->dport = k->sport;
		fwd->sport = k->dport;
		return bpf_map_delete_elem(&nat4, fwd) == 0;
	}
	fwd->daddr = k->saddr;
	fwd->saddr = k->daddr;
	ne = bpf_map_lookup_elem(&nat4, fwd);
	if (!ne)
		return 0;
	/* Read before the delete frees the element. */
	rev->daddr = *(volatile __be32 *)&ne->to_saddr;
	rev->dport = *(volatile __be16 *)&ne->to_sport;
	rev->saddr = k->saddr;
	rev->sport = k->dport;
	rev->nexthdr = k->nexthdr;
	rev->flags = CT_F_IN;
	if (bpf_map_delete_elem(&nat4, fwd) == 0)
		n++;
	if (bpf_map_delete_elem(&nat4, rev) == 0)
		n++;
	return n;
}

__attribute__((noinline)) int nat_purge6(const struct ct_key6 *k, __u32 ct_flags, struct nat_keys6 *nk)
{
	struct ct_key6 *fwd, *rev;
	struct nat_entry6 *ne;
	int n = 0;

	if (!k || !nk || k->flags != CT_F_OUT)
		return 0;
	fwd = &nk->fwd;
	rev = &nk->rev;
	__builtin_memcpy(fwd, k, sizeof(*fwd));
	if (ct_flags & CT_ENTRY_DSR_INTERNAL) {
		fwd->dport = k->sport;
		fwd->sport = k->dport;
		return bpf_map_delete_elem(&nat6, fwd) == 0;
	}
	__builtin_memcpy(fwd->daddr, k->saddr, 16);
	__builtin_memcpy(fwd->saddr, k->daddr, 16);
	ne = bpf_map_lookup_elem(&nat6, fwd);
	if (!ne)
		return 0;
	__builtin_memcpy(rev->daddr, ne->to_saddr, 16);
	rev->dport = *(volatile __be16 *)&ne->to_sport;
	__builtin_memcpy(rev->saddr, k->saddr, 16);
	rev->sport = k->dport;
	rev->nexthdr = k->nexthdr;
	rev->flags = CT_F_IN;
	if (bpf_map_delete_elem(&nat6, fwd) == 0)
		n++;
	if (bpf_map_delete_elem(&nat6, rev) == 0)
		n++;
	return n;
}

#endif
