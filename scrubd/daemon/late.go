package daemon

import (
	"errors"
	"net/netip"
	"os"
	"slices"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/owner"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// The DEL window: a CNI DEL reaches ctscrub before the IP-assigning plugin
// (bridge, cilium-cni) removes the pod's interface, and the recorder stays
// on the interface until it goes. Packets crossing it after the DEL scrub
// (a closing connection's FIN/ACK, a last datagram) make CT entries the
// recorder indexes under the IP, and nothing deleted them until the next
// scrub of the address. So after a DEL whose scrub released the IP
// (ownership.go), scrubd waits until the pod's interface is gone (at most
// lateDelMax) and scrubs the IP once more through the index: the keys
// recorded since the DEL scrub took the rest. Bounded: index only (an IP
// whose index is incomplete is left to the next ADD, which sweeps it), no
// walk. Guarded: the IP is scrubbed only while it is still in the same
// release, checked under the backend's scrub lock of the IP: an ADD of the
// address since the DEL (its scrub ran, the new pod's entries are live), an
// index start, or any sign of an unseen owner ends the release, and the late
// scrub leaves the IP alone.

const (
	// lateDelPoll is how often the pod's interface is looked for.
	lateDelPoll = 100 * time.Millisecond
	// lateDelMax bounds the wait for the interface to go: past it the late
	// scrub runs anyway (a runtime that never removes the interface).
	lateDelMax = 30 * time.Second
)

// Results of late DEL scrubs, per IP (ctscrub_del_late_total{result}).
const (
	lateScrubbed   = "scrubbed"
	lateNewOwner   = "new_owner"
	lateIncomplete = "incomplete"
	lateFailed     = "failed"
)

// scheduleLateDel starts the late scrub of pod's IPs that its DEL released.
func (d *Daemon) scheduleLateDel(pod api.IndexedPod, netns string) {
	var b scrub.Backend
	for _, x := range d.backends {
		if x.Name() == "cilium" {
			b = x
		}
	}
	if b == nil || d.rec == nil {
		return // no recorder: nothing was indexed in the window
	}
	at := map[netip.Addr]owner.Mark{}
	var ips []netip.Addr
	for _, ip := range pod.IPs {
		if t, ok := d.own.Released(ip); ok {
			at[ip] = t
			ips = append(ips, ip)
		}
	}
	if len(ips) == 0 {
		return
	}
	d.late.Go(func() { d.lateDel(b, pod, netns, ips, at) })
}

func (d *Daemon) lateDel(b scrub.Backend, pod api.IndexedPod, netns string, ips []netip.Addr, at map[netip.Addr]owner.Mark) {
	ctx := d.workCtx
	t0 := time.Now()
	gone := false
	for {
		if gone = ifaceGone(netns, pod.IfName); gone || time.Since(t0) >= lateDelMax {
			break
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(lateDelPoll):
		}
	}
	waited := time.Since(t0)
	select {
	case d.slots <- struct{}{}:
		defer func() { <-d.slots }()
	case <-ctx.Done():
		return
	}
	var newOwner []netip.Addr
	req := scrub.Request{IPs: ips, Reason: scrub.ReasonDelLate, IndexOnly: true, Still: func(ip netip.Addr) bool {
		if d.own.Still(ip, at[ip]) {
			return true
		}
		newOwner = append(newOwner, ip)
		return false
	}}
	start := time.Now()
	res, err := b.Scrub(ctx, req)
	res = normalize(b, ctx, res, err)
	res.Duration = time.Since(start)
	var incomplete []netip.Addr
	for _, ip := range ips {
		switch {
		case slices.Contains(newOwner, ip):
			d.m.late.WithLabelValues(lateNewOwner).Inc()
		case res.PerIP[ip.String()] == "":
			incomplete = append(incomplete, ip)
			d.m.late.WithLabelValues(lateIncomplete).Inc()
		case res.Outcome != scrub.Complete:
			d.m.late.WithLabelValues(lateFailed).Inc()
		default:
			d.m.late.WithLabelValues(lateScrubbed).Inc()
		}
	}
	if len(res.PerIP) > 0 {
		d.m.observe(scrub.ReasonDelLate, res)
		d.m.count(res)
	}
	lvl := "info"
	if res.Outcome != scrub.Complete {
		lvl = "warn"
	}
	attrs := []any{"ips", ips, "reason", scrub.ReasonDelLate, "backend", res.Backend, "method", res.Method,
		"deleted", res.Total, "per_map", res.Deleted, "duration_s", res.Duration.Seconds(), "result", res.Outcome,
		"container_id", pod.ContainerID, "ifname", pod.IfName, "interface_gone", gone, "waited_s", waited.Seconds(),
		"skipped_new_owner", newOwner, "skipped_incomplete", incomplete, "error", res.Error}
	if lvl == "warn" {
		d.log.Warn("scrub", attrs...)
	} else {
		d.log.Info("scrub", attrs...)
	}
}

// ifaceGone reports whether ifname no longer exists in the network namespace
// at netns (or the namespace itself is gone). An empty netns cannot be
// looked at: the caller waits its bound.
func ifaceGone(netns, ifname string) bool {
	if netns == "" {
		return false
	}
	if _, err := os.Stat(netns); errors.Is(err, os.ErrNotExist) {
		return true
	}
	entered := false
	err := recorder.InNetns(netns, func() error {
		entered = true
		_, err := netlink.LinkByName(ifname)
		return err
	})
	if err == nil {
		return false
	}
	if !entered {
		return true // not a network namespace any more (unmounted)
	}
	var nf netlink.LinkNotFoundError
	return errors.As(err, &nf)
}
