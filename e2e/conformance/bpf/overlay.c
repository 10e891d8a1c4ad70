// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* Cilium's bpf_overlay.c (the tunnel device's programs, tunnel mode) for
 * the conformance suite: cil_from_overlay receives what another node sent
 * over the tunnel, after the kernel took the outer header off, and delivers
 * it to local pods by tail call into their policy programs (bpf_lxc.c,
 * shared maps). BPF_PROG_TEST_RUN has no tunnel metadata: the tunnel key
 * (the sender's identity, as the remote node's bpf_lxc put it) is mocked the
 * way Cilium's own overlay tests do, with the identity of the harness's
 * remote pods. */
#include "harness.h"

/* A tunnel-mode node's config, as Cilium's overlay tests set it (the
 * agent defines both with routing-mode tunnel). */
#define ENCAP_IFINDEX 42
#define TUNNEL_MODE 1

#include <bpf/ctx/skb.h>
#include "tests/common.h"
#include "tests/pktgen.h"

#define CONF_OVERLAY_IDENTITY 5001 /* remotePodID (node.go) */

#define skb_get_tunnel_key mock_skb_get_tunnel_key
int mock_skb_get_tunnel_key(__maybe_unused struct __sk_buff *skb,
			    struct bpf_tunnel_key *key,
			    __maybe_unused __u32 size,
			    __maybe_unused __u32 flags)
{
	key->tunnel_id = CONF_OVERLAY_IDENTITY;
	key->remote_ipv4 = bpf_htonl(0xc0000214); /* 192.0.2.20, another node */
	return 0;
}

#include "bpf_overlay.c"
