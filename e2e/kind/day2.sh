#!/usr/bin/env bash
# `make e2e-kind-day2`: day-2 operations on the kind cluster of `make
# e2e-kind`, with pods churning throughout (TestKindDay2, docs/kind.md "Day
# 2"): what the expiry sweep does beside Cilium's GC and SNAT mappings, the
# worker node restarted, scrubd OOM-killed, ctscrub upgraded from an
# earlier commit's chart and image, Cilium upgraded from CILIUM_PREV_VERSION
# and rolled back. Builds what the steps need, brings the cluster up
# (cluster.sh up), runs the test, and deletes the cluster (also on failure
# and Ctrl-C). Its last line is one JSON object with one object per step.
#
# Variables: those of run.sh and cluster.sh, and
#   CTSCRUB_PREV_REF=00651c2   the earlier ctscrub: a commit of this repo
#                              (default: main just before the chart became an
#                              operator artefact, issue 25 items 1-3), its
#                              tree exported with git archive, its image
#                              built by its own e2e/kind/images/ctscrub.sh
#   CILIUM_PREV_VERSION=1.17.6 the Cilium the upgrade starts from
#   CILIUM_PREV_BUILD=1        build its images when not cached (images/cilium.sh,
#                              20-40 min of CPU cold); 0: the Cilium steps skip
#                              when they are not cached
#   CTSCRUB_DAY2_STEPS=        comma-separated steps to run (default all)
#   CTSCRUB_DAY2_OOM_LIMIT=    scrubd's memory limit in scrubd_oom (default
#                              half its working set, at least 8Mi)
#   E2E_KIND_KEEP=1            keep the cluster (`e2e/kind/cluster.sh down` later)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
start=$(date +%s)
WORK=${CTSCRUB_KIND_WORK:-/var/tmp/ctscrub-kind}
export CTSCRUB_KIND_WORK=$WORK
export NODE_CIDR_MASK=${NODE_CIDR_MASK:-27}
GO=${GO:-go}
CTSCRUB_PREV_REF=${CTSCRUB_PREV_REF:-00651c2}
CILIUM_PREV_VERSION=${CILIUM_PREV_VERSION:-1.17.6}
CILIUM_PREV_BUILD=${CILIUM_PREV_BUILD:-1}
log() { printf '%s e2e-kind-day2: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

"$HERE/install.sh"
export PATH=${CTSCRUB_KIND_PREFIX:-/opt/ctscrub-kind}/bin:$PATH
mkdir -p "$WORK/logs"

# The earlier ctscrub: its tree and its image, built as that tree builds it.
prev_sha=$(git -C "$ROOT" rev-parse --short=12 "$CTSCRUB_PREV_REF^{commit}")
prev_tree=$WORK/ctscrub-prev-$prev_sha
if [[ ! -f $prev_tree/go.mod ]]; then
	rm -rf "$prev_tree"; mkdir -p "$prev_tree"
	git -C "$ROOT" archive "$prev_sha" | tar -x -C "$prev_tree"
fi
log "earlier ctscrub $CTSCRUB_PREV_REF ($prev_sha): building its image"
CTSCRUB_PREV_IMAGE=$(CTSCRUB_KIND_WORK=$WORK/prev "$prev_tree/e2e/kind/images/ctscrub.sh")
export CTSCRUB_PREV_REF CTSCRUB_PREV_IMAGE CTSCRUB_PREV_CHART=$prev_tree/conf/chart

# Cilium's previous version: its images (cached, or built when asked) and chart.
CILIUM_PREV_IMAGE= CILIUM_PREV_OPERATOR_IMAGE= CILIUM_PREV_CHART= CILIUM_PREV_UNAVAILABLE=
prev_imgs=$WORK/cilium-$CILIUM_PREV_VERSION.images
# 1.16 and 1.17 exit on this kernel (no /proc/modules) and fail to build
# their datapath with clang 19: the change build.sh makes for 1.16
# (images/cilium-1.16-patch.sh; docs/kind.md, "Cilium versions"), which
# applies to 1.17.6's source too. Seen: the unpatched 1.17.6 agent in
# CrashLoopBackOff, "open /proc/modules: no such file or directory".
# Given to that build only: exported, the build of the current version's
# images (cluster.sh) would apply it to 1.18.8 and fail.
patched= prev_patch=
case $CILIUM_PREV_VERSION in
1.16.* | 1.17.*) prev_patch=$HERE/images/cilium-1.16-patch.sh; patched=-patched ;;
esac
if [[ $CILIUM_PREV_BUILD == 1 ]]; then
	log "Cilium $CILIUM_PREV_VERSION images (built if not cached: 20-40 min cold; log $WORK/logs/cilium-$CILIUM_PREV_VERSION.log)"
	CILIUM_VERSION=$CILIUM_PREV_VERSION CILIUM_DELEGATE=0 CILIUM_PATCH=$prev_patch "$HERE/images/cilium.sh" >"$prev_imgs" 2>"$WORK/logs/cilium-$CILIUM_PREV_VERSION.log" ||
		CILIUM_PREV_UNAVAILABLE="images/cilium.sh failed for $CILIUM_PREV_VERSION: see $WORK/logs/cilium-$CILIUM_PREV_VERSION.log"
else
	# The newest cached images of the version, without building.
	{
		docker images --format '{{.Repository}}:{{.Tag}}' | grep -m1 -E "^ctscrub-kind/cilium:$CILIUM_PREV_VERSION$patched-[0-9a-f]{16}$" || true
		docker images --format '{{.Repository}}:{{.Tag}}' | grep -m1 -E "^ctscrub-kind/cilium-operator-generic:$CILIUM_PREV_VERSION$patched-[0-9a-f]{16}$" || true
	} >"$prev_imgs"
	[[ $(wc -l <"$prev_imgs") == 2 ]] || CILIUM_PREV_UNAVAILABLE="no cached ctscrub-kind/cilium:$CILIUM_PREV_VERSION$patched images and CILIUM_PREV_BUILD=0 (a cold build takes 20-40 min of CPU)"
fi
if [[ -z $CILIUM_PREV_UNAVAILABLE ]]; then
	CILIUM_PREV_IMAGE=$(grep '^ctscrub-kind/cilium:' "$prev_imgs")
	CILIUM_PREV_OPERATOR_IMAGE=$(grep '^ctscrub-kind/cilium-operator-generic:' "$prev_imgs")
	CILIUM_PREV_CHART=$("$GO" mod download -json "github.com/cilium/cilium@v$CILIUM_PREV_VERSION" | jq -r .Dir)/install/kubernetes/cilium
	[[ -f $CILIUM_PREV_CHART/Chart.yaml ]] || CILIUM_PREV_UNAVAILABLE="no chart at $CILIUM_PREV_CHART"
fi
export CILIUM_PREV_VERSION CILIUM_PREV_IMAGE CILIUM_PREV_OPERATOR_IMAGE CILIUM_PREV_CHART CILIUM_PREV_UNAVAILABLE

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
# BPF masquerade: the expiry_sweep step's flows get SNAT mappings, whose
# fate beside their expired CT entries the step measures.
export CILIUM_HELM_ARGS="${CILIUM_HELM_ARGS:-} --set bpf.masquerade=true"
"$HERE/cluster.sh" up >"$WORK/run.env"
set -a
# shellcheck disable=SC1091
source "$WORK/run.env"
set +a
imgs=("$CTSCRUB_PREV_IMAGE")
[[ -n $CILIUM_PREV_IMAGE ]] && imgs+=("$CILIUM_PREV_IMAGE" "$CILIUM_PREV_OPERATOR_IMAGE")
log "loading ${imgs[*]}"
kind load docker-image --name "$CLUSTER" "${imgs[@]}" >&2

results=$WORK/results.jsonl
rm -f "$results"
rc=0
CTSCRUB_KIND=1 CTSCRUB_KIND_DAY2=1 CTSCRUB_KIND_RESULTS=$results "$GO" test -C "$ROOT" -count=1 -v -timeout 120m \
	-run '^TestKindDay2$' ./e2e/kind/ || rc=$?
((rc == 0)) || "$HERE/cluster.sh" diag || true
down || rc=1
trap - EXIT
# The last "steps" line holds every step's object.
jq -cs --arg k8s "$K8S_VERSION" --arg v "$CILIUM_VERSION" --arg pv "$CILIUM_PREV_VERSION" --arg ref "$CTSCRUB_PREV_REF" \
	--argjson dur $(($(date +%s) - start)) --argjson rc "$rc" --arg at "$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
	'{at: $at, k8s_version: $k8s, cilium_version: $v, cilium_prev_version: $pv, ctscrub_prev_ref: $ref,
	  steps: ((map(select(.steps)) | last | .steps) // {}), duration_s: $dur, passed: ($rc == 0)}' \
	<(cat "$results" 2>/dev/null; echo '{}')
exit $rc
