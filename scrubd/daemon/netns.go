package daemon

import (
	"fmt"

	"github.com/ctscrub/ctscrub/internal/netnsid"
	"github.com/ctscrub/ctscrub/scrubd/api"
)

// checkPodNetns refuses an index start whose netns is scrubd's own: with
// hostNetwork (conf/daemonset.yaml) that is the node's, and the recorder
// would put its filters on the node's interface of that name. A runtime
// that hands the node's namespace as CNI_NETNS is misconfigured. The
// plugin checks CNI_NETNS against its own namespace before an ADD
// (plugin/netns.go); this check also covers any other caller of the API.
// A path that cannot be read is left to the attach, which says why.
func (d *Daemon) checkPodNetns(path string) *api.Error {
	if d.ownNetns == (netnsid.ID{}) {
		return nil
	}
	id, err := netnsid.Of(path)
	if err != nil || id != d.ownNetns {
		return nil
	}
	return &api.Error{Code: api.CodeBadRequest, Message: fmt.Sprintf(
		"netns %s is scrubd's own network namespace (the node's): CNI_NETNS must be the pod's; nothing attached (is the runtime passing the host's namespace?)", path)}
}
