package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"
)

// The install and uninstall subcommands are what the DaemonSet's init
// container (and sidecar) run: CNI runtimes never pass arguments, so they
// cannot collide with a CNI command.
//
//	ctscrub install   [--bin-dir D] [--conf-dir D] [--conflist F] [--after T] [--entry JSON] [--replace] [--watch 10s]
//	ctscrub uninstall [--conf-dir D] [--conflist F] [--bin-dir D --remove-binary]
//	                  [--keep-recorders] [--netns-dirs D,D] [--state-file F] [--proc D]
//	                  [--remove-state [--pin-dir D] [--run-dir D]]

// defaultEntry is the ctscrub entry inserted into the conflist.
const defaultEntry = `{"type":"ctscrub","socket":"/run/ctscrub/scrubd.sock","timeout":"30s","failurePolicy":"fail"}`

func runSubcommand(name string, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("ctscrub "+name, flag.ContinueOnError)
	fs.SetOutput(out)
	binDir := fs.String("bin-dir", "/opt/cni/bin", "CNI bin dir to copy this binary into (as ctscrub)")
	confDir := fs.String("conf-dir", "/etc/cni/net.d", "the runtime's CNI config dir")
	conflist := fs.String("conflist", "", "conflist file name in --conf-dir (default: the first *.conflist holding a plugin of type --after)")
	after := fs.String("after", "cilium-cni", "type of the IP-assigning plugin ctscrub is chained after")
	entry := fs.String("entry", defaultEntry, "the ctscrub entry (JSON)")
	replace := fs.Bool("replace", false, "install: replace a ctscrub entry already in the conflist with --entry (default: keep it)")
	watch := fs.Duration("watch", 0, "keep checking every interval and put the entry back when the conflist is rewritten (0: once)")
	wait := fs.Duration("wait", 0, "install: until the conflist to chain into exists, try again every second for this long before failing (an init container started before Cilium wrote its conflist; 0: fail at once)")
	removeBinary := fs.Bool("remove-binary", false, "uninstall: also remove ctscrub from --bin-dir")
	keepRecorders := fs.Bool("keep-recorders", false, "uninstall: leave the recorder's tc filters on pods' interfaces (default: remove them from every netns)")
	netnsDirs := fs.String("netns-dirs", "/var/run/netns,/run/netns", "uninstall: comma-separated dirs where the runtime binds pods' network namespaces")
	proc := fs.String("proc", "/proc", "uninstall: also look in the netns of every process under this dir (\"\": only --netns-dirs and --state-file)")
	stateFile := fs.String("state-file", "", "uninstall: scrubd's state file, read for more pod netns paths (default: attachments.json in --run-dir)")
	removeState := fs.Bool("remove-state", false, "uninstall: also remove scrubd's pin dir and run dir (refused while scrubd answers)")
	pinDir := fs.String("pin-dir", "/sys/fs/bpf/ctscrub", "uninstall: scrubd's pin dir on bpffs (--remove-state)")
	runDir := fs.String("run-dir", "/run/ctscrub", "uninstall: scrubd's run dir: socket, state file, snapshot (--remove-state)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	switch name {
	case "uninstall":
		o := uninstallOptions{
			binDir: *binDir, confDir: *confDir, conflist: *conflist, removeBinary: *removeBinary,
			keepRecorders: *keepRecorders, stateFile: *stateFile, proc: *proc,
			removeState: *removeState, pinDir: *pinDir, runDir: *runDir,
		}
		for _, d := range strings.Split(*netnsDirs, ",") {
			if d = strings.TrimSpace(d); d != "" {
				o.netnsDirs = append(o.netnsDirs, d)
			}
		}
		if o.stateFile == "" {
			o.stateFile = filepath.Join(o.runDir, "attachments.json")
		}
		return uninstall(o, out)
	case "install":
		var e map[string]any
		if err := json.Unmarshal([]byte(*entry), &e); err != nil {
			return fmt.Errorf("--entry %s: %v", *entry, err)
		}
		if e["type"] != "ctscrub" {
			return fmt.Errorf("--entry must have \"type\": \"ctscrub\", got %v", e["type"])
		}
		// The entry must pass the plugin's own parser, or every pod would fail.
		check, _ := json.Marshal(mergeMaps(map[string]any{"cniVersion": "1.0.0", "name": "check"}, e))
		if _, err := parseConfig(check); err != nil {
			return fmt.Errorf("--entry: %v", err)
		}
		if err := installBinary(*binDir, out); err != nil {
			return err
		}
		if err := waitInsert(*wait, time.Second, func() error { return insertEntry(*confDir, *conflist, *after, e, *replace, out) }, out); err != nil {
			if *watch == 0 {
				return err
			}
			fmt.Fprintf(out, "ctscrub install: %v (retrying in %s)\n", err, *watch)
		}
		for *watch > 0 {
			time.Sleep(*watch)
			if err := insertEntry(*confDir, *conflist, *after, e, *replace, out); err != nil {
				fmt.Fprintf(out, "ctscrub install: %v (retrying in %s)\n", err, *watch)
			}
		}
		return nil
	}
	return fmt.Errorf("unknown subcommand %q", name)
}

// waitInsert runs insert until it succeeds, every interval for at most wait,
// and returns its last error. Each new error is printed once: the usual one,
// "no conflist yet", would otherwise fill the log once a second.
func waitInsert(wait, interval time.Duration, insert func() error, out io.Writer) error {
	deadline := time.Now().Add(wait)
	last := ""
	for {
		err := insert()
		if err == nil || !time.Now().Before(deadline) {
			return err
		}
		if err.Error() != last {
			fmt.Fprintf(out, "ctscrub install: %v (trying again every %s for up to %s)\n", err, interval, wait)
			last = err.Error()
		}
		time.Sleep(interval)
	}
}

func mergeMaps(a, b map[string]any) map[string]any {
	for k, v := range b {
		a[k] = v
	}
	return a
}

// installBinary copies this executable to binDir/ctscrub through a temp file
// and a rename, so a runtime never execs a half-written plugin.
func installBinary(binDir string, out io.Writer) error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	data, err := os.ReadFile(self)
	if err != nil {
		return err
	}
	dst := filepath.Join(binDir, "ctscrub")
	if old, err := os.ReadFile(dst); err == nil && bytes.Equal(old, data) {
		return nil
	}
	if err := writeAtomic(dst, data, 0o755); err != nil {
		return fmt.Errorf("install plugin binary into %s: %w (is the host's CNI bin dir mounted there?)", binDir, err)
	}
	fmt.Fprintf(out, "ctscrub install: wrote %s\n", dst)
	return nil
}

func writeAtomic(path string, data []byte, mode os.FileMode) error {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Chmod(mode); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), path)
}

// findConflist returns the conflist to edit: name, or the first *.conflist in
// lexical order (the one runtimes use) whose plugins include type after.
func findConflist(confDir, name, after string) (string, error) {
	if name != "" {
		return filepath.Join(confDir, name), nil
	}
	files, err := filepath.Glob(filepath.Join(confDir, "*.conflist"))
	if err != nil {
		return "", err
	}
	sort.Strings(files)
	for _, f := range files {
		list, err := readConflist(f)
		if err != nil {
			continue
		}
		if pluginIndex(list, after) >= 0 {
			return f, nil
		}
	}
	return "", fmt.Errorf("no *.conflist in %s has a plugin of type %q: is Cilium installed and has it written its CNI config yet? (or give --conflist / --after)", confDir, after)
}

func readConflist(path string) (map[string]any, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var list map[string]any
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber() // keep numbers exactly as written
	if err := dec.Decode(&list); err != nil {
		return nil, fmt.Errorf("%s: %v", path, err)
	}
	if _, ok := list["plugins"].([]any); !ok {
		return nil, fmt.Errorf("%s: no \"plugins\" list", path)
	}
	return list, nil
}

func pluginIndex(list map[string]any, typ string) int {
	for i, p := range list["plugins"].([]any) {
		if m, ok := p.(map[string]any); ok && m["type"] == typ {
			return i
		}
	}
	return -1
}

// withoutCtscrub drops every ctscrub entry from the plugin list.
func withoutCtscrub(plugins []any) []any {
	return slices.DeleteFunc(slices.Clone(plugins), func(p any) bool {
		m, ok := p.(map[string]any)
		return ok && m["type"] == "ctscrub"
	})
}

// insertEntry puts entry right after the plugin of type after, and rewrites
// the file only when it changes. A ctscrub entry already chained after it is
// left as it is unless replace is set (then it is replaced by entry).
func insertEntry(confDir, name, after string, entry map[string]any, replace bool, out io.Writer) error {
	path, err := findConflist(confDir, name, after)
	if err != nil {
		return err
	}
	list, err := readConflist(path)
	if err != nil {
		return err
	}
	if i, j := pluginIndex(list, after), pluginIndex(list, "ctscrub"); i >= 0 && j > i && !replace {
		return nil // already chained, with whatever settings the operator chose
	}
	before, _ := json.Marshal(list)
	plugins := withoutCtscrub(list["plugins"].([]any))
	list["plugins"] = plugins
	i := pluginIndex(list, after)
	if i < 0 {
		return fmt.Errorf("%s has no plugin of type %q to chain ctscrub after", path, after)
	}
	list["plugins"] = slices.Insert(plugins, i+1, any(entry))
	now, _ := json.Marshal(list)
	if bytes.Equal(before, now) {
		return nil
	}
	pretty, _ := json.MarshalIndent(list, "", "  ")
	if err := writeAtomic(path, append(pretty, '\n'), 0o644); err != nil {
		return fmt.Errorf("rewrite %s: %w", path, err)
	}
	fmt.Fprintf(out, "ctscrub install: chained ctscrub after %s in %s\n", after, path)
	if files, _ := filepath.Glob(filepath.Join(confDir, "*.conf*")); len(files) > 0 {
		sort.Strings(files)
		if files[0] != path && !strings.HasSuffix(files[0], ".cilium_bak") {
			fmt.Fprintf(out, "ctscrub install: warning: %s sorts before %s, and runtimes use the first config\n", files[0], path)
		}
	}
	return nil
}

// removeEntry drops ctscrub from the named conflist, or from every conflist.
func removeEntry(confDir, name string, out io.Writer) error {
	files := []string{filepath.Join(confDir, name)}
	if name == "" {
		files, _ = filepath.Glob(filepath.Join(confDir, "*.conflist"))
	}
	for _, f := range files {
		list, err := readConflist(f)
		if err != nil {
			if name != "" {
				return err
			}
			continue
		}
		plugins := list["plugins"].([]any)
		kept := withoutCtscrub(plugins)
		if len(kept) == len(plugins) {
			continue
		}
		list["plugins"] = kept
		pretty, _ := json.MarshalIndent(list, "", "  ")
		if err := writeAtomic(f, append(pretty, '\n'), 0o644); err != nil {
			return fmt.Errorf("rewrite %s: %w", f, err)
		}
		fmt.Fprintf(out, "ctscrub uninstall: removed ctscrub from %s\n", f)
	}
	return nil
}
