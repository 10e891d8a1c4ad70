#!/usr/bin/env bash
# A kind cluster with real Cilium, and optionally ctscrub, from the images of
# e2e/kind/images/build.sh. Root; run e2e/kind/install.sh first.
#
#   cluster.sh up      build or reuse the images, create the cluster, install
#                      Cilium (chaining as docs/plugin.md tells operators) and
#                      ctscrub (conf/chart); print shell variables for the
#                      tests (also in $WORK/cluster-$CLUSTER.env)
#   cluster.sh down    delete the cluster and the kind network, and check that
#                      the machine's iptables and interfaces are as before `up`
#   cluster.sh env     print the variables of a running cluster
#   cluster.sh install-ctscrub   install ctscrub with its chart on a running
#                      cluster brought up with CTSCRUB=0 (the blackhole test
#                      measures without it first)
#   cluster.sh diag    save the cluster's state for a post-mortem (pods,
#                      events, Cilium's and ctscrub's logs, `cilium-dbg
#                      status`) under $WORK/logs/diag-<time>; `up` and run.sh
#                      call it on failure, before the cluster is deleted
#
# Variables (defaults):
#   CLUSTER=ctscrub-e2e     kind cluster name
#   WORKERS=1               worker nodes (plus one control plane)
#   NODE_CIDR_MASK=24       size of each node's pod CIDR (Cilium cluster-pool
#                           within 10.244.0.0/16); e2e-kind uses 27 so pod IPs
#                           repeat within the churn
#   CTSCRUB=1               install ctscrub with its chart (0: the CNI only)
#   CNI=cilium              the cluster's CNI: cilium, or kindnet (kind's own
#                           CNI; kindnetd cannot be built here, so the
#                           reference bridge + host-local plugins, chained as
#                           flannel does, with kube-proxy: docs/kind.md)
#   KUBE_PROXY_MODE=        iptables or nftables where kube-proxy runs
#                           (CNI=kindnet, CILIUM_LB=default; default iptables)
#   CILIUM_LB=kpr           Cilium's service load balancing: kpr (kube-proxy
#                           replacement, socket LB at connect()), default
#                           (Cilium's default Helm values: kube-proxy runs,
#                           per-packet LB in bpf_lxc), hostns (kube-proxy
#                           replacement with socketLB.hostNamespaceOnly=true)
#   CILIUM_VERSION=1.18.8   and every variable of images/build.sh
#   CILIUM_DELEGATE=0       1: Cilium built with cilium/patches (images/cilium.sh)
#                           and started with --conntrack-scrub-delegate on
#                           ctscrub's socket (docs/delegate-api.md), BPF
#                           masquerade and its Prometheus metrics on (so the
#                           tests read its NAT map and its delegate counters)
#   CILIUM_HELM_ARGS=       more `helm install cilium` arguments
#   CTSCRUB_HELM_ARGS=      more `helm install ctscrub` arguments
#   CTSCRUB_KIND_WORK=/var/tmp/ctscrub-kind   scratch space and state
#
# `up` deletes the cluster again if it fails; run `down` from a trap (as
# e2e/kind/run.sh does) to delete it on Ctrl-C.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PREFIX=${CTSCRUB_KIND_PREFIX:-/opt/ctscrub-kind}
export PATH=$PREFIX/bin:$PATH
WORK=${CTSCRUB_KIND_WORK:-/var/tmp/ctscrub-kind}
CLUSTER=${CLUSTER:-ctscrub-e2e}
WORKERS=${WORKERS:-1}
NODE_CIDR_MASK=${NODE_CIDR_MASK:-24}
CTSCRUB=${CTSCRUB:-1}
CNI=${CNI:-cilium}
CILIUM_LB=${CILIUM_LB:-kpr}
# Why CNI=kindnet runs the reference plugins (the JSON line says it).
KINDNET_UNAVAILABLE="the Go module proxy serves neither sigs.k8s.io/kind/images/kindnetd nor github.com/aojea/kindnet, and no registry is reachable"
CILIUM_DELEGATE=${CILIUM_DELEGATE:-0}
[[ $CILIUM_DELEGATE == 0 || $CILIUM_DELEGATE == 1 ]] || { echo "CILIUM_DELEGATE=$CILIUM_DELEGATE: must be 0 or 1" >&2; exit 2; }
export CILIUM_DELEGATE
POD_SUBNET=10.244.0.0/16
KUBECONFIG=$WORK/kubeconfig-$CLUSTER
export KUBECONFIG
envfile=$WORK/cluster-$CLUSTER.env
before=$WORK/host-before-$CLUSTER
log() { printf '%s cluster: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# The machine's own network state, for `down` to check. Other programs on a
# shared machine add and remove their own interfaces and rules meanwhile, so
# `down` flags only what is new since `up` and Docker's or kind's: an
# interface on kind's bridge, the bridge itself, an iptables rule or chain
# naming Docker or that bridge (dockerd runs with ip-forward off, so
# net.ipv4.ip_forward is not its to change; other tests here turn it on).
host_state() {
	# grep finds nothing on a machine without rules: not an error.
	{
		ip -o link show | awk -F': ' '{print "link " $2}' | sed 's/@.*//'
		iptables-save 2>/dev/null | { grep -v '^#' || true; } | sed 's/\[[0-9:]*\]//; s/^/ip4 /'
		ip6tables-save 2>/dev/null | { grep -v '^#' || true; } | sed 's/\[[0-9:]*\]//; s/^/ip6 /'
		echo "ip_forward $(cat /proc/sys/net/ipv4/ip_forward)"
	} | sort -u
}

down() {
	local bridge=
	if docker network inspect kind >/dev/null 2>&1; then
		bridge=br-$(docker network inspect kind -f '{{.Id}}' | cut -c1-12)
	fi
	# Containers the tests ran on kind's network (TestKindNodePortChurn's
	# clients), if a test ended before its cleanup.
	local ids
	ids=$(docker ps -aq --filter "label=org.ctscrub.kind.cluster=$CLUSTER" 2>/dev/null || true)
	[[ -z $ids ]] || docker rm -f $ids >/dev/null 2>&1 || true
	if kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
		log "deleting cluster $CLUSTER"
		kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || log "kind delete cluster failed"
	fi
	# kind leaves its network; remove it when no other container uses it.
	if [[ -n $bridge ]] && [[ $(docker network inspect kind -f '{{len .Containers}}') == 0 ]]; then
		docker network rm kind >/dev/null || true
	fi
	rm -f "$envfile"
	if [[ -f $before ]]; then
		local left
		left=$(comm -13 "$before" <(host_state) |
			grep -E "DOCKER|docker|${bridge:-br-kindnone}" || true)
		if [[ -n $bridge ]] && ip link show "$bridge" >/dev/null 2>&1; then left+=$'\n'"link $bridge (kind's bridge) still there"; fi
		if [[ -n $bridge ]] && ip -o link show master "$bridge" 2>/dev/null | grep -q .; then left+=$'\n'"interfaces on $bridge still there"; fi
		rm -f "$before"
		if [[ -n ${left//[$'\n']/} ]]; then
			log "left on the machine by the cluster or Docker (not there before 'up'):"
			echo "$left" >&2
			return 1
		fi
		log "no interface or iptables rule of Docker's or kind's left"
	fi
}

print_env() { cat "$envfile"; }

# What a failed run needs to be understood once the cluster is gone. Best
# effort: every command may fail (no API server yet, a pod not running).
diag() {
	kind get clusters 2>/dev/null | grep -qx "$CLUSTER" || return 0
	local d
	d=$WORK/logs/diag-$(date -u +%Y%m%dT%H%M%S)
	mkdir -p "$d"
	log "saving the cluster's state to $d"
	{
		kubectl get nodes -o wide
		kubectl get pods -A -o wide
		kubectl get events -A --sort-by=.lastTimestamp
	} >"$d/cluster.txt" 2>&1 || true
	kubectl describe pods -A >"$d/describe-pods.txt" 2>&1 || true
	local pod
	for pod in $(kubectl -n kube-system get pods -o name 2>/dev/null | grep -E 'cilium|ctscrub|coredns|kube-proxy'); do
		kubectl -n kube-system logs --all-containers --prefix "$pod" >"$d/${pod#pod/}.log" 2>&1 || true
		kubectl -n kube-system logs --all-containers --prefix --previous "$pod" >"$d/${pod#pod/}.previous.log" 2>&1 || true
		[[ $pod == pod/cilium-[a-z0-9][a-z0-9][a-z0-9][a-z0-9][a-z0-9] ]] &&
			kubectl -n kube-system exec "$pod" -c cilium-agent -- cilium-dbg status --verbose >"$d/${pod#pod/}.status.txt" 2>&1 || true
	done
	local n
	for n in $(kind get nodes --name "$CLUSTER" 2>/dev/null); do
		docker exec "$n" sh -c 'journalctl -u kubelet --no-pager | tail -n 300; ls -l /etc/cni/net.d; cat /etc/cni/net.d/*' >"$d/node-$n.txt" 2>&1 || true
	done
	return 0
}

up() {
	kind get clusters 2>/dev/null | grep -qx "$CLUSTER" &&
		die "a kind cluster $CLUSTER exists: '$0 down' first (or CLUSTER=another-name)"
	mkdir -p "$WORK"
	modes
	host_state >"$before"
	"$HERE/images/build.sh" >"$WORK/images-$CLUSTER.env"
	# shellcheck disable=SC1090
	source "$WORK/images-$CLUSTER.env"
	[[ $KUBE_PROXY_MODE == none || -n ${KUBE_PROXY_IMAGE:-} ]] || die "no KUBE_PROXY_IMAGE from images/build.sh"
	# kubectl of the cluster's version, from the Kubernetes build.
	if [[ ${CTSCRUB_KIND_UPSTREAM:-0} != 1 ]]; then
		id=$(docker create "$KIND_NODE_IMAGE" /nonexistent)
		docker cp "$id:/usr/bin/kubectl" "$PREFIX/bin/kubectl" >&2; docker rm "$id" >/dev/null
	fi
	trap 'rc=$?; if ((rc)); then log "up failed: deleting the cluster"; diag; down || true; fi' EXIT
	local conf=$WORK/kind-$CLUSTER.yaml
	{
		cat <<EOY
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
networking:
  disableDefaultCNI: true
  kubeProxyMode: $KUBE_PROXY_MODE
  podSubnet: $POD_SUBNET
EOY
		if [[ $CNI == kindnet ]]; then
			# host-local takes each node's podCIDR: make them NODE_CIDR_MASK
			# wide, so the churn's pods reuse addresses. (kind v0.33 writes
			# kubeadm's v1beta3 for Kubernetes < 1.36: extraArgs is a map.)
			cat <<EOY
kubeadmConfigPatches:
  - |
    kind: ClusterConfiguration
    controllerManager:
      extraArgs:
        node-cidr-mask-size-ipv4: "$NODE_CIDR_MASK"
EOY
		fi
		cat <<EOY
nodes:
  - role: control-plane
    image: $KIND_NODE_IMAGE
EOY
		for _ in $(seq "$WORKERS"); do printf '  - role: worker\n    image: %s\n' "$KIND_NODE_IMAGE"; done
	} >"$conf"
	log "creating cluster $CLUSTER (1 control plane, $WORKERS workers, $KIND_NODE_IMAGE; CNI $CNI, kube-proxy $KUBE_PROXY_MODE, Cilium LB $CILIUM_LB)"
	kind create cluster --name "$CLUSTER" --config "$conf" --kubeconfig "$KUBECONFIG" --wait 0s >&2
	local nodes
	nodes=$(kind get nodes --name "$CLUSTER" | paste -sd, -)
	log "loading images into $nodes"
	local imgs=()
	# kube-proxy's first: its pods wait for it (ErrImagePull until then).
	[[ $KUBE_PROXY_MODE == none ]] || imgs+=("$KUBE_PROXY_IMAGE")
	[[ $CNI == cilium ]] && imgs+=("$CILIUM_IMAGE" "$CILIUM_OPERATOR_IMAGE" "$PROMETHEUS_IMAGE")
	# The probe: TestKindBlackhole's client (CNI=kindnet) and
	# TestKindRemoteBackend's (every CNI).
	imgs+=("$PROBE_IMAGE" "$CTSCRUB_IMAGE" "$SERVER_IMAGE" "$CLIENT_IMAGE")
	kind load docker-image --name "$CLUSTER" "${imgs[@]}" >&2
	if [[ $KUBE_PROXY_MODE != none ]]; then
		# Out of their image-pull back-off at once.
		kubectl -n kube-system delete pod -l k8s-app=kube-proxy --wait=false >&2
	fi
	if [[ $CNI == kindnet ]]; then
		bridge_cni "$nodes"
		kubectl -n kube-system rollout status ds/kube-proxy --timeout=5m >&2
		kubectl wait --for=condition=Ready node --all --timeout=5m >&2
		[[ $CTSCRUB == 1 ]] && install_ctscrub
		[[ $CTSCRUB == 1 ]] && kubectl -n kube-system rollout status ds/ctscrub --timeout=5m >&2
		kubectl -n kube-system rollout status deploy/coredns --timeout=5m >&2
		write_env "$nodes"
		trap - EXIT
		log "cluster $CLUSTER ready"
		print_env
		return 0
	fi

	local cp_ip
	cp_ip=$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$CLUSTER-control-plane")
	if [[ $CTSCRUB == 1 ]]; then
		# First ctscrub: its chart holds the CNI ConfigMap that Cilium writes
		# the chain from (docs/plugin.md, option 1).
		install_ctscrub
	else
		kubectl apply -f "$ROOT/conf/cilium-cni-configmap.yaml" >&2
	fi
	log "installing Cilium $CILIUM_VERSION from $CILIUM_CHART"
	local chart=("$CILIUM_CHART")
	[[ -n ${CILIUM_CHART_REPO:-} ]] && chart=(cilium --repo "$CILIUM_CHART_REPO" --version "$CILIUM_VERSION")
	local caps=() lb=()
	case $CILIUM_LB in
	kpr) lb=(--set kubeProxyReplacement=true) ;;
	default) lb=() ;; # Cilium's defaults: kubeProxyReplacement false, socket LB off
	hostns) lb=(--set kubeProxyReplacement=true --set socketLB.hostNamespaceOnly=true) ;;
	esac
	case $CILIUM_VERSION in
	1.16.*)
		# Cilium 1.16's agent runs `bpftool feature probe` at start and
		# exits when it fails. Its chart grants CAP_SYS_ADMIN and leaves
		# CAP_BPF and CAP_PERFMON commented out; Cilium's own image has a
		# bpftool that takes CAP_SYS_ADMIN, Debian's (built with libcap,
		# in the test's image) wants the two: the chart's list with the
		# two it documents for kernels >= 5.8. A Helm value, not a patch.
		caps=(--set "securityContext.capabilities.ciliumAgent={CHOWN,KILL,NET_ADMIN,NET_RAW,IPC_LOCK,SYS_MODULE,SYS_ADMIN,SYS_RESOURCE,PERFMON,BPF,DAC_OVERRIDE,FOWNER,SETGID,SETUID}")
		;;
	esac
	local delegate=()
	if [[ $CILIUM_DELEGATE == 1 ]]; then
		[[ $CTSCRUB == 1 ]] || die "CILIUM_DELEGATE=1 needs ctscrub (CTSCRUB=1): its scrubd is the delegate"
		# As docs/delegate-api.md tells users: the flag, and the socket's
		# host directory mounted (HostToContainer: scrubd may re-create the
		# socket after the agent started). A values file, since --set would
		# split the flag's own '='. BPF masquerade gives the churn's pods
		# SNAT mappings of their own (their egress), which the delegate
		# must delete as Cilium's walk would; Prometheus gives the tests
		# the agent's delegate counters.
		local vals=$WORK/cilium-delegate-$CLUSTER.yaml
		cat >"$vals" <<EOY
extraArgs: ["--conntrack-scrub-delegate=/run/ctscrub-delegate/delegate.sock"]
extraHostPathMounts:
  - name: ctscrub-delegate
    mountPath: /run/ctscrub-delegate
    hostPath: /run/ctscrub-delegate
    hostPathType: DirectoryOrCreate
    readOnly: false
    mountPropagation: HostToContainer
bpf:
  masquerade: true
prometheus:
  enabled: true
EOY
		delegate=(-f "$vals")
		log "Cilium with the conntrack scrub delegate ($vals)"
	fi
	# shellcheck disable=SC2086
	helm install cilium "${chart[@]}" --namespace kube-system "${caps[@]}" \
		--set cni.customConf=true --set cni.configMap=cilium-cni-ctscrub --set cni.exclusive=false \
		--set ipam.mode=cluster-pool \
		--set "ipam.operator.clusterPoolIPv4PodCIDRList={$POD_SUBNET}" \
		--set ipam.operator.clusterPoolIPv4MaskSize="$NODE_CIDR_MASK" \
		"${lb[@]}" --set k8sServiceHost="$cp_ip" --set k8sServicePort=6443 \
		--set operator.replicas=1 \
		--set image.override="$CILIUM_IMAGE" --set image.pullPolicy=IfNotPresent \
		--set operator.image.override="$CILIUM_OPERATOR_IMAGE" --set operator.image.pullPolicy=IfNotPresent \
		--set envoy.enabled=false --set l7Proxy=false \
		${delegate[@]+"${delegate[@]}"} \
		${CILIUM_HELM_ARGS:-} >&2
	kubectl -n kube-system rollout status ds/cilium --timeout=10m >&2
	[[ $KUBE_PROXY_MODE == none ]] || kubectl -n kube-system rollout status ds/kube-proxy --timeout=5m >&2
	kubectl wait --for=condition=Ready node --all --timeout=5m >&2
	if [[ $CTSCRUB == 1 ]]; then
		kubectl -n kube-system rollout status ds/ctscrub --timeout=5m >&2
	fi
	kubectl -n kube-system rollout status deploy/coredns --timeout=5m >&2
	write_env "$nodes"
	trap - EXIT
	log "cluster $CLUSTER ready"
	print_env
}

install_ctscrub() {
	log "installing ctscrub ($CTSCRUB_IMAGE) with conf/chart"
	local cni=()
	# On the bridge + host-local nodes: chained after bridge, Cilium's CNI
	# ConfigMap not made, the nf_conntrack backend only.
	[[ $CNI == kindnet ]] && cni=(--set cniChainAfter=bridge --set ciliumCNIConfigMap.create=false --set config.backends=nfct)
	# The remote-backend watch (docs/remote.md), off in the chart by
	# default, on in the e2e: every test runs beside it, and
	# TestKindRemoteBackend turns it off and on again by helm upgrade.
	# shellcheck disable=SC2086
	helm install ctscrub "$ROOT/conf/chart" --namespace kube-system \
		--set image.repository="${CTSCRUB_IMAGE%:*}" --set image.tag="${CTSCRUB_IMAGE##*:}" \
		--set image.pullPolicy=IfNotPresent \
		--set "config.pod_cidrs={$POD_SUBNET}" "${cni[@]}" \
		--set config.remote_backends.enabled=true \
		${CTSCRUB_HELM_ARGS:-} >&2
}

# The cluster's modes from CNI, CILIUM_LB, KUBE_PROXY_MODE (see the head).
modes() {
	case $CNI in
	cilium)
		case $CILIUM_LB in
		kpr | hostns) [[ ${KUBE_PROXY_MODE:-none} == none ]] || die "CILIUM_LB=$CILIUM_LB replaces kube-proxy: KUBE_PROXY_MODE=$KUBE_PROXY_MODE makes no sense"
			KUBE_PROXY_MODE=none ;;
		default) KUBE_PROXY_MODE=${KUBE_PROXY_MODE:-iptables} ;;
		*) die "CILIUM_LB=$CILIUM_LB: want kpr, default or hostns" ;;
		esac ;;
	kindnet) KUBE_PROXY_MODE=${KUBE_PROXY_MODE:-iptables}
		[[ $CILIUM_LB == kpr ]] || die "CILIUM_LB is Cilium's: not with CNI=kindnet" ;;
	*) die "CNI=$CNI: want cilium or kindnet" ;;
	esac
	case $KUBE_PROXY_MODE in
	none | iptables | nftables) ;;
	*) die "KUBE_PROXY_MODE=$KUBE_PROXY_MODE: want iptables or nftables" ;;
	esac
}

# CNI=kindnet: kindnetd cannot be built here (KINDNET_UNAVAILABLE), so each
# node gets what a flannel-style cluster chains: the reference bridge +
# host-local (+ portmap; loopback for the runtime) from this machine's
# Debian package (the nodes run the same Debian release), one conflist per
# node with its podCIDR, and a route to every other node's podCIDR via that
# node (what kindnetd and flannel's host-gw write). br_netfilter's
# bridge-nf-call-iptables, per network namespace, is set in each node's: a
# pod's reply to a client on the same bridge must pass the node's conntrack
# to be un-DNATed (kube-proxy's requirement for bridge CNIs).
bridge_cni() {
	local nodes=$1 n m cidr ip
	local -A cidrs ips
	for n in ${nodes//,/ }; do
		for _ in $(seq 60); do
			cidr=$(kubectl get node "$n" -o jsonpath='{.spec.podCIDR}')
			[[ -n $cidr ]] && break
			sleep 2
		done
		[[ -n $cidr ]] || die "node $n got no podCIDR from the controller manager"
		cidrs[$n]=$cidr
		ips[$n]=$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$n")
	done
	for n in ${nodes//,/ }; do
		for p in bridge host-local loopback portmap; do
			[[ -x /usr/lib/cni/$p ]] || die "/usr/lib/cni/$p missing (apt-get install containernetworking-plugins; scripts/setup.sh)"
			docker cp "/usr/lib/cni/$p" "$n:/opt/cni/bin/$p" >&2
		done
		docker exec "$n" sysctl -qw net.bridge.bridge-nf-call-iptables=1 net.bridge.bridge-nf-call-ip6tables=1 >&2
		for m in ${nodes//,/ }; do
			[[ $m == "$n" ]] || docker exec "$n" ip route replace "${cidrs[$m]}" via "${ips[$m]}" >&2
		done
		log "$n: bridge + host-local on ${cidrs[$n]}"
		docker exec -i "$n" sh -c 'cat >/etc/cni/net.d/10-bridge.conflist.tmp && mv /etc/cni/net.d/10-bridge.conflist.tmp /etc/cni/net.d/10-bridge.conflist' <<EOJ
{
  "cniVersion": "1.0.0",
  "name": "bridge",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "${cidrs[$n]}"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOJ
	done
}

write_env() {
	local cni_used=$CNI
	[[ $CNI == kindnet ]] && cni_used=bridge
	{
		printf 'CLUSTER=%q\nKUBECONFIG=%q\nNODES=%q\nPOD_SUBNET=%q\nNODE_CIDR_MASK=%q\nCTSCRUB_INSTALLED=%q\n' \
			"$CLUSTER" "$KUBECONFIG" "$1" "$POD_SUBNET" "$NODE_CIDR_MASK" "$CTSCRUB"
		printf 'CNI=%q\nCNI_USED=%q\nKUBE_PROXY_MODE=%q\nCILIUM_LB=%q\n' "$CNI" "$cni_used" "$KUBE_PROXY_MODE" "$CILIUM_LB"
		[[ $CNI == kindnet ]] && printf 'KINDNET_UNAVAILABLE=%q\n' "$KINDNET_UNAVAILABLE"
		cat "$WORK/images-$CLUSTER.env"
	} >"$envfile"
}

# install-ctscrub: ctscrub on a cluster brought up with CTSCRUB=0.
install_later() {
	[[ -f $envfile ]] || die "no running cluster $CLUSTER ($envfile)"
	set -a
	# shellcheck disable=SC1090
	source "$envfile"
	set +a
	install_ctscrub
	kubectl -n kube-system rollout status ds/ctscrub --timeout=5m >&2
	sed -i 's/^CTSCRUB_INSTALLED=.*/CTSCRUB_INSTALLED=1/' "$envfile"
}

case ${1:-} in
up) up ;;
down) down ;;
env) print_env ;;
diag) diag ;;
install-ctscrub) install_later ;;
*) echo "usage: $0 up|down|env|diag|install-ctscrub (see the head of this file)" >&2; exit 2 ;;
esac
