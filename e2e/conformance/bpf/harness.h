/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* ctscrub conformance harness: the parts shared by lxc.c and host.c.
 *
 * Compiled against the Cilium source of one version from the Go module cache
 * (never copied here), the way Cilium's bpf/tests/ compile their tests:
 * -I<cilium>/bpf -I<cilium>/bpf/include, tests/common.h and tests/pktgen.h,
 * feature macros defined before bpf_lxc.c / bpf_host.c is included, and the
 * tests' map helpers (tests/lib/) for the endpoint, ipcache, policy and
 * service maps. CILIUM_MINOR (16, 18, 20, ...) selects the helper
 * signatures that changed between versions. */
#ifndef CTSCRUB_CONFORMANCE_HARNESS_H
#define CTSCRUB_CONFORMANCE_HARNESS_H

/* Legacy host routing (no ENABLE_HOST_ROUTING): bpf_host passes packets
 * for local pods to the stack, which routes them to the pod's veth where
 * cil_to_container runs; no FIB lookup needs mocking. The CT entries are
 * those of BPF host routing (the same ct_lookup/ct_create calls in the
 * pod's ingress policy path).
 *
 * Feature macros must be 1, not empty: the datapath tests several of them
 * with is_defined(), and an empty one silently disables the path. */
#define ENABLE_IPV4 1
#define ENABLE_IPV6 1
#define ENABLE_ROUTING 1
#define ENABLE_NODEPORT 1
#define ENABLE_SCTP 1
#define ETH_HLEN 14
#define ENABLE_ICMP_RULE 1
#endif
