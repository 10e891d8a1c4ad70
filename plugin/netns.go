package main

import (
	"os"
	"strings"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/ctscrub/ctscrub/internal/netnsid"
)

// The CNI library's skel refuses an ADD or DEL whose CNI_NETNS is the
// plugin's own network namespace, after the plugin's function has run. It
// reads the namespace of the calling thread under runtime.LockOSThread,
// and a process's first LockOSThread starts one more OS thread: 0.4-1.1 ms
// of every ADD and DEL on this project's VM (docs/bench.md, session 7).
// ctscrub makes the same check with two stats instead (no goroutine of the
// plugin changes namespace, so the process's namespace is every thread's),
// before an ADD does anything, and turns skel's off. A runtime that sets
// CNI_NETNS_OVERRIDE itself ("1" or "true", as skel reads it) turns both
// off. scrubd refuses to attach in its own namespace too (the node's).
const netnsOverrideEnv = "CNI_NETNS_OVERRIDE"

// runtimeNetnsOverride is what the runtime set, read before main sets it.
var runtimeNetnsOverride = os.Getenv(netnsOverrideEnv)

// skipSkelNetnsCheck turns skel's check off; main calls it before skel
// reads the environment. Only ADD and DEL have the check (the first
// os.Setenv copies the environment into a map: no cost for the others).
func skipSkelNetnsCheck() {
	if c := os.Getenv("CNI_COMMAND"); c == "ADD" || c == "DEL" {
		os.Setenv(netnsOverrideEnv, "1")
	}
}

func netnsOverridden() bool {
	return strings.EqualFold(runtimeNetnsOverride, "true") || runtimeNetnsOverride == "1"
}

// checkNetns is skel's check: an error when netns names the plugin's own
// network namespace. A path that cannot be read is not an error here (a
// DEL's namespace may be gone already), as in skel.
func checkNetns(netns string) error {
	if netns == "" || netnsOverridden() {
		return nil
	}
	ns, err := netnsid.Of(netns)
	if err != nil {
		return nil
	}
	if self, err := netnsid.Self(); err == nil && ns == self {
		return types.NewError(types.ErrInvalidNetNS, "plugin's netns and netns from CNI_NETNS should not be the same", "")
	}
	return nil
}
