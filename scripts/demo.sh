#!/usr/bin/env bash
# `make demo`: sets the machine up (apt packages, bpffs), builds the demo and
# runs it. `make demo` has already built bin/scrubd and bin/ctscrub.
#
#   ENTRIES=N      CT entries to fill the maps with (default 1048576)
#   PER_IP=K       stale entries each reused IP's previous owner left (default 1000)
#   DEMO_SHORT=1   the quick run CI uses (65536 entries, fewer pods and flows)
#   DEMO_HOLD=1    keep the node up after the summary until Ctrl-C, to look around
#
# Everything the demo creates is removed at the end, also on Ctrl-C; see
# docs/demo.md.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=$PATH:/usr/local/go/bin

if [[ $EUID -ne 0 ]]; then
	echo "demo: run as root (BPF maps, network namespaces): sudo make demo" >&2
	exit 1
fi

./scripts/setup.sh
for b in bin/scrubd bin/ctscrub; do
	[[ -x $b ]] || { echo "demo: $b is missing: run 'make build' (make demo does it first)" >&2; exit 1; }
done
CGO_ENABLED=0 go build -o bin/ctscrub-demo ./e2e/demo
# exec: Ctrl-C and SIGTERM go straight to the demo, which cleans up.
exec ./bin/ctscrub-demo
