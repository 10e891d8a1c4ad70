#!/usr/bin/env bash
# Installs what ctscrub's tests, benchmarks and demo need on a fresh Debian
# machine, as root. Idempotent: safe to run again.
set -euo pipefail

if [[ $EUID -ne 0 ]]; then
	echo "setup: run as root (BPF maps, network namespaces and containerd need it)" >&2
	exit 1
fi

pkgs=(clang-19 llvm-19 libbpf-dev linux-libc-dev iproute2 iptables conntrack
	containernetworking-plugins containerd runc curl jq)
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
echo "setup: done"
