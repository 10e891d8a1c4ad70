package daemon

import (
	"net/netip"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/index"
)

// abandonedWait bounds how long a stopping daemon waits for flights whose
// callers are gone (abandoned: cancelled, no one waits for them) before it
// writes the index snapshot. They were cancelled with the work context and
// normally return within the backends' cancellation bound (milliseconds);
// under CPU starvation an in-kernel sweep can overrun it.
const abandonedWait = 3 * time.Second

// reasonStillRunning marks, in the snapshot, an IP whose scrub had not
// returned when the daemon stopped: its keys may be out of the index (taken
// by the scrub) and some of its entries deleted or not, so after the restart
// only a sweep can prove it clean.
const reasonStillRunning = "scrub still running when the daemon stopped"

// snapshotAtStop writes the index snapshot of a clean stop. It is called
// after the API has stopped (no new flight can start), the work context was
// cancelled, and the recorder's reader has returned. Flights may still run:
// the abandoned ones, whose callers left (deadline, disconnect) before the
// work returned; each may hold keys it took from the index. The snapshot
// waits for them up to abandonedWait; any still running then has its IPs
// written as incomplete, so the restarted daemon sweeps them instead of
// trusting a set with keys missing.
func (d *Daemon) snapshotAtStop() {
	deadline := time.Now().Add(abandonedWait)
	for d.flights.running() > 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	// Taken before the copy: after the API stopped no flight starts, so this
	// is every flight that can run while the index is copied.
	live := d.flights.liveIPs()
	if len(live) > 0 {
		d.log.Warn("scrubs still running at the stop: their IPs are written incomplete in the index snapshot and will sweep after the restart",
			"ips", live, "waited", abandonedWait.String())
	}
	if err := d.writeSnapshotMarking(live); err != nil {
		d.log.Warn("no index snapshot written: attached IPs will sweep after the restart", "err", err)
	} else if p := d.snapshotPath(); p != "" {
		d.log.Info("index snapshot written", "path", p, "keys", d.ix.Keys(), "incomplete_ips", d.ix.IncompleteIPs(), "still_running_ips", len(live))
	}
}

// markIncomplete sets reason on the given IPs of a snapshot, adding the IPs
// it lacks (a scrub that took an IP's every key may have left an empty slot).
func markIncomplete(s *index.Snapshot, ips []netip.Addr, reason string) {
	if len(ips) == 0 {
		return
	}
	mark := make(map[netip.Addr]bool, len(ips))
	for _, ip := range ips {
		mark[ip] = true
	}
	for i := range s.IPs {
		if mark[s.IPs[i].IP] {
			s.IPs[i].Incomplete = reason
			delete(mark, s.IPs[i].IP)
		}
	}
	for ip := range mark {
		s.IPs = append(s.IPs, index.SnapshotIP{IP: ip, Incomplete: reason})
	}
}
