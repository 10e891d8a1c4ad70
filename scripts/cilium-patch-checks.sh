# Cilium's own offline checks of a patched copy of its module source, for
# scripts/cilium-patch-test.sh (sourced, not run; needs lib.sh's GO, log,
# and the test script's step). What Cilium's CI runs on a pull request
# (`make precheck`, `make custom-lint`, `make govet`, golangci-lint with
# .golangci.yaml, Documentation's check-cmdref.sh) that can run here without
# Docker or network beyond the Go module proxy, on the files the patches
# touch; docs/upstream-delegate.md lists what is not run and why.
#
# checks DIR VERSION: DIR holds src (the patched tree, a git repository with
# the tag base at the stock source), mod (the module the agent was built in)
# and cilium-agent. Sets the global checks_ok (what passed, for the summary
# line) or fail (what failed); returns 1 on a failure. Each check's output
# is in DIR/check-<name>.log.
#
# CILIUM_PATCH_SELFTEST=1: after every check passed, break the patched tree
# once per check (a commit on top of the series that a reviewer at Cilium
# would reject for that check's reason), run that check alone, and fail the
# series unless it fails; the tree is reset to the series afterwards. Sets
# selftest_ok. The breaks are in selftest_break below.

# The shell checks of Cilium's contrib/scripts that `make precheck` runs and
# that run offline on the tree (each greps or formats the whole tree, as in
# Cilium's CI; all pass on the stock trees of 1.18.8 and 1.20.2). Those of a
# version that lacks them are left out (check-go-test-tags.sh is 1.20's,
# check-test-tags.sh 1.18's, check-fuzz.sh 1.20's).
CHECK_SCRIPTS=(check-fmt check-log-newlines lock-check check-viper check-time check-go-test-tags check-test-tags check-fuzz check-preflight-clusterrole)

# Where golangci-lint binaries are kept between runs, one per version
# (built from the Go module proxy on first use).
CILIUM_TOOLS=${CILIUM_PATCH_TOOLS:-/var/tmp/ctscrub-cilium-tools}

# The tools of Cilium's source tree and the module its custom vet runs
# (Cilium's go.mod `tool` directive), as packages the module of DIR/mod must
# resolve: cilium_module adds them to CILIUM_MODULE_PKGS.
check_tool_pkgs() {
	local src=$1 t
	for t in slogloggercheck metricslint statedblint; do
		[[ -d $src/tools/$t ]] && echo "github.com/cilium/cilium/tools/$t"
	done
	grep -q 'github.com/cilium/linters' "$src/go.mod" && echo github.com/cilium/linters
}

# changed_lines SRC: "file:line" for every line the patches add or change,
# the lines a diagnostic must be on to be the patches' own.
changed_lines() {
	git -C "$1" diff -U0 base HEAD -- '*.go' | awk '
		/^\+\+\+ b\// {f = substr($0, 7); next}
		/^@@/ {
			split($3, a, ","); start = substr(a[1], 2); n = (a[2] == "" ? 1 : a[2])
			for (i = 0; i < n; i++) print f ":" start + i
		}'
}

# own_diagnostics SRC LOG: the lines of LOG (go vet's or golangci-lint's
# "path:line:col: message") on a line the patches changed; a diagnostic of
# code no patch changed is stock Cilium's, not the series'.
own_diagnostics() {
	local src=$1 log=$2
	awk -v src="$src/" 'NR == FNR {own[$0] = 1; next}
		match($0, /^[^ :]*\.go:[0-9]+:/) {
			loc = substr($0, RSTART, RLENGTH - 1); sub("^" src, "", loc); sub(/^\.\.\/src\//, "", loc)
			sub(/^github\.com\/cilium\/cilium\//, "", loc)
			if (loc in own) print
		}' <(changed_lines "$src") "$log"
}

# golangci_lint SRC: the path of the golangci-lint Cilium SRC pins
# (GOLANGCILINT_WANT_VERSION in Makefile.defs), built on first use.
golangci_lint() {
	local want bin
	want=$(awk '$1 == "GOLANGCILINT_WANT_VERSION" {print $3}' "$1/Makefile.defs")
	[[ -n $want ]] || return 1
	bin=$CILIUM_TOOLS/golangci-lint-$want
	if [[ ! -x $bin ]]; then
		mkdir -p "$CILIUM_TOOLS/gobin-$want" &&
			(cd / && GOBIN=$CILIUM_TOOLS/gobin-$want CGO_ENABLED=0 "$GO" install "github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$want") >&2 &&
			mv "$CILIUM_TOOLS/gobin-$want/golangci-lint" "$bin" || return 1
	fi
	echo "$bin"
}

# run_check DIR NAME: run the check NAME on DIR/src, output in
# DIR/check-NAME.log; 0 if it passed.
run_check() {
	local dir=$1 name=$2 src=$1/src pkgs=() out rc
	mapfile -t pkgs < <(git -C "$src" diff --name-only base HEAD -- '*.go' | xargs -r -n1 dirname | sort -u | sed "s|^|github.com/cilium/cilium/|")
	local env=(env CGO_ENABLED=0 "GOFLAGS=-mod=mod -tags=osusergo -trimpath")
	case $name in
	check-*|lock-check)
		(cd "$src" && GO=$GO bash "contrib/scripts/$name.sh") >"$dir/check-$name.log" 2>&1 ;;
	slogloggercheck)
		# `go run ./tools/slogloggercheck .` in Cilium's precheck: the whole tree.
		(cd "$dir/mod" && "${env[@]}" "$GO" run github.com/cilium/cilium/tools/slogloggercheck "$src") >"$dir/check-$name.log" 2>&1 ;;
	custom-vet)
		# contrib/scripts/custom-vet-check.sh: `go tool github.com/cilium/linters
		# -ioreadall.ignore safeio ./...`, here on the touched packages.
		(cd "$dir/mod" && "${env[@]}" "$GO" run github.com/cilium/linters -ioreadall.ignore safeio "${pkgs[@]}") >"$dir/check-$name.log" 2>&1 ;;
	metricslint|statedblint)
		# `make custom-lint`'s metrics-lint and statedb-lint: tools/<name>
		# on ./..., here on the touched packages.
		(cd "$dir/mod" && "${env[@]}" "$GO" run "github.com/cilium/cilium/tools/$name" "${pkgs[@]}") >"$dir/check-$name.log" 2>&1 ;;
	go-vet)
		# `make govet` (plain go vet); fails on a diagnostic on a line the
		# patches changed. Stock 1.18.8's pkg/endpoint fails Go 1.26's
		# printf check (bpf.go:598), code no patch touches: such
		# diagnostics are listed in the log, not counted.
		(cd "$dir/mod" && "${env[@]}" "$GO" vet "${pkgs[@]}") >"$dir/check-$name.log" 2>&1
		rc=$?
		[[ $rc -eq 0 ]] && return 0
		out=$(own_diagnostics "$src" "$dir/check-$name.log")
		if [[ -z $out ]] && grep -qE '^[^ :]*\.go:[0-9]+:' "$dir/check-$name.log"; then
			vet_stock=$(grep -cE '^[^ :]*\.go:[0-9]+:' "$dir/check-$name.log")
			return 0
		fi
		[[ -n $out ]] && printf 'diagnostics on lines the patches changed:\n%s\n' "$out" >>"$dir/check-$name.log"
		return 1 ;;
	golangci-lint)
		# Cilium's .golangci.yaml, with the version Cilium pins, on the
		# touched packages (their tests included, as the config says); an
		# issue counts on a line the patches changed (the rest is stock).
		# golangci-lint takes directories, not import paths: those of the
		# touched packages in the patched tree (the module in DIR/mod
		# replaces github.com/cilium/cilium with it).
		local bin dirs=()
		mapfile -t dirs < <(git -C "$src" diff --name-only base HEAD -- '*.go' | xargs -r -n1 dirname | sort -u | sed "s|^|../src/|")
		bin=$(golangci_lint "$src" 2>"$dir/check-$name.log") || { echo "building golangci-lint failed" >>"$dir/check-$name.log"; return 1; }
		lint_version=$("$bin" version --short 2>/dev/null)
		(cd "$dir/mod" && "${env[@]}" GOLANGCI_LINT_CACHE=$CILIUM_TOOLS/golangci-cache "$bin" run --config "$src/.golangci.yaml" \
			--modules-download-mode=mod --build-tags osusergo --max-issues-per-linter 0 --max-same-issues 0 \
			--output.text.path stdout --show-stats=false "${dirs[@]}") >>"$dir/check-$name.log" 2>&1
		rc=$?
		[[ $rc -eq 0 ]] && return 0
		out=$(own_diagnostics "$src" "$dir/check-$name.log")
		if [[ -z $out ]] && grep -qE '^[^ :]*\.go:[0-9]+:' "$dir/check-$name.log"; then
			lint_stock=$(grep -cE '^[^ :]*\.go:[0-9]+:' "$dir/check-$name.log")
			return 0
		fi
		[[ -n $out ]] && printf 'issues on lines the patches changed:\n%s\n' "$out" >>"$dir/check-$name.log"
		return 1 ;;
	cmdref)
		# Documentation/check-cmdref.sh after update-cmdref.sh, for the
		# agent (the only binary the series change): regenerate
		# Documentation/cmdref/cilium-agent*.md with the agent built
		# from the patched tree and compare with the tree's.
		rm -rf "$dir/cmdref" && mkdir -p "$dir/cmdref" &&
			"$dir/cilium-agent" cmdref "$dir/cmdref" >"$dir/check-$name.log" 2>&1 || return 1
		local f rc=0
		diff <(cd "$src/Documentation/cmdref" && ls cilium-agent*.md) <(cd "$dir/cmdref" && ls) >>"$dir/check-$name.log" 2>&1 || rc=1
		for f in "$dir"/cmdref/*.md; do
			diff -u "$src/Documentation/cmdref/${f##*/}" "$f" >>"$dir/check-$name.log" 2>&1 || rc=1
		done
		[[ $rc -eq 0 ]] || echo "HINT: Documentation/cmdref is stale: run cilium-agent cmdref Documentation/cmdref (make -C Documentation update-cmdref)" >>"$dir/check-$name.log"
		return $rc ;;
	helm-docs)
		# What Cilium's CI regenerates from the chart's values and compares
		# (tests-smoke's `make -C install/kubernetes`, Documentation's
		# check-helmvalues.sh): the chart's README.md (helm-docs) and
		# Documentation/helm-values.rst (helm-docs, awk, m2r2, sed, as
		# Documentation/Makefile's update-helm-values does), made in a copy
		# and compared with the tree's. m2r2 is on PyPI, which this machine
		# cannot reach: Debian's m2r (scripts/setup.sh) gives the same
		# helm-values.rst on stock 1.18.8 and 1.20.2.
		local hd h=$dir/helm rc=0
		hd=$(helm_docs) || { echo "building helm-docs failed" >"$dir/check-$name.log"; return 1; }
		command -v m2r >/dev/null || { echo "m2r not installed (apt-get install m2r; scripts/setup.sh)" >"$dir/check-$name.log"; return 1; }
		rm -rf "$h" && mkdir -p "$h/Documentation" && cp -a "$src/install" "$h/" &&
			cp "$src/Documentation/helm-values.tmp.tmpl" "$h/Documentation/" || return 1
		(cd "$h/install/kubernetes" && "$hd" --log-level warning) >"$dir/check-$name.log" 2>&1 || return 1
		(cd "$h/Documentation" &&
			"$hd" -d -c ../install/kubernetes -t "$PWD/helm-values.tmp.tmpl" >helm-values.tmp 2>/dev/null &&
			awk -F'|' '{print "|"$2"|"$5"|"$3"|"$4"|"}' helm-values.tmp >helm-values.awk &&
			m2r --overwrite helm-values.awk &&
			sed 's/^\(   \* - \)\([[:print:]]\{1,\}\)$/\1:spelling:ignore:`\2`/' helm-values.rst >helm-values.sed &&
			printf '..\n  %s\n\n%s\n' "AUTO-GENERATED. Please DO NOT edit manually." "$(cat helm-values.sed)" >helm-values.rst) >>"$dir/check-$name.log" 2>&1 || return 1
		diff -u "$src/install/kubernetes/cilium/README.md" "$h/install/kubernetes/cilium/README.md" >>"$dir/check-$name.log" 2>&1 || rc=1
		diff -u "$src/Documentation/helm-values.rst" "$h/Documentation/helm-values.rst" >>"$dir/check-$name.log" 2>&1 || rc=1
		[[ $rc -eq 0 ]] || echo "HINT: the chart's README.md or Documentation/helm-values.rst is stale: make -C install/kubernetes docs; make -C Documentation update-helm-values" >>"$dir/check-$name.log"
		return $rc ;;
	*) echo "unknown check $name" >"$dir/check-$name.log"; return 1 ;;
	esac
}

# helm_docs: the path of helm-docs (HELM_DOCS_VERSION), built on first use.
HELM_DOCS_VERSION=v1.14.2
helm_docs() {
	local bin=$CILIUM_TOOLS/helm-docs-$HELM_DOCS_VERSION
	if [[ ! -x $bin ]]; then
		mkdir -p "$CILIUM_TOOLS/gobin-helm-docs" &&
			(cd / && GOBIN=$CILIUM_TOOLS/gobin-helm-docs CGO_ENABLED=0 "$GO" install "github.com/norwoodj/helm-docs/cmd/helm-docs@$HELM_DOCS_VERSION") >&2 &&
			mv "$CILIUM_TOOLS/gobin-helm-docs/helm-docs" "$bin" || return 1
	fi
	echo "$bin"
}

# check_names SRC: the checks that apply to the version in SRC.
check_names() {
	local src=$1 c
	for c in "${CHECK_SCRIPTS[@]}"; do [[ -f $src/contrib/scripts/$c.sh ]] && echo "$c"; done
	[[ -d $src/tools/slogloggercheck ]] && echo slogloggercheck
	grep -q 'github.com/cilium/linters' "$src/go.mod" && echo custom-vet
	[[ -d $src/tools/metricslint ]] && echo metricslint
	[[ -d $src/tools/statedblint ]] && echo statedblint
	echo go-vet
	echo golangci-lint
	echo cmdref
	echo helm-docs
}

checks() {
	local dir=$1 version=$2 src=$1/src names=() n start passed=() t
	vet_stock=0 lint_stock=0 lint_version=
	mapfile -t names < <(check_names "$src")
	for n in "${names[@]}"; do
		start=$(date +%s)
		if ! run_check "$dir" "$n"; then
			tail -n 40 "$dir/check-$n.log" >&2
			fail="Cilium's check $n (log: $dir/check-$n.log)"
			return 1
		fi
		t=$(($(date +%s) - start))
		case $n in
		go-vet) [[ $vet_stock -gt 0 ]] && n="go-vet ($vet_stock stock diagnostics off the patches' lines)" ;;
		golangci-lint) n="golangci-lint $lint_version (${t}s)"; [[ $lint_stock -gt 0 ]] && n="golangci-lint $lint_version (${t}s, $lint_stock stock issues off the patches' lines)" ;;
		esac
		passed+=("$n")
	done
	checks_ok="Cilium's checks passed: $(IFS=,; echo "${passed[*]}" | sed 's/,/, /g')"
	[[ -n ${CILIUM_PATCH_SELFTEST:-} ]] || return 0
	selftest "$dir" "${names[@]}"
}

# selftest_break SRC NAME: change the patched tree so that NAME must fail,
# as a patch could: in the first non-test .go file the patches add or
# change (a new file beside it for what needs one).
selftest_break() {
	local src=$1 name=$2 f d pkg
	f=$(git -C "$src" diff --name-only --diff-filter=AM base HEAD -- '*.go' | grep -v '_test\.go$' | head -1)
	d=$(dirname "$f") pkg=$(awk '/^package /{print $2; exit}' "$src/$f")
	case $name in
	check-fmt) printf '\nvar  selftestFmt=1\n' >>"$src/$f" ;;
	check-log-newlines) printf '\nfunc selftestLog() { log.Info("selftest\\n") }\n' >>"$src/$f" ;;
	lock-check) printf '\nvar selftestLock sync.Mutex\n' >>"$src/$f" ;;
	check-viper) printf '\nvar selftestViper = viper.GetString("selftest")\n' >>"$src/$f" ;;
	check-time)
		# The stdlib time package in a non-test file (Cilium wants pkg/time).
		printf '// SPDX-License-Identifier: Apache-2.0\n// Copyright Authors of Cilium\n\npackage %s\n\nimport (\n\t"time"\n)\n\nvar selftestTime = time.Second\n' "$pkg" >"$src/$d/selftest_time.go" ;;
	check-go-test-tags|check-test-tags)
		printf '//go:build privileged_tests\n\npackage %s\n' "$pkg" >"$src/$d/selftest_tags_test.go" ;;
	check-fuzz)
		printf '// SPDX-License-Identifier: Apache-2.0\n// Copyright Authors of Cilium\n\npackage %s\n\nimport "testing"\n\nfunc FuzzSelftest(f *testing.F) {}\n' "$pkg" >"$src/$d/selftest_test.go" ;;
	check-preflight-clusterrole)
		printf '# selftest\n' >>"$src/install/kubernetes/cilium/templates/cilium-agent/clusterrole.yaml" ;;
	slogloggercheck)
		# The default slog logger without the comment that justifies it.
		printf '// SPDX-License-Identifier: Apache-2.0\n// Copyright Authors of Cilium\n\npackage %s\n\nimport "github.com/cilium/cilium/pkg/logging"\n\nvar selftestLogger = logging.DefaultSlogLogger\n' "$pkg" >"$src/$d/selftest_slog.go" ;;
	custom-vet)
		# io.ReadAll of an unbounded reader (Cilium's ioreadall linter).
		printf '// SPDX-License-Identifier: Apache-2.0\n// Copyright Authors of Cilium\n\npackage %s\n\nimport (\n\t"io"\n\t"os"\n)\n\nfunc selftestReadAll() ([]byte, error) { return io.ReadAll(os.Stdin) }\n' "$pkg" >"$src/$d/selftest_vet.go" ;;
	metricslint)
		# WithLabelValues with more values than the vector has labels.
		printf '// SPDX-License-Identifier: Apache-2.0\n// Copyright Authors of Cilium\n\npackage %s\n\nimport "github.com/cilium/cilium/pkg/metrics/metric"\n\ntype selftestMetrics struct{ Walks metric.Vec[metric.Counter] }\n\nvar selftestM = selftestMetrics{Walks: metric.NewCounterVec(metric.CounterOpts{Name: "selftest_total"}, []string{"event"})}\n\nfunc selftestMetric() { selftestM.Walks.WithLabelValues("create", "extra").Inc() }\n' "$pkg" >"$src/$d/selftest_metric.go" ;;
	statedblint)
		return 2 ;; # no break written: the series uses no StateDB table
	go-vet)
		printf '// SPDX-License-Identifier: Apache-2.0\n// Copyright Authors of Cilium\n\npackage %s\n\nimport "fmt"\n\nvar selftestVet = fmt.Sprintf("%%d", "not a number")\n' "$pkg" >"$src/$d/selftest_vet.go" ;;
	golangci-lint)
		# No SPDX header (goheader) and math/rand (depguard).
		printf 'package %s\n\nimport "math/rand"\n\nvar selftestRand = rand.Int()\n' "$pkg" >"$src/$d/selftest_lint.go" ;;
	helm-docs)
		# A value's comment changed without the docs regenerated.
		sed -i '0,/^# -- /s/^# -- /# -- Selftest: /' "$src/install/kubernetes/cilium/values.yaml" ;;
	cmdref)
		# A flag's help changed without Documentation/cmdref: change the
		# text of the cmdref instead, which the check must see as stale.
		sed -i '0,/^      --/s/^      --/      --selftest-stale /' "$src/Documentation/cmdref/cilium-agent.md" ;;
	*) return 2 ;;
	esac
	git -C "$src" add -A && git -C "$src" -c user.name=selftest -c user.email=selftest@localhost commit -qm "selftest: break $name"
}

selftest() {
	local dir=$1 n caught=() skipped=() src=$1/src
	shift
	for n in "$@"; do
		selftest_break "$src" "$n"
		case $? in
		0) ;;
		2) skipped+=("$n"); continue ;;
		*) fail="selftest: breaking the tree for $n"; return 1 ;;
		esac
		# go vet and golangci-lint count only what is on the patches'
		# lines: the break is, since base..HEAD now includes it.
		if run_check "$dir" "$n"; then
			git -C "$src" reset -q --hard HEAD~1
			fail="selftest: $n passed on a tree broken for it (log: $dir/check-$n.log)"
			return 1
		fi
		cp "$dir/check-$n.log" "$dir/selftest-$n.log"
		caught+=("$n")
		git -C "$src" reset -q --hard HEAD~1 || { fail="selftest: resetting the tree after $n"; return 1; }
	done
	# The tree is the series' again: the cmdref check's own output and
	# the checks' logs are rewritten by the test and the next run.
	selftest_ok="selftest: ${#caught[@]} of $# checks failed on a tree broken for them"
	[[ ${#skipped[@]} -gt 0 ]] && selftest_ok+=" (no break for: ${skipped[*]})"
	return 0
}
