#!/usr/bin/env bash
# make bench-cilium-node: a kind cluster of its own (CLUSTER, default
# ctscrub-bench-node: never the e2e's) with real Cilium, the benchmark
# (bench/ciliumnode) against its worker, and the cluster deleted at the end,
# also on failure and Ctrl-C (KEEP=1 keeps it).
#
# It takes the images `make e2e-kind` builds (e2e/kind/images) from Docker's
# image store, newest of each name unless given, and builds only ctscrub's
# (seconds: e2e/kind/images/ctscrub.sh, from this tree, so the benchmark runs
# the code beside it, not whatever ctscrub image another tree built last):
#   NODE_IMAGE            kind node image (Kubernetes)
#   CILIUM_IMAGE          stock Cilium agent (tag <version>-<hash>: no patch)
#   CILIUM_DELEGATE_IMAGE Cilium agent with cilium/patches (tag
#                         <version>-delegate-<hash>: CILIUM_DELEGATE=1
#                         e2e/kind/images/cilium.sh), for ctscrub_delegate only
#   CILIUM_COALESCED_IMAGE Cilium agent with cilium/patches/coalesce-v* (tag
#                         <version>-coalesced-<hash>: CILIUM_COALESCED=1
#                         e2e/kind/images/cilium.sh), for cilium_coalesced only
#   CILIUM_OPERATOR_IMAGE Cilium operator (stock, every variant)
#   CTSCRUB_IMAGE         ctscrub (conf/Containerfile)
#   CLIENT_IMAGE          busybox, for the traffic pods (SERVER_IMAGE: same unless set)
#   CILIUM_CHART          Cilium's Helm chart dir (default: the Cilium module's, CILIUM_VERSION)
# Tools (kind, helm, kubectl) from PATH or e2e/kind/install.sh's prefix.
#
# Cilium is installed the way the incident's node ran: maps sized for ENTRIES
# (bpf.ctTcpMax/ctAnyMax = CT_MAX, default ENTRIES), a GC interval drifted to
# hours (conntrackGCInterval, CT_GC_INTERVAL, default 12h: Cilium's own GC
# does not run during the benchmark), debug logs (the per-endpoint
# regeneration statistics and cilium-cni's per-call lines are debug level),
# its metrics on, and cni.exclusive=false so ctscrub's installer may chain
# itself into Cilium's own conflist (docs/plugin.md, option 2). Those values
# go to a file (CILIUM_VALUES) that the benchmark layers each variant's own
# on when it upgrades Cilium (cilium_gc60, cilium_coalesced, ctscrub_delegate). IPAM is
# cluster-pool with small node ranges (NODE_CIDR_MASK, default: the smallest
# holding PODS + 12 addresses) so that ctscrub_delegate's warm-up can give
# every free address of the worker a pod once (docs/cilium-node.md).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PREFIX=${CTSCRUB_KIND_PREFIX:-/opt/ctscrub-kind}
export PATH=$PATH:$PREFIX/bin
CLUSTER=${CLUSTER:-ctscrub-bench-node}
CILIUM_VERSION=${CILIUM_VERSION:-1.18.8}
export ENTRIES=${ENTRIES:-4194304}
CT_MAX=${CT_MAX:-$ENTRIES}
CT_GC_INTERVAL=${CT_GC_INTERVAL:-12h}
POD_CIDR=${POD_CIDR:-10.244.0.0/16}
PODS=${PODS:-20}
if [[ -z ${NODE_CIDR_MASK:-} ]]; then
	NODE_CIDR_MASK=32
	while ((1 << (32 - NODE_CIDR_MASK) < PODS + 12)); do NODE_CIDR_MASK=$((NODE_CIDR_MASK - 1)); done
fi
VARIANTS=${VARIANTS:-}
WORK=$(mktemp -d /tmp/ctscrub-bench-node.XXXXXX)
export KUBECONFIG=$WORK/kubeconfig
trap 'rm -rf "$WORK"' EXIT
log() { printf '%s bench-cilium-node: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

[[ $(id -u) == 0 ]] || die "run as root (the benchmark opens the node's CT maps in this kernel)"
for t in docker kind helm nsenter curl jq; do
	command -v "$t" >/dev/null || die "$t not found: run e2e/kind/install.sh (make e2e-kind does) or put it on PATH"
done
docker info >/dev/null 2>&1 || die "no Docker engine answers: e2e/kind/install.sh starts one"

# newest IMAGE_REF whose repository matches $1 and tag $2 (grep -E), or die
# naming the variable $3 and how to build one ($4).
newest() {
	local ref
	ref=$(docker images --format '{{.CreatedAt}}|{{.Repository}}:{{.Tag}}' | grep -E "\|($1):($2)\$" | sort -r | head -1 | cut -d'|' -f2)
	[[ -n $ref ]] || die "no image $1:$2 in Docker's store: ${4:-build the images first (make e2e-kind)}, or set $3"
	echo "$ref"
}
tag_any='[^<][^ ]*'
v_re=${CILIUM_VERSION//./\\.}
NODE_IMAGE=${NODE_IMAGE:-$(newest 'ctscrub-kind/node' "$tag_any" NODE_IMAGE)}
# Stock and patched agents share a repository: the tag tells them apart.
CILIUM_IMAGE=${CILIUM_IMAGE:-$(newest 'ctscrub-kind/cilium' "$v_re-[0-9a-f]+" CILIUM_IMAGE "CILIUM_VERSION=$CILIUM_VERSION e2e/kind/images/cilium.sh builds it")}
export CILIUM_DELEGATE_IMAGE=${CILIUM_DELEGATE_IMAGE:-}
if [[ -z $VARIANTS || ,$VARIANTS, == *,ctscrub_delegate,* ]]; then
	CILIUM_DELEGATE_IMAGE=${CILIUM_DELEGATE_IMAGE:-$(newest 'ctscrub-kind/cilium' "$v_re-delegate-[0-9a-f]+" CILIUM_DELEGATE_IMAGE \
		"CILIUM_DELEGATE=1 CILIUM_VERSION=$CILIUM_VERSION e2e/kind/images/cilium.sh builds it (or leave ctscrub_delegate out of VARIANTS)")}
fi
export CILIUM_COALESCED_IMAGE=${CILIUM_COALESCED_IMAGE:-}
if [[ -z $VARIANTS || ,$VARIANTS, == *,cilium_coalesced,* ]]; then
	CILIUM_COALESCED_IMAGE=${CILIUM_COALESCED_IMAGE:-$(newest 'ctscrub-kind/cilium' "$v_re-coalesced-[0-9a-f]+" CILIUM_COALESCED_IMAGE \
		"CILIUM_COALESCED=1 CILIUM_VERSION=$CILIUM_VERSION e2e/kind/images/cilium.sh builds it (or leave cilium_coalesced out of VARIANTS)")}
fi
CILIUM_OPERATOR_IMAGE=${CILIUM_OPERATOR_IMAGE:-$(newest 'ctscrub-kind/cilium-operator-generic' "$v_re-[0-9a-f]+" CILIUM_OPERATOR_IMAGE)}
if [[ -z ${CTSCRUB_IMAGE:-} ]]; then
	CTSCRUB_IMAGE=$(CTSCRUB_KIND_WORK=$WORK/images "$ROOT/e2e/kind/images/ctscrub.sh") || die "building ctscrub's image from $ROOT failed"
fi
export CTSCRUB_IMAGE
export CLIENT_IMAGE=${CLIENT_IMAGE:-$(newest 'ctscrub-kind/busybox' "$tag_any" CLIENT_IMAGE)}
export SERVER_IMAGE=${SERVER_IMAGE:-$CLIENT_IMAGE}
if [[ -z ${CILIUM_CHART:-} ]]; then
	dir=$(cd "$ROOT" && go mod download -json "github.com/cilium/cilium@v${CILIUM_VERSION#v}" | jq -r .Dir)
	CILIUM_CHART=$dir/install/kubernetes/cilium
fi
[[ -f $CILIUM_CHART/Chart.yaml ]] || die "no Helm chart at $CILIUM_CHART (set CILIUM_CHART)"
log "images: node $NODE_IMAGE, cilium $CILIUM_IMAGE (delegate: ${CILIUM_DELEGATE_IMAGE:-none}, coalesced: ${CILIUM_COALESCED_IMAGE:-none}), operator $CILIUM_OPERATOR_IMAGE, ctscrub $CTSCRUB_IMAGE, client $CLIENT_IMAGE"

# kubectl of the cluster's own version, from the node image.
mkdir -p "$WORK/bin"
id=$(docker create "$NODE_IMAGE" /nonexistent)
docker cp "$id:/usr/bin/kubectl" "$WORK/bin/kubectl" >/dev/null; docker rm "$id" >/dev/null
export PATH=$WORK/bin:$PATH

kind get clusters 2>/dev/null | grep -qx "$CLUSTER" && die "a kind cluster $CLUSTER exists already: delete it (kind delete cluster --name $CLUSTER) or set CLUSTER"
cleanup() {
	local rc=$?
	if [[ ${KEEP:-} == 1 ]]; then
		log "KEEP=1: cluster $CLUSTER kept (KUBECONFIG=$KUBECONFIG); kind delete cluster --name $CLUSTER when done"
	else
		log "deleting cluster $CLUSTER"
		kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || log "warning: kind delete cluster --name $CLUSTER failed"
		rm -rf "$WORK"
	fi
	exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

cat >"$WORK/kind.yaml" <<EOF
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
networking:
  disableDefaultCNI: true
  kubeProxyMode: none
  podSubnet: $POD_CIDR
nodes:
  - role: control-plane
  - role: worker
EOF
log "creating cluster $CLUSTER"
kind create cluster --name "$CLUSTER" --image "$NODE_IMAGE" --config "$WORK/kind.yaml" --kubeconfig "$KUBECONFIG" --wait 0s >&2
for img in "$CILIUM_IMAGE" ${CILIUM_DELEGATE_IMAGE:+"$CILIUM_DELEGATE_IMAGE"} ${CILIUM_COALESCED_IMAGE:+"$CILIUM_COALESCED_IMAGE"} "$CILIUM_OPERATOR_IMAGE" "$CTSCRUB_IMAGE" "$CLIENT_IMAGE" "$SERVER_IMAGE"; do
	kind load docker-image "$img" --name "$CLUSTER" >&2
done

# The API server by address (as e2e/kind/cluster.sh does): the agent needs it
# before any DNS works on the node.
cp_ip=$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$CLUSTER-control-plane")
op_repo=${CILIUM_OPERATOR_IMAGE%:*} op_tag=${CILIUM_OPERATOR_IMAGE##*:}
op_repo=${op_repo%-generic} # the chart appends -generic (ipam's operator flavour)
# The values every variant shares; the benchmark layers a variant's own
# (image, GC interval, the delegate flag) on these when it upgrades.
# rollOutCiliumPods: a change to Cilium's ConfigMap alone (the GC interval)
# rolls the agents, which read it only at start.
export CILIUM_VALUES=$WORK/cilium-values.yaml CILIUM_CHART
cat >"$CILIUM_VALUES" <<EOF
image: {override: "$CILIUM_IMAGE", pullPolicy: IfNotPresent}
operator:
  image: {repository: "$op_repo", tag: "$op_tag", useDigest: false, pullPolicy: IfNotPresent}
  replicas: 1
envoy: {enabled: false}
l7Proxy: false
hubble: {enabled: false}
kubeProxyReplacement: true
k8sServiceHost: "$cp_ip"
k8sServicePort: 6443
ipam:
  mode: cluster-pool
  operator: {clusterPoolIPv4PodCIDRList: ["$POD_CIDR"], clusterPoolIPv4MaskSize: $NODE_CIDR_MASK}
cni: {exclusive: false}
debug: {enabled: true}
prometheus: {enabled: true}
bpf: {ctTcpMax: $CT_MAX, ctAnyMax: $CT_MAX}
conntrackGCInterval: "$CT_GC_INTERVAL"
rollOutCiliumPods: true
EOF
log "installing Cilium $CILIUM_VERSION (CT maps $CT_MAX entries each, GC interval $CT_GC_INTERVAL, node pod ranges /$NODE_CIDR_MASK, debug logs)"
helm install cilium "$CILIUM_CHART" --namespace kube-system --wait=false -f "$CILIUM_VALUES" >&2
kubectl -n kube-system rollout status ds/cilium --timeout=10m >&2
kubectl wait --for=condition=Ready node --all --timeout=5m >&2
kubectl -n kube-system rollout status deploy/coredns --timeout=5m >&2 || log "warning: coredns not ready (the traffic pods' DNS lookups fail; TCP flows still run)"

log "running the benchmark (ENTRIES=$ENTRIES EXPIRED=${EXPIRED:-0.8} PODS=$PODS WARMUP=${WARMUP:-0})"
export CLUSTER POD_CIDR PODS CT_GC_INTERVAL CILIUM_IMAGE
(cd "$ROOT" && go run ./bench/ciliumnode)
