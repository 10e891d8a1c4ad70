package demo

import (
	"errors"
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
const (
	WorkDir  = "/run/ctscrub-demo"
	BPFDir   = "/sys/fs/bpf/ctscrub-demo"
	lockPath = "/run/ctscrub-demo.lock"
)

// lock makes sure one demo (or test of this package) runs at a time on the
// machine: they share names. It waits up to wait for a running one to end.
func lock(wait time.Duration, w io.Writer) (*os.File, error) {
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

// sysctl files the bridge plugin turns on (isGateway); the demo puts back
// what it found.
var forwardSysctls = []string{
	"/proc/sys/net/ipv4/ip_forward",
	"/proc/sys/net/ipv6/conf/all/forwarding",
}

// saveSysctls pushes the restore of the forwarding sysctls and, when
// stateFile is set, writes them there for a run after a crash.
func saveSysctls(c *Cleanup, stateFile string) error {
	saved := map[string]string{}
	for _, p := range forwardSysctls {
		v, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		saved[p] = strings.TrimSpace(string(v))
	}
	if stateFile != "" {
		var b strings.Builder
		for p, v := range saved {
			fmt.Fprintf(&b, "%s=%s\n", p, v)
		}
		if err := os.WriteFile(stateFile, []byte(b.String()), 0o600); err != nil {
			return err
		}
	}
	c.Push("restore ip_forward sysctls", func() error { return restoreSysctls(saved) })
	return nil
}

func restoreSysctls(saved map[string]string) error {
	var errs []error
	for p, v := range saved {
		cur, _ := os.ReadFile(p)
		if strings.TrimSpace(string(cur)) != v {
			errs = append(errs, os.WriteFile(p, []byte(v), 0o644))
		}
	}
	return errors.Join(errs...)
}

// removeLeftovers undoes what a previous run left when it could not clean up
// (SIGKILL, power loss). It reports what it removed on w.
func removeLeftovers(w io.Writer) error {
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
	entries, _ := os.ReadDir(netnsDir)
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), namePrefix+"-") {
			if err := ip("netns", "del", e.Name()); err != nil {
				return fmt.Errorf("remove leftover netns: %w", err)
			}
			removed = append(removed, "netns "+e.Name())
		}
	}
	for _, l := range []string{bridgeName, outsideVeth} {
		if _, err := os.Stat("/sys/class/net/" + l); err == nil {
			if err := delLink(l); err != nil {
				return fmt.Errorf("remove leftover link: %w", err)
			}
			removed = append(removed, "link "+l)
		}
	}
	if n, err := removeForwardRules(); err != nil {
		return fmt.Errorf("remove leftover FORWARD rules: %w", err)
	} else if n > 0 {
		removed = append(removed, fmt.Sprintf("%d FORWARD rules", n))
	}
	if b, err := os.ReadFile(filepath.Join(WorkDir, "sysctls")); err == nil {
		saved := map[string]string{}
		for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
			if p, v, ok := strings.Cut(line, "="); ok && strings.HasPrefix(p, "/proc/sys/net/") {
				saved[p] = v
			}
		}
		if err := restoreSysctls(saved); err != nil {
			return fmt.Errorf("restore sysctls of a previous run: %w", err)
		}
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
	entries, _ := os.ReadDir(netnsDir)
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), namePrefix+"-") {
			out = append(out, filepath.Join(netnsDir, e.Name()))
		}
	}
	for _, l := range []string{bridgeName, outsideVeth} {
		if _, err := os.Stat("/sys/class/net/" + l); err == nil {
			out = append(out, "link "+l)
		}
	}
	for _, d := range []string{BPFDir, WorkDir} {
		if _, err := os.Stat(d); err == nil {
			out = append(out, d)
		}
	}
	if n := forwardRulesLeft(); n > 0 {
		out = append(out, fmt.Sprintf("%d iptables FORWARD rules tagged %q", n, fwComment))
	}
	return out
}
