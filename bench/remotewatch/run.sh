#!/usr/bin/env bash
# make bench-remote-watch: a one-node kind cluster of its own (CLUSTER,
# default ctscrub-watch: never the e2e's), made by e2e/kind/cluster.sh with
# CNI=kindnet (the bridge plugins and kube-proxy in iptables mode, no
# Cilium, no ctscrub), the benchmark (bench/remotewatch) against it, and the
# cluster deleted at the end, also on failure and Ctrl-C (KEEP=1 keeps it).
# Root. Images: e2e/kind/images/build.sh, built or reused from Docker's
# store (make e2e-kind builds them; no registry is needed).
#
# On a machine shared with other kind runs, hold the kind lock while the
# cluster exists:
#   flock /var/tmp/ctscrub-kind.lock make bench-remote-watch
#
# Variables: those of bench/remotewatch/main.go (SERVICES, ENDPOINTS, RATE,
# WINDOW, FANOUT, FANOUT_CYCLES, FANOUT_WINDOW, PODS, POD_RATE, POD_WINDOW, PROJ_NODES, ...), CLUSTER, KEEP,
# KUBE_PROXY_MODE (default nftables; iptables),
# CTSCRUB_KIND_WORK (default /var/tmp/ctscrub-kind-watch).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
GO=${GO:-go}
export CLUSTER=${CLUSTER:-ctscrub-watch}
export CTSCRUB_KIND_WORK=${CTSCRUB_KIND_WORK:-/var/tmp/ctscrub-kind-watch}
# nftables: kube-proxy's rules for 100,000 endpoints in iptables mode (the
# nft backend of this node image) took minutes of a core to write once,
# and its CPU would then be that, not its watch (docs/remote.md, Scale).
KUBE_PROXY_MODE=${KUBE_PROXY_MODE:-nftables}
export PATH=${CTSCRUB_KIND_PREFIX:-/opt/ctscrub-kind}/bin:$PATH
log() { printf '%s bench-remote-watch: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
[[ $(id -u) == 0 ]] || { log "run as root (docker, nsenter into the node)"; exit 1; }

bin=$(mktemp -d /tmp/ctscrub-remotewatch.XXXXXX)
CGO_ENABLED=0 "$GO" build -C "$ROOT" -o "$bin/remotewatch" ./bench/remotewatch
commit=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
[[ -z $(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null) ]] || commit+="-dirty"

"$ROOT/e2e/kind/install.sh"
mkdir -p "$CTSCRUB_KIND_WORK"
down() {
	trap - EXIT INT TERM
	rm -rf "$bin"
	if [[ ${KEEP:-0} == 1 ]]; then
		log "KEEP=1: cluster $CLUSTER kept; CLUSTER=$CLUSTER CTSCRUB_KIND_WORK=$CTSCRUB_KIND_WORK e2e/kind/cluster.sh down when done"
		return 0
	fi
	"$ROOT/e2e/kind/cluster.sh" down
}
trap 'down; exit 130' INT TERM
trap 'rc=$?; down || rc=1; exit $rc' EXIT
start=$(date +%s)
CNI=kindnet CTSCRUB=0 WORKERS=0 KUBE_PROXY_MODE=$KUBE_PROXY_MODE "$ROOT/e2e/kind/cluster.sh" up >"$CTSCRUB_KIND_WORK/run-$CLUSTER.env"
set -a
# shellcheck disable=SC1090
source "$CTSCRUB_KIND_WORK/run-$CLUSTER.env"
set +a
log "cluster $CLUSTER up in $(($(date +%s) - start))s; measuring"
NODE=$CLUSTER-control-plane GIT_COMMIT=$commit "$bin/remotewatch"
