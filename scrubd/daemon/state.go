package daemon

import (
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

// stateFile is what survives a daemon restart in user space. The recorder's
// maps and links are pinned in bpffs by the recorder itself; the index is not
// persisted: after a restart every attached IP is marked incomplete, so its
// next scrub sweeps (see docs/daemon.md, "Restarts").
type stateFile struct {
	Version int              `json:"version"`
	Pods    []api.IndexedPod `json:"pods"`
	Stopped []api.IndexedPod `json:"stopped,omitempty"`
}

// pods is the set of attachments scrubd indexes, and of those recently
// stopped (a DEL without prevResult asks for their IPs). Every change is
// written to the state file before it is acknowledged.
type pods struct {
	mu      sync.Mutex
	path    string
	ttl     time.Duration
	active  map[api.Attachment]api.IndexedPod
	stopped map[api.Attachment]api.IndexedPod
}

func newPods(path string, ttl time.Duration) *pods {
	return &pods{
		path: path, ttl: ttl,
		active:  make(map[api.Attachment]api.IndexedPod),
		stopped: make(map[api.Attachment]api.IndexedPod),
	}
}

// load reads the state file; a missing file is an empty state.
func (p *pods) load() error {
	if p.path == "" {
		return nil
	}
	data, err := os.ReadFile(p.path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
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
	for a, other := range p.active {
		if a == pod.Attachment {
			continue
		}
		for _, ip := range other.IPs {
			if slices.Contains(pod.IPs, ip) {
				delete(p.active, a)
				other.Stopped = time.Now().UTC()
				p.stopped[a] = other
				displaced = append(displaced, other)
				break
			}
		}
	}
	p.active[pod.Attachment] = pod
	delete(p.stopped, pod.Attachment)
	return displaced, p.saveLocked()
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
	delete(p.active, a)
	pod.Stopped = time.Now().UTC()
	p.stopped[a] = pod
	return pod, true, p.saveLocked()
}

// forget drops an attachment from both sets.
func (p *pods) forget(a api.Attachment) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.active, a)
	delete(p.stopped, a)
	return p.saveLocked()
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
