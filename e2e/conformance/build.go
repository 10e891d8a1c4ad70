// Package conformance runs Cilium's real datapath programs (bpf_lxc.c,
// bpf_host.c) compiled from the github.com/cilium/cilium Go module's source
// beside ctscrub's recorder, and checks that every CT entry Cilium creates
// for a pod IP is in that IP's index (or that the IP is marked incomplete).
// See docs/conformance.md.
//
// It is a module of its own so that Cilium never enters ctscrub's go.mod:
// Cilium's source is fetched with `go mod download` into the module cache
// and clang is pointed at it; nothing of Cilium's is copied into the repo.
package conformance

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// Versions are the Cilium releases the suite knows how to build, oldest
// first. The newest is the newest github.com/cilium/cilium the Go module
// proxy serves (checked with `go list -m -versions github.com/cilium/cilium`
// on 2026-11-30).
var Versions = []string{"v1.16.5", "v1.17.6", "v1.18.8", "v1.19.4", "v1.20.2"}

// Objects are the compiled programs of one Cilium version.
type Objects struct {
	Version string
	Minor   int
	Source  string // the module's directory in the Go module cache
	// Object files: Cilium's bpf_lxc.c and bpf_host.c with the harness's
	// configuration (see bpf/*.c), the second node's pair with the host
	// firewall and (bpf_host) NodePort DSR on, the third node's
	// bpf_lxc.c with socket LB in host-namespace-only mode, and the
	// fourth's with ENABLE_L7_LB.
	LXC, Host, LXCHostFW, HostDSR, LXCHostNS, LXCL7LB string
	// Overlay: bpf_overlay.c (tunnel mode), the default node's tunnel
	// device.
	Overlay   string
	BuildTime time.Duration // zero when every object came from the cache
}

// Clang is the compiler used (the one `make generate` pins).
var Clang = envOr("CONFORMANCE_CLANG", "clang-19")

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

// cacheDir holds compiled objects, keyed by version, sources and flags, so
// a second run does not rebuild.
func cacheDir() string {
	if d := os.Getenv("CONFORMANCE_CACHE"); d != "" {
		return d
	}
	d, err := os.UserCacheDir()
	if err != nil {
		d = os.TempDir()
	}
	return filepath.Join(d, "ctscrub-conformance")
}

// Source fetches github.com/cilium/cilium@version into the Go module cache
// (`go mod download`) and returns its directory.
func Source(version string) (string, error) {
	cmd := exec.Command("go", "mod", "download", "-json", "github.com/cilium/cilium@"+version)
	cmd.Dir = os.TempDir() // outside any module: no go.mod is touched
	out, err := cmd.Output()
	var res struct{ Dir, Error string }
	if jerr := json.Unmarshal(out, &res); jerr == nil && res.Error != "" {
		return "", fmt.Errorf("go mod download github.com/cilium/cilium@%s: %s", version, res.Error)
	}
	if err != nil {
		return "", fmt.Errorf("go mod download github.com/cilium/cilium@%s: %w", version, err)
	}
	if res.Dir == "" {
		return "", fmt.Errorf("go mod download github.com/cilium/cilium@%s: no directory in %q", version, out)
	}
	return res.Dir, nil
}

func minorOf(version string) (int, error) {
	var maj, min, patch int
	if _, err := fmt.Sscanf(version, "v%d.%d.%d", &maj, &min, &patch); err != nil || maj != 1 {
		return 0, fmt.Errorf("cilium version %q: want v1.N.P", version)
	}
	return min, nil
}

// harnessDir is where this package's C files are.
func harnessDir() (string, error) {
	d, err := filepath.Abs("bpf")
	if err != nil {
		return "", err
	}
	if _, err := os.Stat(filepath.Join(d, "harness.h")); err != nil {
		return "", fmt.Errorf("conformance: harness sources not found in %s (run from e2e/conformance): %w", d, err)
	}
	return d, nil
}

var buildMu sync.Mutex

// Build compiles the harness objects of one Cilium version (or takes them
// from the cache).
func Build(version string) (*Objects, error) {
	buildMu.Lock()
	defer buildMu.Unlock()
	minor, err := minorOf(version)
	if err != nil {
		return nil, err
	}
	src, err := Source(version)
	if err != nil {
		return nil, err
	}
	hdir, err := harnessDir()
	if err != nil {
		return nil, err
	}
	o := &Objects{Version: version, Minor: minor, Source: src}
	start := time.Now()
	built := false
	type job struct {
		dst  *string
		file string
	}
	jobs := []job{{&o.LXC, "lxc.c"}, {&o.Host, "host.c"}, {&o.LXCHostFW, "lxc_hostfw.c"}, {&o.HostDSR, "host_dsr.c"}, {&o.LXCHostNS, "lxc_hostns.c"}, {&o.LXCL7LB, "lxc_l7lb.c"}, {&o.Overlay, "overlay.c"}}
	errs := make([]error, len(jobs))
	fresh := make([]bool, len(jobs))
	var wg sync.WaitGroup
	for i, j := range jobs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			*j.dst, fresh[i], errs[i] = compile(src, hdir, j.file, version, minor)
		}()
	}
	wg.Wait()
	for i := range jobs {
		if errs[i] != nil {
			return nil, errs[i]
		}
		built = built || fresh[i]
	}
	if built {
		o.BuildTime = time.Since(start)
	}
	return o, nil
}

func clangFlags(src, hdir string, minor int) []string {
	return []string{
		"-I" + hdir, "-I" + filepath.Join(src, "bpf"), "-I" + filepath.Join(src, "bpf", "include"),
		"-D__NR_CPUS__=2", fmt.Sprintf("-DCILIUM_MINOR=%d", minor),
		"-O2", "-g", "--target=bpf", "-std=gnu99", "-nostdinc", "-mcpu=v3",
		"-Wall", "-Wno-address-of-packed-member", "-Wno-unknown-warning-option",
		"-Wno-gnu-variable-sized-type-not-at-end", "-Wno-unused-function", "-Wno-unused-variable",
		// The tests' CHECK programs trap on build bugs that do not concern
		// the datapath itself (needed for the DSR paths of 1.16 and 1.18).
		"-D__throw_build_bug()=((void)0)",
	}
}

// compile builds one harness file unless the cache has it.
func compile(src, hdir, file, version string, minor int) (path string, fresh bool, err error) {
	h := sha256.New()
	fmt.Fprintln(h, version, Clang, strings.Join(clangFlags(src, "", minor), " "))
	ents, err := os.ReadDir(hdir)
	if err != nil {
		return "", false, err
	}
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(hdir, e.Name()))
		if err != nil {
			return "", false, err
		}
		fmt.Fprintln(h, e.Name(), len(b))
		h.Write(b)
	}
	dir := filepath.Join(cacheDir(), version)
	out := filepath.Join(dir, strings.TrimSuffix(file, ".c")+"-"+hex.EncodeToString(h.Sum(nil))[:16]+".o")
	if _, err := os.Stat(out); err == nil {
		return out, false, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", false, err
	}
	tmp := fmt.Sprintf("%s.%d.tmp", out, os.Getpid())
	args := append([]string{"-n", "10", Clang}, clangFlags(src, hdir, minor)...)
	args = append(args, "-c", filepath.Join(hdir, file), "-o", tmp)
	cmd := exec.Command("nice", args...)
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", false, fmt.Errorf("compile %s against cilium %s: %w\n%s", file, version, err, b)
	}
	if err := os.Rename(tmp, out); err != nil {
		return "", false, err
	}
	return out, true, nil
}
