#!/usr/bin/env bash
# Cilium's agent and operator images, version $CILIUM_VERSION, built from the
# github.com/cilium/cilium Go module, with no change to Cilium's source unless
# CILIUM_PATCH, CILIUM_DELEGATE or CILIUM_COALESCED (below) asks for one.
# Prints two lines, the agent image and the operator image
# (ctscrub-kind/cilium:<version>-<hash>,
# ctscrub-kind/cilium-operator-generic:<version>-<hash>), built or reused.
#
# The agent image is what Cilium's images/cilium/Dockerfile assembles, from
# Debian instead of Cilium's builder images: the binaries of
# `make install-container-binary`, the module's bpf/ tree (the agent compiles
# the datapath at run time with clang), images/cilium/init-container.sh and
# plugins/cilium-cni/{install-plugin,cni-uninstall}.sh, the runtime's
# iptables-wrapper, and the loopback CNI plugin (Debian's).
#
# CILIUM_PATCH (optional): a script run in the module's source copy before
# the build, for versions that need a change to build or run on this kernel
# (see docs/kind.md); the image is then tagged <version>-patched-<hash>.
#
# CILIUM_DELEGATE=1 (optional): apply cilium/patches/v$CILIUM_VERSION/*.patch
# (the conntrack scrub delegate, docs/upstream-delegate.md) to the source
# copy, after CILIUM_PATCH; the image is tagged <version>[-patched]-delegate-<hash>
# and its hash covers the patch files.
#
# CILIUM_COALESCED=1 (optional): apply cilium/patches/coalesce-v$CILIUM_VERSION/*.patch
# (the in-agent baseline: concurrent endpoint CT scrubs coalesced into one
# walk, off the endpoint's lock; cilium/patches/README.md) instead; the image
# is tagged <version>[-patched]-coalesced-<hash>. Not with CILIUM_DELEGATE=1:
# the two series are alternatives, each against stock Cilium.
source "$(dirname "$0")/lib.sh"
source "$IMAGES_DIR/cilium-module.sh"
CILIUM_VERSION=${CILIUM_VERSION:-1.18.8}
CILIUM_VERSION=${CILIUM_VERSION#v}
CILIUM_PATCH=${CILIUM_PATCH:-}
CILIUM_DELEGATE=${CILIUM_DELEGATE:-0}
CILIUM_COALESCED=${CILIUM_COALESCED:-0}
patched=; [[ -n $CILIUM_PATCH ]] && patched=-patched
[[ $CILIUM_DELEGATE == [01] ]] || die "CILIUM_DELEGATE=$CILIUM_DELEGATE: must be 0 or 1"
[[ $CILIUM_COALESCED == [01] ]] || die "CILIUM_COALESCED=$CILIUM_COALESCED: must be 0 or 1"
[[ $CILIUM_DELEGATE == 1 && $CILIUM_COALESCED == 1 ]] &&
	die "CILIUM_DELEGATE=1 and CILIUM_COALESCED=1: pick one (each series is written against stock Cilium, and the images are compared with each other)"
series_patches=() # the series applied: the delegate or the coalesced scrub
if [[ $CILIUM_DELEGATE == 1 ]]; then
	series_patches=("$ROOT/cilium/patches/v$CILIUM_VERSION"/*.patch)
	[[ -f ${series_patches[0]} ]] ||
		die "CILIUM_DELEGATE=1: no patch for Cilium $CILIUM_VERSION in cilium/patches/v$CILIUM_VERSION (see cilium/patches/README.md)"
	patched+=-delegate
elif [[ $CILIUM_COALESCED == 1 ]]; then
	series_patches=("$ROOT/cilium/patches/coalesce-v$CILIUM_VERSION"/*.patch)
	[[ -f ${series_patches[0]} ]] ||
		die "CILIUM_COALESCED=1: no patch for Cilium $CILIUM_VERSION in cilium/patches/coalesce-v$CILIUM_VERSION (see cilium/patches/README.md)"
	patched+=-coalesced
fi
hash=$(inputs_hash "$IMAGES_DIR/lib.sh" "$IMAGES_DIR/cilium.sh" "$IMAGES_DIR/cilium-module.sh" "$CILIUM_VERSION" \
	${CILIUM_PATCH:+"$CILIUM_PATCH"} "${series_patches[@]}")
agent=ctscrub-kind/cilium:$CILIUM_VERSION$patched-$hash
operator=ctscrub-kind/cilium-operator-generic:$CILIUM_VERSION$patched-$hash
if have_image "$agent" && have_image "$operator"; then printf '%s\n%s\n' "$agent" "$operator"; exit 0; fi

log "building Cilium $CILIUM_VERSION from its Go module (about 6-9 min on 2 cores) -> $agent, $operator"
dir=$WORK/cilium-$CILIUM_VERSION
rm -rf "$dir"; mkdir -p "$dir"
mod=github.com/cilium/cilium
src=$("$GO" mod download -json "$mod@v$CILIUM_VERSION" | jq -r .Dir)
if [[ -n $CILIUM_PATCH || ${#series_patches[@]} -gt 0 ]]; then
	# A writable copy of the module, built in place of the proxy's.
	cp -a "$src" "$dir/src"; chmod -R u+w "$dir/src"; src=$dir/src
	if [[ -n $CILIUM_PATCH ]]; then (cd "$src" && "$CILIUM_PATCH"); fi
	for p in "${series_patches[@]}"; do
		(cd "$src" && git apply --whitespace=nowarn "$p") || die "$p does not apply to Cilium $CILIUM_VERSION's source"
	done
fi
pkgs=($mod/daemon $mod/cilium-dbg $mod/cilium-health $mod/cilium-health/responder
	$mod/plugins/cilium-cni $mod/tools/mount $mod/tools/sysctlfix $mod/operator)
# The module the binaries are built in (cilium-module.sh): Cilium's replace
# directives repeated, versions the module proxy refuses swapped.
CILIUM_MODULE_PKGS=("${pkgs[@]}")
cilium_module "$dir/mod" "$CILIUM_VERSION" "$src"
cd "$dir/mod"
# The version string holds a space: quoted, or the linker takes its second
# word for an argument of its own ("usage: link").
ld="-s -w -X '$mod/pkg/version.ciliumVersion=$CILIUM_VERSION ctscrub-kind'"
out=$dir/out
mkdir -p "$out/usr/bin" "$out/opt/cni/bin" "$out/cni"
go_build -tags osusergo -ldflags "$ld" -o "$out/usr/bin/" "${pkgs[@]:0:7}"
mv "$out/usr/bin/daemon" "$out/usr/bin/cilium-agent"
mv "$out/usr/bin/responder" "$out/usr/bin/cilium-health-responder"
mv "$out/usr/bin/mount" "$out/usr/bin/cilium-mount"
mv "$out/usr/bin/sysctlfix" "$out/usr/bin/cilium-sysctlfix"
mv "$out/usr/bin/cilium-cni" "$out/opt/cni/bin/cilium-cni"
mkdir -p "$dir/op/usr/bin"
go_build -tags osusergo,ipam_provider_operator -ldflags "$ld" -o "$dir/op/usr/bin/cilium-operator-generic" $mod/operator

# The agent's tree on top of the Debian rootfs.
rootfs=$("$IMAGES_DIR/rootfs.sh" cilium "${CILIUM_PACKAGES[@]}")
extract "$rootfs" "$dir/root"
cp -a "$out/." "$dir/root/"
mkdir -p "$dir/root/var/lib/cilium" "$dir/root/home/cilium" "$dir/root/usr/local/bin"
cp -r "$src/bpf" "$dir/root/var/lib/cilium/bpf"
install -m 0755 "$src/images/cilium/init-container.sh" "$src/plugins/cilium-cni/install-plugin.sh" \
	"$src/plugins/cilium-cni/cni-uninstall.sh" "$dir/root/"
cp /usr/lib/cni/loopback "$dir/root/cni/loopback" ||
	die "no /usr/lib/cni/loopback: apt-get install containernetworking-plugins"
ln -sf /usr/bin/clang-19 "$dir/root/usr/local/bin/clang"
ln -sf /usr/bin/llc-19 "$dir/root/usr/local/bin/llc"
ln -sf /usr/bin/llvm-objcopy-19 "$dir/root/usr/local/bin/llvm-objcopy"
# Cilium's iptables-wrapper picks iptables-legacy or -nft as the host uses.
install -m 0755 "$src/images/runtime/iptables-wrapper-installer.sh" "$dir/root/iptables-wrapper-installer.sh"
chroot "$dir/root" /iptables-wrapper-installer.sh --no-sanity-check >/dev/null
rm -f "$dir/root/iptables-wrapper-installer.sh" # it removes itself in some versions
import_dir "$dir/root" "$agent" \
	--change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
	--change 'ENV HUBBLE_SERVER=unix:///var/run/cilium/hubble.sock' \
	--change 'ENV INITSYSTEM=SYSTEMD' --change 'WORKDIR /home/cilium' \
	--change 'CMD ["/usr/bin/cilium-dbg"]'
# The operator: its binary and the CA bundle, as Cilium's image.
mkdir -p "$dir/op/etc/ssl/certs"
cp /etc/ssl/certs/ca-certificates.crt "$dir/op/etc/ssl/certs/"
import_dir "$dir/op" "$operator" --change 'CMD ["/usr/bin/cilium-operator-generic"]'
cd / && rm -rf "$dir"
printf '%s\n%s\n' "$agent" "$operator"
