// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* bpf_lxc.c as Cilium builds it with socket LB limited to the host
 * namespace (bpf-lb-sock-hostns-only, socketLB.hostNamespaceOnly=true):
 * pkg/datapath/linux/config sets ENABLE_SOCKET_LB_HOST_ONLY, and not
 * ENABLE_SOCKET_LB_FULL, in 1.16 to 1.20. In bpf_lxc.c's include graph
 * that macro is read only where ENABLE_PER_PACKET_LB is decided.
 *
 * harness.h turns SCTP on, which compiles ENABLE_PER_PACKET_LB by itself;
 * it is turned off here so that this object's per-packet LB comes from
 * the host-only macro alone (the cases on this node check that Cilium
 * made a SERVICE entry, i.e. that the path ran). */
#include "harness.h"
#undef ENABLE_SCTP
#define ENABLE_SOCKET_LB_HOST_ONLY 1

#include "lxc.c"
