// Package recorder is the kernel side of ctscrub's index: it loads
// bpf/recorder.c, attaches it to pods' container-side interfaces as two
// direct-action cls_bpf filters on a clsact qdisc (not tcx links: see
// docs/recorder.md, "Why cls_bpf filters and not tcx links") and feeds its
// records into the index.
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
	"sync/atomic"
	"time"

	"github.com/ctscrub/ctscrub/internal/nsexec"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/ringbuf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/bpf"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/recorder/tcfilter"
)

// DefaultPinDir is where scrubd pins the recorder's maps (and where an
// older scrubd pinned its tcx links, under links/, which Attach removes).
const DefaultPinDir = "/sys/fs/bpf/ctscrub"

// Defaults for Options.
const (
	DefaultRingBytes   = 8 << 20 // ~150k records of burst while user space is busy or down
	DefaultReopenIdle  = 10 * time.Second
	DefaultSeenEntries = 1 << 18 // flows remembered per node and family (96 bytes each for IPv4, 120 for IPv6 in the kernel, preallocated)
	// DefaultFrontEntries: slots per CPU of the IPv4 TCP front cache (24
	// bytes each: 384 KiB per CPU).
	DefaultFrontEntries = 1 << 14
	// DefaultLostEntries: pod IPs with a lost-record count (a node's pod
	// IPs over the pins' lifetime; 1.5 MiB preallocated).
	DefaultLostEntries = 1 << 14
)

// Names of Cilium's service maps, looked up under Options.CTRoot.
const (
	ServiceMap4 = "cilium_lb4_services_v2"
	ServiceMap6 = "cilium_lb6_services_v2"
)

// The recorder's pinned maps (under Options.PinDir). Their names are the
// map names in bpf/recorder.c. The front cache is not pinned: it is a copy
// of rec_flows4 entries, checked against rec_gen.
var pinnedMaps = []string{"rec_events", "rec_flows4", "rec_flows6", "rec_gen", "rec_lost_ip", "rec_lost_total", "rec_lost_overflow", "rec_owner", "rec_foreign_total"}

// Pins of an older recorder (LRU lost counter, flow caches without
// generations), removed by Load. rec_lost's counts are carried over.
var legacyMaps = []string{"rec_seen4", "rec_seen6", "rec_lost"}

// Options configure Load.
type Options struct {
	// PinDir holds the recorder's pinned maps. Default DefaultPinDir.
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
	// LostEntries sizes the per-IP lost counters (rec_lost_ip, a hash that
	// never evicts; a loss it has no room for marks every IP incomplete).
	// Default DefaultLostEntries.
	LostEntries int
	// FrontEntries sizes the per-CPU front cache of established IPv4 TCP
	// flows: a power of two. Default DefaultFrontEntries.
	FrontEntries int
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
	// NodeConfig is the Cilium agent's node_config.h, whose CT lifetimes
	// bound how long a SERVICE entry lives (a flow to a service without
	// backends is settled as "no entry" only within them). Default
	// DefaultNodeConfig; unreadable, no flow is settled that way.
	NodeConfig string
	// CTFill counts the entries of one of Cilium's CT maps cheaply
	// (cilium.Backend.Count with the kernel's counter). Without it no
	// flow is settled as "no entry" (an LRU eviction cannot be excluded).
	CTFill func(ctmap.Kind) (int64, error)
	// L7LB reports whether the node's Cilium has ENABLE_L7_LB (read from
	// node_config.h). A flow to an L7 load-balancer VIP is recorded as the
	// plain flow Cilium then keeps; without L7LB, or when it reports
	// false, the pod is marked incomplete (ReasonL7LBUnconfirmed).
	L7LB func() bool
	// NodeNetns is the network namespace the pods' host-side veths live
	// in, where Attach puts the host-side link (docs/recorder.md,
	// "Host-side recording"). Default: the process's own (scrubd runs in
	// the node's).
	NodeNetns string
	// ContainerSideOnly attaches the container-side filters only, as the
	// recorder did before host-side recording: frames a pod sends with
	// PACKET_QDISC_BYPASS are then missed. For tests and benchmarks of the
	// container side; scrubd never sets it.
	ContainerSideOnly bool
}

// Recorder is the loaded recorder.
type Recorder struct {
	opts Options
	objs bpf.RecorderObjects
	// progMu guards what ReloadPrograms swaps: the programs Attach puts on
	// interfaces, and the service maps they read.
	progMu sync.RWMutex
	prog   [3]*ebpf.Program       // ingress, egress, host side
	vip    [2]bool                // VIP detection on for IPv4, IPv6
	svc    [numWatched]ebpf.MapID // the Cilium maps the programs read (watchedMaps)
	// reloaded: programs of a ReloadPrograms (r.objs holds the first ones).
	reloaded []*ebpf.Program

	ifaces    [64]sync.Mutex // striped by interface: Attach/Detach of one interface in turn
	lostMu    sync.Mutex
	lostSeen  map[[16]byte]uint64 // last lost count acted on, per IP
	overflow  uint64              // last overflow count acted on
	lostTotal atomic.Uint64       // rec_lost_total when PollLost last read the counts
	// An older recorder's per-IP lost counter (LRU, pin removed): its
	// programs count into it until Attach replaces them, so it is polled too.
	legacy     *ebpf.Map
	legacySeen map[[16]byte]uint64

	genMu sync.Mutex // one generation bump at a time (read, add one, write)

	ctMu sync.RWMutex // guards opts.CT: held by a prune, taken by SetCT

	fill      fillWatch     // the CT maps' fill, sampled (noentry.go)
	life      lifetimes     // SERVICE entries' lifetimes on this node
	noEntries atomic.Uint64 // flows settled as "Cilium made no entry"

	// nodeNS: the namespace of the pods' host-side veths (Options.NodeNetns),
	// open; nil with ContainerSideOnly, or until the first Attach opens a
	// named one (nodeNSMu).
	nodeNSMu sync.Mutex
	nodeNS   *os.File

	// netnsCheck: the programs compare a sent packet's network namespace
	// with its source address's owner's, not only the ifindex.
	netnsCheck bool

	bar atomic.Pointer[barrier] // Run's, while it runs

	unresolved       atomic.Uint64 // IPs Resolve marked incomplete
	repicksConfirmed atomic.Uint64 // flows confirmRepicks settled
	// svcq: Run's early-resolution queue (its drops are a metric).
	svcq atomic.Pointer[resolveQueue]
}

// FastSyncs returns how many Index.Sync calls of the running Run found the
// reader caught up and returned without waking it; 0 when Run is not
// running.
func (r *Recorder) FastSyncs() uint64 {
	if b := r.bar.Load(); b != nil {
		return b.fast.Load()
	}
	return 0
}

// SetCT points the prune at other CT maps (Cilium re-created them). It
// returns once no prune uses the old ones, so the caller may close them.
// Recording itself does not depend on the CT maps: records carry keys.
func (r *Recorder) SetCT(ct *ctmap.Maps) {
	r.ctMu.Lock()
	r.opts.CT = ct
	r.ctMu.Unlock()
	r.resetFill()
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
	if opts.LostEntries == 0 {
		opts.LostEntries = DefaultLostEntries
	}
	if opts.FrontEntries == 0 {
		opts.FrontEntries = DefaultFrontEntries
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
	if opts.FrontEntries < 1 || opts.FrontEntries&(opts.FrontEntries-1) != 0 {
		return nil, fmt.Errorf("recorder: front-cache size %d: must be a power of two", opts.FrontEntries)
	}

	spec, err := recorderSpec(opts)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(opts.PinDir, 0o700); err != nil {
		return nil, fmt.Errorf("recorder: create pin dir %s: %w (is bpffs mounted at /sys/fs/bpf?)", opts.PinDir, err)
	}

	if opts.NodeConfig == "" {
		opts.NodeConfig = DefaultNodeConfig
	}
	r := &Recorder{opts: opts, lostSeen: make(map[[16]byte]uint64)}
	r.life.path = opts.NodeConfig
	if !opts.ContainerSideOnly && opts.NodeNetns == "" {
		// The process's own, now: the calling goroutine's thread is in it.
		// A named one is opened at the first Attach (it may not exist yet).
		if r.nodeNS, err = openNodeNS(""); err != nil {
			return nil, err
		}
	}
	repl, err := openServiceMaps(spec, opts, &r.vip, &r.svc)
	if err != nil {
		r.closeNodeNS()
		return nil, err
	}
	defer func() {
		for _, m := range repl {
			m.Close()
		}
	}()
	err = spec.LoadAndAssign(&r.objs, &ebpf.CollectionOptions{
		Maps:            ebpf.MapOptions{PinPath: opts.PinDir},
		MapReplacements: repl,
	})
	if err != nil {
		r.closeNodeNS()
		var ve *ebpf.VerifierError
		switch {
		case errors.Is(err, ebpf.ErrMapIncompatible):
			return nil, fmt.Errorf("recorder: pinned maps under %s were made with other sizes (RingBytes, SeenEntries or LostEntries changed?): %w; "+
				"keep the old sizes, or remove %s/rec_* to start fresh (the index then treats every IP as not tracked)", opts.PinDir, err, opts.PinDir)
		case errors.As(err, &ve):
			return nil, fmt.Errorf("recorder: load BPF programs: %+v", ve)
		}
		return nil, fmt.Errorf("recorder: load BPF programs (root, bpffs at /sys/fs/bpf?): %w", err)
	}
	r.prog = [3]*ebpf.Program{r.objs.RecorderIngress, r.objs.RecorderEgress, r.objs.RecorderHost}
	if n := r.PruneHostLinks(); n > 0 {
		opts.Log.Info("recorder: removed host-side links of interfaces gone while scrubd was down", "links", n)
	}
	r.netnsCheck = netnsCookieInTC()
	if !r.netnsCheck {
		opts.Log.Warn("recorder: this kernel's tc programs cannot read a network namespace's cookie (bpf_get_netns_cookie); "+
			"a sent packet's source address is checked against its interface's ifindex only: a pod whose interface has the ifindex of "+
			"another pod's (in its own namespace) can file keys under that pod's addresses", "source_check", r.SourceCheck())
	}
	if (r.vip[0] || r.vip[1]) && opts.CT != nil {
		if _, err := r.life.get(); err != nil {
			opts.Log.Warn("recorder: a pod whose flow to a service finds no backend will be marked incomplete (its DEL scrub sweeps): the SERVICE entries' lifetimes are unknown", "err", err)
		}
	}
	r.legacy = removeLegacyMaps(opts.PinDir, opts.Log)
	r.legacySeen = make(map[[16]byte]uint64)
	return r, nil
}

// recorderSpec is the embedded BPF object set up for opts: sizes, the
// programs' constants, the pinned maps.
func recorderSpec(opts Options) (*ebpf.CollectionSpec, error) {
	spec, err := bpf.LoadRecorder()
	if err != nil {
		return nil, fmt.Errorf("recorder: parse embedded BPF object: %w", err)
	}
	// The program counts time in 2^30 ns units (a shift, not a division).
	idle := uint32((opts.ReopenIdle + 1<<30 - 1) >> 30)
	if err := spec.Variables["reopen_idle"].Set(idle); err != nil {
		return nil, fmt.Errorf("recorder: set reopen_idle: %w", err)
	}
	// A non-TCP flow's front cache entry stands for half the idle time:
	// the time it does not note makes a reopening early, never late.
	if err := spec.Variables["front_idle"].Set((max(idle, 1) - 1) / 2); err != nil {
		return nil, fmt.Errorf("recorder: set front_idle: %w", err)
	}
	if err := spec.Variables["front_mask"].Set(uint32(opts.FrontEntries - 1)); err != nil {
		return nil, fmt.Errorf("recorder: set front_mask: %w", err)
	}
	if err := setSourceCheck(spec); err != nil {
		return nil, err
	}
	spec.Maps["rec_events"].MaxEntries = uint32(opts.RingBytes)
	spec.Maps["rec_flows4"].MaxEntries = uint32(opts.SeenEntries)
	spec.Maps["rec_flows6"].MaxEntries = uint32(opts.SeenEntries)
	spec.Maps["rec_front4"].MaxEntries = uint32(opts.FrontEntries)
	spec.Maps["rec_lost_ip"].MaxEntries = uint32(max(opts.LostEntries, 1))
	for _, n := range pinnedMaps {
		spec.Maps[n].Pinning = ebpf.PinByName
	}
	return spec, nil
}

// watchedMaps are the maps of Cilium's the programs read, pinned under
// CTRoot: the service maps (VIP detection) and the four global CT maps (a
// service flow's SERVICE entry, for its backend_id).
var watchedMaps = []string{ServiceMap4, ServiceMap6,
	ctmap.TCP4.Name(), ctmap.Any4.Name(), ctmap.TCP6.Name(), ctmap.Any6.Name()}

const numWatched = 6

// openServiceMaps opens Cilium's maps the programs read (watchedMaps),
// pinned under opts.CTRoot, as replacements for the programs' own, and
// sets vip (detection on per family) and ids (the maps opened). A family
// whose service map is not pinned has VIP detection off; a CT map not
// pinned leaves its service flows' backends to user space (Resolve).
func openServiceMaps(spec *ebpf.CollectionSpec, opts Options, vip *[2]bool, ids *[numWatched]ebpf.MapID) (map[string]*ebpf.Map, error) {
	repl := make(map[string]*ebpf.Map)
	fail := func(err error) (map[string]*ebpf.Map, error) {
		for _, m := range repl {
			m.Close()
		}
		return nil, err
	}
	for i, name := range watchedMaps {
		if i < 2 {
			vip[i] = false
		}
		ids[i] = 0
		path := filepath.Join(opts.CTRoot, name)
		m, err := ebpf.LoadPinnedMap(path, nil)
		if errors.Is(err, os.ErrNotExist) {
			if i < 2 {
				opts.Log.Info("recorder: Cilium service map not pinned, VIP detection off for this family (fine without Cilium; with Cilium check --ct-root)",
					"map", path)
			}
			continue
		}
		if err != nil {
			return fail(fmt.Errorf("recorder: open Cilium service map %s: %w", path, err))
		}
		ms := spec.Maps[name]
		if m.Type() != ms.Type || m.KeySize() != ms.KeySize || m.ValueSize() != ms.ValueSize {
			m.Close()
			// Failing is safer than running blind: without VIP detection
			// an IP talking to a service would be declared complete.
			return fail(fmt.Errorf("recorder: Cilium service map %s: type %s key %d value %d, expected %s key %d value %d (unsupported Cilium version?)",
				path, m.Type(), m.KeySize(), m.ValueSize(), ms.Type, ms.KeySize, ms.ValueSize))
		}
		ms.MaxEntries = m.MaxEntries()
		ms.Flags = m.Flags()
		repl[name] = m
		if i < 2 {
			vip[i] = true
		}
		if info, err := m.Info(); err == nil {
			ids[i], _ = info.ID()
		}
	}
	return repl, nil
}

// removeLegacyMaps removes an older recorder's pins and returns its lost
// counter, if there was one (PollLost reads it as it reads its own).
func removeLegacyMaps(dir string, log *slog.Logger) (lost *ebpf.Map) {
	if m, err := ebpf.LoadPinnedMap(filepath.Join(dir, "rec_lost"), nil); err == nil {
		lost = m
	}
	for _, n := range legacyMaps {
		if err := os.Remove(filepath.Join(dir, n)); err == nil {
			log.Info("recorder: removed an older recorder's map pin", "pin", filepath.Join(dir, n))
		}
	}
	return lost
}

// VIPDetection reports whether Cilium's service maps were found for IPv4
// and IPv6.
func (r *Recorder) VIPDetection() (v4, v6 bool) {
	r.progMu.RLock()
	defer r.progMu.RUnlock()
	return r.vip[0], r.vip[1]
}

// lockIface serialises Attach and Detach of one interface (different pods
// attach in parallel); it returns the unlock function.
func (r *Recorder) lockIface(netnsPath, ifname string) func() {
	h := fnv.New32a()
	h.Write([]byte(netnsPath + "\x00" + ifname))
	mu := &r.ifaces[h.Sum32()%uint32(len(r.ifaces))]
	mu.Lock()
	return mu.Unlock
}

// The recorder's tc filters (package tcfilter knows them, for uninstall):
// one direct-action cls_bpf filter on each of the clsact qdisc's hooks, at
// FilterPriority with FilterHandle, named tcfilter.Name (see
// docs/recorder.md, "Where it runs").
const (
	FilterPriority = tcfilter.Priority
	FilterHandle   = tcfilter.Handle
	filterName     = tcfilter.Name
)

func recorderFilter(ifindex int, parent uint32, prog *ebpf.Program) *netlink.BpfFilter {
	return &netlink.BpfFilter{
		FilterAttrs: netlink.FilterAttrs{
			LinkIndex: ifindex,
			Parent:    parent,
			Handle:    FilterHandle,
			Priority:  FilterPriority,
			Protocol:  unix.ETH_P_ALL,
		},
		Fd:           prog.FD(),
		Name:         filterName,
		DirectAction: true,
	}
}

// Attach attaches the recorder to ifname inside the network namespace at
// netnsPath: a clsact qdisc (kept when one exists) and a direct-action
// cls_bpf filter on its ingress and egress hooks. The programs return
// TC_ACT_UNSPEC: the next filter runs and no verdict changes. The filters
// live as long as the interface (they survive a daemon restart and hold the
// program); attaching an interface already attached replaces the filters'
// program in place (an upgrade), atomically.
//
// Before the filters go live it records the interface's addresses as its
// own (rec_owner: the address, the ifindex, the network namespace's
// cookie), so the first packet the pod sends from them is not taken for a
// forged source; an earlier owner's entry of a reused address is
// overwritten.
//
// It then bumps the generation of the interface's addresses (ForgetIPs),
// O(1) per address: flows cached for a pod that held an address before
// (or for live pods towards it) stop matching, so the new pod's flows that
// reuse a 5-tuple are recorded. The addresses must be configured when
// Attach runs, as they are when the CNI chain calls it after the
// IP-assigning plugin. If that step fails the error says so and the caller
// must treat the addresses as incomplete.
func (r *Recorder) Attach(netnsPath, ifname string) (ifindex int, err error) {
	return r.AttachSteps(netnsPath, ifname, nil)
}

// AttachSteps is Attach calling mark (when not nil) after each of its steps
// with the step's name ("enter", "link", "addrs", "owner", "qdisc",
// "filters", "leave", "host", "forget", "legacy"): scrubd's per-request
// timing (docs/daemon.md, "Server-Timing").
//
// Unless Options.ContainerSideOnly, Attach also puts recorder_host on the
// interface's host-side peer (attachHost). When that fails the filters stay
// on and the error wraps ErrHostSide: the caller must keep the pod's IPs
// incomplete while it lives (ReasonHostSide).
func (r *Recorder) AttachSteps(netnsPath, ifname string, mark func(step string)) (ifindex int, err error) {
	if mark == nil {
		mark = func(string) {}
	}
	defer r.lockIface(netnsPath, ifname)()
	addrs, ifindex, hostIfindex, hostErr, err := r.attachFilters(netnsPath, ifname, mark)
	mark("leave")
	if err != nil {
		return 0, fmt.Errorf("recorder: attach to %s in netns %s: %w", ifname, netnsPath, err)
	}
	if hostErr == nil && hostIfindex != 0 {
		hostErr = r.attachHost(netnsPath, ifname, hostIfindex)
	}
	mark("host")
	// After both hooks: flows cached before either was on are recorded again.
	if err := r.ForgetIPs(addrs...); err != nil {
		return ifindex, fmt.Errorf("recorder: attach to %s in netns %s: %w", ifname, netnsPath, errors.Join(err, hostErr))
	}
	mark("forget")
	// A pod attached by an older scrubd (tcx links pinned under
	// PinDir/links): the filters record now, so the links can go.
	r.removeLegacyLinks(netnsPath, ifname)
	mark("legacy")
	if hostErr != nil {
		return ifindex, fmt.Errorf("recorder: attach to %s in netns %s: %w", ifname, netnsPath, hostErr)
	}
	return ifindex, nil
}

// attachFilters records the interface's addresses as its own, then installs
// (or re-points) its filters, and returns the addresses, and the host-side
// peer's ifindex or why it has none (wrapping ErrHostSide).
func (r *Recorder) attachFilters(netnsPath, ifname string, mark func(string)) (addrs []netip.Addr, ifindex, hostIfindex int, hostErr error, err error) {
	err = InNetns(netnsPath, func() error {
		mark("enter")
		// NETLINK_ROUTE only: a handle with no family named opens a
		// socket for XFRM and NETFILTER as well, about 35 µs more per
		// attach on this project's VM, on the pod start's path.
		h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
		if err != nil {
			return fmt.Errorf("netlink: %w", err)
		}
		defer h.Close()
		l, err := h.LinkByName(ifname)
		if err != nil {
			return fmt.Errorf("find interface %q: %w", ifname, err)
		}
		mark("link")
		// The programs parse from an Ethernet header; on an interface
		// without one (netkit in L3 mode, tun, ipip) they would record
		// nothing while the index believed them attached.
		if et := l.Attrs().EncapType; et != "ether" {
			return fmt.Errorf("interface %q has link type %q, not Ethernet: the recorder parses Ethernet frames only (veth, netkit in L2 mode); this pod cannot be indexed, its scrubs will sweep", ifname, et)
		}
		ifindex = l.Attrs().Index
		if !r.opts.ContainerSideOnly {
			hostIfindex, hostErr = r.hostPeer(h, l)
		}
		list, err := h.AddrList(l, netlink.FAMILY_ALL)
		if err != nil {
			return fmt.Errorf("list addresses of %s: %w", ifname, err)
		}
		for _, a := range list {
			if ip, ok := netip.AddrFromSlice(a.IP); ok {
				addrs = append(addrs, ip.Unmap())
			}
		}
		mark("addrs")
		// Before the filters: a genuine first packet must find its
		// source owned. Without the entries every flow the pod sends
		// would be taken as forged (its IPs marked incomplete).
		netns, err := netnsCookie()
		if err != nil {
			return err
		}
		if err := r.own(addrs, netns, ifindex, hostIfindex); err != nil {
			return err
		}
		mark("owner")
		qd := &netlink.GenericQdisc{
			QdiscAttrs: netlink.QdiscAttrs{LinkIndex: ifindex, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT},
			QdiscType:  "clsact",
		}
		if err := h.QdiscAdd(qd); err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("add clsact qdisc to %s: %w", ifname, err)
		}
		mark("qdisc")
		if err := r.replaceFilters(h, ifindex, ifname); err != nil {
			return err
		}
		mark("filters")
		return nil
	})
	return addrs, ifindex, hostIfindex, hostErr, err
}

// replaceFilters creates the interface's two filters or swaps their program
// in place. The programs' fds are used under progMu's read lock:
// ReloadPrograms closes the programs it replaces under the write lock.
func (r *Recorder) replaceFilters(h *netlink.Handle, ifindex int, ifname string) error {
	r.progMu.RLock()
	defer r.progMu.RUnlock()
	for _, f := range []*netlink.BpfFilter{
		recorderFilter(ifindex, netlink.HANDLE_MIN_INGRESS, r.prog[0]),
		recorderFilter(ifindex, netlink.HANDLE_MIN_EGRESS, r.prog[1]),
	} {
		if err := h.FilterReplace(f); err != nil {
			return fmt.Errorf("add cls_bpf filter (priority %d, handle %#x) to %s: %w (another filter of another kind at priority %d?)",
				FilterPriority, FilterHandle, ifname, err, FilterPriority)
		}
	}
	return nil
}

// Attached reports whether ctscrub's filters are on ifname in netnsPath
// (both hooks): they are found by priority and handle, no pin needed.
func Attached(netnsPath, ifname string) (bool, error) {
	var n int
	err := InNetns(netnsPath, func() error {
		l, err := netlink.LinkByName(ifname)
		if err != nil {
			return err
		}
		for _, parent := range []uint32{netlink.HANDLE_MIN_INGRESS, netlink.HANDLE_MIN_EGRESS} {
			fs, err := netlink.FilterList(l, parent)
			if err != nil {
				return err
			}
			for _, f := range fs {
				if bf, ok := f.(*netlink.BpfFilter); ok && bf.Handle == FilterHandle && bf.Priority == FilterPriority {
					n++
					break
				}
			}
		}
		return nil
	})
	if err != nil {
		return false, fmt.Errorf("recorder: list filters of %s in netns %s: %w", ifname, netnsPath, err)
	}
	return n == 2, nil
}

// Detach removes the recorder's filters from ifname in netnsPath (the
// clsact qdisc stays: other programs may use it), its host-side link, and the interface's
// addresses' owner entries that still name it. It succeeds when the
// netns, the interface or the filters are already gone. The daemon does not
// call it at CNI DEL: the filters keep recording until the runtime removes
// the interface, and go with it.
func (r *Recorder) Detach(netnsPath, ifname string) error {
	defer r.lockIface(netnsPath, ifname)()
	r.removeLegacyLinks(netnsPath, ifname)
	r.detachHost(netnsPath, ifname)
	if _, err := os.Stat(netnsPath); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	err := InNetns(netnsPath, func() error {
		l, err := netlink.LinkByName(ifname)
		if err != nil {
			var nf netlink.LinkNotFoundError
			if errors.As(err, &nf) {
				return nil
			}
			return fmt.Errorf("find interface %q: %w", ifname, err)
		}
		var errs []error
		for _, f := range []*netlink.BpfFilter{
			recorderFilter(l.Attrs().Index, netlink.HANDLE_MIN_INGRESS, r.objs.RecorderIngress),
			recorderFilter(l.Attrs().Index, netlink.HANDLE_MIN_EGRESS, r.objs.RecorderEgress),
		} {
			f.Fd = -1
			if err := netlink.FilterDel(f); err != nil && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.EINVAL) {
				errs = append(errs, fmt.Errorf("delete filter: %w", err))
			}
		}
		// After the filters: nothing reads the entries any more. An
		// interface or namespace already gone leaves its entries to the
		// LRU and to the next owner's Attach; its cookie never returns.
		if list, err := netlink.AddrList(l, netlink.FAMILY_ALL); err == nil {
			if netns, err := netnsCookie(); err == nil {
				var addrs []netip.Addr
				for _, a := range list {
					if ip, ok := netip.AddrFromSlice(a.IP); ok {
						addrs = append(addrs, ip.Unmap())
					}
				}
				r.disown(addrs, netns, l.Attrs().Index)
			}
		}
		return errors.Join(errs...)
	})
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("recorder: detach from %s in netns %s: %w", ifname, netnsPath, err)
	}
	return nil
}

// legacyLinkPins are the pin paths of the tcx links an older scrubd pinned
// for one interface under PinDir/links.
func (r *Recorder) legacyLinkPins(netnsPath, ifname string) []string {
	sum := sha256.Sum256([]byte(netnsPath + "\x00" + ifname))
	base := strings.NewReplacer("/", "_", ".", "_").Replace(filepath.Base(netnsPath))
	name := fmt.Sprintf("%s_%s_%s", base, ifname, hex.EncodeToString(sum[:6]))
	dir := filepath.Join(r.opts.PinDir, "links")
	return []string{filepath.Join(dir, name+"_ingress"), filepath.Join(dir, name+"_egress")}
}

// removeLegacyLinks drops the tcx links an older scrubd pinned for one
// interface (the link goes with its pin). One stat when there are none.
func (r *Recorder) removeLegacyLinks(netnsPath, ifname string) {
	for _, pin := range r.legacyLinkPins(netnsPath, ifname) {
		if _, err := os.Lstat(pin); err != nil {
			continue
		}
		if l, err := link.LoadPinnedLink(pin, nil); err == nil {
			l.Unpin()
			l.Close()
		}
		os.Remove(pin)
	}
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
	bar := &barrier{rd: rd, pos: mapPositions(r.objs.RecEvents)}
	defer bar.pos.close()
	r.bar.Store(bar)
	defer r.bar.Store(nil)
	hooks := r.Hooks(ix)
	hooks.Sync = func(ctx context.Context) error {
		if err := bar.wait(ctx); err != nil {
			return err
		}
		return r.syncLost(ix)
	}
	ix.SetHooks(hooks)
	defer ix.SetHooks(nil)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		// Scrubs do not wait for this poll: Sync reads the counters
		// itself (syncLost). It keeps the marks (and their metric)
		// current between scrubs.
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for n := 1; ; n++ {
			select {
			case <-ctx.Done():
				rd.Close()
				return
			case <-t.C:
			}
			if err := r.PollLost(ix); err != nil {
				r.opts.Log.Warn("recorder: poll lost counters", "err", err)
			}
			// Deleted pods leave their host-side links' pins (scrubd
			// does not detach at DEL); each holds a program.
			if n%60 == 0 {
				r.PruneHostLinks()
			}
		}
	}()
	defer wg.Wait()

	var q *pruneQueue
	r.ctMu.RLock()
	prune := r.opts.CT != nil
	r.ctMu.RUnlock()
	if prune {
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
					r.ctMu.RLock()
					_, err := r.Prune(ix, r.opts.CT, ip)
					r.ctMu.RUnlock()
					if err != nil {
						r.opts.Log.Warn("recorder: prune", "ip", ip, "err", err)
					}
				}
			}
		}()
	}

	// Early resolution: a service flow's OUT key in the index soon after
	// its record, so the audit and the prune see it.
	svcq := newResolveQueue(resolveQueueLen)
	r.svcq.Store(svcq)
	wg.Add(1)
	go func() {
		defer wg.Done()
		r.resolveEarly(ctx, ix, svcq)
	}()
	// The CT maps' fill, so a flow to a service without backends can be
	// settled as "no entry" (noentry.go).
	wg.Add(1)
	go func() {
		defer wg.Done()
		r.WatchFill(ctx.Done())
	}()

	var rec ringbuf.Record
	for {
		upTo := bar.noted()
		if err := rd.ReadInto(&rec); err != nil {
			if isFlushed(err) {
				bar.appliedUpTo()
				bar.flushed(upTo)
				continue
			}
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
			bar.appliedUpTo()
			continue
		}
		Apply(ix, &rc)
		if rc.Kind == RecL7LB && (r.opts.L7LB == nil || !r.opts.L7LB()) {
			if pod := rc.addrs()[0]; ix.Owns(pod) { // the OUT key's daddr
				ix.MarkIncomplete(pod, ReasonL7LBUnconfirmed)
			}
		}
		bar.appliedUpTo()
		if rc.Kind == RecServiceEntry {
			svcq.offer(rc.addrs()[1], time.Now()) // the pod: saddr of the SERVICE key
		}
		if q != nil {
			for _, ip := range rc.addrs() {
				if ix.Owns(ip) && ix.NeedsPrune(ip) {
					q.offer(ip)
				}
			}
		}
	}
}

// ServiceMapsChanged reports whether Cilium's service maps pinned under
// CTRoot are other maps than the ones the programs read: Cilium re-created
// one (an agent restart that changed its size), or one appeared after the
// programs were loaded (Cilium started after scrubd). Until ReloadPrograms
// runs, VIP detection looks at maps Cilium no longer fills, so a flow to a
// new service is recorded as a flow to its VIP, a key Cilium never makes:
// the pod's IP would pass as complete with its real entries missing. The
// same for the CT maps the programs read SERVICE entries from (a
// re-created one is reported once the CT watch handed it over).
func (r *Recorder) ServiceMapsChanged() bool {
	r.progMu.RLock()
	svc := r.svc
	r.progMu.RUnlock()
	for i, name := range watchedMaps {
		var id ebpf.MapID
		if m, err := ebpf.LoadPinnedMap(filepath.Join(r.opts.CTRoot, name), nil); err == nil {
			if info, ierr := m.Info(); ierr == nil {
				id, _ = info.ID()
			}
			m.Close()
		}
		// A pin gone (Cilium between unpin and re-create) is no change yet.
		if id == 0 || id == svc[i] {
			continue
		}
		if i >= 2 && !r.ctHandedOver(watchedCT[i-2], id) {
			continue
		}
		return true
	}
	return false
}

// watchedCT are the CT maps of watchedMaps[2:], in that order.
var watchedCT = []ctmap.Kind{ctmap.TCP4, ctmap.Any4, ctmap.TCP6, ctmap.Any6}

// ctHandedOver: a re-created CT map (pinned as id) is followed once the
// daemon's CT watch has re-opened the CT maps and handed them over
// (SetCT): that watch marks every IP first, with the reason that names the
// CT maps, and Resolve reads the new maps from then on. Without maps handed
// over (no CT watch) the pins are followed at once.
func (r *Recorder) ctHandedOver(k ctmap.Kind, id ebpf.MapID) bool {
	r.ctMu.RLock()
	ct := r.opts.CT
	r.ctMu.RUnlock()
	return ct == nil || ct.ID(k) == id
}

// ReloadPrograms loads the recorder's programs again over the service maps
// pinned now, keeping every other map (the ring buffer, the flow caches,
// the generations and the lost counters are pinned; the per-CPU front
// cache is shared with the old programs). Interfaces keep the old programs
// until Attach puts the new ones on them (in place, atomically); the caller
// re-attaches every interface and then treats every IP as incomplete.
func (r *Recorder) ReloadPrograms() error {
	spec, err := recorderSpec(r.opts)
	if err != nil {
		return err
	}
	var vip [2]bool
	var ids [numWatched]ebpf.MapID
	repl, err := openServiceMaps(spec, r.opts, &vip, &ids)
	if err != nil {
		return err
	}
	defer func() {
		for _, m := range repl {
			m.Close()
		}
	}()
	// The recorder's own maps are the ones Load opened, which the reader
	// reads, not whatever the pin dir holds now: with the pins gone (a
	// cleanup script, a bpffs remount) a load by pin path made fresh maps,
	// and the new programs recorded into a ring no one read (make soak).
	own := r.ownMaps()
	for name := range spec.Maps {
		if strings.HasPrefix(name, "rec_") && own[name] == nil {
			return fmt.Errorf("recorder: reload: map %s is not among the recorder's own (ownMaps)", name)
		}
	}
	for name, m := range own {
		repl[name] = m
	}
	var objs bpf.RecorderObjects
	err = spec.LoadAndAssign(&objs, &ebpf.CollectionOptions{MapReplacements: repl})
	for name := range own {
		delete(repl, name) // r's own: not closed by the defer
	}
	if err != nil {
		return fmt.Errorf("recorder: reload BPF programs over the service maps under %s: %w", r.opts.CTRoot, err)
	}
	objs.RecorderMaps.Close() // clones of r.objs's and of the service maps
	r.progMu.Lock()
	r.prog = [3]*ebpf.Program{objs.RecorderIngress, objs.RecorderEgress, objs.RecorderHost}
	r.vip, r.svc = vip, ids
	// The programs an earlier reload made: filters still using them hold
	// their own references (until Attach moves them), so only this
	// process's fds go. Load's own stay in r.objs until Close.
	for _, p := range r.reloaded {
		p.Close()
	}
	r.reloaded = []*ebpf.Program{objs.RecorderIngress, objs.RecorderEgress, objs.RecorderHost}
	r.progMu.Unlock()
	r.opts.Log.Warn("recorder: Cilium's service maps changed; programs reloaded over the maps pinned now",
		"vip_detection_v4", vip[0], "vip_detection_v6", vip[1])
	return nil
}

// ownMaps are the recorder's own maps, by name in its BPF object: every
// map of it but Cilium's.
func (r *Recorder) ownMaps() map[string]*ebpf.Map {
	m := r.objs.RecorderMaps
	return map[string]*ebpf.Map{
		"rec_events": m.RecEvents, "rec_flows4": m.RecFlows4, "rec_flows6": m.RecFlows6,
		"rec_foreign_total": m.RecForeignTotal, "rec_front4": m.RecFront4, "rec_gen": m.RecGen,
		"rec_lost_ip": m.RecLostIp, "rec_lost_overflow": m.RecLostOverflow, "rec_lost_total": m.RecLostTotal,
		"rec_owner": m.RecOwner,
	}
}

// programs are the programs Attach puts on interfaces now.
func (r *Recorder) programs() (ingress, egress *ebpf.Program) {
	r.progMu.RLock()
	defer r.progMu.RUnlock()
	return r.prog[0], r.prog[1]
}

// syncLost is the second half of Index.Sync, after the ring's barrier: a
// record lost before the scrub asked is in no ring, only in the lost
// counters, and the poll of those runs once a second. One lookup of
// rec_lost_total tells whether any loss happened since the counts were last
// read; if so, PollLost marks the IPs now, before the scrub reads their
// state. The program counts a loss per IP (or as overflow) before it counts
// it in the total, so a total that moved means the per-IP count is there.
func (r *Recorder) syncLost(ix *index.Index) error {
	var total uint64
	if err := r.objs.RecLostTotal.Lookup(uint32(0), &total); err != nil {
		return fmt.Errorf("recorder: read lost counter: %w", err)
	}
	if total == r.lostTotal.Load() {
		return nil
	}
	return r.PollLost(ix)
}

// PollLost marks incomplete every IP whose lost count grew since the last
// poll, and every IP of the index when rec_lost_ip had no room to count a
// loss (its overflow counter grew). Run calls it every second, and Sync
// when the total moved (syncLost).
func (r *Recorder) PollLost(ix *index.Index) error {
	r.lostMu.Lock()
	defer r.lostMu.Unlock()
	// The total first: a loss counted after this read is seen by the next
	// poll or Sync, since its per-IP count may not be read below.
	var total uint64
	if err := r.objs.RecLostTotal.Lookup(uint32(0), &total); err != nil {
		return fmt.Errorf("recorder: read lost counter: %w", err)
	}
	if err := r.pollLostLocked(ix); err != nil {
		return err
	}
	r.lostTotal.Store(total)
	return nil
}

func (r *Recorder) pollLostLocked(ix *index.Index) error {
	var over uint64
	if err := r.objs.RecLostOverflow.Lookup(uint32(0), &over); err != nil {
		return fmt.Errorf("recorder: read lost overflow counter: %w", err)
	}
	if over > r.overflow {
		r.opts.Log.Error("recorder: the per-IP lost counter is full; every IP is marked incomplete", "overflow", over)
		// A bootstrap pass filing now vouches for no address either: a
		// lost record's address may have no slot yet.
		ix.SpoilFiling()
		for _, ip := range ix.IPs() {
			ix.MarkIncomplete(ip, index.ReasonLost)
		}
		r.overflow = over
	}
	if r.legacy != nil {
		if err := pollCounts(r.legacy, r.legacySeen, ix); err != nil {
			return fmt.Errorf("recorder: read an older recorder's lost counters: %w", err)
		}
	}
	return pollCounts(r.objs.RecLostIp, r.lostSeen, ix)
}

// pollCounts marks incomplete every IP whose count in m grew past seen.
func pollCounts(m *ebpf.Map, seen map[[16]byte]uint64, ix *index.Index) error {
	var k [16]byte
	var v uint64
	it := m.Iterate()
	for it.Next(&k, &v) {
		if v > seen[k] {
			ix.MarkIncomplete(netip.AddrFrom16(k).Unmap(), index.ReasonLost)
			seen[k] = v
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

// Reloaded reports how many reloaded programs the recorder holds open (3
// after any number of reloads, 0 before the first).
func (r *Recorder) Reloaded() int {
	r.progMu.RLock()
	defer r.progMu.RUnlock()
	return len(r.reloaded)
}

// Close releases the programs and maps. Pinned maps and the filters stay, so
// attached interfaces keep recording until the next Load reads the ring.
func (r *Recorder) Close() error {
	r.closeNodeNS()
	if r.legacy != nil {
		r.legacy.Close()
	}
	for _, p := range r.reloaded {
		p.Close()
	}
	return r.objs.Close()
}

// Programs returns the ingress and egress programs Attach uses now
// (benchmarks read their run-time statistics).
func (r *Recorder) Programs() (ingress, egress *ebpf.Program) { return r.programs() }
