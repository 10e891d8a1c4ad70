// Package nfct is ctscrub's backend for the kernel's nf_conntrack, the table
// kube-proxy (iptables/nftables), Calico's iptables dataplane, flannel and the
// bridge plugin keep pod flows in.
//
// An index of the entries of every local pod IP is fed by conntrack NEW and
// DESTROY events and seeded by one dump at start (subscribed first, so no flow
// falls between the dump and the events). A scrub deletes exactly the IP's
// entries by original tuple, each guarded by its flow ID (CTA_ID) so a newer
// flow that reused the tuple survives: O(k), whatever the table's size.
//
// Events are lossy: when the socket overruns, the kernel drops them and says so
// (ENOBUFS, and the socket's drop counter). Which IPs the lost events were about
// cannot be known, so every IP becomes incomplete until a re-seeding dump or a
// fallback for that IP has run. The fallback is the kernel's filtered flush
// (CTA_FILTER on IPCTNL_MSG_CT_DELETE, Linux 6.12+), or, on older kernels and
// for IPv6 (see docs/nfct.md), one dump matched in user space and deleted entry
// by entry.
package nfct

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// MapName is the key of Result.Deleted and the map label of the metrics.
const MapName = "nf_conntrack"

// Fallback selects how incomplete IPs are scrubbed.
type Fallback string

const (
	// FallbackAuto: the filtered flush for IPv4 where the kernel has it
	// (6.12+), a dump otherwise.
	FallbackAuto Fallback = ""
	// FallbackFlush: always the filtered flush (fails on kernels before 6.12).
	FallbackFlush Fallback = "flush"
	// FallbackDump: one full dump matched in user space, then deletes by tuple.
	FallbackDump Fallback = "dump"
)

// Config configures the backend.
type Config struct {
	// PodCIDRs: only entries with an address in them are indexed. Empty
	// means every address (only sensible in tests).
	PodCIDRs []netip.Prefix
	// Netns is the network namespace whose table is scrubbed (a path such as
	// /var/run/netns/x); "" is the daemon's own (the host's).
	Netns string
	// Zones restricts indexing and scrubs to these conntrack zones; empty
	// means every zone.
	Zones []uint16
	// EventBufferBytes is the event socket's receive buffer (forced past
	// net.core.rmem_max with CAP_NET_ADMIN). 0 means 64 MiB.
	EventBufferBytes int
	// Fallback for incomplete IPs.
	Fallback Fallback
	// ResyncAfterLoss is the least time between two re-seeding dumps after
	// event losses; 0 means 30 s, negative disables them (only the per-IP
	// fallback then restores completeness).
	ResyncAfterLoss time.Duration
	// Peers files local pods' entries under their addresses outside the
	// pod CIDRs too, for ScrubPeer (the remote-backend watch).
	Peers bool
}

// NFCT is the nf_conntrack backend. It implements scrub.Backend.
type NFCT struct {
	cfg   Config
	ix    *index
	ev    *socket
	req   *socket
	reqMu sync.Mutex // one request/ACK exchange at a time on req

	flushOK   bool // kernel has the filtered flush
	evBuf     int  // granted event receive buffer
	events    atomic.Uint64
	lossSeen  atomic.Uint64 // socket drops already turned into a loss mark
	lossMarks atomic.Uint64
	busy      atomic.Bool // the event reader holds a datagram not yet applied
	resync    chan struct{}

	stop      chan struct{}
	wg        sync.WaitGroup
	closeOnce sync.Once
}

var _ scrub.Backend = (*NFCT)(nil)

// New subscribes to the conntrack events of cfg.Netns, seeds the index with
// one dump, and returns the running backend.
func New(cfg Config) (*NFCT, error) {
	if cfg.EventBufferBytes == 0 {
		cfg.EventBufferBytes = 64 << 20
	}
	if cfg.ResyncAfterLoss == 0 {
		cfg.ResyncAfterLoss = 30 * time.Second
	}
	for _, p := range cfg.PodCIDRs {
		if !p.IsValid() {
			return nil, fmt.Errorf("nfct: invalid pod CIDR %v", p)
		}
	}
	switch cfg.Fallback {
	case FallbackAuto, FallbackFlush, FallbackDump:
	default:
		return nil, fmt.Errorf("nfct: unknown fallback %q (want %q or %q)", cfg.Fallback, FallbackFlush, FallbackDump)
	}
	if v, err := readSysctl(cfg.Netns, "net/netfilter/nf_conntrack_events"); err == nil && v == "0" {
		return nil, fmt.Errorf("nfct: net.netfilter.nf_conntrack_events is 0 in %s: the kernel sends no conntrack events, so the index cannot learn flows (set it to 1)", nsName(cfg.Netns))
	}
	n := &NFCT{
		cfg:     cfg,
		ix:      newIndex(cfg.PodCIDRs, cfg.Zones),
		flushOK: kernelAtLeast(6, 12),
		resync:  make(chan struct{}, 1),
		stop:    make(chan struct{}),
	}
	if cfg.Peers {
		n.ix.enablePeers()
	}
	if cfg.Fallback == FallbackFlush && !n.flushOK {
		return nil, fmt.Errorf("nfct: fallback %q needs Linux 6.12+ (CTA_FILTER on flush); this kernel is older: use %q", FallbackFlush, FallbackDump)
	}
	var err error
	if n.ev, err = openSocket(cfg.Netns); err != nil {
		return nil, fmt.Errorf("nfct: event socket in %s: %w", nsName(cfg.Netns), err)
	}
	if n.req, err = openSocket(cfg.Netns); err != nil {
		n.ev.close()
		return nil, fmt.Errorf("nfct: request socket in %s: %w", nsName(cfg.Netns), err)
	}
	n.evBuf = n.ev.setRcvBuf(cfg.EventBufferBytes)
	// Thousands of ACKs per scrub batch and a dump's bursts land here.
	n.req.setRcvBuf(8 << 20)
	tv := unix.Timeval{Usec: 200_000}
	_ = unix.SetsockoptTimeval(n.ev.fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	tv = unix.Timeval{Sec: 30}
	_ = unix.SetsockoptTimeval(n.req.fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	// Subscribe before the dump: a flow created during the dump is seen by
	// one or both, never by neither.
	for _, g := range []int{nfnlGrpConntrackNew, nfnlGrpConntrackDestroy} {
		if err := unix.SetsockoptInt(n.ev.fd, unix.SOL_NETLINK, unix.NETLINK_ADD_MEMBERSHIP, g); err != nil {
			n.closeSockets()
			return nil, fmt.Errorf("nfct: join conntrack event group %d: %w (needs CAP_NET_ADMIN)", g, err)
		}
	}
	n.wg.Add(1)
	go n.readEvents()
	if err := n.seed(); err != nil {
		n.Close()
		return nil, fmt.Errorf("nfct: seed the index from a dump of %s: %w", nsName(cfg.Netns), err)
	}
	if cfg.ResyncAfterLoss > 0 {
		n.wg.Add(1)
		go n.resyncLoop()
	}
	return n, nil
}

func nsName(p string) string {
	if p == "" {
		return "the daemon's network namespace"
	}
	return "network namespace " + p
}

// Name implements scrub.Backend.
func (n *NFCT) Name() string { return "nfct" }

// Close stops the event reader and closes the sockets.
func (n *NFCT) Close() error {
	n.closeOnce.Do(func() {
		close(n.stop)
		n.wg.Wait()
		n.closeSockets()
	})
	return nil
}

func (n *NFCT) closeSockets() {
	n.ev.close()
	n.req.close()
}

// walkSocket opens a socket of its own for an operation that walks the whole
// table (a dump, a filtered flush): seconds at millions of entries, during
// which index scrubs of other IPs keep using req.
func (n *NFCT) walkSocket() (*socket, error) {
	s, err := openSocket(n.cfg.Netns)
	if err != nil {
		return nil, err
	}
	s.setRcvBuf(8 << 20)
	tv := unix.Timeval{Sec: 60}
	_ = unix.SetsockoptTimeval(s.fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	return s, nil
}

// seed dumps the whole table into the index. Completeness holds from the loss
// generation read before the dump started.
func (n *NFCT) seed() error {
	gen := n.ix.gen()
	s, err := n.walkSocket()
	if err != nil {
		return err
	}
	defer s.close()
	if err := s.dump(0, nil, func(e Entry) { n.ix.add(&e) }); err != nil {
		return err
	}
	n.ix.markSeeded(gen)
	return nil
}

func (n *NFCT) readEvents() {
	defer n.wg.Done()
	buf := make([]byte, 64<<10)
	newType, delType := msgType(msgCTNew), msgType(msgCTDelete)
	for {
		select {
		case <-n.stop:
			return
		default:
		}
		nr, _, err := unix.Recvfrom(n.ev.fd, buf, 0)
		if err != nil {
			switch {
			case errors.Is(err, unix.EAGAIN), errors.Is(err, unix.EINTR):
			case errors.Is(err, unix.ENOBUFS):
				n.noteLoss()
			default:
				// An unexpected socket error may hide lost events too.
				n.noteLoss()
				time.Sleep(50 * time.Millisecond)
			}
			continue
		}
		n.busy.Store(true)
		netlinkMessages(buf[:nr], func(typ, _ uint16, _ uint32, body []byte) bool {
			if len(body) < nfgenLen || (typ != newType && typ != delType) {
				return true
			}
			e, ok := parseEntry(body[nfgenLen:])
			if !ok {
				return true
			}
			n.events.Add(1)
			if typ == newType {
				n.ix.add(&e)
			} else {
				n.ix.remove(&e)
			}
			return true
		})
		n.busy.Store(false)
	}
}

// noteLoss turns new socket drops into a loss mark: every IP incomplete.
func (n *NFCT) noteLoss() {
	d := n.ev.drops()
	n.lossSeen.Store(d)
	n.lossMarks.Add(1)
	n.ix.markLost()
	select {
	case n.resync <- struct{}{}:
	default:
	}
}

func (n *NFCT) resyncLoop() {
	defer n.wg.Done()
	var last time.Time
	for {
		select {
		case <-n.stop:
			return
		case <-n.resync:
		}
		if wait := n.cfg.ResyncAfterLoss - time.Since(last); wait > 0 {
			select {
			case <-n.stop:
				return
			case <-time.After(wait):
			}
		}
		last = time.Now()
		_ = n.seed() // a failed re-seed leaves IPs incomplete: the fallback covers them
	}
}

// catchUp makes the index current before a scrub looks at it: events the
// kernel already queued are applied, and drops not yet reported are marked.
// It gives up after a second (the IPs are then scrubbed as incomplete).
func (n *NFCT) catchUp(ctx context.Context) bool {
	deadline := time.Now().Add(time.Second)
	for {
		if n.ev.drops() != n.lossSeen.Load() {
			n.noteLoss()
		}
		if n.ev.queued() == 0 && !n.busy.Load() {
			return true
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return false
		}
		time.Sleep(200 * time.Microsecond)
	}
}

// Scrub deletes every nf_conntrack entry of req.IPs (in the configured zones).
// IPs the index proves complete are deleted by tuple; the rest go through the
// fallback. When ctx ends it stops between batches and returns Cancelled, what
// it deleted, and ctx's error.
func (n *NFCT) Scrub(ctx context.Context, req scrub.Request) (scrub.Result, error) {
	return n.scrub(ctx, req, false)
}

// Sweep scrubs req.IPs through the fallback whatever the index knows: what a
// scrub of incomplete IPs costs (benchmarks), or a belt-and-braces cleanup.
func (n *NFCT) Sweep(ctx context.Context, req scrub.Request) (scrub.Result, error) {
	return n.scrub(ctx, req, true)
}

func (n *NFCT) scrub(ctx context.Context, req scrub.Request, sweep bool) (scrub.Result, error) {
	start := time.Now()
	res := scrub.Result{
		Backend: n.Name(),
		Method:  scrub.MethodIndex,
		Outcome: scrub.Complete,
		Deleted: map[string]int{MapName: 0},
		PerIP:   make(map[string]scrub.Method, len(req.IPs)),
	}
	finish := func(err error) (scrub.Result, error) {
		res.Total = res.Deleted[MapName]
		res.Duration = time.Since(start)
		switch {
		case err == nil:
		case ctx.Err() != nil:
			res.Outcome, res.Error = scrub.Cancelled, err.Error()
			err = ctx.Err()
		default:
			res.Outcome, res.Error = scrub.Failed, err.Error()
		}
		return res, err
	}
	caughtUp := n.catchUp(ctx)
	var fallback []netip.Addr
	for _, ip := range req.IPs {
		ip = ip.Unmap()
		if !ip.IsValid() {
			return finish(fmt.Errorf("nfct scrub: invalid IP in request"))
		}
		if req.Still != nil && !req.Still(ip) {
			continue
		}
		fs, complete := n.ix.take(ip)
		if !complete || !caughtUp || sweep {
			fallback = append(fallback, ip)
			res.PerIP[ip.String()] = scrub.MethodSweep
			continue
		}
		res.PerIP[ip.String()] = scrub.MethodIndex
		if err := ctx.Err(); err != nil {
			return finish(err)
		}
		if req.DryRun {
			res.Deleted[MapName] += len(fs)
			continue
		}
		del, err := n.deleteFlows(ctx, ip, fs)
		res.Deleted[MapName] += del
		if err != nil {
			return finish(fmt.Errorf("nfct scrub %s by index: %w", ip, err))
		}
	}
	if len(fallback) > 0 {
		res.Method = scrub.MethodSweep
		del, err := n.fallback(ctx, fallback, req.DryRun)
		res.Deleted[MapName] += del
		if err != nil {
			return finish(err)
		}
	}
	return finish(nil)
}

// ScrubPeer deletes this node's entries that hold addr, a Service backend
// that left the cluster (docs/remote.md): the entries of local clients
// towards it, DNATed to it (addr is their reply source) or sent to it, in
// O(k), each by its tuple and flow ID (a newer flow that reused the tuple
// survives). It trusts no completeness: an entry the index missed stays
// for kube-proxy or its timeout, as without it. The caller makes sure no
// local pod holds addr.
func (n *NFCT) ScrubPeer(ctx context.Context, addr netip.Addr) (scrub.Result, error) {
	start := time.Now()
	addr = addr.Unmap()
	res := scrub.Result{Backend: n.Name(), Method: scrub.MethodIndex, Outcome: scrub.Complete, Deleted: map[string]int{MapName: 0}}
	n.catchUp(ctx)
	fs := n.ix.peerFlowsOf(addr)
	del, err := n.deleteFlows(ctx, netip.Addr{}, fs)
	res.Deleted[MapName], res.Total, res.Duration = del, del, time.Since(start)
	if err != nil {
		res.Outcome, res.Error = scrub.Failed, err.Error()
		return res, err
	}
	// Deleted or already gone: their records go (DESTROY events would
	// drop them too, unless lost).
	n.ix.mu.Lock()
	for _, f := range fs {
		ix := n.ix
		if s := ix.ips[addr]; s != nil {
			ix.forgetLocked(addr, f.key, f.id)
		}
		ix.forgetPeerLocked(addr, f.key, f.id)
	}
	n.ix.mu.Unlock()
	return res, nil
}

// deleteBatch is how many deletes go in one sendmsg: their ACKs (about 1 KiB
// of receive buffer each) must fit the request socket's 8 MiB.
const deleteBatch = 512

// deleteFlows deletes fs by original tuple + zone + ID, batchwise, and drops
// from the index of ip every flow the kernel deleted or no longer has.
func (n *NFCT) deleteFlows(ctx context.Context, ip netip.Addr, fs []flow) (int, error) {
	deleted := 0
	for len(fs) > 0 {
		if err := ctx.Err(); err != nil {
			return deleted, err
		}
		b := fs[:min(len(fs), deleteBatch)]
		fs = fs[len(b):]
		d, gone, err := n.deleteBatch(b)
		deleted += d
		if ip.IsValid() {
			n.ix.forget(ip, gone)
		}
		if err != nil {
			return deleted, err
		}
	}
	return deleted, nil
}

// deleteBatch sends one batch; gone lists the flows deleted or already gone.
func (n *NFCT) deleteBatch(fs []flow) (deleted int, gone []flow, err error) {
	n.reqMu.Lock()
	defer n.reqMu.Unlock()
	var m msgBuf
	m.b = make([]byte, 0, len(fs)*112)
	first := n.req.seq.Add(uint32(len(fs))) - uint32(len(fs)) + 1
	for i := range fs {
		t := fs[i].key.tuple()
		fam := uint8(unix.AF_INET)
		if fs[i].key.v6 {
			fam = unix.AF_INET6
		}
		m.begin(msgType(msgCTDelete), unix.NLM_F_REQUEST|unix.NLM_F_ACK, first+uint32(i), fam, 0)
		m.tuple(ctaTupleOrig, &t)
		if fs[i].key.zone != 0 {
			m.be16(ctaZone, fs[i].key.zone)
		}
		m.be32(ctaID, fs[i].id)
		m.end()
	}
	gone = make([]flow, 0, len(fs))
	var firstErr error
	err = n.req.exchange(&m, first, len(fs), func(i int, errno unix.Errno) {
		switch errno {
		case 0:
			deleted++
			gone = append(gone, fs[i])
		case unix.ENOENT: // already gone, or the tuple now belongs to a newer flow
			gone = append(gone, fs[i])
		default:
			if firstErr == nil {
				firstErr = fmt.Errorf("delete conntrack entry %v: %w", fs[i].key.tuple(), errno)
			}
		}
	})
	if err == nil {
		err = firstErr
	}
	return deleted, gone, err
}

// fallback removes every entry of ips without the index, then records the IPs
// complete as of the loss generation read before it started.
func (n *NFCT) fallback(ctx context.Context, ips []netip.Addr, dryRun bool) (int, error) {
	gen := n.ix.gen()
	var flush, dump []netip.Addr
	for _, ip := range ips {
		if n.useFlush(ip) && !dryRun {
			flush = append(flush, ip)
		} else {
			dump = append(dump, ip)
		}
	}
	// Four kernel walks per IP against one user-space walk for the whole set:
	// at 1M entries 1.7 s against 4.2 s (docs/nfct.md), so past two IPs the
	// dump is cheaper.
	if len(flush) > flushMaxIPs && n.cfg.Fallback != FallbackFlush {
		dump, flush = append(dump, flush...), nil
	}
	deleted := 0
	for _, ip := range flush {
		d, err := n.flushIP(ctx, ip)
		deleted += d
		if err != nil {
			return deleted, fmt.Errorf("nfct filtered flush of %s: %w", ip, err)
		}
		n.ix.markClean(ip, gen)
	}
	if len(dump) > 0 {
		d, err := n.dumpDelete(ctx, dump, dryRun)
		deleted += d
		if err != nil {
			return deleted, fmt.Errorf("nfct dump-and-delete of %v: %w", dump, err)
		}
		if !dryRun {
			for _, ip := range dump {
				n.ix.markClean(ip, gen)
			}
		}
	}
	return deleted, nil
}

// flushMaxIPs is the most IPs one fallback flushes; more go through one dump.
const flushMaxIPs = 2

func (n *NFCT) useFlush(ip netip.Addr) bool {
	switch n.cfg.Fallback {
	case FallbackDump:
		return false
	case FallbackFlush:
		return true
	}
	// IPv6: this kernel's ctnetlink_filter_match_tuple compares v6 addresses
	// with !ipv6_addr_cmp, which inverts the match (see docs/nfct.md): a v6
	// filtered flush by address would delete every entry but the IP's.
	return n.flushOK && ip.Is4()
}

// flushDirs is the minimal set of filtered flushes that catches every entry
// holding an IP. The filter ANDs its flags, so each position is its own
// flush: original source (the pod as client, SNAT'd or not), reply source
// (the pod as server, also behind DNAT where the original destination is a
// VIP), original destination (traffic to the IP DNAT'd elsewhere) and reply
// destination (traffic SNAT'd to the IP). Without NAT the last two find
// nothing new, but only a walk can tell.
var flushDirs = []struct {
	tuple uint16
	flags uint16
	flag  uint32
}{
	{ctaTupleOrig, ctaFilterOrigFlags, filterFlagIPSrc},
	{ctaTupleReply, ctaFilterReplyFlags, filterFlagIPSrc},
	{ctaTupleOrig, ctaFilterOrigFlags, filterFlagIPDst},
	{ctaTupleReply, ctaFilterReplyFlags, filterFlagIPDst},
}

// flushIP runs the kernel's filtered flush for ip in each direction (and each
// configured zone). The kernel does not say how many it deleted: the count is
// the drop of the table's entry count, so concurrent churn makes it inexact.
func (n *NFCT) flushIP(ctx context.Context, ip netip.Addr) (int, error) {
	before, _, _ := n.Count()
	zones := n.cfg.Zones
	if len(zones) == 0 {
		zones = []uint16{0} // no zone filter: every zone
	}
	for _, d := range flushDirs {
		for _, z := range zones {
			if err := ctx.Err(); err != nil {
				return 0, err
			}
			if err := n.flushOne(ip, d.tuple, d.flags, d.flag, z, len(n.cfg.Zones) > 0); err != nil {
				return 0, err
			}
		}
	}
	after, _, _ := n.Count()
	return int(max(before-after, 0)), nil
}

func (n *NFCT) flushOne(ip netip.Addr, tuple, flagsAttr uint16, flag uint32, zone uint16, zoned bool) error {
	ws, err := n.walkSocket()
	if err != nil {
		return err
	}
	defer ws.close()
	fam := uint8(unix.AF_INET)
	if ip.Is6() {
		fam = unix.AF_INET6
	}
	var m msgBuf
	seq := ws.seq.Add(1)
	m.begin(msgType(msgCTDelete), unix.NLM_F_REQUEST|unix.NLM_F_ACK, seq, fam, 1)
	m.nest(tuple)
	m.nest(ctaTupleIP)
	src, dst := uint16(ctaIPv4Src), uint16(ctaIPv4Dst)
	if ip.Is6() {
		src, dst = ctaIPv6Src, ctaIPv6Dst
	}
	if flag == filterFlagIPSrc {
		m.attr(src, ip.AsSlice())
	} else {
		m.attr(dst, ip.AsSlice())
	}
	m.endNest()
	m.endNest()
	m.nest(ctaFilter)
	m.attr(flagsAttr, binary.NativeEndian.AppendUint32(nil, flag))
	m.endNest()
	if zoned {
		m.be16(ctaZone, zone)
	}
	m.end()
	var errno unix.Errno
	if err := ws.exchange(&m, seq, 1, func(_ int, e unix.Errno) { errno = e }); err != nil {
		return err
	}
	if errno != 0 {
		return fmt.Errorf("kernel refused CTA_FILTER flush: %w", errno)
	}
	return nil
}

// dumpDelete is the fallback without the filtered flush: one dump of the whole
// table matched in user space against the whole set of IPs (one walk for any
// number of IPs; a kernel-side dump filter would need a walk per IP and
// direction), then deletes by tuple, each guarded by its ID.
func (n *NFCT) dumpDelete(ctx context.Context, ips []netip.Addr, dryRun bool) (int, error) {
	set := make(map[netip.Addr]bool, len(ips))
	for _, ip := range ips {
		set[ip] = true
	}
	var fs []flow
	ws, err := n.walkSocket()
	if err != nil {
		return 0, err
	}
	err = ws.dump(0, nil, func(e Entry) {
		if !n.ix.zoneTracked(e.Zone) {
			return
		}
		if set[e.Orig.Src.Unmap()] || set[e.Orig.Dst.Unmap()] || set[e.Reply.Src.Unmap()] || set[e.Reply.Dst.Unmap()] {
			fs = append(fs, flow{keyOf(&e), e.ID})
		}
	})
	ws.close()
	if err != nil {
		return 0, err
	}
	if dryRun {
		return len(fs), nil
	}
	return n.deleteFlows(ctx, netip.Addr{}, fs)
}

// Count returns the number of entries in the table and nf_conntrack_max, from
// the kernel's global stats (IPCTNL_MSG_CT_GET_STATS): cheap, no walk.
func (n *NFCT) Count() (entries, maxEntries int64, err error) {
	n.reqMu.Lock()
	defer n.reqMu.Unlock()
	var m msgBuf
	seq := n.req.seq.Add(1)
	m.begin(msgType(5 /* IPCTNL_MSG_CT_GET_STATS */), unix.NLM_F_REQUEST, seq, unix.AF_UNSPEC, 0)
	m.end()
	if err := unix.Sendto(n.req.fd, m.b, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return 0, 0, fmt.Errorf("nfct: request conntrack stats: %w", err)
	}
	buf := make([]byte, 8192)
	for {
		nr, _, err := unix.Recvfrom(n.req.fd, buf, 0)
		if err != nil {
			return 0, 0, fmt.Errorf("nfct: read conntrack stats: %w", err)
		}
		found := false
		netlinkMessages(buf[:nr], func(typ, _ uint16, s uint32, body []byte) bool {
			if s != seq {
				return true
			}
			found = true
			if typ == unix.NLMSG_ERROR {
				err = fmt.Errorf("nfct: conntrack stats: %w", nlError(body))
				return false
			}
			if len(body) >= nfgenLen {
				attrs(body[nfgenLen:], func(t uint16, d []byte) {
					if len(d) < 4 {
						return
					}
					switch t {
					case 1: // CTA_STATS_GLOBAL_ENTRIES
						entries = int64(binary.BigEndian.Uint32(d))
					case 2: // CTA_STATS_GLOBAL_MAX_ENTRIES
						maxEntries = int64(binary.BigEndian.Uint32(d))
					}
				})
			}
			return false
		})
		if found {
			return entries, maxEntries, err
		}
	}
}

// IndexStats describes the index for metrics and status.
type IndexStats struct {
	Keys          int    // indexed (IP, entry) pairs: ctscrub_index_keys{backend="nfct"}
	IPs           int    // IPs with a slot
	IncompleteIPs int    // of those, incomplete: ctscrub_index_incomplete_ips{backend="nfct"}
	IncompleteAll bool   // events were lost and no re-seed has run since: every IP, even one without a slot, is incomplete
	Lost          uint64 // events the kernel dropped: ctscrub_index_lost_total{backend="nfct"}
	LossMarks     uint64 // times a loss was detected (each marks every IP incomplete)
	Events        uint64 // NEW and DESTROY events applied
	EventBuffer   int    // receive buffer the kernel granted the event socket, bytes
	FilteredFlush bool   // the kernel has CTA_FILTER on flush (6.12+)
}

// Stats returns the index's figures.
func (n *NFCT) Stats() IndexStats {
	keys, ips, inc, all := n.ix.stats()
	return IndexStats{
		Keys: keys, IPs: ips, IncompleteIPs: inc, IncompleteAll: all,
		Lost: n.Lost(), LossMarks: n.lossMarks.Load(), Events: n.events.Load(),
		EventBuffer: n.evBuf, FilteredFlush: n.flushOK,
	}
}

// Lost is the number of conntrack events the kernel dropped on the event
// socket since the backend started (ctscrub_index_lost_total{backend="nfct"}).
func (n *NFCT) Lost() uint64 { return n.ev.drops() }

// Complete reports whether the index proves it holds every entry of ip.
func (n *NFCT) Complete(ip netip.Addr) bool {
	_, c := n.IndexIP(ip)
	return c
}

// IndexIP returns how many entries the index holds for ip and whether it
// proves they are all (for `scrubd index --ip`).
func (n *NFCT) IndexIP(ip netip.Addr) (entries int, complete bool) {
	ip = ip.Unmap()
	n.ix.mu.Lock()
	defer n.ix.mu.Unlock()
	if s := n.ix.ips[ip]; s != nil {
		entries = len(s.flows)
	}
	return entries, n.ix.completeLocked(ip)
}

// kernelAtLeast compares the running kernel's release with major.minor.
func kernelAtLeast(major, minor int) bool {
	var u unix.Utsname
	if unix.Uname(&u) != nil {
		return false
	}
	rel := unix.ByteSliceToString(u.Release[:])
	parts := strings.SplitN(rel, ".", 3)
	if len(parts) < 2 {
		return false
	}
	ma, _ := strconv.Atoi(parts[0])
	mi, _ := strconv.Atoi(strings.TrimLeftFunc(parts[1], func(r rune) bool { return r < '0' || r > '9' }))
	return ma > major || ma == major && mi >= minor
}

// readSysctl reads /proc/sys/<name> as seen from the network namespace nsPath.
func readSysctl(nsPath, name string) (string, error) {
	path := "/proc/sys/" + name
	if nsPath == "" {
		b, err := os.ReadFile(path)
		return strings.TrimSpace(string(b)), err
	}
	// /proc/sys/net follows the netns of the thread that opens the file.
	fd, err := inNetns(nsPath, func() (int, error) { return unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0) })
	if err != nil {
		return "", err
	}
	f := os.NewFile(uintptr(fd), path)
	defer f.Close()
	b := make([]byte, 64)
	k, err := f.Read(b)
	return strings.TrimSpace(string(b[:k])), err
}
