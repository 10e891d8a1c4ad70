// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* Cilium's bpf_host.c (the node's native device programs) for the
 * conformance suite: cil_from_netdev receives what comes from off the node
 * (world, remote pods, NodePort clients) and delivers it to local pods by
 * tail call into their policy programs (bpf_lxc.c, shared maps). */
#include "harness.h"

#include <bpf/ctx/skb.h>
#include "tests/common.h"
#include "tests/pktgen.h"

#include "bpf_host.c"
