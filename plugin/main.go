// Command ctscrub is a chained CNI plugin. It runs after the plugin that gives
// the pod its IPs (Cilium's cilium-cni, or bridge + host-local) and hands the
// pod's IPs to scrubd: on ADD, scrub stale CT entries of the IP's previous
// owner and start indexing the pod's flows; on DEL, scrub the pod's entries
// and end its attachment (the recorder's filters stay until the runtime
// removes the interface, so the flows of that window are still indexed).
// CHECK, STATUS and GC ask scrubd too. `ctscrub install` and `ctscrub
// uninstall` put the plugin into a node's CNI config and take it, and the
// recorder's filters, out again. See plugin/README.md.
package main

import (
	"fmt"
	"io"
	"os"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/version"
)

// Version is the plugin's version, set at build time with
// -ldflags "-X main.Version=...".
var Version = "dev"

// supportedVersions are the CNI spec versions ctscrub speaks. CHECK needs
// 0.4.0+, STATUS and GC 1.1.0; skel refuses them below that.
var supportedVersions = version.PluginSupports("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")

// stdout and stderr are variables so tests can read what a command printed.
var (
	stdout io.Writer = os.Stdout
	stderr io.Writer = os.Stderr
)

func main() {
	if len(os.Args) > 1 && (os.Args[1] == "install" || os.Args[1] == "uninstall") {
		if err := runSubcommand(os.Args[1], os.Args[2:], os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, "ctscrub:", err)
			os.Exit(1)
		}
		return
	}
	skipSkelNetnsCheck() // ctscrub checks CNI_NETNS itself (netns.go)
	skel.PluginMainFuncs(skel.CNIFuncs{
		Add:    cmdAdd,
		Del:    cmdDel,
		Check:  cmdCheck,
		Status: cmdStatus,
		GC:     cmdGC,
	}, supportedVersions, "CNI plugin ctscrub "+Version)
	if os.Getenv("CNI_COMMAND") == "VERSION" {
		// The bare start's trace: exec and exit, to set beside ADD's and DEL's.
		newTrace("VERSION").print(nil)
	}
}
