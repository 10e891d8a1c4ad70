#!/usr/bin/env bash
# make cilium-patch-test: for each series of patches to Cilium and each
# version it has (CILIUM_PATCH_SERIES to pick series, default "delegate
# coalesce"; CILIUM_PATCH_VERSIONS to pick versions, e.g. "1.20.2"), on a
# copy of the github.com/cilium/cilium module's source: apply the series
# (git am), build the agent (./daemon, as cilium.sh builds cilium-agent for
# the kind images), run Cilium's own offline checks of the files the series
# touches (scripts/cilium-patch-checks.sh: precheck's contrib/scripts, custom
# vet and lint, go vet, golangci-lint at the version Cilium pins, the agent's
# cmdref regenerated and compared), go test of every package the series
# touches, and, as root, the privileged tests of the packages it adds.
# CILIUM_PATCH_SELFTEST=1 also shows each check failing on a tree broken for
# it (a few minutes more per series). The series:
#   delegate  cilium/patches/v<version>/           (the conntrack scrub delegate)
#   coalesce  cilium/patches/coalesce-v<version>/  (the in-agent baseline:
#             coalesced endpoint scrubs, off the endpoint's lock)
# One summary line per series and version; exits 1 if any failed.
#
# Slow cold: about an hour per version on this shared 2-core machine, a
# few minutes per series with the Go cache warm, golangci-lint most of it
# (docs/upstream-delegate.md has the figures); it runs at lib.sh's
# niceness (NICE, default 10). Scratch space:
# CILIUM_PATCH_WORK (default /var/tmp/ctscrub-cilium-patch), kept for
# inspection, replaced on the next run; each step's output is in its
# <dir>/<step>.log, <dir> the series' directory name (v1.20.2,
# coalesce-v1.20.2).
source "$(dirname "$0")/../e2e/kind/images/lib.sh"
source "$IMAGES_DIR/cilium-module.sh"
source "$(dirname "$0")/cilium-patch-checks.sh"
set +e # each version's failure is reported, not fatal to the others

PATCHES=$ROOT/cilium/patches
PWORK=${CILIUM_PATCH_WORK:-/var/tmp/ctscrub-cilium-patch}
mod=github.com/cilium/cilium
series=(${CILIUM_PATCH_SERIES:-delegate coalesce})

# series_prefix SERIES: the prefix of its directories in cilium/patches,
# before the version.
series_prefix() {
	case $1 in
	delegate) echo v ;;
	coalesce) echo coalesce-v ;;
	*) die "CILIUM_PATCH_SERIES: unknown series $1 (have: delegate, coalesce)" ;;
	esac
}

# The series and versions to test, as directory names.
runs=()
for s in "${series[@]}"; do
	prefix=$(series_prefix "$s") || exit 1
	if [[ -n ${CILIUM_PATCH_VERSIONS:-} ]]; then
		for v in $CILIUM_PATCH_VERSIONS; do runs+=("$prefix${v#v}"); done
	else
		for d in $(cd "$PATCHES" && ls -d "$prefix"[0-9]*/ 2>/dev/null | tr -d / | sort -V); do runs+=("$d"); done
	fi
done
[[ ${#runs[@]} -gt 0 ]] || die "no patches in $PATCHES for the series ${series[*]}"

# step NAME DIR CMD...: run CMD with its output in DIR/NAME.log; on failure
# show the log's tail.
step() {
	local name=$1 dir=$2; shift 2
	if ! "$@" >"$dir/$name.log" 2>&1; then
		tail -n 40 "$dir/$name.log" >&2
		return 1
	fi
}

apply() (
	local src=$1 version=$2 name=$3
	cd "$src" && git init -q && git add -A &&
		git -c user.name=ctscrub -c user.email=ctscrub@localhost commit -qm "github.com/cilium/cilium v$version (module source)" &&
		git tag base &&
		git -c user.name=ctscrub -c user.email=ctscrub@localhost am -q "$PATCHES/$name"/*.patch
)

# test_series NAME: NAME is the series' directory (v1.20.2, coalesce-v1.20.2);
# the version is what follows its last v.
test_series() {
	local name=$1 version=${1##*v} dir=$PWORK/$1 src pkgs=()
	rm -rf "$dir"; mkdir -p "$dir"
	ls "$PATCHES/$name"/*.patch >/dev/null 2>&1 || { echo "no *.patch in $PATCHES/$name" >&2; fail=patches; return 1; }
	src=$("$GO" mod download -json "$mod@v$version" | jq -r .Dir) && [[ -d $src ]] ||
		{ echo "go mod download $mod@v$version failed" >&2; fail=download; return 1; }
	# The module cache is read-only: a writable copy, a git repository so
	# that git am applies the patches whole or not at all.
	cp -a "$src" "$dir/src" && chmod -R u+w "$dir/src" || { fail=copy; return 1; }
	step apply "$dir" apply "$dir/src" "$version" "$name" || { fail="git am (the patches do not apply)"; return 1; }
	# The packages the patches touch: every directory holding a changed .go file.
	mapfile -t pkgs < <(git -C "$dir/src" diff --name-only base HEAD -- '*.go' | xargs -r -n1 dirname | sort -u | sed "s|^|$mod/|")
	npatches=$(git -C "$dir/src" rev-list --count base..HEAD)
	[[ ${#pkgs[@]} -gt 0 ]] || { fail="the patches change no .go file"; return 1; }
	# In a subshell: cilium_module dies on failure.
	local tools=()
	mapfile -t tools < <(check_tool_pkgs "$dir/src")
	(CILIUM_MODULE_PKGS=("$mod/daemon" "${pkgs[@]}" "${tools[@]}") CILIUM_MODULE_TEST=1
		step resolve "$dir" cilium_module "$dir/mod" "$version" "$dir/src") || { fail="resolving the module"; return 1; }
	(cd "$dir/mod" && step build "$dir" go_build -tags osusergo -o "$dir/cilium-agent" "$mod/daemon") ||
		{ fail="go build $mod/daemon"; return 1; }
	# vet and test build with the agent build's flags (-trimpath, -tags
	# osusergo), so they reuse the packages it compiled: with other flags a
	# cold run compiled every dependency twice.
	local bflags=(-trimpath -tags osusergo)
	# go test's own vet pass is off: Go 1.26's printf check fails stock
	# 1.18.8's pkg/endpoint (bpf.go:598, code no patch touches). The
	# checks' go vet runs on every touched package and counts what is on
	# the patches' lines (scripts/cilium-patch-checks.sh).
	# Cilium's own offline checks of the touched files (precheck's scripts,
	# custom vet and lint, go vet, golangci-lint, the cmdref).
	checks "$dir" "$version" || return 1
	(cd "$dir/mod" && step test "$dir" env CGO_ENABLED=0 GOFLAGS=-mod=mod "$GO" test "${bflags[@]}" -vet=off -count=1 -p 1 -timeout 30m "${pkgs[@]}") ||
		{ fail="go test"; return 1; }
	tested=${#pkgs[@]}
	# Cilium's privileged tests (TestPrivileged*, PRIVILEGED_TESTS set) that
	# the patches add, as root: the delegate's trust checks against a real
	# root socket and a peer of another uid; the coalesced scrub's walk
	# against one walk per endpoint on real CT and NAT maps (named *_test).
	# Only those: the touched packages' own privileged tests create and
	# pin BPF maps of their own.
	local ptests=() ppkgs=()
	mapfile -t ptests < <(git -C "$dir/src" diff base HEAD -- '*_test.go' | sed -n 's/^+func \(TestPrivileged[A-Za-z0-9_]*\)(.*/\1/p' | sort -u)
	mapfile -t ppkgs < <(git -C "$dir/src" diff --name-only base HEAD -- '*_test.go' |
		while read -r f; do git -C "$dir/src" diff base HEAD -- "$f" | grep -q '^+func TestPrivileged' && echo "$mod/$(dirname "$f")"; done | sort -u)
	privileged="not run (not root)"
	[[ ${#ptests[@]} -eq 0 ]] && privileged="none (the series adds none)"
	if [[ ${#ptests[@]} -gt 0 && $(id -u) -eq 0 ]]; then
		(cd "$dir/mod" && step privileged "$dir" env CGO_ENABLED=0 GOFLAGS=-mod=mod PRIVILEGED_TESTS=1 "$GO" test "${bflags[@]}" -vet=off -count=1 -v -run "^($(IFS='|'; echo "${ptests[*]}"))\$" "${ppkgs[@]}") ||
			{ fail="go test of the privileged tests"; return 1; }
		privileged="passed ($(grep -c '^--- PASS: TestPrivileged' "$dir/privileged.log") of ${#ptests[@]}: ${ptests[*]})"
		[[ $(grep -c '^--- PASS: TestPrivileged' "$dir/privileged.log") -eq ${#ptests[@]} ]] ||
			{ fail="privileged tests: $(grep -c '^--- PASS: TestPrivileged' "$dir/privileged.log") of ${#ptests[@]} passed (skipped?)"; return 1; }
	fi
}

summary=() failed=0
for name in "${runs[@]}"; do
	start=$(date +%s) fail= npatches=0 tested=0 privileged= checks_ok= selftest_ok=
	[[ -n ${CILIUM_PATCH_SELFTEST:-} ]] || selftest_ok="selftest not run"
	log "Cilium ${name##*v}: applying $PATCHES/$name, building the agent, testing the packages the patches touch"
	if test_series "$name"; then
		line="cilium-patch-test $name: PASS ($npatches patches applied, cilium-agent built, go test of $tested packages passed; privileged tests the series adds: $privileged; $checks_ok; $selftest_ok) in $(($(date +%s) - start))s"
		[[ -f $PWORK/$name/test.log ]] && grep -E '^(ok|FAIL|---)' "$PWORK/$name/test.log" | sed 's/^/  /' >&2
		[[ -f $PWORK/$name/privileged.log ]] && grep -E '^(ok|FAIL|--- )' "$PWORK/$name/privileged.log" | sed 's/^/  /' >&2
	else
		failed=1
		line="cilium-patch-test $name: FAIL at: $fail, after $(($(date +%s) - start))s (logs: $PWORK/$name/*.log)"
	fi
	echo "$line" >&2
	summary+=("$line")
done
printf '%s\n' "${summary[@]}"
exit "$failed"
