package daemon

import (
	"context"
	"encoding/json"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

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
	case req.Reason == scrub.ReasonDel:
		ev = owner.Del
		if a.IfName == "" {
			a = d.pods.attachmentOf(req.ContainerID, ips)
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
		d.watchConflist(ctx, dir, 5*time.Second)
		return nil
	}})
	return nil
}

// watchConflist checks every interval that the runtime's CNI config (the
// first config file in dir, as containerd and CRI-O pick it) chains ctscrub;
// while it does not, pods are created that the recorder never sees.
func (d *Daemon) watchConflist(ctx context.Context, dir string, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	watched := false
	for {
		chained, file := conflistChains(dir)
		first := !watched
		watched = true
		changed := d.own.SetChained(chained)
		d.chained.Set(b2f(chained))
		if !chained && (changed || first) {
			d.log.Warn("the CNI config does not chain ctscrub: pods may start unseen, nothing is trusted until it does", "conf_dir", dir, "file", file, "epoch", d.own.Epoch())
		} else if chained && changed {
			d.log.Info("the CNI config chains ctscrub again; attachments indexed before are no longer trusted", "conf_dir", dir, "file", file, "epoch", d.own.Epoch())
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// conflistChains reports whether the first CNI config file in dir (sorted by
// name: the one the runtime uses) has a plugin of type ctscrub. No config at
// all is "not chained" (pods cannot start then, but the next one may come
// without ctscrub).
func conflistChains(dir string) (bool, string) {
	path, ok := conflistRuns(dir, "ctscrub")
	return ok, path
}

// conflistRuns reports whether the first CNI config file in dir runs a
// plugin of type typ, and names the file ("" when there is none).
func conflistRuns(dir, typ string) (string, bool) {
	if dir == "" {
		return "", false
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return "", false
	}
	var names []string
	for _, e := range ents {
		n := e.Name()
		if !e.IsDir() && (strings.HasSuffix(n, ".conflist") || strings.HasSuffix(n, ".conf") || strings.HasSuffix(n, ".json")) {
			names = append(names, n)
		}
	}
	slices.Sort(names)
	if len(names) == 0 {
		return "", false
	}
	path := filepath.Join(dir, names[0])
	data, err := os.ReadFile(path)
	if err != nil {
		return path, false
	}
	var conf struct {
		Type    string `json:"type"`
		Plugins []struct {
			Type string `json:"type"`
		} `json:"plugins"`
	}
	if json.Unmarshal(data, &conf) != nil {
		return path, false
	}
	for _, p := range conf.Plugins {
		if p.Type == typ {
			return path, true
		}
	}
	return path, conf.Type == typ
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
