#!/usr/bin/env bash
# `make e2e-kind`: the whole kind e2e on this machine or any Linux one with
# root (docs/kind.md). Installs and starts what it needs (install.sh), builds
# or reuses the images (images/build.sh), creates the cluster with Cilium and
# ctscrub (cluster.sh up), runs the tests, and deletes the cluster
# (cluster.sh down, also on failure and Ctrl-C), which checks that the
# machine's interfaces and iptables are as they were. Its last line is one
# JSON object: k8s_version, cilium_version, nodes, pods_churned,
# stale_entries_left, inherited_entries, scrubs (by method), duration_s,
# image_build_s, and the tests' other figures.
#
# Variables: those of cluster.sh and images/build.sh (CILIUM_VERSION, ...),
# and E2E_KIND_RUN (go test -run pattern, default every kind test),
# E2E_KIND_KEEP=1 (keep the cluster: `e2e/kind/cluster.sh down` later).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
start=$(date +%s)
WORK=${CTSCRUB_KIND_WORK:-/var/tmp/ctscrub-kind}
export CTSCRUB_KIND_WORK=$WORK
# Small node CIDRs (32 addresses), so the churn's 50 pods reuse IPs.
export NODE_CIDR_MASK=${NODE_CIDR_MASK:-27}
GO=${GO:-go}
log() { printf '%s e2e-kind: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

"$HERE/install.sh"
export PATH=${CTSCRUB_KIND_PREFIX:-/opt/ctscrub-kind}/bin:$PATH
mkdir -p "$WORK"
down() {
	trap - EXIT INT TERM
	if [[ ${E2E_KIND_KEEP:-0} == 1 ]]; then
		log "E2E_KIND_KEEP=1: cluster kept; 'e2e/kind/cluster.sh down' when done"
		return 0
	fi
	"$HERE/cluster.sh" down
}
trap 'down; exit 130' INT TERM
trap 'rc=$?; down || rc=1; exit $rc' EXIT
"$HERE/cluster.sh" up >"$WORK/run.env"
set -a
# shellcheck disable=SC1091
source "$WORK/run.env"
set +a

results=$WORK/results.jsonl
rm -f "$results"
rc=0
CTSCRUB_KIND=1 CTSCRUB_KIND_UNINSTALL=1 CTSCRUB_KIND_RESULTS=$results "$GO" test -C "$ROOT" -count=1 -v -timeout 60m \
	-run "${E2E_KIND_RUN:-^(TestChart.*|TestKind.*)$}" ./e2e/kind/ || rc=$?
((rc == 0)) || "$HERE/cluster.sh" diag || true
down || rc=1
trap - EXIT
jq -cs --arg k8s "$K8S_VERSION" --arg cilium "$CILIUM_VERSION" \
	--argjson nodes "$(tr ',' '\n' <<<"$NODES" | grep -c .)" \
	--argjson dur $(($(date +%s) - start)) --argjson img "$IMAGE_BUILD_S" --argjson rc "$rc" \
	'{k8s_version: $k8s, cilium_version: $cilium, nodes: $nodes} + add +
	 {duration_s: $dur, image_build_s: $img, passed: ($rc == 0)}' \
	<(cat "$results" 2>/dev/null; echo '{}')
exit $rc
