#!/usr/bin/env bash
# make bench-cilium-node: a kind cluster of its own (CLUSTER, default
# ctscrub-bench-node: never the e2e's) with real Cilium, the benchmark
# (bench/ciliumnode) against its worker, and the cluster deleted at the end,
# also on failure and Ctrl-C (KEEP=1 keeps it).
#
# It builds no image: it takes the ones `make e2e-kind` builds (e2e/kind/images)
# from Docker's image store, newest of each name unless given:
#   NODE_IMAGE            kind node image (Kubernetes)
#   CILIUM_IMAGE, CILIUM_OPERATOR_IMAGE   Cilium agent and operator
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
# itself into Cilium's own conflist (docs/plugin.md, option 2).
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

# newest IMAGE_REF matching a repository pattern (grep -E), or die.
newest() {
	local ref
	ref=$(docker images --format '{{.CreatedAt}}|{{.Repository}}:{{.Tag}}' | grep -E "\|($1):" | grep -v ':<none>$' | sort -r | head -1 | cut -d'|' -f2)
	[[ -n $ref ]] || die "no image $1 in Docker's store: build the images first (make e2e-kind), or set $2"
	echo "$ref"
}
NODE_IMAGE=${NODE_IMAGE:-$(newest 'ctscrub-kind/node' NODE_IMAGE)}
CILIUM_IMAGE=${CILIUM_IMAGE:-$(newest 'ctscrub-kind/cilium' CILIUM_IMAGE)}
CILIUM_OPERATOR_IMAGE=${CILIUM_OPERATOR_IMAGE:-$(newest 'ctscrub-kind/cilium-operator-generic' CILIUM_OPERATOR_IMAGE)}
export CTSCRUB_IMAGE=${CTSCRUB_IMAGE:-$(newest 'ctscrub-kind/ctscrub' CTSCRUB_IMAGE)}
export CLIENT_IMAGE=${CLIENT_IMAGE:-$(newest 'ctscrub-kind/busybox' CLIENT_IMAGE)}
export SERVER_IMAGE=${SERVER_IMAGE:-$CLIENT_IMAGE}
if [[ -z ${CILIUM_CHART:-} ]]; then
	dir=$(cd "$ROOT" && go mod download -json "github.com/cilium/cilium@v${CILIUM_VERSION#v}" | jq -r .Dir)
	CILIUM_CHART=$dir/install/kubernetes/cilium
fi
[[ -f $CILIUM_CHART/Chart.yaml ]] || die "no Helm chart at $CILIUM_CHART (set CILIUM_CHART)"
log "images: node $NODE_IMAGE, cilium $CILIUM_IMAGE, operator $CILIUM_OPERATOR_IMAGE, ctscrub $CTSCRUB_IMAGE, client $CLIENT_IMAGE"

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
for img in "$CILIUM_IMAGE" "$CILIUM_OPERATOR_IMAGE" "$CTSCRUB_IMAGE" "$CLIENT_IMAGE" "$SERVER_IMAGE"; do
	kind load docker-image "$img" --name "$CLUSTER" >&2
done

# The API server by address (as e2e/kind/cluster.sh does): the agent needs it
# before any DNS works on the node.
cp_ip=$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$CLUSTER-control-plane")
split() { local r=${1%:*}; echo "$r" "${1##*:}"; }
read -r cil_repo cil_tag < <(split "$CILIUM_IMAGE")
read -r op_repo op_tag < <(split "$CILIUM_OPERATOR_IMAGE")
op_repo=${op_repo%-generic} # the chart appends -generic (ipam's operator flavour)
log "installing Cilium $CILIUM_VERSION (CT maps $CT_MAX entries each, GC interval $CT_GC_INTERVAL, debug logs)"
helm install cilium "$CILIUM_CHART" --namespace kube-system --wait=false \
	--set image.repository="$cil_repo" --set image.tag="$cil_tag" --set image.useDigest=false --set image.pullPolicy=IfNotPresent \
	--set operator.image.repository="$op_repo" --set operator.image.tag="$op_tag" --set operator.image.useDigest=false \
	--set operator.image.pullPolicy=IfNotPresent --set operator.replicas=1 \
	--set envoy.enabled=false --set l7Proxy=false --set hubble.enabled=false \
	--set kubeProxyReplacement=true --set k8sServiceHost="$cp_ip" --set k8sServicePort=6443 \
	--set ipam.mode=kubernetes --set cni.exclusive=false \
	--set debug.enabled=true --set prometheus.enabled=true \
	--set bpf.ctTcpMax="$CT_MAX" --set bpf.ctAnyMax="$CT_MAX" \
	--set conntrackGCInterval="$CT_GC_INTERVAL" >&2
kubectl -n kube-system rollout status ds/cilium --timeout=10m >&2
kubectl wait --for=condition=Ready node --all --timeout=5m >&2
kubectl -n kube-system rollout status deploy/coredns --timeout=5m >&2 || log "warning: coredns not ready (the traffic pods' DNS lookups fail; TCP flows still run)"

log "running the benchmark (ENTRIES=$ENTRIES EXPIRED=${EXPIRED:-0.8} PODS=${PODS:-20})"
export CLUSTER POD_CIDR
(cd "$ROOT" && go run ./bench/ciliumnode)
