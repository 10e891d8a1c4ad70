// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* Cilium's bpf_lxc.c (the pod's veth programs) for the conformance suite.
 * Entry points used: cil_from_container (the pod sends), cil_to_container
 * (the pod receives through the stack) and the pod's ingress policy program
 * (reached by tail call from local delivery, also from bpf_host.c). */
#include "harness.h"

#include <bpf/ctx/skb.h>
#include "tests/common.h"
#include "tests/pktgen.h"

#include "bpf_lxc.c"

#include "tests/lib/endpoint.h"
#include "tests/lib/ipcache.h"
#include "tests/lib/policy.h"
#include "tests/lib/lb.h"

#include "setup.h"
