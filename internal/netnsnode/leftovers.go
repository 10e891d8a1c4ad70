package netnsnode

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Fixed places, so a run can undo what an interrupted (SIGKILLed) one left.
var (
	WorkDir  = "/run/ctscrub-demo"
	BPFDir   = "/sys/fs/bpf/ctscrub-demo"
	lockPath = "/run/ctscrub-demo.lock"
)

// UseNames switches every name and place to prefix (before anything is
// created): `make soak` runs as "ctscrub-soak" beside a demo.
func UseNames(prefix string) {
	NamePrefix, NetName = prefix, prefix
	NodeNS, OutsideNS = prefix+"-node", prefix+"-outside"
	WorkDir, BPFDir, lockPath = "/run/"+prefix, "/sys/fs/bpf/"+prefix, "/run/"+prefix+".lock"
}

// Lock makes sure one demo (or test of this package, or a check for
// leftovers) runs at a time on the machine: they share names. It waits up to
// wait for a running one to end; closing the file releases it.
func Lock(wait time.Duration, w io.Writer) (*os.File, error) {
	f, err := os.OpenFile(lockPath, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	if syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) == nil {
		return f, nil
	}
	fmt.Fprintf(w, "Another ctscrub demo is running on this machine (%s is locked); waiting up to %s ...\n", lockPath, wait)
	deadline := time.Now().Add(wait)
	for time.Now().Before(deadline) {
		time.Sleep(200 * time.Millisecond)
		if syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) == nil {
			return f, nil
		}
	}
	f.Close()
	return nil, fmt.Errorf("another ctscrub demo is still running (%s is locked): wait for it or stop it", lockPath)
}

// RemoveLeftovers undoes what a previous run left when it could not clean up
// (SIGKILL, power loss). It reports what it removed on w.
func RemoveLeftovers(w io.Writer) error {
	var removed []string
	// The previous daemon, by the pid it wrote, only if it still is scrubd.
	if b, err := os.ReadFile(filepath.Join(WorkDir, "scrubd.pid")); err == nil {
		if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && pid > 1 {
			cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
			if strings.Contains(string(cmd), "scrubd") && strings.Contains(string(cmd), WorkDir) {
				_ = syscall.Kill(pid, syscall.SIGKILL)
				for i := 0; i < 50; i++ {
					if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); err != nil {
						break
					}
					time.Sleep(20 * time.Millisecond)
				}
				removed = append(removed, fmt.Sprintf("scrubd pid %d", pid))
			}
		}
	}
	entries, _ := os.ReadDir(NetnsDir)
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), NamePrefix+"-") {
			if err := RunIP("netns", "del", e.Name()); err != nil {
				return fmt.Errorf("remove leftover netns: %w", err)
			}
			removed = append(removed, "netns "+e.Name())
		}
	}
	if _, err := os.Stat(stateDirPath()); err == nil {
		if err := removeStateDir(stateDirPath()); err != nil {
			return fmt.Errorf("remove leftover %s: %w", stateDirPath(), err)
		}
		removed = append(removed, stateDirPath())
	}
	for _, d := range []string{BPFDir, WorkDir} {
		if _, err := os.Stat(d); err == nil {
			if err := os.RemoveAll(d); err != nil {
				return fmt.Errorf("remove leftover %s: %w", d, err)
			}
			removed = append(removed, d)
		}
	}
	if len(removed) > 0 {
		fmt.Fprintf(w, "Removed what an interrupted run left behind: %s\n\n", strings.Join(removed, ", "))
	}
	return nil
}

// Leftovers lists what the demo may leave on the machine that still exists;
// empty after a clean run. The CI test checks it.
func Leftovers() []string {
	var out []string
	entries, _ := os.ReadDir(NetnsDir)
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), NamePrefix+"-") {
			out = append(out, filepath.Join(NetnsDir, e.Name()))
		}
	}
	for _, d := range []string{BPFDir, WorkDir, stateDirPath()} {
		if _, err := os.Stat(d); err == nil {
			out = append(out, d)
		}
	}
	return out
}
