// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* bpf_host.c of the suite's second node: NodePort DSR (IP option / IPv6
 * extension header mode, as Cilium's tests/tc_nodeport_lb*_dsr_backend.c
 * configure it: the backend's node receives the client's packet with the
 * service address in an option) and the host firewall (cil_to_host and
 * cil_from_host enforce the host endpoint's policy, with CT entries of their
 * own in the global maps). Paired with lxc_hostfw.c. */
#define ENABLE_DSR 1
#define DSR_ENCAP_GENEVE 3
#define ENABLE_HOST_FIREWALL 1

#include "host.c"
