package daemon

import (
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/scrubd/api"
)

// nsID is a network namespace's identity: the device and inode of its nsfs
// file, whatever path names it (/proc/PID/ns/net, a bind mount under
// /var/run/netns).
type nsID struct{ dev, ino uint64 }

func netnsID(path string) (nsID, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return nsID{}, err
	}
	return nsID{dev: st.Dev, ino: st.Ino}, nil
}

// checkPodNetns refuses an index start whose netns is scrubd's own: with
// hostNetwork (conf/daemonset.yaml) that is the node's, and the recorder
// would put its filters on the node's interface of that name. A runtime
// that hands the node's namespace as CNI_NETNS is misconfigured; the CNI
// library's skel checks the same thing against the plugin's namespace, but
// only after the plugin's ADD has done its work, and the plugin skips that
// check (plugin/main.go) since this one runs before anything is attached.
// A path that cannot be read is left to the attach, which says why.
func (d *Daemon) checkPodNetns(path string) *api.Error {
	if d.ownNetns == (nsID{}) {
		return nil
	}
	id, err := netnsID(path)
	if err != nil || id != d.ownNetns {
		return nil
	}
	return &api.Error{Code: api.CodeBadRequest, Message: fmt.Sprintf(
		"netns %s is scrubd's own network namespace (the node's): CNI_NETNS must be the pod's; nothing attached (is the runtime passing the host's namespace?)", path)}
}
