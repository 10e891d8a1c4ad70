#!/usr/bin/env bash
# Installs and starts what the kind e2e needs, idempotently (root, Debian):
#   - Debian packages: docker.io, debootstrap (the images' rootfs), jq,
#     busybox-static (the client workload image), prometheus (promtool);
#   - runcwrap (e2e/kind/runcwrap) as dockerd's default runtime, so privileged
#     containers (the kind nodes) start on machines whose capability bounding
#     set lacks a capability Docker grants (this VM: CAP_SYS_RESOURCE);
#   - dockerd, started by hand when no engine answers (no systemd here), with
#     iptables, ip6tables, ip-forward and the default bridge off: the engine
#     then never touches the machine's iptables, its FORWARD policy or
#     net.ipv4.ip_forward, and the only interfaces it makes are the kind
#     network's bridge and veths, which `cluster.sh down` removes;
#   - kind (sigs.k8s.io/kind@$KIND_VERSION), helm (helm.sh/helm/v3@$HELM_VERSION),
#     both from the Go module proxy; kubectl comes from the Kubernetes build
#     (images/k8s.sh) and is installed by cluster.sh.
#
# On a machine where a Docker engine already answers, the engine is left as it
# is (its own runtime and iptables settings).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
GO=${GO:-go}
KIND_VERSION=${KIND_VERSION:-v0.33.0}
HELM_VERSION=${HELM_VERSION:-v3.19.0}
# Where the tools go; cluster.sh and the tests find them here.
PREFIX=${CTSCRUB_KIND_PREFIX:-/opt/ctscrub-kind}
DOCKERD_LOG=${DOCKERD_LOG:-/var/log/ctscrub-kind-dockerd.log}
# dockerd's --data-root when install.sh starts it (empty: Docker's default,
# /var/lib/docker). Another directory gives an engine with an empty image
# store, e.g. to time a build from nothing without losing the cached images.
DOCKER_DATA_ROOT=${DOCKER_DATA_ROOT:-}
log() { printf '%s install: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

[[ $(id -u) == 0 ]] || { log "run as root"; exit 1; }
mkdir -p "$PREFIX/bin"

pkgs=()
for p in docker.io debootstrap jq busybox-static prometheus; do
	dpkg -s "$p" >/dev/null 2>&1 || pkgs+=("$p")
done
if ((${#pkgs[@]})); then
	log "apt-get install ${pkgs[*]}"
	apt-get update -q >/dev/null
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${pkgs[@]}" >/dev/null
fi

# runcwrap: static, so the same binary also runs inside the kind nodes.
wrap=$PREFIX/bin/runcwrap
CGO_ENABLED=0 "$GO" build -C "$ROOT" -trimpath -o "$wrap.new" ./e2e/kind/runcwrap
if cmp -s "$wrap.new" "$wrap"; then rm "$wrap.new"; else mv "$wrap.new" "$wrap"; fi

if docker info >/dev/null 2>&1; then
	log "a Docker engine answers: used as it is"
else
	mkdir -p /etc/docker
	conf=/etc/docker/daemon.json
	want=$(jq -n --arg wrap "$wrap" '{
		"default-runtime": "runcwrap",
		"runtimes": {"runcwrap": {"path": $wrap}},
		"iptables": false, "ip6tables": false, "ip-forward": false,
		"bridge": "none", "storage-driver": "overlay2"}')
	if [[ -f $conf ]] && ! jq -e --argjson want "$want" '. == $want' "$conf" >/dev/null; then
		log "$conf exists with other settings: kept as $conf.ctscrub-bak"
		cp "$conf" "$conf.ctscrub-bak"
	fi
	echo "$want" >"$conf"
	args=()
	[[ -n $DOCKER_DATA_ROOT ]] && args+=(--data-root "$DOCKER_DATA_ROOT")
	log "starting dockerd ${args[*]} (log: $DOCKERD_LOG)"
	# setsid: the engine outlives this script and is not killed by a Ctrl-C
	# in the terminal that started it. Without the caller's descriptors: one
	# inherited (a `flock <file> make e2e-kind` serialising runs) would be
	# held by the engine for good, and the next run would wait forever.
	(
		for fd in /proc/$BASHPID/fd/*; do
			fd=${fd##*/}
			((fd > 2)) && eval "exec $fd>&-"
		done
		exec setsid nohup dockerd "${args[@]}" >>"$DOCKERD_LOG" 2>&1 </dev/null
	) &
	for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
	docker info >/dev/null 2>&1 || { tail -20 "$DOCKERD_LOG" >&2; log "dockerd did not start"; exit 1; }
fi

gobin() { # gobin MODULE/PKG@VERSION NAME: go install into $PREFIX/bin unless there
	local have
	have=$("$GO" version -m "$PREFIX/bin/$2" 2>/dev/null | awk '$1=="mod"{print $3; exit}') || true
	[[ $have == "${1##*@}" ]] && return
	log "go install $1 (nice)"
	GOBIN=$PREFIX/bin CGO_ENABLED=0 nice -n 10 "$GO" install -trimpath "$1"
}
gobin "sigs.k8s.io/kind@$KIND_VERSION" kind
gobin "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" helm
log "ready: docker $(docker version --format '{{.Server.Version}}'), $("$PREFIX/bin/kind" version | cut -d' ' -f2), helm $("$PREFIX/bin/helm" version --short)"
