package daemon

import (
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

const (
	chainedConflist   = `{"cniVersion":"1.0.0","name":"cilium","plugins":[{"type":"cilium-cni"},{"type":"ctscrub"}]}`
	unchainedConflist = `{"cniVersion":"1.0.0","name":"cilium","plugins":[{"type":"cilium-cni"}]}`
)

// writeConfAtomic writes a config file as the installer and Cilium's agent
// do: a temp file (not a config name) renamed over the target.
func writeConfAtomic(t *testing.T, path, data string) {
	t.Helper()
	tmp := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".tmp")
	if err := os.WriteFile(tmp, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// chainedConfDir is a CNI config dir holding one conflist that chains
// ctscrub (the delegate needs the watch).
func chainedConfDir(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	writeConfAtomic(t, filepath.Join(dir, "05-cilium.conflist"), chainedConflist)
	return dir
}

// holdWatch holds the watch before its next read: held is closed once it
// waits there (it has an event, and has not read), release lets it go.
func holdWatch(t *testing.T) (held <-chan struct{}, release func()) {
	t.Helper()
	h, done := make(chan struct{}), make(chan struct{})
	var once sync.Once
	hook := func(string) { once.Do(func() { close(h); <-done }) }
	conflistBeforeRead.Store(&hook)
	var rel sync.Once
	release = func() { rel.Do(func() { close(done) }) }
	t.Cleanup(func() { release(); conflistBeforeRead.Store(nil) })
	return h, release
}

// readCounter counts the watch's reads of one dir (conflistReadHook).
type readCounter struct {
	mu sync.Mutex
	n  map[string]int
}

func countReads(t *testing.T) *readCounter {
	t.Helper()
	rc := &readCounter{n: map[string]int{}}
	hook := func(dir string) {
		rc.mu.Lock()
		rc.n[dir]++
		rc.mu.Unlock()
	}
	conflistReadHook.Store(&hook)
	t.Cleanup(func() { conflistReadHook.Store(nil) })
	return rc
}

func (rc *readCounter) reads(dir string) int {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	return rc.n[dir]
}

// step runs change and waits for the watch to read dir after it.
func (rc *readCounter) step(t *testing.T, dir, what string, change func()) {
	t.Helper()
	n := rc.reads(dir)
	change()
	waitFor(t, "the watch to read the dir after: "+what, func() bool { return rc.reads(dir) > n })
}

func chained(td *testDaemon, t *testing.T) float64 {
	return counterValue(t, td, "ctscrub_cni_chained", nil)
}

// conflistDaemon starts a daemon watching a CNI config dir that holds one
// chained conflist, waits for the watch to call it chained, and gives one
// IP a clean handover (released by a DEL scrubd saw).
func conflistDaemon(t *testing.T) (td *testDaemon, root *ctRoot, conf string) {
	t.Helper()
	root = newCTRoot(t, 1<<14)
	cfg := testConfig(t, root)
	cfg.CNIConfDir = t.TempDir()
	conf = filepath.Join(cfg.CNIConfDir, "05-cilium.conflist")
	writeConfAtomic(t, conf, chainedConflist)
	td = startDaemon(t, cfg)
	waitFor(t, "the conflist watch to call the config chained", func() bool { return counterValue(t, td, "ctscrub_cni_chained", nil) == 1 })
	return td, root, conf
}

const unseenLog = "a pod scrubd never indexed existed"

// waitUnseen waits up to d for the watch's sign of an unseen owner; it
// reports whether it came (the ADD that follows checks the effect).
func waitUnseen(td *testDaemon, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if strings.Contains(td.logs.text(), unseenLog) {
			return true
		}
		time.Sleep(time.Millisecond)
	}
	return false
}

// An installer that re-chains quickly: Cilium's agent writes its own
// conflist (no ctscrub), the installer puts the entry back a few ms later
// (or at once). Pods created in between are unseen; the watch must say so
// though the file it reads afterwards chains ctscrub. Which rule saw it (the
// unchained version read, R1, or two versions between two reads, R2) is
// logged.
func TestConflistTransientUnchainedVersion(t *testing.T) {
	for _, c := range []struct {
		name string
		gap  time.Duration
		held bool // the watch held before its read until both are written: R2
	}{{"gap=2ms", 2 * time.Millisecond, false}, {"gap=0", 0, false}, {"unread", 0, true}} {
		t.Run(c.name, func(t *testing.T) {
			td, root, conf := conflistDaemon(t)
			x := mustAddr("10.244.0.50")
			ownedIP(t, td, root, x, "old")()

			var held <-chan struct{}
			release := func() {}
			if c.held {
				held, release = holdWatch(t)
			}
			writeConfAtomic(t, conf, unchainedConflist)
			if c.held {
				<-held // the watch has the rename's event, not read yet
			}
			time.Sleep(c.gap)
			writeConfAtomic(t, conf, chainedConflist)
			release()
			unseen := unseenFlows(x)
			root.put4(t, unseen) // a pod created in between
			if !waitUnseen(td, 2*time.Second) {
				t.Errorf("no sign of an unseen owner 2 s after an unchained version of %s", conf)
			}
			for _, l := range strings.Split(td.logs.text(), "\n") {
				if strings.Contains(l, unseenLog) {
					t.Logf("%s", l[strings.Index(l, `"why"`):])
				}
			}
			if r := addScrub(t, td, x, "new"); r.Method != scrub.MethodSweep {
				t.Errorf("ADD after an unchained version of the conflist lived %s: method %s, want sweep", c.gap, r.Method)
			}
			if n := root.present4(t, unseen); n != 0 {
				t.Errorf("%d entries of the unseen pod left on %s", n, x)
			}
		})
	}
}

// Rewrites that leave the chain as it was: Cilium's agent writing the same
// chained conflist at its start (a rename), an in-place rewrite of the same
// bytes (the only config: half-written, no pod could start), a chmod, a
// file of another name beside it. None is a sign of an unseen owner: the
// released IP's next ADD trusts the index.
func TestConflistIdenticalRewriteKeepsReleases(t *testing.T) {
	rc := countReads(t)
	td, root, conf := conflistDaemon(t)
	dir := filepath.Dir(conf)
	x := mustAddr("10.244.0.51")
	ownedIP(t, td, root, x, "old")()

	for range 3 {
		rc.step(t, dir, "an identical rename", func() { writeConfAtomic(t, conf, chainedConflist) })
	}
	rc.step(t, dir, "an identical in-place write", func() {
		if err := os.WriteFile(conf, []byte(chainedConflist), 0o644); err != nil {
			t.Fatal(err)
		}
	})
	rc.step(t, dir, "a chmod", func() {
		if err := os.Chmod(conf, 0o600); err != nil {
			t.Fatal(err)
		}
	})
	rc.step(t, dir, "a later file that chains too", func() {
		writeConfAtomic(t, filepath.Join(dir, "10-other.conflist"), strings.Replace(chainedConflist, "cilium", "other", 1))
	})
	// A file the runtime does not read (no read follows it: the rename
	// after it is what the watch reads).
	if err := os.WriteFile(filepath.Join(dir, "05-cilium.conflist.cilium_bak"), []byte(unchainedConflist), 0o644); err != nil {
		t.Fatal(err)
	}
	rc.step(t, dir, "an identical rename", func() { writeConfAtomic(t, conf, chainedConflist) })
	if strings.Contains(td.logs.text(), unseenLog) {
		t.Errorf("a rewrite that kept the chain was taken for a sign of an unseen owner:\n%s", td.logs.text())
	}
	if v := chained(td, t); v != 1 {
		t.Errorf("ctscrub_cni_chained %v after rewrites that kept the chain, want 1", v)
	}
	if r := addScrub(t, td, x, "new"); r.Method != scrub.MethodIndex {
		t.Errorf("ADD after identical rewrites: method %s, want index", r.Method)
	}
}

// The first file renamed away and back (or rewritten in place) while a
// later file does not chain: in between, the runtime used the later one.
func TestConflistFirstFileAwayWhileLaterUnchained(t *testing.T) {
	for _, c := range []struct {
		name   string
		change func(t *testing.T, conf string)
	}{
		{"renamed away and back", func(t *testing.T, conf string) {
			if err := os.Rename(conf, conf+".away"); err != nil {
				t.Fatal(err)
			}
			if err := os.Rename(conf+".away", conf); err != nil {
				t.Fatal(err)
			}
		}},
		{"rewritten in place", func(t *testing.T, conf string) {
			if err := os.WriteFile(conf, []byte(chainedConflist), 0o644); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			rc := countReads(t)
			td, root, conf := conflistDaemon(t)
			dir := filepath.Dir(conf)
			rc.step(t, dir, "a later file without ctscrub", func() {
				writeConfAtomic(t, filepath.Join(dir, "10-flannel.conflist"), `{"cniVersion":"1.0.0","name":"cbr0","plugins":[{"type":"flannel"}]}`)
			})
			if strings.Contains(td.logs.text(), unseenLog) || chained(td, t) != 1 {
				t.Fatalf("a later file without ctscrub counted: %v\n%s", chained(td, t), td.logs.text())
			}
			x := mustAddr("10.244.0.52")
			ownedIP(t, td, root, x, "old")()
			rc.step(t, dir, c.name, func() { c.change(t, conf) })
			if !strings.Contains(td.logs.text(), unseenLog) {
				t.Errorf("the first file %s beside a later unchained file: no sign of an unseen owner", c.name)
			}
			if r := addScrub(t, td, x, "new"); r.Method != scrub.MethodSweep {
				t.Errorf("ADD after that: method %s, want sweep", r.Method)
			}
		})
	}
}

// CRI-O with cni_default_network uses the file of that network, which need
// not be the first: it must chain too.
func TestConflistDefaultNetwork(t *testing.T) {
	rc := countReads(t)
	root := newCTRoot(t, 1<<14)
	cfg := testConfig(t, root)
	cfg.CNIConfDir = t.TempDir()
	cfg.CNIDefaultNetwork = "crio"
	dir := cfg.CNIConfDir
	writeConfAtomic(t, filepath.Join(dir, "05-cilium.conflist"), chainedConflist)
	crio := filepath.Join(dir, "10-crio.conflist")
	writeConfAtomic(t, crio, `{"cniVersion":"1.0.0","name":"crio","plugins":[{"type":"bridge"}]}`)
	td := startDaemon(t, cfg)
	waitFor(t, "a first read", func() bool { return rc.reads(dir) > 0 })
	if v := chained(td, t); v != 0 {
		t.Errorf("the default network's file does not chain ctscrub: ctscrub_cni_chained %v, want 0", v)
	}
	rc.step(t, dir, "the default network chained", func() {
		writeConfAtomic(t, crio, `{"cniVersion":"1.0.0","name":"crio","plugins":[{"type":"bridge"},{"type":"ctscrub"}]}`)
	})
	if v := chained(td, t); v != 1 {
		t.Errorf("both files chain ctscrub: ctscrub_cni_chained %v, want 1", v)
	}
	rc.step(t, dir, "the default network's file gone", func() {
		if err := os.Remove(crio); err != nil {
			t.Fatal(err)
		}
	})
	if v := chained(td, t); v != 0 {
		t.Errorf("no file of the default network: ctscrub_cni_chained %v, want 0", v)
	}
}

// Multus's 00-multus.conf sorts first and delegates to the cluster network:
// the delegates must chain ctscrub; an unknown cluster network is not
// chained.
func TestConflistMultus(t *testing.T) {
	rc := countReads(t)
	root := newCTRoot(t, 1<<14)
	cfg := testConfig(t, root)
	cfg.CNIConfDir = t.TempDir()
	dir := cfg.CNIConfDir
	cilium := filepath.Join(dir, "05-cilium.conflist")
	multus := filepath.Join(dir, "00-multus.conf")
	writeConfAtomic(t, cilium, chainedConflist)
	writeConfAtomic(t, multus, `{"cniVersion":"0.3.1","name":"multus-cni-network","type":"multus","kubeconfig":"/etc/cni/net.d/multus.d/multus.kubeconfig","delegates":[`+unchainedConflist+`]}`)
	td := startDaemon(t, cfg)
	waitFor(t, "a first read", func() bool { return rc.reads(dir) > 0 })
	if v := chained(td, t); v != 0 {
		t.Errorf("Multus delegating to a conflist without ctscrub: ctscrub_cni_chained %v, want 0", v)
	}
	for _, c := range []struct {
		what, conf string
		want       float64
	}{
		{"delegates that chain", `{"cniVersion":"0.3.1","name":"multus-cni-network","type":"multus","delegates":[` + chainedConflist + `]}`, 1},
		{"a second delegate that does not", `{"cniVersion":"0.3.1","name":"multus-cni-network","type":"multus","delegates":[` + chainedConflist + `,` + unchainedConflist + `]}`, 0},
		{"clusterNetwork: the chained file's path", `{"cniVersion":"0.3.1","name":"multus-cni-network","type":"multus","clusterNetwork":"/etc/cni/net.d/05-cilium.conflist"}`, 1},
		{"clusterNetwork: the chained network's name", `{"cniVersion":"0.3.1","name":"multus-cni-network","type":"multus","clusterNetwork":"cilium"}`, 1},
		{"clusterNetwork: a network not in the dir", `{"cniVersion":"0.3.1","name":"multus-cni-network","type":"multus","clusterNetwork":"calico"}`, 0},
		{"the thick plugin's shim (no delegates)", `{"cniVersion":"0.3.1","name":"multus-cni-network","type":"multus-shim","socketDir":"/host/run/multus/"}`, 0},
		{"defaultNetworks", `{"cniVersion":"0.3.1","name":"multus-cni-network","type":"multus","clusterNetwork":"cilium","defaultNetworks":["sriov"]}`, 0},
	} {
		rc.step(t, dir, c.what, func() { writeConfAtomic(t, multus, c.conf) })
		if v := chained(td, t); v != c.want {
			t.Errorf("Multus with %s: ctscrub_cni_chained %v, want %v", c.what, v, c.want)
		}
	}
	// The cluster network's own file is watched too.
	rc.step(t, dir, "clusterNetwork by path", func() {
		writeConfAtomic(t, multus, `{"cniVersion":"0.3.1","name":"multus-cni-network","type":"multus","clusterNetwork":"/etc/cni/net.d/05-cilium.conflist"}`)
	})
	rc.step(t, dir, "the cluster network unchained", func() { writeConfAtomic(t, cilium, unchainedConflist) })
	if v := chained(td, t); v != 0 {
		t.Errorf("Multus's clusterNetwork rewritten without ctscrub: ctscrub_cni_chained %v, want 0", v)
	}
}

// The dir removed (and its files with it), then made again: not chained
// until the watch reads the new one, and releases made before are not
// trusted.
func TestConflistDirRemovedAndRecreated(t *testing.T) {
	rc := countReads(t)
	td, root, conf := conflistDaemon(t)
	dir := filepath.Dir(conf)
	x := mustAddr("10.244.0.53")
	ownedIP(t, td, root, x, "old")()
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the watch to see the dir go", func() bool { return chained(td, t) == 0 })
	if !strings.Contains(td.logs.text(), unseenLog) {
		t.Errorf("the CNI config dir removed: no sign of an unseen owner")
	}
	unseen := unseenFlows(x)
	root.put4(t, unseen)
	n := rc.reads(dir)
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	writeConfAtomic(t, conf, chainedConflist)
	waitFor(t, "the watch to read the new dir", func() bool { return rc.reads(dir) > n && chained(td, t) == 1 })
	if r := addScrub(t, td, x, "new"); r.Method != scrub.MethodSweep {
		t.Errorf("ADD after the dir came back: method %s, want sweep", r.Method)
	}
	if n := root.present4(t, unseen); n != 0 {
		t.Errorf("%d entries of the unseen pod left on %s", n, x)
	}
	// Watched again: a change is seen.
	rc.step(t, dir, "unchained in the new dir", func() { writeConfAtomic(t, conf, unchainedConflist) })
	if v := chained(td, t); v != 0 {
		t.Errorf("the new dir's config without ctscrub: ctscrub_cni_chained %v, want 0", v)
	}
}

// Versions scrubd never read count only where the runtime may have used
// them: a later file rewritten twice while the first chains is no sign; a
// file that sorts first, created and removed between two reads, is.
func TestConflistUnreadVersionsOnlyWhereUsed(t *testing.T) {
	rc := countReads(t)
	td, root, conf := conflistDaemon(t)
	dir := filepath.Dir(conf)
	later := filepath.Join(dir, "10-other.conflist")
	rc.step(t, dir, "a later file", func() { writeConfAtomic(t, later, unchainedConflist) })
	x := mustAddr("10.244.0.54")
	ownedIP(t, td, root, x, "old")()

	held, release := holdWatch(t)
	writeConfAtomic(t, later, chainedConflist)
	<-held
	writeConfAtomic(t, later, unchainedConflist)
	n := rc.reads(dir)
	release()
	waitFor(t, "the watch's read", func() bool { return rc.reads(dir) > n })
	if strings.Contains(td.logs.text(), unseenLog) {
		t.Errorf("two unread versions of a file after the chained first one taken for a sign:\n%s", td.logs.text())
	}
	if r := addScrub(t, td, x, "new"); r.Method != scrub.MethodIndex {
		t.Errorf("ADD after that: method %s, want index", r.Method)
	}

	y := mustAddr("10.244.0.55")
	ownedIP(t, td, root, y, "old-y")()
	held, release = holdWatch(t)
	first := filepath.Join(dir, "01-brief.conflist")
	writeConfAtomic(t, first, unchainedConflist)
	<-held
	if err := os.Remove(first); err != nil {
		t.Fatal(err)
	}
	n = rc.reads(dir)
	release()
	waitFor(t, "the watch's read", func() bool { return rc.reads(dir) > n })
	if !strings.Contains(td.logs.text(), unseenLog) {
		t.Errorf("a first file that came and went unread: no sign of an unseen owner")
	}
	if r := addScrub(t, td, y, "new-y"); r.Method != scrub.MethodSweep {
		t.Errorf("ADD after that: method %s, want sweep", r.Method)
	}
}

// A config file that is a symlink to a file elsewhere changes with no event
// in the dir: the backstop's re-read finds a version whose changes were not
// counted (R3, R6), a sign of an unseen owner though it still chains.
func TestConflistBackstopSymlink(t *testing.T) {
	was := conflistRecheck
	t.Cleanup(func() { conflistRecheck = was }) // after the daemon's stop
	conflistRecheck = 200 * time.Millisecond
	rc := countReads(t)
	root := newCTRoot(t, 1<<14)
	cfg := testConfig(t, root)
	cfg.CNIConfDir = t.TempDir()
	dir := cfg.CNIConfDir
	target := filepath.Join(t.TempDir(), "cilium.conflist")
	writeConfAtomic(t, target, chainedConflist)
	if err := os.Symlink(target, filepath.Join(dir, "05-cilium.conflist")); err != nil {
		t.Fatal(err)
	}
	td := startDaemon(t, cfg)
	waitFor(t, "the watch to call the config chained", func() bool { return chained(td, t) == 1 })
	x := mustAddr("10.244.0.56")
	ownedIP(t, td, root, x, "old")()
	if strings.Contains(td.logs.text(), unseenLog) {
		t.Fatalf("a sign of an unseen owner before any change:\n%s", td.logs.text())
	}
	n := rc.reads(dir)
	writeConfAtomic(t, target, strings.Replace(chainedConflist, `"cilium-cni"}`, `"cilium-cni","mtu":1450}`, 1))
	waitFor(t, "the backstop's re-read", func() bool { return rc.reads(dir) > n+1 })
	if !strings.Contains(td.logs.text(), unseenLog) {
		t.Errorf("the symlinked config changed with no event: no sign of an unseen owner")
	}
	if r := addScrub(t, td, x, "new"); r.Method != scrub.MethodSweep {
		t.Errorf("ADD after that: method %s, want sweep", r.Method)
	}
}
