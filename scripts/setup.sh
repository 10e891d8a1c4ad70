#!/usr/bin/env bash
# Installs what ctscrub's tests, benchmarks and demo need on a fresh Debian
# machine, as root. Idempotent: safe to run again.
set -euo pipefail

if [[ $EUID -ne 0 ]]; then
	echo "setup: run as root (BPF maps, network namespaces and containerd need it)" >&2
	exit 1
fi

# prometheus: promtool, for the alert rules' tests (e2e/kind TestAlertRules).
pkgs=(clang-19 llvm-19 libbpf-dev linux-libc-dev iproute2 iptables conntrack
	containernetworking-plugins containerd runc curl jq prometheus)
missing=()
for p in "${pkgs[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
	echo "setup: installing ${missing[*]}"
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# bpffs: ctscrub pins its state under /sys/fs/bpf/ctscrub.
if ! mount | grep -q ' /sys/fs/bpf type bpf'; then
	mkdir -p /sys/fs/bpf
	mount -t bpf bpf /sys/fs/bpf
fi

# nf_conntrack: loaded so its sysctls and netlink exist.
modprobe nf_conntrack 2>/dev/null || true
modprobe nf_conntrack_netlink 2>/dev/null || true

# crictl for the containerd CRI test.
if ! command -v crictl >/dev/null && [[ ! -x "$(go env GOPATH)/bin/crictl" ]]; then
	echo "setup: installing crictl"
	GOFLAGS= go install sigs.k8s.io/cri-tools/cmd/crictl@v1.37.0
fi
# helm for the chart's tests (e2e/kind TestChart*: conf/ and conf/chart are
# one source), where e2e/kind/install.sh puts it too; built from the module
# proxy, niced (it is a large build).
HELM_VERSION=${HELM_VERSION:-v3.19.0}
HELM_PREFIX=${CTSCRUB_KIND_PREFIX:-/opt/ctscrub-kind}
have=$(go version -m "$HELM_PREFIX/bin/helm" 2>/dev/null | awk '$1=="mod"{print $3; exit}') || true
if [[ $have != "$HELM_VERSION" ]]; then
	echo "setup: installing helm $HELM_VERSION into $HELM_PREFIX/bin"
	mkdir -p "$HELM_PREFIX/bin"
	GOFLAGS= GOBIN=$HELM_PREFIX/bin CGO_ENABLED=0 nice -n 10 go install -trimpath "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
fi
echo "setup: done"
