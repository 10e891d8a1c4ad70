#!/usr/bin/env bash
# The kind node image: Kubernetes $K8S_VERSION on a Debian rootfs, built the
# way kind's own node image is (images/base and pkg/build/nodeimage in the
# sigs.k8s.io/kind module, whose files it uses): systemd, containerd and runc
# from Debian, kind's base-image files, kubeadm/kubelet/kubectl, and the
# control-plane images (kube-apiserver, kube-controller-manager,
# kube-scheduler, etcd, coredns, pause) preloaded into the node's containerd
# under the names `kubeadm config images list` prints. Prints the image
# (ctscrub-kind/node:<k8s version>-<hash>), built or reused.
#
# For machines like this one, the node's containerd runs runc through
# runcwrap (see e2e/kind/runcwrap) and has restrict_oom_score_adj set; both
# are no-ops where they are not needed.
source "$(dirname "$0")/lib.sh"
K8S_VERSION=${K8S_VERSION:-v1.34.4}
KIND_VERSION=${KIND_VERSION:-v0.33.0}
CRICTL_VERSION=${CRICTL_VERSION:-v1.34.0}
rootfs=$("$IMAGES_DIR/rootfs.sh" node "${NODE_PACKAGES[@]}")
k8s=$("$IMAGES_DIR/k8s.sh")
extras=$("$IMAGES_DIR/extras.sh")
image=ctscrub-kind/node:$K8S_VERSION-$(inputs_hash "$IMAGES_DIR/lib.sh" "$IMAGES_DIR/node.sh" \
	"$ROOT/e2e/kind/runcwrap/main.go" "$rootfs" "$k8s" "$extras" "$KIND_VERSION" "$CRICTL_VERSION")
if have_image "$image"; then echo "$image"; exit 0; fi

log "assembling the kind node image -> $image"
kind_src=$("$GO" mod download -json "sigs.k8s.io/kind@$KIND_VERSION" | jq -r .Dir)/images/base/files
dir=$WORK/node
rm -rf "$dir"; mkdir -p "$dir"
extract "$rootfs" "$dir/root"
extract "$k8s" "$dir/k8s"
extract "$extras" "$dir/extras"
r=$dir/root

# kind's base image (images/base/Dockerfile), step by step.
install -m 0755 "$kind_src"/usr/local/bin/* "$r/usr/local/bin/"
mkdir -p "$r/kind/bin" "$r/etc/systemd/system/kubelet.service.d"
cp -r "$kind_src/kind/." "$r/kind/"; chmod 0755 "$r/kind" "$r/kind/bin" "$r"/kind/bin/*
install -m 0644 "$kind_src"/etc/crictl.yaml "$r/etc/"
install -m 0644 "$kind_src"/etc/containerd/* "$r/etc/containerd/"
install -m 0644 "$kind_src"/etc/default/* "$r/etc/default/"
install -m 0644 "$kind_src"/etc/sysctl.d/* "$r/etc/sysctl.d/"
find "$kind_src/etc/systemd/system" -maxdepth 1 -type f -exec install -m 0644 {} "$r/etc/systemd/system/" \;
install -m 0644 "$kind_src"/etc/systemd/system/kubelet.service.d/* "$r/etc/systemd/system/kubelet.service.d/"
find "$r/lib/systemd/system/sysinit.target.wants/" -name systemd-tmpfiles-setup.service -delete
rm -f "$r"/lib/systemd/system/multi-user.target.wants/* "$r"/etc/systemd/system/*.wants/* \
	"$r"/lib/systemd/system/local-fs.target.wants/* "$r"/lib/systemd/system/sockets.target.wants/*udev* \
	"$r"/lib/systemd/system/sockets.target.wants/*initctl* "$r"/lib/systemd/system/basic.target.wants/*
echo "ReadKMsg=no" >>"$r/etc/systemd/journald.conf"
ln -sf /usr/lib/systemd/systemd "$r/sbin/init"
# kind's units name its own containerd build in /usr/local/bin.
for b in containerd containerd-shim-runc-v2 ctr; do ln -sf "/usr/bin/$b" "$r/usr/local/bin/$b"; done
chroot "$r" systemctl enable kubelet.service containerd.service undo-mount-hacks.service 2>&1 | grep -v "^Created symlink" >&2 || true
# -L, not -e: the link is absolute (/etc/systemd/...), so it dangles from outside the chroot.
[[ -L $r/etc/systemd/system/multi-user.target.wants/kubelet.service ]] || die "systemctl enable kubelet failed in the rootfs"
chroot "$r" systemctl mask systemd-binfmt.service >/dev/null
mkdir -p "$r/etc/kubernetes/manifests" "$r/opt/cni/bin"
chroot "$r" ctr oci spec |
	jq '.hooks.createContainer[.hooks.createContainer|length] |= . + {"path": "/kind/bin/mount-product-files.sh"}' |
	jq 'del(.process.rlimits)' >"$r/etc/containerd/cri-base.json"

# This machine's needs (no-ops elsewhere).
CGO_ENABLED=0 "$GO" build -C "$ROOT" -trimpath -o "$r/usr/local/sbin/runcwrap" ./e2e/kind/runcwrap
pause_ref=registry.k8s.io/pause:$("$dir/k8s/usr/local/bin/kubeadm" config images list --kubernetes-version "$K8S_VERSION" 2>/dev/null | awk -F: '/pause/{print $2}')
sed -i \
	-e 's|^\(\s*\)SystemdCgroup = true|&\n\1BinaryName = "/usr/local/sbin/runcwrap"|' \
	-e 's|restrict_oom_score_adj = false|restrict_oom_score_adj = true|' \
	-e "s|sandbox_image = .*|sandbox_image = \"$pause_ref\"|" \
	"$r/etc/containerd/config.toml"
grep -q 'BinaryName = "/usr/local/sbin/runcwrap"' "$r/etc/containerd/config.toml" || die "kind's containerd config changed: runcwrap not set"

# Kubernetes.
install -m 0755 "$dir"/k8s/usr/local/bin/{kubeadm,kubelet,kubectl} "$r/usr/bin/"
# crictl, as kind's base image has it (bench-cilium-node and debugging use it).
GOBIN=$dir/crictl CGO_ENABLED=0 GOFLAGS= "$GO" install -trimpath "sigs.k8s.io/cri-tools/cmd/crictl@$CRICTL_VERSION"
install -m 0755 "$dir/crictl/crictl" "$r/usr/local/bin/crictl"
echo "$K8S_VERSION" >"$r/kind/version"

# The control-plane images, each a single binary, preloaded into the node's
# containerd: a containerd of the same version as the node's (Debian's, on
# this machine) imports them into the rootfs's /var/lib/containerd; the CRI
# unpacks each on first use.
mkdir -p "$dir/img"
refs=()
while read -r ref; do
	name=${ref##*/}; name=${name%%:*}
	bin=$name entry=""
	case $name in
	kube-proxy) continue ;; # the cluster runs without kube-proxy
	coredns) entry='ENTRYPOINT ["/usr/local/bin/coredns"]' ;;
	pause) bin=pause entry='ENTRYPOINT ["/pause"]' ;;
	esac
	t=$dir/img/$name; mkdir -p "$t/usr/local/bin" "$t/tmp"; chmod 1777 "$t/tmp"
	if [[ $name == pause ]]; then cp "$dir/extras/pause" "$t/pause"
	elif [[ -f $dir/k8s/usr/local/bin/$bin ]]; then cp "$dir/k8s/usr/local/bin/$bin" "$t/usr/local/bin/"
	else cp "$dir/extras/usr/local/bin/$bin" "$t/usr/local/bin/"; fi
	tar -C "$t" -c . | "$DOCKER" import --change 'ENV PATH=/usr/local/bin:/usr/bin:/bin' ${entry:+--change "$entry"} - "$ref" >/dev/null
	refs+=("$ref")
done < <("$dir/k8s/usr/local/bin/kubeadm" config images list --kubernetes-version "$K8S_VERSION")
"$DOCKER" save "${refs[@]}" -o "$dir/images.tar"
"$DOCKER" rmi "${refs[@]}" >/dev/null
cat >"$dir/containerd.toml" <<EOM
version = 2
root = "$r/var/lib/containerd"
state = "$dir/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "$dir/containerd.sock"
EOM
containerd --config "$dir/containerd.toml" >"$dir/containerd.log" 2>&1 &
ctrd=$!
trap 'kill $ctrd 2>/dev/null || true' EXIT
for _ in $(seq 50); do [[ -S $dir/containerd.sock ]] && break; sleep 0.2; done
ctr --address "$dir/containerd.sock" -n k8s.io images import --no-unpack "$dir/images.tar" >/dev/null ||
	{ cat "$dir/containerd.log" >&2; die "ctr import into the node's containerd failed"; }
ctr --address "$dir/containerd.sock" -n k8s.io images ls -q | grep -qF "$pause_ref" || die "the pause image is not in the node's containerd"
kill $ctrd; wait $ctrd 2>/dev/null || true; trap - EXIT
rm -rf "$r/var/lib/containerd/tmpmounts"

import_dir "$r" "$image" --change 'ENV container=docker' \
	--change 'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]'
cd / && rm -rf "$dir"
echo "$image"
