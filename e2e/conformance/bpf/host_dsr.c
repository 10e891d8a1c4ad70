// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* bpf_host.c with NodePort DSR (IP option / IPv6 extension header mode), as
 * Cilium's tests/tc_nodeport_lb*_dsr_backend.c configure it: the backend's
 * node receives the client's packet with the service address in an option. */
#define ENABLE_DSR 1
#define DSR_ENCAP_GENEVE 3

#include "host.c"
