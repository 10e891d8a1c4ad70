// Command runcwrap runs runc with a container's capabilities fitted to the
// machine: it is set as the Docker engine's default runtime (and as
// containerd's runc inside the kind nodes) by e2e/kind/install.sh.
//
// Two things break privileged containers on some machines, this project's
// VMs among them:
//   - The machine's capability bounding set lacks a capability the engine
//     grants to privileged containers (here CAP_SYS_RESOURCE), and runc fails
//     with "unable to apply caps". runcwrap drops every capability that is not
//     in its own bounding set.
//   - Docker 20.10 does not know CAP_BPF and CAP_PERFMON (Linux 5.8), so a
//     privileged container (a kind node) lacks them and so does everything
//     inside it: bpftool in Cilium's pod fails. runcwrap adds them to each set
//     of a privileged container (one that holds CAP_SYS_ADMIN, CAP_SYS_MODULE,
//     CAP_SYS_RAWIO, CAP_SYS_BOOT and CAP_MAC_ADMIN), when the bounding set
//     has them. A container that asked for chosen capabilities gets no more
//     than it asked for.
//
// It edits the bundle's config.json for `create` and `run`, and the process
// file for `exec --process`, then execs the real runc (RUNC, default
// /usr/sbin/runc or /usr/bin/runc) with the same arguments. With nothing to
// change it changes nothing.
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// Capability numbers from linux/capability.h, for the bounding set mask.
var capNumbers = map[string]uint{
	"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_DAC_READ_SEARCH": 2, "CAP_FOWNER": 3,
	"CAP_FSETID": 4, "CAP_KILL": 5, "CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SETPCAP": 8,
	"CAP_LINUX_IMMUTABLE": 9, "CAP_NET_BIND_SERVICE": 10, "CAP_NET_BROADCAST": 11,
	"CAP_NET_ADMIN": 12, "CAP_NET_RAW": 13, "CAP_IPC_LOCK": 14, "CAP_IPC_OWNER": 15,
	"CAP_SYS_MODULE": 16, "CAP_SYS_RAWIO": 17, "CAP_SYS_CHROOT": 18, "CAP_SYS_PTRACE": 19,
	"CAP_SYS_PACCT": 20, "CAP_SYS_ADMIN": 21, "CAP_SYS_BOOT": 22, "CAP_SYS_NICE": 23,
	"CAP_SYS_RESOURCE": 24, "CAP_SYS_TIME": 25, "CAP_SYS_TTY_CONFIG": 26, "CAP_MKNOD": 27,
	"CAP_LEASE": 28, "CAP_AUDIT_WRITE": 29, "CAP_AUDIT_CONTROL": 30, "CAP_SETFCAP": 31,
	"CAP_MAC_OVERRIDE": 32, "CAP_MAC_ADMIN": 33, "CAP_SYSLOG": 34, "CAP_WAKE_ALARM": 35,
	"CAP_BLOCK_SUSPEND": 36, "CAP_AUDIT_READ": 37, "CAP_PERFMON": 38, "CAP_BPF": 39,
	"CAP_CHECKPOINT_RESTORE": 40,
}

func main() {
	runc := os.Getenv("RUNC")
	if runc == "" {
		runc = "/usr/sbin/runc"
		if _, err := os.Stat(runc); err != nil {
			runc = "/usr/bin/runc"
		}
	}
	if bnd, err := boundingSet(); err != nil {
		fmt.Fprintf(os.Stderr, "runcwrap: %v (capabilities left as they are)\n", err)
	} else if err := fixArgs(os.Args[1:], bnd); err != nil {
		fmt.Fprintf(os.Stderr, "runcwrap: %v\n", err)
		os.Exit(1)
	}
	argv := append([]string{runc}, os.Args[1:]...)
	err := syscall.Exec(runc, argv, os.Environ())
	fmt.Fprintf(os.Stderr, "runcwrap: exec %s: %v\n", runc, err)
	os.Exit(1)
}

// boundingSet reads CapBnd from /proc/self/status.
func boundingSet() (uint64, error) {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "CapBnd:"); ok {
			return strconv.ParseUint(strings.TrimSpace(v), 16, 64)
		}
	}
	return 0, fmt.Errorf("no CapBnd in /proc/self/status")
}

// fixArgs finds the JSON file the runc command line names and fits its
// capabilities. runc's global flags come before the command.
func fixArgs(args []string, bnd uint64) error {
	cmd, i := "", 0
	for ; i < len(args); i++ {
		a := args[i]
		if !strings.HasPrefix(a, "-") {
			cmd = a
			break
		}
		// Global flags that take a value as the next argument.
		switch a {
		case "--root", "--log", "--log-format", "--criu", "--rootless":
			i++
		}
	}
	rest := args[min(i+1, len(args)):]
	switch cmd {
	case "create", "run":
		bundle := flagValue(rest, "--bundle", "-b")
		if bundle == "" {
			bundle = "."
		}
		return fixFile(filepath.Join(bundle, "config.json"), bnd, true)
	case "exec":
		if p := flagValue(rest, "--process", "-p"); p != "" {
			return fixFile(p, bnd, false)
		}
	}
	return nil
}

func flagValue(args []string, long, short string) string {
	for i, a := range args {
		if a == long || a == short {
			if i+1 < len(args) {
				return args[i+1]
			}
			return ""
		}
		if v, ok := strings.CutPrefix(a, long+"="); ok {
			return v
		}
		if v, ok := strings.CutPrefix(a, short+"="); ok {
			return v
		}
	}
	return ""
}

// fixFile rewrites the capabilities of a bundle's config.json (spec: under
// "process") or of an exec process file (the process itself), in place and
// only if something changes.
func fixFile(path string, bnd uint64, spec bool) error {
	raw, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var doc map[string]any
	if err := json.Unmarshal(raw, &doc); err != nil {
		return fmt.Errorf("%s: %v", path, err)
	}
	proc := doc
	if spec {
		p, ok := doc["process"].(map[string]any)
		if !ok {
			return nil
		}
		proc = p
	}
	caps, ok := proc["capabilities"].(map[string]any)
	if !ok {
		return nil
	}
	changed := false
	for set, v := range caps {
		list, ok := v.([]any)
		if !ok {
			continue
		}
		fixed, ch := fitSet(list, bnd)
		if ch {
			caps[set] = fixed
			changed = true
		}
	}
	if !changed {
		return nil
	}
	out, err := json.Marshal(doc)
	if err != nil {
		return err
	}
	st, err := os.Stat(path)
	if err != nil {
		return err
	}
	return os.WriteFile(path, out, st.Mode().Perm())
}

// fitSet drops capabilities outside the bounding set and adds CAP_BPF and
// CAP_PERFMON to a privileged container's set.
func fitSet(list []any, bnd uint64) ([]any, bool) {
	inBnd := func(name string) bool {
		n, known := capNumbers[name]
		return !known || bnd&(1<<n) != 0 // unknown names: leave them to runc
	}
	have := map[string]bool{}
	out := make([]any, 0, len(list)+2)
	changed := false
	for _, v := range list {
		name, _ := v.(string)
		if !inBnd(name) {
			changed = true
			continue
		}
		have[name] = true
		out = append(out, v)
	}
	if have["CAP_SYS_ADMIN"] && have["CAP_SYS_MODULE"] && have["CAP_SYS_RAWIO"] &&
		have["CAP_SYS_BOOT"] && have["CAP_MAC_ADMIN"] {
		for _, add := range []string{"CAP_BPF", "CAP_PERFMON"} {
			if !have[add] && inBnd(add) {
				out = append(out, add)
				changed = true
			}
		}
	}
	return out, changed
}
