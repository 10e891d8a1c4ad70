# cilium_module DIR VERSION SRC (sourced, not run; needs lib.sh's GO, log,
# die): makes DIR, a module holding only a go.mod (go_module), a module in
# which Cilium VERSION's packages resolve and build from the module proxy:
# github.com/cilium/cilium replaced by SRC when SRC is not the module cache's
# own copy (a patched copy), Cilium's own replace directives repeated, and
# every version the proxy refuses swapped for the nearest one it serves.
# Used by cilium.sh (the kind images) and scripts/cilium-patch-test.sh.
cilium_module() {
	local dir=$1 version=$2 src=$3 mod=github.com/cilium/cilium
	go_module "$dir" ctscrub-kind/cilium
	if [[ $src != "$("$GO" mod download -json "$mod@v$version" | jq -r .Dir)" ]]; then
		echo "replace $mod => $src" >>"$dir/go.mod"
	fi
	echo "require $mod v$version" >>"$dir/go.mod"
	# Cilium's own replace directives (its forks of controller-tools, gobgp,
	# apimachinery) apply only in its own module: repeat them here, with its
	# go.sum (the sum database does not know some of the forks' versions). A
	# fork the module proxy does not serve is left out, with a warning: 1.18's
	# github.com/cilium/apimachinery v0.33.3-1 (403 from proxy.golang.org; it
	# adds `omitzero` support to apimachinery's converters), so the build uses
	# the k8s.io/apimachinery version Cilium requires. See docs/kind.md.
	cp "$src/go.sum" "$dir/go.sum"
	awk '/^replace \(/{b=1; next} b && /^\)/{b=0; next}
		b && /=>/ {print "replace " $0; next}
		/^replace .*=>/ {sub(/^replace /, ""); print "replace " $0}' "$src/go.mod" | grep -v '=> \.' |
		while read -r _ from _ to ver; do
			if "$GO" mod download "$to@$ver" 2>/dev/null; then
				echo "replace $from => $to $ver" >>"$dir/go.mod"
			else
				log "warning: $to@$ver (Cilium's replacement of $from) is not on the module proxy: building with $from as Cilium's go.mod requires it"
			fi
		done
	# A version Cilium's go.mod requires may be refused by the module proxy
	# (403: 1.18.8's k8s.io/endpointslice v0.33.9, among others). Each one
	# found is replaced by the nearest version of the same module the proxy
	# serves (the highest below it, else the lowest above it), with a warning.
	# CILIUM_MODULE_PKGS: the packages that must resolve (with their tests'
	# dependencies when CILIUM_MODULE_TEST is set).
	local err refused m v alt _i test=()
	[[ -n ${CILIUM_MODULE_TEST:-} ]] && test=(-test)
	for _i in $(seq 10); do
		err=$(cd "$dir" && CGO_ENABLED=0 GOFLAGS=-mod=mod "$GO" list -deps "${test[@]}" -tags osusergo,ipam_provider_operator "${CILIUM_MODULE_PKGS[@]}" 2>&1 >/dev/null) && return 0
		refused=$(grep -oE '[A-Za-z0-9._~/-]+@v[^:[:space:]]+: reading https?://[^ ]+: 403' <<<"$err" | head -1 | cut -d: -f1)
		[[ -n $refused ]] || { echo "$err" >&2; die "resolving Cilium $version's packages failed"; }
		m=${refused%@*} v=${refused#*@}
		alt=$( { "$GO" -C / list -m -versions "$m" | tr ' ' '\n' | tail -n +2; echo "$v"; } | sort -V | awk -v v="$v" '
			$0 == v {hit = 1; next} !hit {below = $0} hit && above == "" {above = $0}
			END {print below; print above}' | while read -r c; do
				[[ -n $c ]] && "$GO" -C / mod download "$m@$c" >/dev/null 2>&1 && { echo "$c"; break; }
			done || true)
		[[ -n $alt ]] || die "$m@$v is refused by the module proxy and no other version of it is served"
		log "warning: $m@$v (required by Cilium $version) is refused by the module proxy: building with $alt"
		echo "replace $m => $m $alt" >>"$dir/go.mod"
	done
	die "resolving Cilium $version's packages: still failing after 10 replacements"
}
