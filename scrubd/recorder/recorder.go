// Package recorder is the kernel side of ctscrub's index: it loads
// bpf/recorder.c, attaches it with tcx to pods' container-side interfaces and
// feeds its records into the index (see docs/recorder.md).
package recorder

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/ctscrub/ctscrub/internal/nsexec"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/ringbuf"
	"github.com/vishvananda/netlink"

	"github.com/ctscrub/ctscrub/bpf"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// DefaultPinDir is where scrubd pins the recorder's maps and links.
const DefaultPinDir = "/sys/fs/bpf/ctscrub"

// Defaults for Options.
const (
	DefaultRingBytes   = 8 << 20 // ~150k records of burst while user space is busy or down
	DefaultReopenIdle  = 10 * time.Second
	DefaultSeenEntries = 1 << 18 // flows remembered per node and family (88 bytes each for IPv4, 112 for IPv6 in the kernel, preallocated)
)

// Names of Cilium's service maps, looked up under Options.CTRoot.
const (
	ServiceMap4 = "cilium_lb4_services_v2"
	ServiceMap6 = "cilium_lb6_services_v2"
)

// The recorder's pinned maps (under Options.PinDir). Their names are the
// map names in bpf/recorder.c.
var pinnedMaps = []string{"rec_events", "rec_seen4", "rec_seen6", "rec_lost", "rec_lost_total"}

// Options configure Load.
type Options struct {
	// PinDir holds the recorder's pinned maps and, under links/, its
	// pinned tcx links. Default DefaultPinDir.
	PinDir string
	// CTRoot is where Cilium pins its global maps; the service maps are
	// read from there. Default ctmap.DefaultRoot.
	CTRoot string
	// RingBytes sizes the ring buffer: a power of two, at least one page.
	// Default DefaultRingBytes.
	RingBytes int
	// SeenEntries sizes the per-node caches of recorded flows (one per
	// family). Default DefaultSeenEntries.
	SeenEntries int
	// Log receives operational messages. Default slog.Default().
	Log *slog.Logger
	// ReopenIdle: a UDP/ICMP/SCTP flow idle this long whose next packet goes
	// the other way is recorded again, with the other side as initiator
	// (Cilium's entry may have expired and been re-created that way). Keep
	// it below Cilium's non-TCP CT lifetime (60 s by default). Resolution
	// about 1.07 s. Default DefaultReopenIdle.
	ReopenIdle time.Duration
	// CT, when set, lets Run prune keys Cilium no longer holds from an IP
	// whose set doubled since its last prune (see Prune). Without it the
	// daemon must call Prune itself or stale keys accumulate until a scrub
	// takes them.
	CT *ctmap.Maps
}

// Recorder is the loaded recorder.
type Recorder struct {
	opts Options
	objs bpf.RecorderObjects
	vip  [2]bool // VIP detection on for IPv4, IPv6
	svc  [2]ebpf.MapID
	// svcWarned: the service-map change was logged already.
	svcWarned [2]bool

	ifaces   [64]sync.Mutex // striped by interface: Attach/Detach of one interface in turn
	lostMu   sync.Mutex
	lostSeen map[[16]byte]uint64 // last lost count acted on, per IP

	forgetQ forgetQueue
}

// Load loads the recorder's programs. Its maps are pinned under PinDir; when
// pins from an earlier run exist they are reused, so records made while the
// daemon was down are still in the ring buffer and the links attached then
// keep feeding it.
func Load(opts Options) (*Recorder, error) {
	if opts.PinDir == "" {
		opts.PinDir = DefaultPinDir
	}
	if opts.CTRoot == "" {
		opts.CTRoot = ctmap.DefaultRoot
	}
	if opts.RingBytes == 0 {
		opts.RingBytes = DefaultRingBytes
	}
	if opts.SeenEntries == 0 {
		opts.SeenEntries = DefaultSeenEntries
	}
	if opts.Log == nil {
		opts.Log = slog.Default()
	}
	if opts.ReopenIdle == 0 {
		opts.ReopenIdle = DefaultReopenIdle
	}
	if opts.RingBytes < os.Getpagesize() || opts.RingBytes&(opts.RingBytes-1) != 0 {
		return nil, fmt.Errorf("recorder: ring buffer size %d: must be a power of two of at least %d bytes", opts.RingBytes, os.Getpagesize())
	}
	if opts.SeenEntries < 1 {
		return nil, fmt.Errorf("recorder: seen-cache size %d: must be positive", opts.SeenEntries)
	}

	spec, err := bpf.LoadRecorder()
	if err != nil {
		return nil, fmt.Errorf("recorder: parse embedded BPF object: %w", err)
	}
	// The program counts time in 2^30 ns units (a shift, not a division).
	idle := uint32((opts.ReopenIdle + 1<<30 - 1) >> 30)
	if err := spec.Variables["reopen_idle"].Set(idle); err != nil {
		return nil, fmt.Errorf("recorder: set reopen_idle: %w", err)
	}
	spec.Maps["rec_events"].MaxEntries = uint32(opts.RingBytes)
	spec.Maps["rec_seen4"].MaxEntries = uint32(opts.SeenEntries)
	spec.Maps["rec_seen6"].MaxEntries = uint32(opts.SeenEntries)
	for _, n := range pinnedMaps {
		spec.Maps[n].Pinning = ebpf.PinByName
	}
	if err := os.MkdirAll(opts.PinDir, 0o700); err != nil {
		return nil, fmt.Errorf("recorder: create pin dir %s: %w (is bpffs mounted at /sys/fs/bpf?)", opts.PinDir, err)
	}

	r := &Recorder{opts: opts, lostSeen: make(map[[16]byte]uint64)}
	repl := make(map[string]*ebpf.Map)
	defer func() {
		for _, m := range repl {
			m.Close()
		}
	}()
	for i, name := range []string{ServiceMap4, ServiceMap6} {
		path := filepath.Join(opts.CTRoot, name)
		m, err := ebpf.LoadPinnedMap(path, nil)
		if errors.Is(err, os.ErrNotExist) {
			opts.Log.Info("recorder: Cilium service map not pinned, VIP detection off for this family (fine without Cilium; with Cilium check --ct-root)",
				"map", path)
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("recorder: open Cilium service map %s: %w", path, err)
		}
		ms := spec.Maps[name]
		if m.Type() != ms.Type || m.KeySize() != ms.KeySize || m.ValueSize() != ms.ValueSize {
			m.Close()
			// Failing is safer than running blind: without VIP detection
			// an IP talking to a service would be declared complete.
			return nil, fmt.Errorf("recorder: Cilium service map %s: type %s key %d value %d, expected %s key %d value %d (unsupported Cilium version?)",
				path, m.Type(), m.KeySize(), m.ValueSize(), ms.Type, ms.KeySize, ms.ValueSize)
		}
		ms.MaxEntries = m.MaxEntries()
		ms.Flags = m.Flags()
		repl[name] = m
		r.vip[i] = true
		if info, err := m.Info(); err == nil {
			r.svc[i], _ = info.ID()
		}
	}

	err = spec.LoadAndAssign(&r.objs, &ebpf.CollectionOptions{
		Maps:            ebpf.MapOptions{PinPath: opts.PinDir},
		MapReplacements: repl,
	})
	if err != nil {
		var ve *ebpf.VerifierError
		switch {
		case errors.Is(err, ebpf.ErrMapIncompatible):
			return nil, fmt.Errorf("recorder: pinned maps under %s were made with other sizes (RingBytes/SeenEntries changed?): %w; "+
				"keep the old sizes, or remove %s/rec_* to start fresh (the index then treats every IP as not tracked)", opts.PinDir, err, opts.PinDir)
		case errors.As(err, &ve):
			return nil, fmt.Errorf("recorder: load BPF programs: %+v", ve)
		}
		return nil, fmt.Errorf("recorder: load BPF programs (root, bpffs at /sys/fs/bpf, kernel 6.6+ for tcx?): %w", err)
	}
	return r, nil
}

// VIPDetection reports whether Cilium's service maps were found for IPv4
// and IPv6.
func (r *Recorder) VIPDetection() (v4, v6 bool) { return r.vip[0], r.vip[1] }

// lockIface serialises Attach and Detach of one interface (different pods
// attach in parallel); it returns the unlock function.
func (r *Recorder) lockIface(pin string) func() {
	h := fnv.New32a()
	h.Write([]byte(pin))
	mu := &r.ifaces[h.Sum32()%uint32(len(r.ifaces))]
	mu.Lock()
	return mu.Unlock
}

// linkPins returns the pin paths of the ingress and egress links of one
// interface. The name is derived from the netns path and interface name
// only, so Detach finds the pins after the netns is gone.
func (r *Recorder) linkPins(netnsPath, ifname string) (ingress, egress string) {
	sum := sha256.Sum256([]byte(netnsPath + "\x00" + ifname))
	base := strings.NewReplacer("/", "_", ".", "_").Replace(filepath.Base(netnsPath))
	name := fmt.Sprintf("%s_%s_%s", base, ifname, hex.EncodeToString(sum[:6]))
	dir := filepath.Join(r.opts.PinDir, "links")
	return filepath.Join(dir, name+"_ingress"), filepath.Join(dir, name+"_egress")
}

// Attach attaches the recorder to ifname inside the network namespace at
// netnsPath (tcx ingress and egress, ahead of any other tcx program; they
// return TCX_NEXT and never change a verdict). The links are pinned under
// PinDir/links, so they survive a daemon restart. Attaching an interface
// that is already attached is a no-op apart from moving the links to this
// Recorder's programs.
//
// On a fresh attach it also drops from the seen caches every flow of the
// interface's addresses (ForgetIPs): they may have belonged to a pod that is
// gone, and its cached flows would hide the new pod's flows that reuse a
// 5-tuple. The addresses must be configured when Attach runs, as they are
// when the CNI chain calls it after the IP-assigning plugin.
func (r *Recorder) Attach(netnsPath, ifname string) (ifindex int, err error) {
	fresh, addrs, ifindex, err := r.attachLinks(netnsPath, ifname)
	if err != nil {
		return 0, fmt.Errorf("recorder: attach to %s in netns %s: %w", ifname, netnsPath, err)
	}
	// Outside the attach lock: pods attached together share the passes.
	if fresh {
		if _, err := r.ForgetIPs(addrs...); err != nil {
			return 0, fmt.Errorf("recorder: attach to %s in netns %s: %w", ifname, netnsPath, err)
		}
	}
	return ifindex, nil
}

// attachLinks attaches (or re-points) the pinned links of one interface and
// returns whether it created them and the interface's addresses.
func (r *Recorder) attachLinks(netnsPath, ifname string) (fresh bool, addrs []netip.Addr, ifindex int, err error) {
	pinIn, pinEg := r.linkPins(netnsPath, ifname)
	defer r.lockIface(pinIn)()
	if err := os.MkdirAll(filepath.Dir(pinIn), 0o700); err != nil {
		return false, nil, 0, fmt.Errorf("create %s: %w", filepath.Dir(pinIn), err)
	}
	err = InNetns(netnsPath, func() error {
		l, err := netlink.LinkByName(ifname)
		if err != nil {
			return fmt.Errorf("find interface %q: %w", ifname, err)
		}
		// The programs parse from an Ethernet header; on an interface
		// without one (netkit in L3 mode, tun, ipip) they would record
		// nothing while the index believed them attached.
		if et := l.Attrs().EncapType; et != "ether" {
			return fmt.Errorf("interface %q has link type %q, not Ethernet: the recorder parses Ethernet frames only (veth, netkit in L2 mode); this pod cannot be indexed, its scrubs will sweep", ifname, et)
		}
		ifindex = l.Attrs().Index
		for _, a := range []struct {
			pin  string
			prog *ebpf.Program
			typ  ebpf.AttachType
		}{
			{pinIn, r.objs.RecorderIngress, ebpf.AttachTCXIngress},
			{pinEg, r.objs.RecorderEgress, ebpf.AttachTCXEgress},
		} {
			created, err := attachOne(a.pin, a.prog, a.typ, ifindex)
			if err != nil {
				return err
			}
			fresh = fresh || created
		}
		list, err := netlink.AddrList(l, netlink.FAMILY_ALL)
		if err != nil {
			return fmt.Errorf("list addresses of %s: %w", ifname, err)
		}
		for _, a := range list {
			if ip, ok := netip.AddrFromSlice(a.IP); ok {
				addrs = append(addrs, ip.Unmap())
			}
		}
		return nil
	})
	return fresh, addrs, ifindex, err
}

// attachOne attaches prog to ifindex and pins the link at pin, or moves an
// existing pinned link of that interface to prog. It reports whether it
// created a link.
func attachOne(pin string, prog *ebpf.Program, typ ebpf.AttachType, ifindex int) (bool, error) {
	if old, err := link.LoadPinnedLink(pin, nil); err == nil {
		info, ierr := old.Info()
		if ierr == nil && info.TCX() != nil && int(info.TCX().Ifindex) == ifindex {
			// Still attached here (daemon restart): run this binary's
			// program from now on, atomically.
			err := old.Update(prog)
			old.Close()
			if err != nil {
				return false, fmt.Errorf("update pinned link %s: %w", pin, err)
			}
			return false, nil
		}
		// A link of an interface that is gone (the netns path was
		// reused): drop it.
		old.Unpin()
		old.Close()
	} else if !errors.Is(err, os.ErrNotExist) {
		os.Remove(pin)
	}
	l, err := link.AttachTCX(link.TCXOptions{Interface: ifindex, Program: prog, Attach: typ, Anchor: link.Head()})
	if err != nil {
		return false, fmt.Errorf("tcx attach %s (kernel 6.6+ needed): %w", typ, err)
	}
	defer l.Close()
	if err := l.Pin(pin); err != nil {
		return false, fmt.Errorf("pin link %s: %w", pin, err)
	}
	return true, nil
}

// Detach removes the recorder from ifname in netnsPath. It succeeds when the
// netns, the interface or the links are already gone.
func (r *Recorder) Detach(netnsPath, ifname string) error {
	pinIn, pinEg := r.linkPins(netnsPath, ifname)
	defer r.lockIface(pinIn)()
	var errs []error
	for _, pin := range []string{pinIn, pinEg} {
		l, err := link.LoadPinnedLink(pin, nil)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			// Not a link (corrupt pin): removing the file is all we can do.
			if rerr := os.Remove(pin); rerr != nil && !errors.Is(rerr, os.ErrNotExist) {
				errs = append(errs, fmt.Errorf("remove pin %s: %w", pin, rerr))
			}
			continue
		}
		// The link goes away with its last reference: the pin and ours.
		if err := l.Unpin(); err != nil {
			errs = append(errs, fmt.Errorf("unpin %s: %w", pin, err))
		}
		l.Close()
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("recorder: detach from %s in netns %s: %w", ifname, netnsPath, err)
	}
	return nil
}

// Attachments lists the pin names of attached links (one per direction and
// interface), for a daemon that reconciles them after a restart.
func (r *Recorder) Attachments() ([]string, error) {
	ents, err := os.ReadDir(filepath.Join(r.opts.PinDir, "links"))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("recorder: list links: %w", err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out, nil
}

// InNetns runs fn on a locked OS thread inside the network namespace at
// path, then moves the thread back. If it cannot move back the thread stays
// locked and Go discards it when the goroutine ends.
func InNetns(path string, fn func() error) error { return nsexec.Do(path, fn) }

// Run reads records until ctx ends and puts each into ix through Apply.
// While it runs, keys the index hands to a scrub (Take) and IPs it declares
// complete (Track) are forgotten by the seen caches (index.Hooks), so
// entries re-created after a scrub are recorded again. It also polls the
// per-IP lost counters and marks an IP incomplete
// (index.ReasonLost) when its count grew; counts found at start count as
// grown, since the records lost may predate this process. Run returns nil
// when ctx ends.
func (r *Recorder) Run(ctx context.Context, ix *index.Index) error {
	rd, err := ringbuf.NewReader(r.objs.RecEvents)
	if err != nil {
		return fmt.Errorf("recorder: open ring buffer: %w", err)
	}
	ix.SetHooks(r.hooks())
	defer ix.SetHooks(nil)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for tick := 0; ; tick++ {
			if err := r.PollLost(ix); err != nil {
				r.opts.Log.Warn("recorder: poll lost counters", "err", err)
			}
			if tick%10 == 0 {
				r.checkServiceMaps()
			}
			select {
			case <-ctx.Done():
				rd.Close()
				return
			case <-t.C:
			}
		}
	}()
	defer wg.Wait()

	var q *pruneQueue
	if r.opts.CT != nil {
		q = newPruneQueue()
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-ctx.Done():
					return
				case ip := <-q.ch:
					q.taken(ip)
					if _, err := r.Prune(ix, r.opts.CT, ip); err != nil {
						r.opts.Log.Warn("recorder: prune", "ip", ip, "err", err)
					}
				}
			}
		}()
	}

	var rec ringbuf.Record
	for {
		if err := rd.ReadInto(&rec); err != nil {
			if errors.Is(err, ringbuf.ErrClosed) {
				// Records submitted just before a loss was counted
				// are in the ring: one last poll after draining is not
				// needed, the counters persist.
				return nil
			}
			return fmt.Errorf("recorder: read ring buffer: %w", err)
		}
		rc, err := ParseRecord(rec.RawSample)
		if err != nil {
			r.opts.Log.Warn("recorder: bad record", "err", err)
			continue
		}
		Apply(ix, &rc)
		if q != nil {
			for _, ip := range rc.addrs() {
				if ix.Owns(ip) && ix.NeedsPrune(ip) {
					q.offer(ip)
				}
			}
		}
	}
}

// checkServiceMaps warns when the service maps pinned under CTRoot are no
// longer the ones the programs were loaded with (Cilium re-created them, or
// started after scrubd): VIP detection then looks at stale maps until
// scrubd restarts.
func (r *Recorder) checkServiceMaps() {
	for i, name := range []string{ServiceMap4, ServiceMap6} {
		if r.svcWarned[i] {
			continue
		}
		path := filepath.Join(r.opts.CTRoot, name)
		var id ebpf.MapID
		m, err := ebpf.LoadPinnedMap(path, nil)
		if err == nil {
			if info, ierr := m.Info(); ierr == nil {
				id, _ = info.ID()
			}
			m.Close()
		}
		switch {
		case r.vip[i] && id != r.svc[i]:
			r.opts.Log.Error("recorder: Cilium's service map changed since scrubd started; VIP detection uses the old map: restart scrubd", "map", path)
			r.svcWarned[i] = true
		case !r.vip[i] && id != 0:
			r.opts.Log.Warn("recorder: Cilium's service map appeared after scrubd started; restart scrubd to turn VIP detection on", "map", path)
			r.svcWarned[i] = true
		}
	}
}

// PollLost marks incomplete every IP whose lost count grew since the last
// poll. Run calls it every second.
func (r *Recorder) PollLost(ix *index.Index) error {
	r.lostMu.Lock()
	defer r.lostMu.Unlock()
	var k [16]byte
	var v uint64
	it := r.objs.RecLost.Iterate()
	for it.Next(&k, &v) {
		if v > r.lostSeen[k] {
			ix.MarkIncomplete(netip.AddrFrom16(k).Unmap(), index.ReasonLost)
			r.lostSeen[k] = v
		}
	}
	return it.Err()
}

// Lost is the total number of records the kernel could not put in the ring
// buffer since the maps were created (metric ctscrub_index_lost_total).
func (r *Recorder) Lost() uint64 {
	var v uint64
	if err := r.objs.RecLostTotal.Lookup(uint32(0), &v); err != nil {
		return 0
	}
	return v
}

// seenKey4 and seenKey6 are struct seen_key4/seen_key6 in bpf/recorder.c:
// the flow from one pod's side (local address and port first).
type (
	seenKey4 [16]byte
	seenKey6 [40]byte
)

func newSeenKey4(local, remote []byte, lport, rport []byte, proto uint8) seenKey4 {
	var k seenKey4
	copy(k[0:4], local)
	copy(k[4:8], remote)
	copy(k[8:10], lport)
	copy(k[10:12], rport)
	k[12] = proto
	return k
}

func newSeenKey6(local, remote []byte, lport, rport []byte, proto uint8) seenKey6 {
	var k seenKey6
	copy(k[0:16], local)
	copy(k[16:32], remote)
	copy(k[32:34], lport)
	copy(k[34:36], rport)
	k[36] = proto
	return k
}

// ForgetFlow4 drops the flow of a CT key from the recorder's cache of seen
// flows, so that a new CT entry for it is recorded again. Index pruning
// calls it for keys Cilium no longer holds. Both pods' views are dropped (a
// same-node flow is cached once per side); related keys are ignored (their
// flow's own key carries them).
func (r *Recorder) ForgetFlow4(k ctmap.CTKey4) error {
	if k.Flags()&ctmap.FlagRelated != 0 {
		return nil
	}
	d, s, dport, sport := k[0:4], k[4:8], k[8:10], k[10:12]
	// The initiator (daddr, sport) as the local side, then the responder.
	return r.forget(r.objs.RecSeen4,
		newSeenKey4(d, s, sport, dport, k.NextHdr()),
		newSeenKey4(s, d, dport, sport, k.NextHdr()))
}

// ForgetFlow6 is ForgetFlow4 for IPv6 keys.
func (r *Recorder) ForgetFlow6(k ctmap.CTKey6) error {
	if k.Flags()&ctmap.FlagRelated != 0 {
		return nil
	}
	d, s, dport, sport := k[0:16], k[16:32], k[32:34], k[34:36]
	return r.forget(r.objs.RecSeen6,
		newSeenKey6(d, s, sport, dport, k.NextHdr()),
		newSeenKey6(s, d, dport, sport, k.NextHdr()))
}

func (r *Recorder) forget(m *ebpf.Map, keys ...any) error {
	for _, k := range keys {
		if err := m.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("recorder: forget flow: %w", err)
		}
	}
	return nil
}

// Close releases the programs and maps. Pinned maps and links stay, so
// attached interfaces keep recording until the next Load reads the ring.
func (r *Recorder) Close() error {
	return r.objs.Close()
}
