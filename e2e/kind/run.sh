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
# Variables: those of cluster.sh and images/build.sh (CILIUM_VERSION, CNI,
# KUBE_PROXY_MODE, CILIUM_LB, ...), and E2E_KIND_RUN (go test -run pattern,
# default every kind test of the mode), E2E_KIND_KEEP=1 (keep the cluster:
# `e2e/kind/cluster.sh down` later).
#
# CILIUM_DELEGATE=1: the default pattern also runs TestKindDelegateFaults
# (issue 38: a fake delegate that hangs, then one served by uid 65534, in
# front of the patched agent; the breaker and the refusals counted) and
# TestKindDelegateUnseenWave (issue 34: a wave of pods started while ctscrub
# is unchained, then deleted and its IPs reused; the delegate's answers about
# them counted by method), which skip with their reason otherwise. They sort
# after TestKindChurn and before TestKindUninstall (churn_test.go <
# delegate_faults_test.go < delegate_unseen_test.go < uninstall_test.go),
# which must come last; the fault test gives scrubd its socket back and waits
# for the agent to delegate again before it ends.
#
# CNI=kindnet: the cluster comes up without ctscrub; TestKindBlackhole runs
# first, measures the blackhole, installs ctscrub (cluster.sh
# install-ctscrub) and measures again; then the churn, the remote backend
# (TestKindRemoteBackend) and the uninstall.
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
CNI=${CNI:-cilium}
up_ctscrub=${CTSCRUB:-1}
[[ $CNI == kindnet ]] && up_ctscrub=0
CTSCRUB=$up_ctscrub "$HERE/cluster.sh" up >"$WORK/run.env"
set -a
# shellcheck disable=SC1091
source "$WORK/run.env"
set +a

results=$WORK/results.jsonl
rm -f "$results"
rc=0
kindtest() {
	CTSCRUB_KIND=1 CTSCRUB_KIND_UNINSTALL=1 CTSCRUB_KIND_RESULTS=$results "$GO" test -C "$ROOT" -count=1 -v -timeout 60m \
		-run "$1" ./e2e/kind/
}
if [[ $CNI == kindnet ]]; then
	if [[ -z ${E2E_KIND_RUN:-} ]]; then
		kindtest '^TestKindBlackhole$' || rc=$?
		# Each test of the run needs ctscrub, which TestKindBlackhole installs.
		((rc == 0)) && { kindtest '^(TestChart.*|TestKindChurn|TestKindRemoteBackend|TestKindUninstall)$' || rc=$?; }
	else
		kindtest "$E2E_KIND_RUN" || rc=$?
	fi
else
	kindtest "${E2E_KIND_RUN:-^(TestChart.*|TestKind.*)$}" || rc=$?
fi
((rc == 0)) || "$HERE/cluster.sh" diag || true
down || rc=1
trap - EXIT
# The CNI's keys: cni is what ran; with CNI=kindnet what was asked and why
# it could not be.
if [[ $CNI == kindnet ]]; then
	mode=$(jq -cn --arg cni "$CNI_USED" --arg kp "$KUBE_PROXY_MODE" --arg why "$KINDNET_UNAVAILABLE" \
		'{cni: $cni, cni_requested: "kindnet", kindnet_unavailable: $why, kube_proxy_mode: $kp}')
else
	mode=$(jq -cn --arg v "$CILIUM_VERSION" --arg lb "$CILIUM_LB" --arg kp "$KUBE_PROXY_MODE" \
		'{cilium_version: $v, cni: "cilium", cilium_lb: $lb, kube_proxy_mode: $kp}')
fi
jq -cs --arg k8s "$K8S_VERSION" --argjson mode "$mode" \
	--argjson nodes "$(tr ',' '\n' <<<"$NODES" | grep -c .)" \
	--argjson dur $(($(date +%s) - start)) --argjson img "$IMAGE_BUILD_S" --argjson rc "$rc" \
	'{k8s_version: $k8s} + $mode + {nodes: $nodes} + add +
	 {duration_s: $dur, image_build_s: $img, passed: ($rc == 0)}' \
	<(cat "$results" 2>/dev/null; echo '{}')
exit $rc
