# ctscrub. Run `make help` for the list of targets. Most targets need root
# (BPF, network namespaces); `.ci/run` is what CI runs.
SHELL := /bin/bash
GO ?= go
# The clang that regenerates bpf/*_bpfel.{go,o}. Pinned: another clang emits
# different objects and CI's staleness check would fail.
BPF_CLANG ?= clang-19
BPF_STRIP ?= llvm-strip-19
BPF_CFLAGS ?= -O2 -g -Wall -Werror -I/usr/include/x86_64-linux-gnu
export BPF2GO_CC := $(BPF_CLANG)
export BPF2GO_STRIP := $(BPF_STRIP)
export BPF2GO_CFLAGS := $(BPF_CFLAGS)

ENTRIES ?=
PER_IP ?=
export ENTRIES PER_IP

BIN := bin

.PHONY: help
help: ## List every target
	@grep -hE '^[a-zA-Z0-9_.-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*## "}{printf "  %-18s %s\n", $$1, $$2}'

.PHONY: build
build: ## Build scrubd and the ctscrub CNI plugin into bin/
	@mkdir -p $(BIN)
	CGO_ENABLED=0 $(GO) build -o $(BIN)/scrubd ./scrubd
	CGO_ENABLED=0 $(GO) build -o $(BIN)/ctscrub ./plugin

.PHONY: generate
generate: ## Regenerate bpf/*_bpfel.{go,o} and the stand-in's (internal/testsupport/standin) with the pinned clang ($(BPF_CLANG))
	$(GO) generate ./bpf/ ./internal/testsupport/standin/

.PHONY: check-generate
check-generate: ## Fail if the committed BPF objects are stale (needs $(BPF_CLANG))
	@if ! command -v $(BPF_CLANG) >/dev/null; then \
		if [ "$${CI:-}" = true ]; then echo "check-generate: $(BPF_CLANG) not installed; CI must check the generated BPF files (scripts/setup.sh installs $(BPF_CLANG))"; exit 1; fi; \
		echo "check-generate: $(BPF_CLANG) not installed, skipped (fails under CI=true; install it with scripts/setup.sh)"; exit 0; fi; \
	$(MAKE) --no-print-directory generate >/dev/null && \
	if ! git diff --quiet -- bpf/ internal/testsupport/standin/ || [ -n "$$(git ls-files --others --exclude-standard -- bpf/ internal/testsupport/standin/)" ]; then git status --short -- bpf/ internal/testsupport/standin/; echo "generated BPF files are stale or uncommitted; run 'make generate' and commit"; exit 1; fi; \
	echo "check-generate: generated BPF files (bpf/, internal/testsupport/standin/) are current"

.PHONY: setup
setup: ## Install what the tests and demo need (apt packages, bpffs); root
	./scripts/setup.sh

.PHONY: test
# -p 1: one test package at a time. Several packages run BPF passes over
# millions of entries; a pass holds its CPU in the kernel (this kernel does not
# preempt it), so two packages' passes at once on a 2-CPU machine can starve
# the goroutines a test needs to cancel a pass or answer in time.
#
# go test -json through bin/testreport: the ordinary go test output as it
# comes, the JSON kept in bin/test-*.json, and every skipped test with its
# reason at the end; `make check-skips` then checks the skips against
# .ci/must-run.txt. pipefail: go test's exit code decides, as without the pipe.
TEST_JSON := $(BIN)/test-main.json $(BIN)/test-conformance.json
test: setup ## Set up (scripts/setup.sh) and run every test (root: real BPF, namespaces, containerd); lists the skipped tests
	@mkdir -p $(BIN) && rm -f $(TEST_JSON)
	CGO_ENABLED=0 $(GO) build -o $(BIN)/testreport ./internal/cmd/testreport
	$(GO) vet ./...
	set -o pipefail; $(GO) test -json -count=1 -p 1 -timeout 25m ./... | $(BIN)/testreport -json-out $(BIN)/test-main.json
	cd e2e/conformance && $(GO) vet ./... && set -o pipefail && CONFORMANCE_VERSIONS=default $(GO) test -json -count=1 -timeout 20m ./... | ../../$(BIN)/testreport -json-out ../../$(BIN)/test-conformance.json

.PHONY: check-skips
check-skips: ## Fail if a test .ci/must-run.txt says must run here skipped in the last make test (CI runs it)
	@CGO_ENABLED=0 $(GO) build -o $(BIN)/testreport ./internal/cmd/testreport
	$(BIN)/testreport -must-run .ci/must-run.txt $(TEST_JSON)

.PHONY: ciliumgc
ciliumgc: ## ctscrub's scrubs and expiry pass against Cilium's own scrub (ctmap GC + SNAT deletes) on the same maps, v1.18.8, v1.19.4, v1.20.2; root
	for d in e2e/ciliumgc/cilium-*/; do (cd $$d && $(GO) vet ./... && $(GO) test -count=1 -v ./...) || exit 1; done

.PHONY: conformance
conformance: ## Cilium's real datapath (every version in e2e/conformance Versions) against the recorder and index; root, clang-19
	cd e2e/conformance && $(GO) vet ./... && CONFORMANCE_VERSIONS=all $(GO) test -count=1 -v -run TestConformance -timeout 30m ./...

# Every fuzz target, as package:Target. Seed corpora (and inputs that once
# failed) are committed under each package's testdata/fuzz and run by
# `go test` as ordinary tests too.
FUZZ_TARGETS := plugin:FuzzParseConfig plugin:FuzzPrevResult scrubd/daemon:FuzzAPI \
	scrubd/recorder:FuzzParseRecord scrubd/nfct:FuzzNetlink scrubd/nfct:FuzzTupleRoundTrip \
	scrubd/ctmap:FuzzKeyCodec scrubd/ctmap:FuzzEntryCodec scrubd/client:FuzzReadAnswer
FUZZTIME ?= 20s

.PHONY: fuzz
fuzz: ## Fuzz every parser briefly (FUZZTIME each, default 20s)
	GO=$(GO) FUZZTIME=$(FUZZTIME) ./scripts/fuzz.sh $(FUZZ_TARGETS)

.PHONY: model
model: ## The ownership model walks, long: the rule 20 x MODEL_STEPS (50000), the real daemon 20 x MODEL_DAEMON_STEPS (500), the sweeper's leave walk 20 x MODEL_LEAVE_TRIALS (50) passes; make test runs 20 x 20000, 8 x 150 and 4 x 15; root
	$(GO) test -count=1 -v -run TestOwnershipModel ./scrubd/owner -model.steps $${MODEL_STEPS:-50000} -model.seeds 20
	$(GO) test -count=1 -v -timeout 60m -run TestOwnershipModelDaemon ./scrubd/daemon -model.daemon.steps $${MODEL_DAEMON_STEPS:-500} -model.daemon.seeds 20
	$(GO) test -count=1 -v -timeout 60m -run TestSweepLeaveModel ./scrubd/cilium -model.leave.trials $${MODEL_LEAVE_TRIALS:-50} -model.leave.seeds 20

.PHONY: demo
demo: build ## Demo node: netns pods through the real CNI chain, CT maps, scrubs (ENTRIES, default 1M)
	./scripts/demo.sh

.PHONY: soak
soak: build ## Churn and real faults on the demo's node (CYCLES, default 500; ENTRIES, default 4M; STARVE_S, default 60; CRI_EVERY, default 5; WARMUP_S, at most 420)
	CGO_ENABLED=0 $(GO) build -o $(BIN)/pause ./e2e/cri/pause
	$(GO) run ./e2e/soak

.PHONY: bench
bench: ## Index scrub vs NextKey walk vs batch walk vs sweep (ENTRIES, PER_IP)
	$(GO) run ./bench/core

.PHONY: bench-cni
bench-cni: build ## ctscrub plugin ADD/DEL as a runtime runs it vs bare exec and bridge (ENTRIES, default 16M; PAIRS, default 1000)
	$(GO) run ./bench/cni

.PHONY: bench-recorder
bench-recorder: ## Recorder: attach/detach cost, ns/packet hot and under a 10,000-flow mix of real packets (FLOWS, NEW_PER_S)
	$(GO) run ./bench/recorder

.PHONY: bench-incident
bench-incident: ## 50 concurrent pod scrubs through scrubd vs Cilium 1.16's serial walks
	$(GO) run ./bench/incident

.PHONY: bench-nfct
bench-nfct: ## nf_conntrack: conntrack -D, DeleteFilters, filtered flush, index scrub
	$(GO) run ./bench/nfct

.PHONY: bench-expiry
bench-expiry: ## Expiry pass vs Cilium's NextKey and batch GC
	$(GO) run ./bench/expiry

.PHONY: bench-remote-watch
bench-remote-watch: ## scrubd's EndpointSlice watch beside kube-proxy's on a one-node kind cluster: CPU, bytes, heap per event, extrapolated to PROJ_NODES (5000); root, ~10 min (docs/remote.md, Scale)
	./bench/remotewatch/run.sh

.PHONY: cilium-patch-test
cilium-patch-test: ## Apply each series in cilium/patches (delegate v*, coalesce coalesce-v*) to Cilium's module source, build the agent, run Cilium's offline checks (vet, lint, cmdref, Helm docs) and go test on what they touch (CILIUM_PATCH_SERIES, CILIUM_PATCH_VERSIONS, CILIUM_PATCH_SELFTEST=1; slow)
	./scripts/cilium-patch-test.sh

.PHONY: e2e-kind
e2e-kind: ## Kind cluster, real Cilium (CILIUM_VERSION, default 1.18.8), ctscrub by its chart; 30 min cold, 6 cached (docs/kind.md); root
	./e2e/kind/run.sh

.PHONY: e2e-kind-day2
e2e-kind-day2: ## Kind cluster with pods churning: node restart, scrubd OOM, ctscrub and Cilium (CILIUM_PREV_VERSION 1.17.6) upgrades (docs/kind.md, Day 2); root
	./e2e/kind/day2.sh

.PHONY: bench-cilium-node
bench-cilium-node: ## Real Cilium in kind: pods start/stop on a full CT table, stock, GC at 60 s, coalesced scrubs (patched agent), with ctscrub, ctscrub as the patched agent's delegate (ENTRIES, EXPIRED, PODS, VARIANTS; images from make e2e-kind and CILIUM_COALESCED=1 e2e/kind/images/cilium.sh)
	./bench/ciliumnode/run.sh

.PHONY: clean
clean: ## Remove build output
	rm -rf $(BIN)
