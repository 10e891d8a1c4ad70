#!/usr/bin/env bash
# The in-cluster Prometheus of the kind e2e (TestKindMetrics): Debian's
# prometheus package (installed on this machine by e2e/kind/install.sh), its
# binary and the libc it links, nothing else. Prints the image
# (ctscrub-kind/prometheus:<version>-<hash>), built or reused.
source "$(dirname "$0")/lib.sh"
bin=/usr/bin/prometheus
dpkg -s prometheus >/dev/null 2>&1 || die "prometheus is not installed (e2e/kind/install.sh installs it)"
ver=$(dpkg-query -W -f '${Version}' prometheus | tr ':~+' '___')
# The shared objects it loads, from ldd, symlinks resolved.
mapfile -t libs < <(ldd "$bin" | awk '/=>/ {print $3} !/=>/ && $1 ~ /^\// {print $1}')
image=ctscrub-kind/prometheus:$ver-$(inputs_hash "$IMAGES_DIR/lib.sh" "$IMAGES_DIR/prometheus.sh" "$bin" "${libs[@]}")
if ! have_image "$image"; then
	log "prometheus image -> $image"
	dir=$WORK/prometheus-img
	rm -rf "$dir"; mkdir -p "$dir/bin" "$dir/tmp" "$dir/prometheus" "$dir/etc"
	chmod 1777 "$dir/tmp" "$dir/prometheus"
	cp "$bin" "$dir/bin/prometheus"
	for l in "${libs[@]}"; do
		mkdir -p "$dir$(dirname "$l")"; cp -L "$l" "$dir$l"
	done
	echo 'nobody:x:65534:65534:nobody:/:/bin/prometheus' >"$dir/etc/passwd"
	import_dir "$dir" "$image" --change 'USER 65534' --change 'WORKDIR /prometheus' \
		--change 'ENTRYPOINT ["/bin/prometheus"]'
	rm -rf "$dir"
fi
echo "$image"
