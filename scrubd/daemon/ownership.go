package daemon

import (
	"net/netip"
	"slices"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/owner"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// Ownership: the recorder only sees pods ctscrub attached to, so the index
// may vouch for an IP only while every pod that held it since its last
// complete scrub was one scrubd indexed. The rule itself, with every sign of
// an unseen owner and what it makes scrubd answer, is scrubd/owner (one
// file, no I/O); this file feeds it the daemon's events and applies its
// verdicts to the index: a Sweep verdict marks the IP incomplete
// (index.ReasonOwner) before the scrub, so the scrub sweeps.

// beginScrub applies the ownership rule to a scrub request before it runs.
// Its ticket's End must follow the scrub (endScrub).
func (d *Daemon) beginScrub(req api.ScrubRequest, ips []netip.Addr) *owner.Ticket {
	ev := owner.Operator
	a := api.Attachment{ContainerID: req.ContainerID, IfName: req.IfName}
	switch {
	case req.DryRun || req.ContainerID == "":
		// A dry run or an operator's scrub: no attachment to judge.
	case req.Reason == scrub.ReasonAdd:
		ev = owner.Add
		if fa := d.foundOf(req.Netns, a.IfName); fa != nil {
			ev, a = owner.AddFound, *fa // boot.go
		}
	case req.Reason == scrub.ReasonDel:
		ev = owner.Del
		if a.IfName == "" {
			a = d.pods.attachmentOf(req.ContainerID, ips)
		} else if _, known := d.pods.get(a); !known && !d.adoptFound(a, req.Netns) { // a pod found at start (boot.go)
			if d.goneBeforeDel(req.Netns) {
				ev = owner.DelGone // refind.go
			}
		}
	}
	t := d.own.Begin(ev, a, ips)
	d.applyVerdicts(t, ev, ips, "container_id", req.ContainerID, "ifname", req.IfName)
	return t
}

// applyVerdicts marks incomplete the IPs the rule does not trust.
func (d *Daemon) applyVerdicts(t *owner.Ticket, ev owner.Event, ips []netip.Addr, attrs ...any) {
	for _, ip := range ips {
		if t.Verdict(ip) == owner.Trust || !d.ix.Owns(ip) || !d.ix.State(ip).Complete {
			continue
		}
		d.ix.MarkIncomplete(ip, index.ReasonOwner)
		d.log.Info("ownership: the index may miss entries of an owner scrubd never saw; the IP sweeps",
			append([]any{"ip", ip, "event", ev.String(), "epoch", d.own.Epoch()}, attrs...)...)
	}
}

// endScrub closes a scrub's ticket: the rule releases the IPs of a DEL whose
// scrub completed on every backend (their next owner may trust the index),
// and names those to mark incomplete now.
func (d *Daemon) endScrub(t *owner.Ticket, results []scrub.Result) {
	_, distrust := t.End(completed(results))
	for _, ip := range distrust {
		d.ix.MarkIncomplete(ip, index.ReasonOwner)
	}
}

// completed reports whether the scrub completed on every backend.
func completed(results []scrub.Result) bool {
	for _, r := range results {
		if r.Outcome != scrub.Complete {
			return false
		}
	}
	return true
}

// unseenOwner is a sign that a pod ctscrub never saw existed: a new epoch of
// the rule, in which no earlier release, create or holder vouches for an IP.
func (d *Daemon) unseenOwner(why string, attrs ...any) {
	n := d.own.Unseen()
	d.pokeSight()
	d.log.Warn("a pod scrubd never indexed existed: released IPs and earlier attachments are no longer trusted, their next scrubs sweep",
		append([]any{"why", why, "released_ips", n, "epoch", d.own.Epoch()}, attrs...)...)
}

// startPod records an index start: the attachment (journal) and the rule.
func (d *Daemon) startPod(pod api.IndexedPod) ([]api.IndexedPod, error) {
	displaced, err := d.pods.start(pod)
	if err != nil {
		return nil, err
	}
	for _, old := range displaced {
		d.own.Stop(old.Attachment)
	}
	displaced = append(displaced, d.displaceFound(pod.IPs)...)
	d.own.Start(pod.Attachment, pod.IPs)
	return displaced, nil
}

// stopPod records that an attachment stopped (its DEL).
func (d *Daemon) stopPod(a api.Attachment) (api.IndexedPod, bool, error) {
	d.own.Stop(a)
	return d.pods.stop(a)
}

// forgetPod drops an attachment (a GC).
func (d *Daemon) forgetPod(a api.Attachment) error {
	d.own.Stop(a)
	return d.pods.forget(a)
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// attachmentOf is the active attachment of containerID holding one of ips
// (a DEL scrub that names no ifname); the zero Attachment when none does.
func (p *pods) attachmentOf(containerID string, ips []netip.Addr) api.Attachment {
	p.mu.Lock()
	defer p.mu.Unlock()
	for a, pod := range p.active {
		if a.ContainerID != containerID {
			continue
		}
		for _, ip := range ips {
			if slices.Contains(pod.IPs, ip) {
				return a
			}
		}
	}
	return api.Attachment{}
}
