# Shared by the image builds in e2e/kind/images (sourced, not run).
#
# Every image is built from Debian packages and Go modules only, and cached by
# content in Docker's image store: its tag is a hash of everything that went
# into it (this directory's scripts, the versions, the Go toolchain, the
# images it builds on), and the same hash is its label
# org.ctscrub.kind.inputs. A build whose tag exists already is skipped.
set -euo pipefail

IMAGES_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$IMAGES_DIR/../../.." && pwd)
DOCKER=${DOCKER:-docker}
GO=${GO:-go}
# Scratch space for throwaway modules, rootfs trees and tars (not the cache:
# the cache is Docker's image store).
WORK=${CTSCRUB_KIND_WORK:-/var/tmp/ctscrub-kind}
# Debian release and mirror for every rootfs.
DEBIAN_SUITE=${DEBIAN_SUITE:-bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# Every build runs at this niceness (absolute; the builds take tens of
# minutes of both cores on a machine shared with others).
NICE=${NICE:-10}
renice -n "$NICE" $$ >/dev/null 2>&1 || true

log() { printf '%s images: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# inputs_hash ARGS...: 16 hex digits over the named files' contents (paths
# relative to the repo root or absolute) and the other arguments as strings.
# The Go version is always part of it.
inputs_hash() {
	{
		"$GO" env GOVERSION
		for a in "$@"; do
			if [[ -f $a ]]; then
				printf 'file %s\n' "${a#"$ROOT"/}"; sha256sum <"$a"
			elif [[ -f $ROOT/$a ]]; then
				printf 'file %s\n' "$a"; sha256sum <"$ROOT/$a"
			else
				printf 'str %s\n' "$a"
			fi
		done
	} | sha256sum | cut -c1-16
}

have_image() { "$DOCKER" image inspect "$1" >/dev/null 2>&1; }

# import_dir DIR IMAGE [docker import --change ...]: a Docker image holding
# exactly DIR's tree, labelled with its inputs hash (the tag).
import_dir() {
	local dir=$1 image=$2; shift 2
	tar -C "$dir" --numeric-owner -c . |
		"$DOCKER" import --change "LABEL org.ctscrub.kind.inputs=${image##*:}" "$@" - "$image" >/dev/null
}

# go_module DIR MODULE: a throwaway module in DIR named MODULE, go.mod only.
go_module() {
	rm -rf "$1"; mkdir -p "$1"
	printf 'module %s\n\ngo 1.24.0\n' "$2" >"$1/go.mod"
}

# Static Go builds for the images; -trimpath so the hash of the sources, not
# the build's paths, decides the output.
go_build() { CGO_ENABLED=0 GOFLAGS="-buildvcs=false -mod=mod" "$GO" build -trimpath "$@"; }

# extract IMAGE DEST: copy an image's whole tree out into DEST.
extract() {
	local id
	mkdir -p "$2"
	id=$("$DOCKER" create "$1" /nonexistent)
	"$DOCKER" export "$id" | tar -C "$2" -x
	"$DOCKER" rm "$id" >/dev/null
}

# The Debian packages of each rootfs (rootfs.sh). The kind node: what kind's
# own base image (images/base/Dockerfile in sigs.k8s.io/kind) installs, with
# Debian's containerd and runc in place of kind's builds, minus storage
# (nfs, iscsi) and rootless (fuse-overlayfs) support.
NODE_PACKAGES=(systemd conntrack iptables nftables iproute2 ethtool util-linux mount kmod
	libseccomp2 pigz e2fsprogs bash ca-certificates curl jq procps socat containerd runc)
# The Cilium agent: what Cilium's runtime image installs
# (images/runtime/install-runtime-deps.sh in the cilium module), with
# Debian's clang/llvm 19 and bpftool in place of Cilium's own builds.
CILIUM_PACKAGES=(bash-completion iproute2 iptables ipset kmod ca-certificates libatomic1
	clang-19 llvm-19 bpftool)

# build_lock NAME: hold an exclusive lock for the rest of the script, then
# re-check the cache, so two runs never build the same image into the same
# scratch directory at once.
build_lock() {
	mkdir -p "$WORK"
	exec 9>"$WORK/$1.lock"
	flock 9
}
