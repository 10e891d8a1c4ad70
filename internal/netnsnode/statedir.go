package netnsnode

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// scrubd's state file (the attachments it indexes, a journal line per ADD
// and DEL) belongs on a tmpfs, as on a real node: the DaemonSet keeps it
// under /run/ctscrub, and /run is a tmpfs on every distribution a
// Kubernetes node runs. This VM's /run is on its ext4 root instead, where
// the journal's fsync cost 2.5–8 ms per ADD and DEL. So the demo, the soak
// and bench-cni put it in WorkDir when that is on a tmpfs, else on a tmpfs
// of their own mounted at stateDirPath(); STATE_DIR=dir overrides (to
// measure another file system).

// stateDirPath is where the demo mounts its own tmpfs when WorkDir is not on
// one; beside WorkDir, not in it, so removing WorkDir never meets a mount.
func stateDirPath() string { return WorkDir + "-state" }

// isTmpfs reports whether dir is on a tmpfs.
func isTmpfs(dir string) bool {
	var st unix.Statfs_t
	return unix.Statfs(dir, &st) == nil && st.Type == unix.TMPFS_MAGIC
}

// prepareStateDir returns the directory for scrubd's state file and the
// kind of file system it is on, mounting a tmpfs when needed (its unmount
// pushed on c).
func prepareStateDir(c *Cleanup) (dir, fs string, err error) {
	if d := os.Getenv("STATE_DIR"); d != "" {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return "", "", fmt.Errorf("STATE_DIR %s: %w", d, err)
		}
		return d, fsName(d), nil
	}
	if isTmpfs(WorkDir) {
		return WorkDir, "tmpfs", nil
	}
	dir = stateDirPath()
	if isTmpfs(dir) {
		return dir, "tmpfs", nil // mounted by this run (a restarted scrubd)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", "", err
	}
	if err := unix.Mount("tmpfs", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "mode=0700"); err != nil {
		os.Remove(dir)
		return "", "", fmt.Errorf("mount a tmpfs for scrubd's state at %s: %w (or set STATE_DIR)", dir, err)
	}
	c.Push("unmount "+dir, func() error { return removeStateDir(dir) })
	return dir, "tmpfs", nil
}

// removeStateDir unmounts and removes the demo's own state tmpfs.
func removeStateDir(dir string) error {
	if err := unix.Unmount(dir, 0); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("unmount %s: %w", dir, err)
	}
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	return nil
}

func fsName(dir string) string {
	if isTmpfs(dir) {
		return "tmpfs"
	}
	var st unix.Statfs_t
	if unix.Statfs(dir, &st) != nil {
		return "unknown"
	}
	if st.Type == unix.EXT4_SUPER_MAGIC {
		return "ext4"
	}
	return fmt.Sprintf("0x%x", st.Type)
}
