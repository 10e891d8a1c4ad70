// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* bpf_lxc.c as Cilium builds it with --enable-envoy-config (Cilium Ingress,
 * Gateway API, CiliumEnvoyConfig): pkg/datapath/linux/config sets
 * ENABLE_L7_LB in 1.16 to 1.20. A flow to a service flagged
 * SVC_FLAG_L7_LOADBALANCER (flags2 bit 2) is then neither load-balanced nor
 * DNATed: __per_packet_lb_svc_xlate_4/6 skip to the CT egress path with the
 * service's proxy port (0 here: the harness runs no Envoy), which keeps the
 * plain OUT entry to the VIP. */
#include "harness.h"
#define ENABLE_L7_LB 1

#include "lxc.c"
