// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* bpf_lxc.c with the host firewall on: traffic to the node's own addresses
 * (identity host) is redirected to cilium_host, where bpf_host's host
 * policy (host_hostfw.c) runs. */
#define ENABLE_HOST_FIREWALL 1

#include "lxc.c"
