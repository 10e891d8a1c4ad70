#!/usr/bin/env bash
# kube-proxy's image, for the clusters that run it (CNI=kindnet,
# CILIUM_LB=default and hostns; docs/kind.md): the node's Debian rootfs
# (iptables, nftables, conntrack, iproute2: what kube-proxy calls in iptables
# and nftables mode) with kube-proxy from the Kubernetes build at
# /usr/local/bin, where kubeadm's DaemonSet runs it. Prints the name
# kubeadm's DaemonSet pulls (registry.k8s.io/kube-proxy:$K8S_VERSION),
# tagged on the built or reused ctscrub-kind/kube-proxy:<version>-<hash>.
# Kept out of node.sh, whose image the other modes share.
source "$(dirname "$0")/lib.sh"
K8S_VERSION=${K8S_VERSION:-v1.34.4}
rootfs=$("$IMAGES_DIR/rootfs.sh" node "${NODE_PACKAGES[@]}")
k8s=$("$IMAGES_DIR/k8s.sh")
image=ctscrub-kind/kube-proxy:$K8S_VERSION-$(inputs_hash "$IMAGES_DIR/lib.sh" "$IMAGES_DIR/kubeproxy.sh" "$rootfs" "$k8s")
ref=registry.k8s.io/kube-proxy:$K8S_VERSION
if ! have_image "$image"; then
	log "kube-proxy image -> $image"
	dir=$WORK/kube-proxy-img
	rm -rf "$dir"; mkdir -p "$dir"
	extract "$k8s" "$dir/k8s"
	[[ -x $dir/k8s/usr/local/bin/kube-proxy ]] || die "$k8s has no kube-proxy (k8s.sh builds it since d0d8db4)"
	id=$("$DOCKER" create "$rootfs" /nonexistent)
	"$DOCKER" cp "$dir/k8s/usr/local/bin/kube-proxy" "$id:/usr/local/bin/kube-proxy"
	"$DOCKER" commit --change "LABEL org.ctscrub.kind.inputs=${image##*:}" \
		--change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
		--change 'ENTRYPOINT ["/usr/local/bin/kube-proxy"]' "$id" "$image" >/dev/null
	"$DOCKER" rm "$id" >/dev/null
	rm -rf "$dir"
fi
"$DOCKER" tag "$image" "$ref"
echo "$ref"
