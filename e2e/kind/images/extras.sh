#!/usr/bin/env bash
# The other control-plane binaries kubeadm's images need: etcd (from
# go.etcd.io/etcd/server/v3), coredns (github.com/coredns/coredns) and the
# sandbox's pause (./pause in this directory). Prints the image that holds them
# (/usr/local/bin), built or reused.
source "$(dirname "$0")/lib.sh"
ETCD_VERSION=${ETCD_VERSION:-v3.6.5}
COREDNS_VERSION=${COREDNS_VERSION:-v1.12.1}
image=ctscrub-kind/k8s-extras:$(inputs_hash "$IMAGES_DIR/lib.sh" "$IMAGES_DIR/extras.sh" "$IMAGES_DIR/pause/main.go" "$ETCD_VERSION" "$COREDNS_VERSION")
if have_image "$image"; then echo "$image"; exit 0; fi

log "building etcd $ETCD_VERSION, coredns $COREDNS_VERSION, pause -> $image"
dir=$WORK/extras
go_module "$dir" ctscrub-kind/extras
mkdir -p "$dir/out/usr/local/bin"
cd "$dir"
# etcd's server module points its sibling modules at ../: use their releases.
cat >>go.mod <<EOM
require (
	go.etcd.io/etcd/server/v3 $ETCD_VERSION
	github.com/coredns/coredns $COREDNS_VERSION
)
replace (
	go.etcd.io/etcd/api/v3 => go.etcd.io/etcd/api/v3 $ETCD_VERSION
	go.etcd.io/etcd/client/pkg/v3 => go.etcd.io/etcd/client/pkg/v3 $ETCD_VERSION
	go.etcd.io/etcd/client/v3 => go.etcd.io/etcd/client/v3 $ETCD_VERSION
	go.etcd.io/etcd/pkg/v3 => go.etcd.io/etcd/pkg/v3 $ETCD_VERSION
)
EOM
go_build -ldflags "-s -w" -o out/usr/local/bin/etcd go.etcd.io/etcd/server/v3
go_build -ldflags "-s -w" -o out/usr/local/bin/coredns github.com/coredns/coredns
(cd "$ROOT" && go_build -ldflags "-s -w" -o "$dir/out/pause" ./e2e/kind/images/pause)
import_dir out "$image"
cd / && rm -rf "$dir"
echo "$image"
