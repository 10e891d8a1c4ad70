#!/usr/bin/env bash
# Builds or reuses every image the kind e2e needs and prints them as shell
# variables (also written to $CTSCRUB_KIND_WORK/images.env, default
# /var/tmp/ctscrub-kind/images.env), for e2e/kind/cluster.sh and the tests:
#
#   K8S_VERSION, CILIUM_VERSION      versions (variables in, pinned defaults)
#   KIND_NODE_IMAGE                  kind node image (Kubernetes K8S_VERSION)
#   CILIUM_IMAGE, CILIUM_OPERATOR_IMAGE   Cilium agent and operator-generic
#   CILIUM_CHART, CILIUM_CHART_REPO  Cilium's chart: a directory (the module's
#                                    install/kubernetes/cilium) or a chart name
#                                    in CILIUM_CHART_REPO
#   CTSCRUB_IMAGE                    ctscrub (conf/Containerfile)
#   SERVER_IMAGE, CLIENT_IMAGE       workloads: agnhost, busybox
#   PROMETHEUS_IMAGE                 Debian's prometheus (TestKindMetrics)
#   KUBE_PROXY_IMAGE                 kube-proxy, named as kubeadm's DaemonSet
#                                    pulls it (CNI=kindnet, CILIUM_LB=default|hostns)
#   PROBE_IMAGE                      the blackhole test's client (e2e/kind/probe)
#   CILIUM_DELEGATE                  1 when CILIUM_IMAGE carries
#                                    cilium/patches (images/cilium.sh), else 0
#   IMAGE_BUILD_S                    seconds this run spent here
#
# Every local image comes from Debian packages and Go modules only, and is
# cached in Docker's image store under a tag that hashes its inputs: a second
# run rebuilds only ctscrub's image when ctscrub changed (seconds).
#
# CTSCRUB_KIND_UPSTREAM=1: on a machine that reaches the registries, name the
# upstream images instead (kindest/node, quay.io/cilium, registry.k8s.io,
# docker.io) and Cilium's chart from https://helm.cilium.io; only ctscrub's
# image is built.
source "$(dirname "$0")/lib.sh"
start=$(date +%s)
K8S_VERSION=${K8S_VERSION:-v1.34.4}
CILIUM_VERSION=${CILIUM_VERSION:-1.18.8}
CILIUM_VERSION=${CILIUM_VERSION#v}
# Cilium 1.16 needs two changes to run here, in the test's images only
# (cilium-1.16-patch.sh; docs/kind.md, "Cilium versions").
if [[ $CILIUM_VERSION == 1.16.* && -z ${CILIUM_PATCH:-} ]]; then
	export CILIUM_PATCH=$IMAGES_DIR/cilium-1.16-patch.sh
fi
CILIUM_DELEGATE=${CILIUM_DELEGATE:-0}
export K8S_VERSION CILIUM_VERSION CILIUM_DELEGATE
out=$WORK/images.env
mkdir -p "$WORK/logs"

if [[ ${CTSCRUB_KIND_UPSTREAM:-0} == 1 && ${CILIUM_DELEGATE:-0} == 1 ]]; then
	die "CILIUM_DELEGATE=1 needs Cilium built here with cilium/patches (cilium.sh): not with CTSCRUB_KIND_UPSTREAM=1"
fi
if [[ ${CTSCRUB_KIND_UPSTREAM:-0} == 1 ]]; then
	KIND_NODE_IMAGE=kindest/node:$K8S_VERSION
	CILIUM_IMAGE=quay.io/cilium/cilium:v$CILIUM_VERSION
	CILIUM_OPERATOR_IMAGE=quay.io/cilium/operator-generic:v$CILIUM_VERSION
	CILIUM_CHART=cilium CILIUM_CHART_REPO=https://helm.cilium.io
	SERVER_IMAGE=registry.k8s.io/e2e-test-images/agnhost:2.56
	CLIENT_IMAGE=docker.io/library/busybox:1.36.1
	KUBE_PROXY_IMAGE=registry.k8s.io/kube-proxy:$K8S_VERSION
	for i in "$KIND_NODE_IMAGE" "$CILIUM_IMAGE" "$CILIUM_OPERATOR_IMAGE" "$SERVER_IMAGE" "$CLIENT_IMAGE" "$KUBE_PROXY_IMAGE"; do
		have_image "$i" || "$DOCKER" pull -q "$i" >/dev/null
	done
else
	# The rootfs builds (network and disk) run beside the Go builds (CPU).
	log "building or reusing images (logs: $WORK/logs)"
	"$IMAGES_DIR/rootfs.sh" node "${NODE_PACKAGES[@]}" >"$WORK/logs/rootfs-node.out" 2>"$WORK/logs/rootfs-node.log" &
	rootfs_pid=$!
	"$IMAGES_DIR/k8s.sh" >/dev/null
	"$IMAGES_DIR/extras.sh" >/dev/null
	wait "$rootfs_pid" || die "rootfs node: see $WORK/logs/rootfs-node.log"
	KIND_NODE_IMAGE=$("$IMAGES_DIR/node.sh")
	# CNI=kindnet runs no Cilium: its images (the longest build) are not needed.
	CILIUM_IMAGE= CILIUM_OPERATOR_IMAGE= CILIUM_CHART=
	if [[ ${CNI:-cilium} != kindnet ]]; then
		{ read -r CILIUM_IMAGE; read -r CILIUM_OPERATOR_IMAGE; } < <("$IMAGES_DIR/cilium.sh")
		[[ -n $CILIUM_OPERATOR_IMAGE ]] || die "cilium.sh failed"
	fi
	{ read -r SERVER_IMAGE; read -r CLIENT_IMAGE; } < <("$IMAGES_DIR/workloads.sh")
	[[ -n $CLIENT_IMAGE ]] || die "workloads.sh failed"
	KUBE_PROXY_IMAGE=$("$IMAGES_DIR/kubeproxy.sh")
	CILIUM_CHART_REPO=
	if [[ ${CNI:-cilium} != kindnet ]]; then
		CILIUM_CHART=$("$GO" mod download -json "github.com/cilium/cilium@v$CILIUM_VERSION" | jq -r .Dir)/install/kubernetes/cilium
		[[ -f $CILIUM_CHART/Chart.yaml ]] || die "no chart at $CILIUM_CHART"
	fi
fi
CTSCRUB_IMAGE=$("$IMAGES_DIR/ctscrub.sh")
# From Debian's package in both modes: the test needs this version's flags
# and API, not whatever an upstream tag holds.
PROMETHEUS_IMAGE=$("$IMAGES_DIR/prometheus.sh")
PROBE_IMAGE=$("$IMAGES_DIR/probe.sh")
IMAGE_BUILD_S=$(($(date +%s) - start))
{
	for v in K8S_VERSION CILIUM_VERSION KIND_NODE_IMAGE CILIUM_IMAGE CILIUM_OPERATOR_IMAGE \
		CILIUM_CHART CILIUM_CHART_REPO CILIUM_DELEGATE CTSCRUB_IMAGE SERVER_IMAGE CLIENT_IMAGE PROMETHEUS_IMAGE \
		KUBE_PROXY_IMAGE PROBE_IMAGE IMAGE_BUILD_S; do
		printf '%s=%q\n' "$v" "${!v}"
	done
} | tee "$out"
log "images ready in ${IMAGE_BUILD_S}s ($out)"
