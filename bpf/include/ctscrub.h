/* Shared between ctscrub's BPF programs and scrubd/recorder/record.go. */
#ifndef CTSCRUB_H
#define CTSCRUB_H

#include <linux/types.h>

/* Cilium's tuple flags (TUPLE_F_*). */
#define CT_F_OUT 0
#define CT_F_IN 1
#define CT_F_RELATED 2
#define CT_F_SERVICE 4

/* struct ipv4_ct_tuple / ipv6_ct_tuple, packed, network byte order:
 * daddr = initiator, saddr = responder, sport = initiator's port,
 * dport = responder's port. */
struct ct_key4 {
	__be32 daddr;
	__be32 saddr;
	__be16 dport;
	__be16 sport;
	__u8 nexthdr;
	__u8 flags;
} __attribute__((packed));

struct ct_key6 {
	__u8 daddr[16];
	__u8 saddr[16];
	__be16 dport;
	__be16 sport;
	__u8 nexthdr;
	__u8 flags;
} __attribute__((packed));

/* struct ct_entry, 56 bytes; only lifetime is read by ctscrub. */
struct ct_entry {
	__u64 reserved0;
	__u64 backend_id;
	__u64 packets;
	__u64 bytes;
	__u32 lifetime;
	__u16 flag_bits;
	__u16 rev_nat_index;
	__u16 ifindex;
	__u8 tx_flags_seen;
	__u8 rx_flags_seen;
	__u32 src_sec_id;
	__u32 last_tx_report;
	__u32 last_rx_report;
};

/* One recorder record, sent through the ring buffer for each new flow. */
#define REC_FLOW 0    /* key is the CT key Cilium creates for the flow */
#define REC_SERVICE 1 /* flow to a service VIP: keys unknowable, mark IP incomplete */
/* A flow the pod sent from an address its interface does not own: key is
 * the CT key Cilium would create if it let the packet through (daddr = the
 * claimed source). File it under saddr (the receiver) only; mark daddr
 * incomplete (Cilium may have created entries with it, or dropped them). */
#define REC_FOREIGN 2
/* A flow the pod sends to a VIP Cilium load-balances per packet: key is
 * Cilium's SERVICE key (daddr = VIP, saddr = the pod, dport = the pod's
 * port, sport = the VIP's port, flags = CT_F_SERVICE); backend is the
 * backend_id its SERVICE entry held when the packet passed (0: no entry
 * yet). Sent for the flow's first packet and again whenever a later packet
 * of the pod's finds another backend_id. (REC_SERVICE is what older
 * programs sent: the IP is then marked incomplete.) */
#define REC_SERVICE_ENTRY 3
/* A flow the pod sends to an L7 load-balancer VIP (SVC_FLAG_L7_LOADBALANCER):
 * key is the flow's plain OUT key, to the VIP, as Cilium keeps it with
 * ENABLE_L7_LB. User space indexes it as REC_FLOW and marks the pod
 * incomplete unless the node's Cilium has ENABLE_L7_LB. The flow is cached
 * as a service flow whose SERVICE entry is absent, so a SERVICE entry made
 * later (the flag removed, Cilium load-balancing the flow's next packets)
 * is read and recorded as REC_SERVICE_ENTRY. */
#define REC_L7LB 4

struct record {
	__u8 family; /* 4 or 6 */
	__u8 kind;   /* REC_* */
	__u16 at_hi; /* REC_SERVICE_ENTRY: the packet's time, bpf_ktime_get_ns() >> 20: */
	__u32 ifindex;
	__u8 key[40]; /* ct_key4 (14 bytes) or ct_key6 (38 bytes), zero padded */
	__u32 backend; /* REC_SERVICE_ENTRY: the SERVICE entry's backend_id */
	__u32 at_lo;   /* bits 47-32 in at_hi, 31-0 here (0: an older program) */
};

#endif
