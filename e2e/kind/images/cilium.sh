#!/usr/bin/env bash
# Cilium's agent and operator images, version $CILIUM_VERSION, built from the
# github.com/cilium/cilium Go module with no change to Cilium's source.
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
source "$(dirname "$0")/lib.sh"
CILIUM_VERSION=${CILIUM_VERSION:-1.18.8}
CILIUM_VERSION=${CILIUM_VERSION#v}
CILIUM_PATCH=${CILIUM_PATCH:-}
patched=; [[ -n $CILIUM_PATCH ]] && patched=-patched
hash=$(inputs_hash "$IMAGES_DIR/lib.sh" "$IMAGES_DIR/cilium.sh" "$CILIUM_VERSION" ${CILIUM_PATCH:+"$CILIUM_PATCH"})
agent=ctscrub-kind/cilium:$CILIUM_VERSION$patched-$hash
operator=ctscrub-kind/cilium-operator-generic:$CILIUM_VERSION$patched-$hash
if have_image "$agent" && have_image "$operator"; then printf '%s\n%s\n' "$agent" "$operator"; exit 0; fi

log "building Cilium $CILIUM_VERSION from its Go module (about 6-9 min on 2 cores) -> $agent, $operator"
dir=$WORK/cilium-$CILIUM_VERSION
go_module "$dir" ctscrub-kind/cilium
cd "$dir"
"$GO" mod download -json "github.com/cilium/cilium@v$CILIUM_VERSION" >dl.json
src=$(jq -r .Dir dl.json)
mod=github.com/cilium/cilium
if [[ -n $CILIUM_PATCH ]]; then
	# A writable copy of the module, built in place of the proxy's.
	cp -a "$src" "$dir/src"; chmod -R u+w "$dir/src"; src=$dir/src
	(cd "$src" && "$CILIUM_PATCH")
	echo "replace $mod => ./src" >>go.mod
fi
echo "require $mod v$CILIUM_VERSION" >>go.mod
# Cilium's own replace directives (its forks of controller-tools, gobgp,
# apimachinery) apply only in its own module: repeat them here, with its
# go.sum (the sum database does not know some of the forks' versions). A fork
# the module proxy does not serve is left out, with a warning: 1.18's
# github.com/cilium/apimachinery v0.33.3-1 (403 from proxy.golang.org; it
# adds `omitzero` support to apimachinery's converters), so the build uses the
# k8s.io/apimachinery version Cilium requires. See docs/kind.md.
cp "$src/go.sum" go.sum
awk '/^replace \(/{b=1; next} b && /^\)/{b=0; next}
	b && /=>/ {print "replace " $0; next}
	/^replace .*=>/ {sub(/^replace /, ""); print "replace " $0}' "$src/go.mod" | grep -v '=> \.' |
	while read -r _ from _ to ver; do
		if "$GO" mod download "$to@$ver" 2>/dev/null; then
			echo "replace $from => $to $ver" >>go.mod
		else
			log "warning: $to@$ver (Cilium's replacement of $from) is not on the module proxy: building with $from as Cilium's go.mod requires it"
		fi
	done
# A version Cilium's go.mod requires may be refused by the module proxy (403:
# 1.18.8's k8s.io/endpointslice v0.33.9, among others). Each one found is
# replaced by the nearest version of the same module the proxy serves (the
# highest below it, else the lowest above it), with a warning.
pkgs=($mod/daemon $mod/cilium-dbg $mod/cilium-health $mod/cilium-health/responder
	$mod/plugins/cilium-cni $mod/tools/mount $mod/tools/sysctlfix $mod/operator)
for _ in $(seq 10); do
	err=$(CGO_ENABLED=0 GOFLAGS=-mod=mod "$GO" list -deps -tags osusergo,ipam_provider_operator "${pkgs[@]}" 2>&1 >/dev/null) && break
	refused=$(grep -oE '[A-Za-z0-9._~/-]+@v[^:[:space:]]+: reading https?://[^ ]+: 403' <<<"$err" | head -1 | cut -d: -f1)
	[[ -n $refused ]] || { echo "$err" >&2; die "resolving Cilium $CILIUM_VERSION's packages failed"; }
	m=${refused%@*} v=${refused#*@}
	alt=$( { "$GO" -C / list -m -versions "$m" | tr ' ' '\n' | tail -n +2; echo "$v"; } | sort -V | awk -v v="$v" '
		$0 == v {hit = 1; next} !hit {below = $0} hit && above == "" {above = $0}
		END {print below; print above}' | while read -r c; do
			[[ -n $c ]] && "$GO" -C / mod download "$m@$c" >/dev/null 2>&1 && { echo "$c"; break; }
		done || true)
	[[ -n $alt ]] || die "$m@$v is refused by the module proxy and no other version of it is served"
	log "warning: $m@$v (required by Cilium $CILIUM_VERSION) is refused by the module proxy: building with $alt"
	echo "replace $m => $m $alt" >>go.mod
done
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
