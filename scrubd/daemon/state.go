package daemon

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/api"
)

// stateVersion is the layout of the state file; a file of another version is
// refused rather than half-read.
const stateVersion = 1

// stateFile is what survives a daemon restart in user space, as a journal
// of attachments (started, stopped, forgotten). The recorder's maps are
// pinned in bpffs and its tc filters stay on the pods' interfaces; the index
// itself is written to a snapshot at a clean stop only (snapshot.go): after
// any other stop every attached IP is marked incomplete, so its next scrub
// sweeps (see docs/daemon.md, "Restarts").
type stateFile struct {
	Version int              `json:"version"`
	Pods    []api.IndexedPod `json:"pods"`
	Stopped []api.IndexedPod `json:"stopped,omitempty"`
}

// journalEntry is one line of the journal beside the state file
// (path + ".log"): the attachment as it is after one change.
type journalEntry struct {
	Op  string         `json:"op"` // journalActive, journalStopped, journalForget
	Pod api.IndexedPod `json:"pod"`
}

const (
	journalActive  = "active"
	journalStopped = "stopped"
	journalForget  = "forget"
)

// pods is the set of attachments scrubd indexes, and of those recently
// stopped (a DEL without prevResult asks for their IPs). Every change is
// written before it is acknowledged: one journal line (a few hundred bytes),
// whatever the number of pods; the state file itself is rewritten only when
// the journal holds more lines than twice the attachments (at least 64), so
// a change costs O(1) amortised instead of a rewrite of every pod
// (docs/daemon.md, "Restarts").
//
// A journal line is written, not fsynced: what it is for is a restart of
// scrubd (a crash, an OOM kill, an upgrade), and a write in the page cache
// survives that. Only a node crash loses it, and a node crash also ends
// every pod, network namespace, CT map and bpffs pin the line describes.
// On a disk (this VM's /run is ext4, not a tmpfs) the fsync cost 2.5–8 ms
// per ADD and DEL; on a tmpfs (/run on a node) it is free and useless. The
// rare rewrite of the file keeps its fsync before the rename, so that even
// a node crash leaves the old file or the new one, never an empty one that
// would stop scrubd from starting.
type pods struct {
	mu       sync.Mutex
	path     string
	ttl      time.Duration
	active   map[api.Attachment]api.IndexedPod
	stopped  map[api.Attachment]api.IndexedPod
	journal  *os.File
	logLines int
}

func newPods(path string, ttl time.Duration) *pods {
	return &pods{
		path: path, ttl: ttl,
		active:  make(map[api.Attachment]api.IndexedPod),
		stopped: make(map[api.Attachment]api.IndexedPod),
	}
}

// load reads the state file and replays its journal; a missing file is an
// empty state.
func (p *pods) load() error {
	if p.path == "" {
		return nil
	}
	data, err := os.ReadFile(p.path)
	if errors.Is(err, os.ErrNotExist) {
		data, err = []byte(fmt.Sprintf(`{"version":%d}`, stateVersion)), nil // the journal alone
	}
	if err != nil {
		return fmt.Errorf("read state file: %w", err)
	}
	var st stateFile
	if err := json.Unmarshal(data, &st); err != nil {
		return fmt.Errorf("state file %s: %v (move it away to start with no attachments; their IPs will then sweep)", p.path, err)
	}
	if st.Version != stateVersion {
		return fmt.Errorf("state file %s: version %d, this scrubd reads %d (move it away to start with no attachments)", p.path, st.Version, stateVersion)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, pod := range st.Pods {
		p.active[pod.Attachment] = pod
	}
	for _, pod := range st.Stopped {
		p.stopped[pod.Attachment] = pod
	}
	return p.replayLocked()
}

// replayLocked applies the journal's lines in order. A torn last line (a
// crash while it was written: that change was never acknowledged) is
// ignored.
func (p *pods) replayLocked() error {
	data, err := os.ReadFile(p.path + ".log")
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read state journal: %w", err)
	}
	lines := bytes.Split(data, []byte("\n"))
	for i, line := range lines {
		if len(line) == 0 {
			continue
		}
		var e journalEntry
		if err := json.Unmarshal(line, &e); err != nil {
			if i == len(lines)-1 {
				break // torn: never acknowledged
			}
			return fmt.Errorf("state journal %s.log, line %d: %v (move it and the state file away to start with no attachments; their IPs will then sweep)", p.path, i+1, err)
		}
		p.applyLocked(e)
		p.logLines++
	}
	return nil
}

func (p *pods) applyLocked(e journalEntry) {
	a := e.Pod.Attachment
	switch e.Op {
	case journalActive:
		p.active[a] = e.Pod
		delete(p.stopped, a)
	case journalStopped:
		p.stopped[a] = e.Pod
		delete(p.active, a)
	case journalForget:
		delete(p.active, a)
		delete(p.stopped, a)
	}
}

// recordLocked makes changes survive a restart of scrubd: one write of their
// journal lines (no fsync, see pods), or a rewrite of the state file when
// the journal has grown past twice the attachments.
func (p *pods) recordLocked(entries ...journalEntry) error {
	if p.path == "" {
		return nil
	}
	if p.logLines+len(entries) > max(64, 2*(len(p.active)+len(p.stopped))) {
		return p.saveLocked()
	}
	var buf bytes.Buffer
	for _, e := range entries {
		line, err := json.Marshal(e)
		if err != nil {
			return err
		}
		buf.Write(line)
		buf.WriteByte('\n')
	}
	if p.journal == nil {
		if err := os.MkdirAll(filepath.Dir(p.path), 0o700); err != nil {
			return fmt.Errorf("state dir: %w", err)
		}
		f, err := os.OpenFile(p.path+".log", os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
		if err != nil {
			return fmt.Errorf("open state journal: %w", err)
		}
		p.journal = f
	}
	if _, err := p.journal.Write(buf.Bytes()); err != nil {
		return fmt.Errorf("write state journal: %w", err)
	}
	p.logLines += len(entries)
	return nil
}

// saveLocked writes the state atomically: a crash leaves the old file or the
// new one, never a torn one.
func (p *pods) saveLocked() error {
	if p.path == "" {
		return nil
	}
	now := time.Now()
	st := stateFile{Version: stateVersion, Pods: sortedPods(p.active)}
	for a, pod := range p.stopped {
		if p.ttl > 0 && now.Sub(pod.Stopped) > p.ttl {
			delete(p.stopped, a)
		}
	}
	st.Stopped = sortedPods(p.stopped)
	data, err := json.MarshalIndent(st, "", "  ")
	if err != nil {
		return err
	}
	dir := filepath.Dir(p.path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("state dir: %w", err)
	}
	tmp, err := os.CreateTemp(dir, ".attachments-*.json")
	if err != nil {
		return fmt.Errorf("write state file: %w", err)
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return fmt.Errorf("write state file: %w", err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return fmt.Errorf("write state file: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("write state file: %w", err)
	}
	if err := os.Rename(tmp.Name(), p.path); err != nil {
		return fmt.Errorf("write state file: %w", err)
	}
	// The file holds every change now; a crash before the truncation only
	// replays changes the file already has.
	if err := os.Truncate(p.path+".log", 0); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("truncate state journal: %w", err)
	}
	p.logLines = 0
	return nil
}

func sortedPods(m map[api.Attachment]api.IndexedPod) []api.IndexedPod {
	out := make([]api.IndexedPod, 0, len(m))
	for _, pod := range m {
		out = append(out, pod)
	}
	slices.SortFunc(out, func(a, b api.IndexedPod) int {
		if a.ContainerID != b.ContainerID {
			if a.ContainerID < b.ContainerID {
				return -1
			}
			return 1
		}
		if a.IfName < b.IfName {
			return -1
		} else if a.IfName > b.IfName {
			return 1
		}
		return 0
	})
	return out
}

// start records an attachment (replacing an earlier one of the same key).
// An other active attachment holding one of its IPs is stale (an IP belongs
// to one live pod; its DEL never reached scrubd): it is moved to the stopped
// set and returned, so that the caller detaches it and an IP has one owner.
func (p *pods) start(pod api.IndexedPod) (displaced []api.IndexedPod, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var entries []journalEntry
	for a, other := range p.active {
		if a == pod.Attachment {
			continue
		}
		for _, ip := range other.IPs {
			if slices.Contains(pod.IPs, ip) {
				other.Stopped = time.Now().UTC()
				displaced = append(displaced, other)
				entries = append(entries, journalEntry{journalStopped, other})
				break
			}
		}
	}
	entries = append(entries, journalEntry{journalActive, pod})
	for _, e := range entries {
		p.applyLocked(e)
	}
	return displaced, p.recordLocked(entries...)
}

// stop moves an attachment to the stopped set; it returns what was known.
func (p *pods) stop(a api.Attachment) (api.IndexedPod, bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	pod, ok := p.active[a]
	if !ok {
		pod, ok = p.stopped[a]
		return pod, ok, nil
	}
	pod.Stopped = time.Now().UTC()
	e := journalEntry{journalStopped, pod}
	p.applyLocked(e)
	return pod, true, p.recordLocked(e)
}

// forget drops an attachment from both sets.
func (p *pods) forget(a api.Attachment) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	e := journalEntry{Op: journalForget, Pod: api.IndexedPod{Attachment: a}}
	p.applyLocked(e)
	return p.recordLocked(e)
}

// get returns an attachment, active or recently stopped.
func (p *pods) get(a api.Attachment) (api.IndexedPod, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if pod, ok := p.active[a]; ok {
		return pod, true
	}
	pod, ok := p.stopped[a]
	if ok && p.ttl > 0 && time.Since(pod.Stopped) > p.ttl {
		return api.IndexedPod{}, false
	}
	return pod, ok
}

// list returns the active and the stopped attachments, sorted.
func (p *pods) list() (active, stopped []api.IndexedPod) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return sortedPods(p.active), sortedPods(p.stopped)
}

func (p *pods) activeCount() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.active)
}

// owner returns the active attachment that holds ip, if any.
func (p *pods) owner(ip netip.Addr) *api.Attachment {
	p.mu.Lock()
	defer p.mu.Unlock()
	for a, pod := range p.active {
		for _, pip := range pod.IPs {
			if pip.Unmap() == ip {
				a := a
				return &a
			}
		}
	}
	return nil
}
