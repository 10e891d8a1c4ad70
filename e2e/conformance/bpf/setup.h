/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Map setup programs of the conformance harness, included after bpf_lxc.c /
 * bpf_host.c and Cilium's tests/lib helpers. Each is a tc program run once
 * with BPF_PROG_TEST_RUN; its arguments are the "packet" (struct conf_args,
 * mirrored by e2e/conformance/harness.go). */
#ifndef CTSCRUB_CONFORMANCE_SETUP_H
#define CTSCRUB_CONFORMANCE_SETUP_H

#define CONF_ENDPOINT 1 /* local pod: endpoints map, ipcache, allow-all policy */
#define CONF_IPCACHE 2  /* remote address: ipcache (identity, tunnel endpoint) */
#define CONF_SERVICE 3  /* service frontend with one backend (or none) */
#define CONF_L7 4       /* policy entry redirecting to the L7 proxy */
#define CONF_DENY 5     /* policy entry denying one identity, protocol and port */
#define CONF_L7_PROXY_PORT 15001 /* an L7 load-balancer frontend's Envoy port */
#define CONF_SVC_FLAG2_L7LB (1 << 2) /* SVC_FLAG_L7_LOADBALANCER (1.16: SVC_FLAG_L7LOADBALANCER) */
/* The service maps' names: macros up to 1.17, the pinned names from 1.18. */
#if CILIUM_MINOR >= 18
#define CONF_LB4_SERVICES cilium_lb4_services_v2
#define CONF_LB6_SERVICES cilium_lb6_services_v2
#else
#define CONF_LB4_SERVICES LB4_SERVICES_MAP_V2
#define CONF_LB6_SERVICES LB6_SERVICES_MAP_V2
#endif

struct conf_args {
	__u32 op;
	__u32 ifindex;
	__u32 lxc_id;
	__u32 sec_id;
	__be32 ip4;
	__be32 tunnel_ep;
	__u8 ip6[16];
	__u8 mac[8];      /* 6 bytes used; arrays 8-byte aligned for the */
	__u8 node_mac[8]; /* helpers' word-sized copies */
	__u8 vip6[16];
	__be32 vip4;
	__be16 vport;
	__be16 bport;
	__u32 backend_id;
	__u16 rev_nat;
	__u8 proto;
	__u8 svc_flags;
	__u8 family;
	__u8 svc_flags2;
	__u8 pad[6];
};

static __always_inline int conf_endpoint(struct conf_args *a)
{
#if CILIUM_MINOR >= 17
	endpoint_v4_add_entry(a->ip4, a->ifindex, (__u16)a->lxc_id, 0, a->sec_id, 0,
			      a->mac, a->node_mac);
#else
	endpoint_v4_add_entry(a->ip4, a->ifindex, (__u16)a->lxc_id, 0, a->sec_id,
			      a->mac, a->node_mac);
#endif
	endpoint_v6_add_entry((union v6addr *)a->ip6, a->ifindex, (__u16)a->lxc_id, 0,
			      a->sec_id, a->mac, a->node_mac);
	ipcache_v4_add_entry(a->ip4, 0, a->sec_id, 0, 0);
	ipcache_v6_add_entry((union v6addr *)a->ip6, 0, a->sec_id, 0, 0);
	return 0;
}

static __always_inline int conf_ipcache(struct conf_args *a)
{
	if (a->family == 4)
		ipcache_v4_add_entry(a->ip4, 0, a->sec_id, a->tunnel_ep, 0);
	else
		ipcache_v6_add_entry((union v6addr *)a->ip6, 0, a->sec_id, a->tunnel_ep, 0);
	return 0;
}

/* backend_id 0: the frontend alone, with no backend (count 0), as the
 * agent writes a service whose endpoints are all gone. */
static __always_inline int conf_service(struct conf_args *a)
{
	__u16 count = a->backend_id ? 1 : 0;

	if (a->family == 4) {
#if CILIUM_MINOR >= 18
		lb_v4_add_service_with_flags(a->vip4, a->vport, a->proto, count, a->rev_nat,
					     a->svc_flags, a->svc_flags2);
#else
		lb_v4_add_service_with_flags(a->vip4, a->vport, count, a->rev_nat,
					     a->svc_flags, a->svc_flags2);
#endif
		if (a->svc_flags2 & CONF_SVC_FLAG2_L7LB) {
			/* The frontend's Envoy port (1.19+ require it). */
			struct lb4_key k = {.address = a->vip4, .dport = a->vport};
			struct lb4_service *v = map_lookup_elem(&CONF_LB4_SERVICES, &k);

			if (!v) {
				k.proto = a->proto;
				v = map_lookup_elem(&CONF_LB4_SERVICES, &k);
			}
			if (v)
				v->l7_lb_proxy_port = CONF_L7_PROXY_PORT;
		}
		if (count)
			lb_v4_add_backend(a->vip4, a->vport, 1, a->backend_id, a->ip4, a->bport,
					  a->proto, 0);
	} else {
#if CILIUM_MINOR >= 18
		lb_v6_add_service_with_flags((union v6addr *)a->vip6, a->vport, a->proto, count,
					     a->rev_nat, a->svc_flags, a->svc_flags2);
#else
		lb_v6_add_service_with_flags((union v6addr *)a->vip6, a->vport, count,
					     a->rev_nat, a->svc_flags, a->svc_flags2);
#endif
		if (count)
			lb_v6_add_backend((union v6addr *)a->vip6, a->vport, 1, a->backend_id,
					  (union v6addr *)a->ip6, a->bport, a->proto, 0);
		if (a->svc_flags2 & CONF_SVC_FLAG2_L7LB) {
			/* The frontend again, both scopes as the helper wrote
			 * it, now with the Envoy port (1.19+ require it). */
			struct lb6_key k __align_stack_8 = {.dport = a->vport};
			struct lb6_service v __align_stack_8 = {
				.l7_lb_proxy_port = CONF_L7_PROXY_PORT,
				.count = count,
				.rev_nat_index = a->rev_nat,
				.flags = a->svc_flags,
				.flags2 = a->svc_flags2,
			};

			ipv6_addr_copy(&k.address, (union v6addr *)a->vip6);
#if CILIUM_MINOR >= 18
			k.proto = a->proto;
#endif
			map_update_elem(&CONF_LB6_SERVICES, &k, &v, BPF_ANY);
			k.scope = LB_LOOKUP_SCOPE_INT;
			map_update_elem(&CONF_LB6_SERVICES, &k, &v, BPF_ANY);
		}
	}
	return 0;
}

/* An L3/L4 policy entry (identity sec_id, direction family == 1 ? egress :
 * ingress, protocol proto, port vport) whose proxy_port (bport) redirects
 * the flow to the L7 proxy, as the agent writes it for an L7 rule. */
#if CILIUM_MINOR >= 20
#define CONF_POLICY_MAP cilium_policy
#elif CILIUM_MINOR >= 18
#define CONF_POLICY_MAP cilium_policy_v2
#else
#define CONF_POLICY_MAP POLICY_MAP
#endif
static __always_inline int conf_l7(struct conf_args *a)
{
	struct policy_key key = {
		.lpm_key.prefixlen = POLICY_FULL_PREFIX,
		.sec_label = a->sec_id,
		.egress = a->family == 1,
		.protocol = a->proto,
		.dport = a->vport,
	};
	struct policy_entry value = {
		.proxy_port = a->bport,
		.lpm_prefix_length = LPM_FULL_PREFIX_BITS,
	};

	return map_update_elem(&CONF_POLICY_MAP, &key, &value, BPF_ANY) ? 3 : 0;
}

/* An L3/L4 deny entry (identity sec_id, ingress, protocol proto, port
 * vport) as the agent writes it for a deny rule: a full-prefix match, which
 * every version's lookup takes before the wildcard allow-all entry (and
 * 1.18+ before any allow). The harness's endpoints share one policy map: the
 * identity and port keep it to the case that adds it. */
static __always_inline int conf_deny(struct conf_args *a)
{
	struct policy_key key = {
		.lpm_key.prefixlen = POLICY_FULL_PREFIX,
		.sec_label = a->sec_id,
		.protocol = a->proto,
		.dport = a->vport,
	};
	struct policy_entry value = {
		.deny = 1,
		.lpm_prefix_length = LPM_FULL_PREFIX_BITS,
	};

	return map_update_elem(&CONF_POLICY_MAP, &key, &value, BPF_ANY) ? 3 : 0;
}

__section("tc")
int conf_setup(struct __ctx_buff *ctx)
{
	struct conf_args a = {};

	if (ctx_load_bytes(ctx, 0, &a, sizeof(a)) < 0)
		return 1;
	switch (a.op) {
	case CONF_ENDPOINT:
		return conf_endpoint(&a);
	case CONF_IPCACHE:
		return conf_ipcache(&a);
	case CONF_SERVICE:
		return conf_service(&a);
	case CONF_L7:
		return conf_l7(&a);
	case CONF_DENY:
		return conf_deny(&a);
	}
	return 2;
}

/* Allow-all policy for every endpoint (what the agent installs for an
 * endpoint without policy enforcement). */
__section("tc")
int conf_policy(struct __ctx_buff *ctx __maybe_unused)
{
#if CILIUM_MINOR >= 20
	policy_add_ingress_allow_all_entry();
	policy_add_egress_allow_all_entry();
#elif CILIUM_MINOR >= 19
	policy_add_entry(false, 0, 0, 0, 0, false, 0);
	policy_add_entry(true, 0, 0, 0, 0, false, 0);
#else
	policy_add_entry(false, 0, 0, 0, false);
	policy_add_entry(true, 0, 0, 0, false);
#endif
	return 0;
}
#endif
