#!/usr/bin/env bash
# rootfs.sh NAME PACKAGE...: a Debian rootfs ($DEBIAN_SUITE, minbase) with
# the packages, by debootstrap from $DEBIAN_MIRROR. Prints the image that
# holds it (ctscrub-kind/rootfs-NAME:<hash>), built or reused. The .debs are
# kept in $WORK/debs for the next rootfs.
source "$(dirname "$0")/lib.sh"
name=$1; shift
pkgs=$(printf '%s\n' "$@" | sort -u | paste -sd, -)
image=ctscrub-kind/rootfs-$name:$(inputs_hash "$IMAGES_DIR/lib.sh" "$IMAGES_DIR/rootfs.sh" "$DEBIAN_SUITE" "$DEBIAN_MIRROR" "$pkgs")
if have_image "$image"; then echo "$image"; exit 0; fi
command -v debootstrap >/dev/null || die "debootstrap is not installed (e2e/kind/install.sh installs it)"

log "debootstrap $DEBIAN_SUITE rootfs $name ($# packages) -> $image"
dir=$WORK/rootfs-$name
rm -rf "$dir"; mkdir -p "$dir/root" "$WORK/debs"
debootstrap --variant=minbase --include="$pkgs" --cache-dir="$WORK/debs" \
	"$DEBIAN_SUITE" "$dir/root" "$DEBIAN_MIRROR" >"$dir/debootstrap.log" 2>&1 ||
	{ tail -20 "$dir/debootstrap.log" >&2; die "debootstrap $name failed (log above)"; }
# What a rootfs made by a container build would not hold.
rm -rf "$dir/root"/var/lib/apt/lists/* "$dir/root"/var/cache/apt/*.bin "$dir/root"/var/log/*.log
import_dir "$dir/root" "$image"
rm -rf "$dir"
echo "$image"
