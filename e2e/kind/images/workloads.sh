#!/usr/bin/env bash
# The test's workload images. Prints two lines, server then client, built or
# reused:
#   ctscrub-kind/agnhost:<version>-<hash>: the Kubernetes e2e server agnhost
#     (k8s.io/kubernetes/test/images/agnhost, from the Kubernetes build);
#   ctscrub-kind/busybox:<version>-<hash>: Debian's busybox-static with its
#     applets linked (sh, nc, wget, nslookup, ping, sleep, timeout, ...).
source "$(dirname "$0")/lib.sh"
k8s=$("$IMAGES_DIR/k8s.sh")
bb=/bin/busybox
dpkg -s busybox-static >/dev/null 2>&1 || die "busybox-static is not installed (e2e/kind/install.sh installs it)"
bbver=$(dpkg-query -W -f '${Version}' busybox-static | tr ':~+' '___')
agn_ver=$(awk '{print $1; exit}' "$("$GO" mod download -json "k8s.io/kubernetes@${K8S_VERSION:-v1.34.4}" | jq -r .Dir)/test/images/agnhost/VERSION")
h=$(inputs_hash "$IMAGES_DIR/lib.sh" "$IMAGES_DIR/workloads.sh" "$k8s" "$bb")
server=ctscrub-kind/agnhost:$agn_ver-$h
client=ctscrub-kind/busybox:$bbver-$h
dir=$WORK/workloads
if ! have_image "$server"; then
	log "agnhost image -> $server"
	rm -rf "$dir"; extract "$k8s" "$dir/k8s"
	mkdir -p "$dir/agnhost/tmp"; chmod 1777 "$dir/agnhost/tmp"
	cp "$dir/k8s/usr/local/bin/agnhost" "$dir/agnhost/agnhost"
	import_dir "$dir/agnhost" "$server" --change 'ENTRYPOINT ["/agnhost"]'
fi
if ! have_image "$client"; then
	log "busybox image -> $client"
	rm -rf "$dir/busybox"; mkdir -p "$dir/busybox/bin" "$dir/busybox/tmp" "$dir/busybox/etc"; chmod 1777 "$dir/busybox/tmp"
	cp "$bb" "$dir/busybox/bin/busybox"
	for a in $("$bb" --list); do [[ $a == busybox ]] || ln -s busybox "$dir/busybox/bin/$a"; done
	echo 'root:x:0:0:root:/root:/bin/sh' >"$dir/busybox/etc/passwd"
	import_dir "$dir/busybox" "$client" --change 'ENV PATH=/bin' --change 'CMD ["sh"]'
fi
rm -rf "$dir"
printf '%s\n%s\n' "$server" "$client"
