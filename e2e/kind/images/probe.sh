#!/usr/bin/env bash
# The blackhole test's client (e2e/kind/probe): one static binary in an
# otherwise empty image. Prints the image (ctscrub-kind/probe:<hash>), built
# or reused; the binary is rebuilt every time (seconds with Go's cache).
source "$(dirname "$0")/lib.sh"
dir=$WORK/probe-img
rm -rf "$dir"; mkdir -p "$dir/tmp"; chmod 1777 "$dir/tmp"
(cd "$ROOT" && CGO_ENABLED=0 "$GO" build -trimpath -o "$dir/probe" ./e2e/kind/probe)
image=ctscrub-kind/probe:$(inputs_hash "$IMAGES_DIR/lib.sh" "$IMAGES_DIR/probe.sh" "$dir/probe")
have_image "$image" || import_dir "$dir" "$image" --change 'ENTRYPOINT ["/probe"]'
rm -rf "$dir"
echo "$image"
