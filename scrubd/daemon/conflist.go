package daemon

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"
)

// The conflist watch (cni_conf_dir): a pod created while the runtime's CNI
// config does not chain ctscrub is an owner scrubd never sees, so every such
// moment must end up in noteConflist. docs/daemon.md, "Ownership", has the
// rules in prose; TestConflist* check them on a real directory.
//
// Which config the runtime uses. containerd and CRI-O (libcni.ConfFiles)
// take the files of the dir ending in .conf, .conflist or .json, sorted by
// name. containerd uses the first (max_conf_num 1) and fails when it does
// not parse; CRI-O skips a file that does not parse and uses the next, or,
// with cni_default_network, the file whose "name" is that network. So the
// node counts as chained only when
//   - the first file that parses as a CNI config chains ctscrub, and
//   - with cni_default_network set, the first file whose "name" is that
//     network chains ctscrub as well (the runtime is not known: both must);
//   - a Multus config (a plugin of type multus or multus-shim) chains when
//     every one of its "delegates" chains ctscrub, or, without delegates,
//     the config its "clusterNetwork" names (a path: that file name in the
//     dir; a network name: the file with that "name") does. Anything else
//     (a thick plugin's shim whose delegates live in its daemon config,
//     "defaultNetworks", which come from NetworkAttachmentDefinitions
//     scrubd cannot read, a clusterNetwork not in the dir) is unknown, and
//     unknown is not chained (fail closed).
// No usable config at all (none that parses, or no file of the default
// network) is "none": no pod can start then. Read as the config's state it
// counts as not chained, as before (the next config may come without
// ctscrub); as a state the dir may have passed through between two reads it
// is harmless.
//
// When. An inotify watch on the dir, not a poll: a poll every 5 s misses an
// unchained version that lives less than that (Cilium's agent writes its own
// conflist, the installer's sidecar re-chains it within 10 s; a quarter of
// such windows fell between two polls). Events only say that something
// changed; the content is what a read finds afterwards, and versions written
// between two reads are never read. The rule, per config file name, between
// two reads (a "read" is a pass over the whole dir, done once the events it
// answers are drained and no writer has the file open):
//
//	R1 a read that is not chained: not chained (the sign of an unseen owner
//	   at the change, every release ended at each check while it lasts, and
//	   again when it chains once more: IPs released meanwhile may have gone
//	   to unseen pods).
//	R2 two or more content versions (a rename onto the name, IN_MOVED_TO, or
//	   a write session: IN_CREATE or IN_MODIFY up to IN_CLOSE_WRITE) between
//	   two reads, or one that was gone again at the read: a version was never
//	   read, and it may have been any config ("unknown"). The content read
//	   now does not excuse it: "identical to the last chained version" is
//	   exactly what Cilium's rewrite followed by the installer's re-chain
//	   leaves.
//	R3 a version read whose event had not come (the identity, device, inode,
//	   ctime, size and SHA-256 of the content, changed with no event for the
//	   name; or an event comes for a version already read while the read
//	   before had counted one of its own): the versions were not counted: an
//	   unknown version, as R2.
//	R4 between the reads each name that changed was its old version, its
//	   new one, absent or half-written (deleted, moved away, written in
//	   place: the runtime skips or fails on it), or unknown (R2, R3). Every
//	   combination over the names that changed must be chained or "none",
//	   an unknown version counting as not chained wherever the runtime may
//	   have used it (first, the default network's, a Multus clusterNetwork);
//	   else a sign of an unseen owner even when what is read now chains.
//	   E.g. the first file rewritten twice unread (unknown, first); the
//	   first file renamed away and back while a later file does not chain;
//	   but not a later file rewritten twice while the first one chains.
//	   More than 6 names changed between two reads: a sign, without trying.
//	R5 an inotify queue overflow (IN_Q_OVERFLOW): events lost, a sign of an
//	   unseen owner. The dir removed or moved (IN_DELETE_SELF, IN_MOVE_SELF,
//	   IN_IGNORED): not chained until it is watched and read again.
//	R6 every 30 s the dir is read again whatever the events (the backstop:
//	   a config file that is a symlink to a file elsewhere changes without
//	   an event in the dir; R3 applies).
//
// So an idempotent rewrite does not end releases: the repo's installer
// (ctscrub install --watch 10s) rewrites only a conflist that lost the entry,
// through a temp file and a rename (one IN_MOVED_TO); Cilium's agent writes
// its conflist (with cni.customConf, the chain from our ConfigMap) once per
// start, the same way. Each is one version read before the next comes. What
// does end them: the read finds an unchained file, or two versions came
// faster than scrubd read them (R2), which is how an unchained version that
// lived a few ms shows. Not seen: a writer that rewrites the file several
// times in one open (no IN_CLOSE_WRITE between) counts once.

// confExts are the config file extensions of libcni.ConfFiles.
var confExts = []string{".conf", ".conflist", ".json"}

// isConfName: a name libcni.ConfFiles lists (a dot file too: the installer's
// temp files, ".05-cilium.conflist.tmp-*", end otherwise).
func isConfName(name string) bool { return slices.Contains(confExts, filepath.Ext(name)) }

// fileID identifies one version of a file.
type fileID struct {
	dev, ino uint64
	ctime    int64
	size     int64
	sum      [sha256.Size]byte
}

// confFile is what one read found in one config file.
type confFile struct {
	id      fileID
	valid   bool     // parses as a CNI config: a type, or a non-empty plugins list
	network string   // its "name"
	chains  bool     // a plugin of type ctscrub
	types   []string // every plugin type, a Multus config's delegates' included
	multus  *multusConf
	// unknown: a version scrubd never read (R2, R3), with why; it may be
	// any config, so wherever the runtime may have used it, it is taken
	// for one that does not chain.
	unknown string
}

// multusConf is what a Multus config says of the network its pods get.
type multusConf struct {
	delegates       []confFile
	clusterNetwork  string
	defaultNetworks []string
}

func isMultus(typ string) bool { return typ == "multus" || typ == "multus-shim" }

// parseConf reads one CNI config (a .conf with "type", or a conflist).
func parseConf(data []byte, depth int) confFile {
	type plugin struct {
		Type            string            `json:"type"`
		Delegates       []json.RawMessage `json:"delegates"`
		ClusterNetwork  string            `json:"clusterNetwork"`
		DefaultNetworks []string          `json:"defaultNetworks"`
	}
	var c struct {
		plugin
		Name    string   `json:"name"`
		Plugins []plugin `json:"plugins"`
	}
	var f confFile
	if json.Unmarshal(data, &c) != nil {
		return f
	}
	plugins := c.Plugins
	if len(plugins) == 0 {
		plugins = []plugin{c.plugin}
	}
	f.valid = c.Type != "" || len(c.Plugins) > 0
	f.network = c.Name
	for _, p := range plugins {
		f.types = append(f.types, p.Type)
		f.chains = f.chains || p.Type == "ctscrub"
		if isMultus(p.Type) && f.multus == nil {
			m := &multusConf{clusterNetwork: p.ClusterNetwork, defaultNetworks: p.DefaultNetworks}
			for _, raw := range p.Delegates {
				dc := confFile{}
				if depth == 0 {
					dc = parseConf(raw, depth+1)
				}
				m.delegates = append(m.delegates, dc)
				f.types = append(f.types, dc.types...)
			}
			f.multus = m
		}
	}
	return f
}

// readConfFile reads one file: its identity and what it says.
func readConfFile(path string) (confFile, error) {
	fh, err := os.Open(path)
	if err != nil {
		return confFile{}, err
	}
	defer fh.Close()
	st, err := fh.Stat()
	if err != nil {
		return confFile{}, err
	}
	if st.IsDir() {
		return confFile{}, errors.New("a directory")
	}
	data, err := io.ReadAll(io.LimitReader(fh, 16<<20))
	if err != nil {
		return confFile{}, err
	}
	f := parseConf(data, 0)
	f.id.size = st.Size()
	f.id.sum = sha256.Sum256(data)
	if s, ok := st.Sys().(*syscall.Stat_t); ok {
		f.id.dev, f.id.ino = s.Dev, s.Ino
		f.id.ctime = s.Ctim.Sec*1e9 + s.Ctim.Nsec
	}
	return f, nil
}

// confDir is one read of the dir: file name to what it held. A file that
// could not be read is there, invalid (the runtime cannot use it either).
type confDir map[string]confFile

func readConfDir(dir string) (confDir, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	out := confDir{}
	for _, e := range ents {
		if e.IsDir() || !isConfName(e.Name()) {
			continue
		}
		f, err := readConfFile(filepath.Join(dir, e.Name()))
		if err != nil && errors.Is(err, os.ErrNotExist) {
			continue // gone since the listing: its event follows
		}
		out[e.Name()] = f
	}
	return out, nil
}

func (c confDir) sorted() []string {
	names := make([]string, 0, len(c))
	for n := range c {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// first is the first file that parses as a CNI config ("" when none), or
// an unknown version before it.
func (c confDir) first() string {
	for _, n := range c.sorted() {
		if c[n].valid || c[n].unknown != "" {
			return n
		}
	}
	return ""
}

// byNetwork is the first valid file whose "name" is network, or an unknown
// version before it.
func (c confDir) byNetwork(network string) string {
	for _, n := range c.sorted() {
		if c[n].valid && c[n].network == network || c[n].unknown != "" {
			return n
		}
	}
	return ""
}

type verdict int

const (
	vNone      verdict = iota // no usable config: no pod can start
	vChained                  // every config the runtime may use chains ctscrub
	vUnchained                // one of them does not, or scrubd cannot tell
)

// evaluate applies the selection rules above to one state of the dir. It
// names the file(s) it went by and, when not chained, why.
func (c confDir) evaluate(defaultNetwork string) (v verdict, files []string, why string) {
	first := c.first()
	if first == "" {
		return vNone, nil, "no file in the dir parses as a CNI config"
	}
	v, why = c.chains(first)
	files = []string{first}
	if defaultNetwork == "" || v == vUnchained {
		return v, files, why
	}
	n := c.byNetwork(defaultNetwork)
	if n == "" {
		return vNone, files, fmt.Sprintf("no config file names the default network %q (cni_default_network)", defaultNetwork)
	}
	if n != first {
		files = append(files, n)
		v, why = c.chains(n)
	}
	return v, files, why
}

// chains judges one file: it chains ctscrub, or it is a Multus config whose
// delegates (or cluster network) all do.
func (c confDir) chains(name string) (verdict, string) {
	f := c[name]
	if f.unknown != "" {
		return vUnchained, f.unknown
	}
	if f.multus == nil {
		if f.chains {
			return vChained, ""
		}
		return vUnchained, name + " has no plugin of type ctscrub"
	}
	m := f.multus
	switch {
	case len(m.defaultNetworks) > 0:
		return vUnchained, name + ": Multus defaultNetworks come from NetworkAttachmentDefinitions, which scrubd cannot read"
	case len(m.delegates) > 0:
		for i, dl := range m.delegates {
			if dl.multus != nil || !dl.chains {
				return vUnchained, fmt.Sprintf("%s: Multus delegate %d (%q) has no plugin of type ctscrub", name, i, dl.network)
			}
		}
		return vChained, ""
	case m.clusterNetwork != "":
		target := ""
		if strings.Contains(m.clusterNetwork, "/") || isConfName(m.clusterNetwork) {
			if b := filepath.Base(m.clusterNetwork); c[b].valid || c[b].unknown != "" {
				target = b
			}
		} else {
			target = c.byNetwork(m.clusterNetwork)
		}
		if target != "" && c[target].unknown != "" {
			return vUnchained, c[target].unknown
		}
		if target == "" || c[target].multus != nil {
			return vUnchained, fmt.Sprintf("%s: Multus clusterNetwork %q is not a config in the dir", name, m.clusterNetwork)
		}
		if !c[target].chains {
			return vUnchained, fmt.Sprintf("%s: Multus clusterNetwork %s has no plugin of type ctscrub", name, target)
		}
		return vChained, ""
	}
	return vUnchained, name + ": a Multus config without delegates or clusterNetwork (its cluster network is unknown to scrubd)"
}

// conflistRuns reports whether the config the runtime uses (the first file
// in dir that parses as a CNI config) runs a plugin of type typ, a Multus
// delegate's included, and names the file ("" when there is none).
func conflistRuns(dir, typ string) (string, bool) {
	if dir == "" {
		return "", false
	}
	c, err := readConfDir(dir)
	if err != nil {
		return "", false
	}
	first := c.first()
	if first == "" {
		return "", false
	}
	return filepath.Join(dir, first), slices.Contains(c[first].types, typ)
}

// enableConflistWatch adds the conflist watch (cni_conf_dir) to the tasks.
func (d *Daemon) enableConflistWatch() error {
	dir := d.cfg.CNIConfDir
	if dir == "" {
		return nil
	}
	d.chained = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "ctscrub_cni_chained",
		Help: "1 when the runtime's CNI config (cni_conf_dir) chains ctscrub; 0 when pods may start unseen.",
	})
	if err := d.m.reg.Register(d.chained); err != nil {
		return err
	}
	d.tasks = append(d.tasks, Task{Name: "conflist", Run: func(ctx context.Context) error {
		return d.watchConflist(ctx, dir, d.cfg.CNIDefaultNetwork, conflistRecheck)
	}})
	return nil
}

// conflistRecheck is the backstop's period (R6).
var conflistRecheck = 30 * time.Second

const (
	// conflistMaxChanged bounds R4's combinations (at most 4^6).
	conflistMaxChanged = 6
	// conflistWriteWait is how long a read waits for a writer that has a
	// config file open to close it.
	conflistWriteWait = time.Second
	// conflistRewatch is how often a removed dir is looked for.
	conflistRewatch = 100 * time.Millisecond
)

// conflistReadHook, when set (tests), is called after each read's verdict.
var conflistReadHook atomic.Pointer[func(dir string)]

// conflistBeforeRead, when set (tests), is called before each read: a test
// holds the watch there to write versions faster than it reads.
var conflistBeforeRead atomic.Pointer[func(dir string)]

// nameEvents are one config file name's events since the last read.
type nameEvents struct {
	versions int  // content versions: renames onto it, write sessions
	absent   bool // deleted, moved away, or written in place (half-written)
	attrib   bool // attributes changed (IN_ATTRIB): the ctime moves
}

// conflistWatch is the inotify watch's state.
type conflistWatch struct {
	d          *Daemon
	dir        string
	defaultNet string
	fd         int
	wake       [2]int // a pipe: ctx's end closes the write side
	last       confDir
	lastCount  map[string]int // versions counted at the last read
	pending    map[string]*nameEvents
	writing    map[string]bool // a write session is open (no IN_CLOSE_WRITE yet)
	since      time.Time       // when the oldest open write session began
	dirty      bool
	overflow   bool
	gone       bool
	retries    int
}

// watchConflist watches dir (R1-R6 above) until ctx ends.
func (d *Daemon) watchConflist(ctx context.Context, dir, defaultNet string, recheck time.Duration) error {
	w := &conflistWatch{d: d, dir: dir, defaultNet: defaultNet, fd: -1}
	if err := unix.Pipe2(w.wake[:], unix.O_NONBLOCK|unix.O_CLOEXEC); err != nil {
		return fmt.Errorf("conflist watch: %w", err)
	}
	defer unix.Close(w.wake[0])
	stop := context.AfterFunc(ctx, func() { unix.Close(w.wake[1]) })
	defer func() {
		if stop() {
			unix.Close(w.wake[1])
		}
	}()
	defer w.close()
	logged := ""
	for ctx.Err() == nil {
		if err := w.open(); err != nil {
			if msg := err.Error(); msg != logged {
				d.log.Warn("cannot watch the CNI config dir: not chained until it can", "conf_dir", dir, "err", err)
				logged = msg
			}
			d.noteConflist(false, dir, "")
			if !w.sleep(conflistRewatch) {
				return nil
			}
			continue
		}
		logged = ""
		if !w.run(recheck) {
			return nil
		}
	}
	return nil
}

func (w *conflistWatch) open() error {
	w.close()
	fd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		return err
	}
	const mask = unix.IN_CREATE | unix.IN_CLOSE_WRITE | unix.IN_MOVED_TO | unix.IN_MOVED_FROM |
		unix.IN_DELETE | unix.IN_MODIFY | unix.IN_ATTRIB | unix.IN_DELETE_SELF | unix.IN_MOVE_SELF | unix.IN_ONLYDIR
	if _, err := unix.InotifyAddWatch(fd, w.dir, mask); err != nil {
		unix.Close(fd)
		return err
	}
	w.fd = fd
	var st unix.Stat_t
	if unix.Stat(w.dir, &st) == nil && st.Nlink == 0 {
		// A hostPath bind mount keeps the removed dir: the host's new
		// one is not what scrubd sees.
		w.d.log.Warn("the CNI config dir was removed on the host and scrubd's mount still shows the old one: restart scrubd's pod", "conf_dir", w.dir)
	}
	// A fresh start: nothing read before counts.
	w.last, w.lastCount = nil, map[string]int{}
	w.pending, w.writing = map[string]*nameEvents{}, map[string]bool{}
	w.dirty, w.overflow, w.gone, w.retries = true, false, false, 0
	return nil
}

func (w *conflistWatch) close() {
	if w.fd >= 0 {
		unix.Close(w.fd)
		w.fd = -1
	}
}

// sleep waits d or until ctx ends (false).
func (w *conflistWatch) sleep(d time.Duration) bool {
	fds := []unix.PollFd{{Fd: int32(w.wake[0]), Events: unix.POLLIN}}
	n, _ := unix.Poll(fds, int(d.Milliseconds()))
	return n == 0
}

// run reads events and the dir until the dir goes (true) or ctx ends
// (false).
func (w *conflistWatch) run(recheck time.Duration) bool {
	next := time.Now().Add(recheck)
	for {
		// Checked before each wait: check's own drain may be the one that
		// saw the dir go, and no event follows it to end the wait.
		if w.gone {
			w.d.noteConflist(false, w.dir, "")
			w.d.log.Warn("the CNI config dir was removed or moved: not chained until it is back", "conf_dir", w.dir)
			return true
		}
		timeout := time.Until(next)
		if w.dirty {
			timeout = 0
			if len(w.writing) > 0 {
				timeout = time.Until(w.since.Add(conflistWriteWait))
			}
		}
		fds := []unix.PollFd{{Fd: int32(w.fd), Events: unix.POLLIN}, {Fd: int32(w.wake[0]), Events: unix.POLLIN}}
		ms := int(max(timeout, 0).Milliseconds())
		if timeout > 0 && ms == 0 {
			ms = 1
		}
		if _, err := unix.Poll(fds, ms); err != nil && !errors.Is(err, unix.EINTR) {
			w.d.log.Error("conflist watch: poll", "err", err)
			return w.sleep(time.Second)
		}
		if fds[1].Revents != 0 {
			return false
		}
		if w.drain(); w.gone {
			continue
		}
		switch {
		case w.dirty && (len(w.writing) == 0 || !time.Now().Before(w.since.Add(conflistWriteWait))):
			w.check()
		case !time.Now().Before(next):
			w.dirty = true
			w.check()
		default:
			continue
		}
		if !w.dirty {
			next = time.Now().Add(recheck)
		}
	}
}

// drain reads every queued event; it reports whether one concerned a
// config file (or the dir).
func (w *conflistWatch) drain() bool {
	var buf [64 << 10]byte
	any := false
	for {
		n, err := unix.Read(w.fd, buf[:])
		if err != nil || n <= 0 {
			if errors.Is(err, unix.EINTR) {
				continue
			}
			return any
		}
		for off := 0; off+unix.SizeofInotifyEvent <= n; {
			ev := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
			name := string(bytes.TrimRight(buf[off+unix.SizeofInotifyEvent:off+unix.SizeofInotifyEvent+int(ev.Len)], "\x00"))
			off += unix.SizeofInotifyEvent + int(ev.Len)
			if w.event(ev.Mask, name) {
				any = true
			}
		}
	}
}

// event records one event; it reports whether it matters.
func (w *conflistWatch) event(mask uint32, name string) bool {
	switch {
	case mask&unix.IN_Q_OVERFLOW != 0:
		w.overflow, w.dirty = true, true
		return true
	case mask&(unix.IN_DELETE_SELF|unix.IN_MOVE_SELF|unix.IN_IGNORED|unix.IN_UNMOUNT) != 0:
		w.gone = true
		return true
	case mask&unix.IN_ISDIR != 0 || !isConfName(name):
		return false
	}
	e := w.pending[name]
	if e == nil {
		e = &nameEvents{}
		w.pending[name] = e
	}
	w.dirty = true
	switch {
	case mask&(unix.IN_CREATE|unix.IN_MODIFY) != 0:
		e.absent = true // half-written until closed
		if !w.writing[name] {
			if len(w.writing) == 0 {
				w.since = time.Now()
			}
			w.writing[name] = true
			e.versions++
		}
	case mask&unix.IN_CLOSE_WRITE != 0:
		delete(w.writing, name)
	case mask&unix.IN_MOVED_TO != 0:
		delete(w.writing, name)
		e.versions++
	case mask&(unix.IN_DELETE|unix.IN_MOVED_FROM) != 0:
		delete(w.writing, name)
		e.absent = true
	case mask&unix.IN_ATTRIB != 0:
		e.attrib = true
	}
	return true
}

// check reads the dir and applies R1-R5 to what changed since the last read.
func (w *conflistWatch) check() {
	if h := conflistBeforeRead.Load(); h != nil {
		(*h)(w.dir)
	}
	cur, err := readConfDir(w.dir)
	if err != nil {
		cur = confDir{}
	}
	// Events that came during the read: the read may have seen part of
	// them. Fold them in and read again, up to a point.
	if w.drain() && !w.gone {
		w.retries++
		if w.retries < 20 {
			return // dirty: the loop reads again
		}
		w.overflow = true // counted as lost: R5
	}
	w.retries, w.dirty = 0, false
	if w.gone {
		return
	}
	v, files, why := cur.evaluate(w.defaultNet)
	file := w.dir
	if len(files) > 0 {
		file = strings.Join(files, ",")
	}
	missed := why // not chained: why not
	if v == vChained && w.last != nil {
		missed = w.missed(cur)
	}
	w.lastCount = map[string]int{}
	for n, e := range w.pending {
		w.lastCount[n] = e.versions
	}
	w.pending, w.overflow = map[string]*nameEvents{}, false
	clear(w.writing) // a writer still writing after the wait: its next write is a new version
	w.last = cur
	w.d.noteConflist(v == vChained, file, missed)
	if h := conflistReadHook.Load(); h != nil {
		(*h)(w.dir)
	}
	if v != vChained && why != "" {
		w.d.log.Debug("CNI config not chained", "conf_dir", w.dir, "why", why)
	}
}

// missed applies R2-R5 to the change from w.last to cur: "" when every
// state the dir may have been in between chained (or had no config).
func (w *conflistWatch) missed(cur confDir) string {
	if w.overflow {
		return "the inotify queue overflowed: changes were lost"
	}
	changed := map[string]bool{}
	for n := range w.pending {
		changed[n] = true
	}
	for n, f := range cur {
		if old, ok := w.last[n]; !ok || old.id != f.id {
			changed[n] = true
		}
	}
	for n := range w.last {
		if _, ok := cur[n]; !ok {
			changed[n] = true
		}
	}
	type states struct {
		name string
		opts []*confFile // nil: absent
	}
	var all []states
	for _, n := range slices.Sorted(maps.Keys(changed)) {
		e := w.pending[n]
		if e == nil {
			e = &nameEvents{}
		}
		old, hadOld := w.last[n]
		now, hasNow := cur[n]
		idChanged := hadOld != hasNow || hadOld && old.id != now.id
		// The same content (ctime aside: a chmod moves it).
		same := hadOld == hasNow && (!hadOld || old.id.dev == now.id.dev && old.id.ino == now.id.ino &&
			old.id.size == now.id.size && old.id.sum == now.id.sum)
		unknown := ""
		switch {
		case e.versions >= 2:
			unknown = fmt.Sprintf("%s: %d versions between two reads, one never read (R2)", n, e.versions)
		case e.versions >= 1 && !hasNow:
			unknown = fmt.Sprintf("%s: a version gone before a read (R2)", n)
		case e.versions == 0 && !e.absent && !(same && (e.attrib || !idChanged)):
			unknown = fmt.Sprintf("%s changed with no event for it: its versions were not counted (R3)", n)
		case e.versions == 0 && !e.absent:
			continue // attributes only
		case e.versions >= 1 && !idChanged && w.lastCount[n] >= 1:
			unknown = fmt.Sprintf("%s: an event for the version already read, after one counted: a version was never read (R3)", n)
		}
		s := states{name: n}
		if hadOld {
			s.opts = append(s.opts, &old)
		} else {
			s.opts = append(s.opts, nil)
		}
		if !same {
			if hasNow {
				s.opts = append(s.opts, &now)
			} else {
				s.opts = append(s.opts, nil)
			}
		}
		if e.absent && hadOld && hasNow {
			s.opts = append(s.opts, nil)
		}
		if unknown != "" {
			s.opts = append(s.opts, &confFile{unknown: unknown})
		}
		all = append(all, s)
	}
	if len(all) > conflistMaxChanged {
		return fmt.Sprintf("%d config files changed between two reads (R4)", len(all))
	}
	// Every combination (R4).
	state := confDir{}
	for n, f := range cur {
		state[n] = f
	}
	var walk func(i int) string
	walk = func(i int) string {
		if i == len(all) {
			if v, files, why := state.evaluate(w.defaultNet); v == vUnchained {
				if strings.HasSuffix(why, "(R2)") || strings.HasSuffix(why, "(R3)") {
					return why // a version never read, where the runtime may have used it
				}
				return fmt.Sprintf("a state between two reads did not chain ctscrub (%s; %s) (R4)", strings.Join(files, ","), why)
			}
			return ""
		}
		for _, o := range all[i].opts {
			if o == nil {
				delete(state, all[i].name)
			} else {
				state[all[i].name] = *o
			}
			if m := walk(i + 1); m != "" {
				return m
			}
		}
		return ""
	}
	return walk(0)
}

// noteConflist records one read of the runtime's CNI config: the
// ownership rule's reading (owner.Rule.SetChained), the gauge, and the
// signs of an unseen owner. All of the watch's effects on ownership go through here.
//
// chained: the config read now chains ctscrub. missed (chained only): a
// state of the config between the last read and this one may not have
// chained it (R2-R5), a sign of an unseen owner all the same.
func (d *Daemon) noteConflist(chained bool, file, missed string) {
	dir := d.cfg.CNIConfDir
	changed := d.own.SetChained(chained)
	d.chained.Set(b2f(chained))
	switch {
	case !chained && changed:
		d.unseenOwner("the CNI config does not chain ctscrub", "conf_dir", dir, "file", file, "detail", missed)
	case chained && changed:
		// SetChained started a new epoch: IPs a DEL released while it did
		// not chain may have gone to a pod created meanwhile.
		d.log.Info("the CNI config chains ctscrub again; what was released or indexed before is not trusted", "conf_dir", dir, "file", file, "epoch", d.own.Epoch())
		d.pokeSight() // pods started meanwhile may still run: find them
	case chained && missed != "":
		d.unseenOwner("a version of the CNI config scrubd could not read may not have chained ctscrub", "conf_dir", dir, "file", file, "detail", missed)
	}
}
