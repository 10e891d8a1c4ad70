package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/internal/netnsid"
	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/recorder/tcfilter"
)

// uninstallOptions are the uninstall subcommand's flags beyond the conflist's.
type uninstallOptions struct {
	binDir, confDir, conflist string
	removeBinary              bool
	keepRecorders             bool
	netnsDirs                 []string
	proc                      string
	stateFile                 string
	removeState               bool
	pinDir, runDir            string
}

// uninstall takes ctscrub off the node: the conflist entry, then (unless
// kept) the recorder's tc filters in every pod netns, then (when asked)
// scrubd's pins and run dir and the plugin binary. Every step runs even if
// an earlier cleanup step failed; the errors are joined.
func uninstall(o uninstallOptions, out io.Writer) error {
	if err := removeEntry(o.confDir, o.conflist, out); err != nil {
		return err
	}
	sock := filepath.Join(o.runDir, "scrubd.sock")
	running := scrubdAnswers(sock)
	var errs []error
	if !o.keepRecorders {
		if running {
			// scrubd believes its attached pods are indexed; taking
			// the filters away under it would make its scrubs miss
			// entries.
			fmt.Fprintf(out, "ctscrub uninstall: scrubd still answers on %s: recorder filters left in place (delete scrubd's DaemonSet, then run ctscrub uninstall again)\n", sock)
		} else if err := removeRecorders(o.netnsDirs, o.stateFile, o.proc, out); err != nil {
			errs = append(errs, err)
		}
	}
	if o.removeState {
		if running {
			errs = append(errs, fmt.Errorf("--remove-state: scrubd still answers on %s: delete scrubd's DaemonSet first (its pins and state are in use)", sock))
		} else {
			errs = append(errs, removeState(o.pinDir, o.runDir, out))
		}
	}
	if o.removeBinary {
		p := filepath.Join(o.binDir, "ctscrub")
		if err := os.Remove(p); err == nil {
			fmt.Fprintf(out, "ctscrub uninstall: removed %s\n", p)
		} else if !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// scrubdAnswers reports whether a scrubd listens on sock (a socket file
// left by a scrubd that is gone refuses the connection).
func scrubdAnswers(sock string) bool {
	c, err := net.DialTimeout("unix", sock, 2*time.Second)
	if err != nil {
		return false
	}
	c.Close()
	return true
}

// removeRecorders removes the recorder's filters from every interface of
// every network namespace bound in dirs, named in scrubd's state file or
// held by a process under proc, and prints one line per interface and a
// count.
func removeRecorders(dirs []string, stateFile, proc string, out io.Writer) error {
	paths, warn, err := podNetns(dirs, stateFile, proc)
	if err != nil {
		return err
	}
	if warn != nil {
		// The dirs and processes still name every live pod netns.
		fmt.Fprintf(out, "ctscrub uninstall: warning: %v (skipped)\n", warn)
	}
	var errs []error
	ifaces, nets := 0, 0
	for _, p := range paths {
		removed, err := tcfilter.RemoveIn(p)
		if err != nil {
			errs = append(errs, err)
		}
		for _, r := range removed {
			fmt.Fprintf(out, "ctscrub uninstall: removed recorder filters (%s) from %s in %s\n", strings.Join(r.Hooks, ", "), r.Ifname, p)
		}
		if len(removed) > 0 {
			ifaces += len(removed)
			nets++
		}
	}
	fmt.Fprintf(out, "ctscrub uninstall: removed the recorder from %d interfaces in %d of %d network namespaces\n", ifaces, nets, len(paths))
	return errors.Join(errs...)
}

// podNetns lists the network namespaces to look in: the files in dirs
// (where runtimes bind them: containerd's CRI makes /var/run/netns/cni-*)
// the netns of scrubd's attachments (state file and journal), and the netns
// of every process under proc (a pod whose runtime binds its netns
// elsewhere), each namespace once however many paths lead to it (the
// first: a bound name rather than a process). Paths that do not exist,
// or are not a bound namespace (a mount point left empty), are left out.
// A state file it cannot read is a warning, not an error.
func podNetns(dirs []string, stateFile, proc string) (paths []string, warn, err error) {
	var cands []string
	for _, d := range dirs {
		ents, err := os.ReadDir(d)
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				continue
			}
			return nil, nil, fmt.Errorf("list netns dir %s: %w", d, err)
		}
		for _, e := range ents {
			if !e.IsDir() {
				cands = append(cands, filepath.Join(d, e.Name()))
			}
		}
	}
	fromState, warn := stateNetns(stateFile)
	cands = append(cands, fromState...)
	if proc != "" {
		procs, _ := os.ReadDir(proc)
		for _, e := range procs {
			if _, perr := strconv.Atoi(e.Name()); perr == nil {
				cands = append(cands, filepath.Join(proc, e.Name(), "ns", "net"))
			}
		}
	}
	seen := map[netnsid.ID]bool{}
	for _, p := range cands {
		var fs unix.Statfs_t
		id, err := netnsid.Of(p)
		if err != nil || unix.Statfs(p, &fs) != nil || fs.Type != unix.NSFS_MAGIC {
			continue
		}
		if !seen[id] {
			seen[id] = true
			paths = append(paths, p)
		}
	}
	return paths, warn, nil
}

// stateNetns reads the netns paths of scrubd's attachments, active and
// stopped, from its state file and the journal beside it. Missing files
// name none; a line it cannot read is skipped (the directories are scanned
// anyway).
func stateNetns(path string) ([]string, error) {
	if path == "" {
		return nil, nil
	}
	var paths []string
	add := func(pods ...api.IndexedPod) {
		for _, p := range pods {
			if p.Netns != "" {
				paths = append(paths, p.Netns)
			}
		}
	}
	var errs []error
	if data, err := os.ReadFile(path); err == nil {
		var st struct {
			Pods    []api.IndexedPod `json:"pods"`
			Stopped []api.IndexedPod `json:"stopped"`
		}
		if err := json.Unmarshal(data, &st); err != nil {
			errs = append(errs, fmt.Errorf("read scrubd's state file %s: %w", path, err))
		}
		add(st.Pods...)
		add(st.Stopped...)
	} else if !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("read scrubd's state file: %w", err))
	}
	if f, err := os.Open(path + ".log"); err == nil {
		sc := bufio.NewScanner(f)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			var e struct {
				Pod api.IndexedPod `json:"pod"`
			}
			if json.Unmarshal(sc.Bytes(), &e) == nil {
				add(e.Pod)
			}
		}
		f.Close()
	}
	return paths, errors.Join(errs...)
}

// removeState removes scrubd's pin dir (on bpffs only) and run dir. Paths
// at the top of the tree (/, /run, /sys) are refused: a typo must not wipe
// a system directory.
func removeState(pinDir, runDir string, out io.Writer) error {
	var errs []error
	for _, d := range []struct {
		path  string
		bpffs bool
	}{{pinDir, true}, {runDir, false}} {
		p := filepath.Clean(d.path)
		if !filepath.IsAbs(p) || filepath.Dir(p) == "/" {
			errs = append(errs, fmt.Errorf("refusing to remove %q: give a directory below a top-level one (like /sys/fs/bpf/ctscrub, /run/ctscrub)", d.path))
			continue
		}
		if _, err := os.Lstat(p); errors.Is(err, os.ErrNotExist) {
			continue
		}
		if d.bpffs {
			var fs unix.Statfs_t
			if err := unix.Statfs(p, &fs); err != nil {
				errs = append(errs, fmt.Errorf("check pin dir %s: %w", p, err))
				continue
			}
			if fs.Type != unix.BPF_FS_MAGIC {
				errs = append(errs, fmt.Errorf("refusing to remove pin dir %s: not on bpffs (wrong --pin-dir?)", p))
				continue
			}
		}
		// Removing a pin drops the map, the host-side tcx link (or an older scrubd's)
		// with its last reference.
		if err := os.RemoveAll(p); err != nil && !errors.Is(err, syscall.ENOENT) {
			errs = append(errs, fmt.Errorf("remove %s: %w", p, err))
			continue
		}
		fmt.Fprintf(out, "ctscrub uninstall: removed %s\n", p)
	}
	return errors.Join(errs...)
}
