// Package netnsid tells network namespaces apart by path: a namespace's
// identity is the device and inode of its nsfs file, whatever path names it
// (/proc/PID/ns/net, a bind mount under /var/run/netns).
package netnsid

import "golang.org/x/sys/unix"

// ID is a namespace's nsfs device and inode.
type ID struct{ Dev, Ino uint64 }

// Of stats path.
func Of(path string) (ID, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return ID{}, err
	}
	return ID{Dev: uint64(st.Dev), Ino: st.Ino}, nil
}

// Self is the calling process's network namespace (its main thread's; a
// thread that entered another namespace is not seen).
func Self() (ID, error) { return Of("/proc/self/ns/net") }
