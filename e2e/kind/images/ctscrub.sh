#!/usr/bin/env bash
# ctscrub's image, built as conf/Containerfile says: bin/scrubd and
# bin/ctscrub, static, in a scratch image. Prints the image
# (ctscrub-kind/ctscrub:<hash of the binaries and the Containerfile>), built
# or reused. The binaries are rebuilt every time (seconds with Go's cache).
source "$(dirname "$0")/lib.sh"
ctx=$WORK/ctscrub-ctx
rm -rf "$ctx"; mkdir -p "$ctx/bin"
(cd "$ROOT" && CGO_ENABLED=0 "$GO" build -trimpath -o "$ctx/bin/scrubd" ./scrubd &&
	CGO_ENABLED=0 "$GO" build -trimpath -o "$ctx/bin/ctscrub" ./plugin)
image=ctscrub-kind/ctscrub:$(inputs_hash "$ctx/bin/scrubd" "$ctx/bin/ctscrub" "$ROOT/conf/Containerfile")
if ! have_image "$image"; then
	log "ctscrub image -> $image"
	"$DOCKER" build -q -f "$ROOT/conf/Containerfile" --label "org.ctscrub.kind.inputs=${image##*:}" -t "$image" "$ctx" >/dev/null
fi
rm -rf "$ctx"
echo "$image"
