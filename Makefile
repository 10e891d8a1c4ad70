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
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*## "}{printf "  %-16s %s\n", $$1, $$2}'

.PHONY: build
build: ## Build scrubd and the ctscrub CNI plugin into bin/
	@mkdir -p $(BIN)
	CGO_ENABLED=0 $(GO) build -o $(BIN)/scrubd ./scrubd
	CGO_ENABLED=0 $(GO) build -o $(BIN)/ctscrub ./plugin

.PHONY: generate
generate: ## Regenerate bpf/*_bpfel.{go,o} with the pinned clang ($(BPF_CLANG))
	cd bpf && $(GO) generate ./...

.PHONY: check-generate
check-generate: ## Fail if the committed BPF objects are stale (needs $(BPF_CLANG))
	@if ! command -v $(BPF_CLANG) >/dev/null; then echo "check-generate: $(BPF_CLANG) not installed, skipped"; exit 0; fi; \
	$(MAKE) --no-print-directory generate >/dev/null && \
	if ! git diff --quiet -- bpf/; then git diff --stat -- bpf/; echo "bpf/: generated files are stale; run 'make generate' and commit"; exit 1; fi; \
	echo "check-generate: bpf/ generated files are current"

.PHONY: setup
setup: ## Install what the tests and demo need (apt packages, bpffs); root
	./scripts/setup.sh

.PHONY: test
# -p 1: one test package at a time. Several packages run BPF passes over
# millions of entries; a pass holds its CPU in the kernel (this kernel does not
# preempt it), so two packages' passes at once on a 2-CPU machine can starve
# the goroutines a test needs to cancel a pass or answer in time.
test: setup ## Set up (scripts/setup.sh) and run every test (root: real BPF, namespaces, containerd)
	$(GO) vet ./...
	$(GO) test -count=1 -p 1 -timeout 25m ./...

.PHONY: fuzz
fuzz: ## Short fuzz runs of the parsers
	$(GO) test ./plugin -run '^$$' -fuzz FuzzParseConfig -fuzztime 20s

.PHONY: demo
demo: build ## Demo node: netns pods through the real CNI chain, CT maps, scrubs (ENTRIES, default 1M)
	./scripts/demo.sh

.PHONY: bench
bench: ## Index scrub vs NextKey walk vs batch walk vs sweep (ENTRIES, PER_IP)
	$(GO) run ./bench/core

.PHONY: bench-incident
bench-incident: ## 50 concurrent pod scrubs through scrubd vs Cilium 1.16's serial walks
	$(GO) run ./bench/incident

.PHONY: bench-nfct
bench-nfct: ## nf_conntrack: conntrack -D, DeleteFilters, filtered flush, index scrub
	$(GO) run ./bench/nfct

.PHONY: bench-expiry
bench-expiry: ## Expiry pass vs Cilium's NextKey and batch GC
	$(GO) run ./bench/expiry

.PHONY: e2e-kind
e2e-kind: ## Kind cluster, real Cilium (CILIUM_VERSION, default 1.18.8), ctscrub by its chart; 40+ min cold (docs/kind.md); root
	./e2e/kind/run.sh

.PHONY: clean
clean: ## Remove build output
	rm -rf $(BIN)
