#!/usr/bin/env bash
# Kubernetes binaries from the k8s.io/kubernetes Go module: kubeadm, kubelet,
# kubectl, the control plane (kube-apiserver, kube-controller-manager,
# kube-scheduler), kube-proxy (for the clusters that run it: CILIUM_LB=default
# and hostns, CNI=kindnet) and the e2e workload server agnhost. Prints the
# image that holds them (/usr/local/bin), built or reused.
#
# k8s.io/kubernetes cannot be built as a plain dependency: its go.mod points
# its 31 staging modules (k8s.io/api, ...) at ./staging. A throwaway module
# requires it and replaces each staging module with its published v0.X.Y.
source "$(dirname "$0")/lib.sh"
K8S_VERSION=${K8S_VERSION:-v1.34.4}
image=ctscrub-kind/k8s:$K8S_VERSION-$(inputs_hash "$IMAGES_DIR/lib.sh" "$IMAGES_DIR/k8s.sh" "$K8S_VERSION")
if have_image "$image"; then echo "$image"; exit 0; fi

log "building Kubernetes $K8S_VERSION from its Go module (6 min on 2 idle cores, about 18 loaded) -> $image"
dir=$WORK/k8s
go_module "$dir" ctscrub-kind/k8s
cd "$dir"
"$GO" mod download -json "k8s.io/kubernetes@$K8S_VERSION" >dl.json
src=$(jq -r .Dir dl.json)
staging=v0.${K8S_VERSION#v1.}
{
	echo "require k8s.io/kubernetes $K8S_VERSION"
	awk '$2 == "=>" && $3 ~ /^\.\/staging\// {print "replace " $1 " => " $1 " '"$staging"'"}' "$src/go.mod"
} >>go.mod
grep -c '^replace' go.mod | grep -qx 31 || log "warning: $(grep -c '^replace' go.mod) staging modules replaced (31 expected for v1.34)"

# Version stamps as hack/lib/version.sh sets them: kubeadm and the kubelet
# compare versions.
minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
ld="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
	ld+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
	ld+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
done
mkdir -p out/usr/local/bin
go_build -tags providerless -ldflags "$ld" -o out/usr/local/bin/ \
	k8s.io/kubernetes/cmd/kubeadm \
	k8s.io/kubernetes/cmd/kubelet \
	k8s.io/kubernetes/cmd/kubectl \
	k8s.io/kubernetes/cmd/kube-apiserver \
	k8s.io/kubernetes/cmd/kube-controller-manager \
	k8s.io/kubernetes/cmd/kube-scheduler \
	k8s.io/kubernetes/cmd/kube-proxy \
	k8s.io/kubernetes/test/images/agnhost
out/usr/local/bin/kubeadm version -o short | grep -qx "$K8S_VERSION" || die "kubeadm reports $(out/usr/local/bin/kubeadm version -o short), want $K8S_VERSION"
import_dir out "$image"
cd / && rm -rf "$dir"
echo "$image"
