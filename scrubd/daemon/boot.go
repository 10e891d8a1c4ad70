package daemon

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/ctscrub/ctscrub/internal/netnsid"
	"github.com/ctscrub/ctscrub/internal/nsexec"
	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/bootstrap"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/owner"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
)

// The bootstrap at start (issue 36; the argument is docs/design.md, "The
// bootstrap pass"). Before the API serves, restore re-attached the pods of
// the state file; findAtStart then finds every pod interface of the node
// (findPodInterfaces), attaches the recorder to those no attachment names
// (found pods), and tells the ownership rule who holds what now
// (owner.Rule.BeginBoot). Once the recorder's reader runs, runBootstrap
// makes the one pass over Cilium's CT maps in the background, finds the
// pod interfaces again, and declares complete the addresses the pass
// vouches for and the rule trusts (index.TrackFiled, owner.Boot.Trust).
// Until then scrubs sweep or go by the index as they would without it.
// A found pod's CNI DEL names its netns and interface: adoptFound gives
// it the attachment the DEL names, so the DEL is its own, not an unknown
// one.

// podKey names a pod interface whatever path names its namespace.
type podKey struct {
	ns     netnsid.ID
	ifname string
}

// foundPod is a pod interface found at start that no attachment names.
type foundPod struct {
	a   api.Attachment // scrubd's name for it until its DEL (foundName)
	key podKey
	pod PodInterface
	ips []netip.Addr // its addresses in the pod CIDRs
}

// bootState is the daemon's part of the bootstrap.
type bootState struct {
	rule  *owner.Boot // nil: no bootstrap this start
	keys  map[podKey]bool
	cover []netip.Prefix
	kept  *owner.State // the rule's state a clean stop kept (snapshot)

	mu    sync.Mutex
	found map[api.Attachment]foundPod

	// Tests: scan replaces the node's pod interfaces (scanPodInterfaces
	// in netns, the node's namespace when set); walked is the pass's
	// bootstrap.Options.Walked.
	netns  string
	ifOpts podIfOptions
	scan   func() ([]PodInterface, []string, error)
	attach func(netns, ifname string) error
	walked func()

	// poke wakes the find after a sign (sightLoop); noSightLoop (tests
	// that run the find themselves) keeps the loop from starting.
	poke        chan struct{}
	noSightLoop bool
}

// bootOn reports whether this start runs the bootstrap: it needs the
// recorder (the pass's entries made behind the walk are its records).
func (d *Daemon) bootOn() bool { return d.cfg.Bootstrap != "off" && d.rec != nil }

// scanPods lists the node's pod interfaces and the pod veths it could not
// follow.
func (d *Daemon) scanPods() (pods []PodInterface, missed []string, err error) {
	if d.bs.scan != nil {
		return d.bs.scan()
	}
	find := func() error {
		pods, missed, err = scanPodInterfaces(d.bs.ifOpts)
		return err
	}
	if d.bs.netns == "" {
		err = find()
	} else if e := nsexec.Do(d.bs.netns, find); e != nil && err == nil {
		err = e
	}
	return pods, missed, err
}

// journalKeys are the pod interfaces of the active attachments.
func (d *Daemon) journalKeys() map[podKey]bool {
	active, _ := d.pods.list()
	journal := map[podKey]bool{}
	for _, p := range active {
		if k, ok := keyOf(p.Netns, p.IfName); ok {
			journal[k] = true
		}
	}
	return journal
}

// ownedIPs are those of ips in the pod CIDRs.
func (d *Daemon) ownedIPs(ips []netip.Addr) []netip.Addr {
	var out []netip.Addr
	for _, ip := range ips {
		if d.ix.Owns(ip) {
			out = append(out, ip)
		}
	}
	return out
}

// foundName is the attachment scrubd gives a found pod until its DEL:
// no container ID a runtime makes starts with "found:".
func foundName(k podKey) api.Attachment {
	return api.Attachment{ContainerID: fmt.Sprintf("found:%d:%d", k.ns.Dev, k.ns.Ino), IfName: k.ifname}
}

// keyOf is the podKey of an interface in the namespace at path.
func keyOf(path, ifname string) (podKey, bool) {
	id, err := netnsid.Of(path)
	return podKey{id, ifname}, err == nil
}

// findAtStart is the attach step of the bootstrap: every pod interface of
// the node that no restored attachment names is attached to and becomes a
// holder of its addresses (their index marked: the pod ran unseen until
// now, which the pass heals). Called by restore, before the API serves.
func (d *Daemon) findAtStart() {
	began := time.Now()
	pods, missed, err := d.scanPods()
	if err != nil {
		d.log.Warn("bootstrap: finding the node's pod interfaces failed in part; free addresses are not vouched for", "err", err)
		missed = append(missed, "(error)")
	}
	d.bs.found = map[api.Attachment]foundPod{}
	fr := d.findStrangers(pods, d.journalKeys())
	missed = append(missed, fr.missed...)
	d.bs.keys = fr.keys
	var strangers []owner.Found
	for _, fp := range fr.found {
		strangers = append(strangers, owner.Found{A: fp.a, IPs: fp.ips})
	}
	d.bs.rule = d.own.BeginBoot(d.bs.kept, strangers, len(missed) > 0)
	if d.bs.kept != nil && !d.bs.rule.Restored {
		d.log.Warn("bootstrap: the releases of the clean stop are not used: a pod ran unseen while scrubd was down (found at start, or not followed)",
			"found_pods", len(strangers), "missed", missed)
	}
	if d.bs.scan == nil {
		d.bs.cover = d.coverRanges(fr.owned)
	}
	d.log.Info("bootstrap: pod interfaces found at start", "pods", len(fr.owned), "not_in_state", len(strangers), "missed", missed,
		"kept_releases", d.bs.rule.Restored, "cover", d.bs.cover, "took_s", time.Since(began).Seconds())
}

// findResult is what one find did with the node's pod interfaces.
type findResult struct {
	owned  []PodInterface  // those with an address in the pod CIDRs
	keys   map[podKey]bool // their keys
	found  []foundPod      // those no attachment or earlier find named: attached now
	missed []string        // gone meanwhile, or the recorder could not attach
}

// findStrangers attaches the recorder to every pod interface of pods that
// skip and no earlier find name, and files each as a found pod (d.bs.found).
// An interface gone meanwhile, or one the recorder could not attach to
// (its addresses stay incomplete), is missed: a pod may run unrecorded.
// The find at start and the find after a sign (refind.go) both use it.
func (d *Daemon) findStrangers(pods []PodInterface, skip map[podKey]bool) findResult {
	fr := findResult{keys: map[podKey]bool{}}
	d.bs.mu.Lock()
	for _, f := range d.bs.found {
		skip[f.key] = true
	}
	d.bs.mu.Unlock()
	for _, p := range pods {
		ips := d.ownedIPs(p.IPs)
		if len(ips) == 0 {
			continue // no address in the pod CIDRs: not a pod of this cluster
		}
		fr.owned = append(fr.owned, p)
		k, ok := keyOf(p.Netns, p.IfName)
		if !ok {
			fr.missed = append(fr.missed, p.HostIf) // gone meanwhile
			continue
		}
		fr.keys[k] = true
		if skip[k] {
			continue // an attachment (re-attached by restore), or found before
		}
		fp, err := d.attachFound(p, k, ips)
		if err != nil {
			fr.missed = append(fr.missed, p.Netns+"/"+p.IfName)
		}
		d.bs.mu.Lock()
		if d.bs.found == nil {
			d.bs.found = map[api.Attachment]foundPod{}
		}
		d.bs.found[fp.a] = fp
		d.bs.mu.Unlock()
		fr.found = append(fr.found, fp)
	}
	return fr
}

// attachFound puts the recorder on a pod interface that no attachment
// names (found at start, or by a find after a sign): its addresses are
// held and marked (the pod ran unseen until now: its entries are in no
// set), and recorded from now on, unless the attach fails (then they stay
// incomplete while it lives).
func (d *Daemon) attachFound(p PodInterface, k podKey, ips []netip.Addr) (foundPod, error) {
	fp := foundPod{a: foundName(k), key: k, pod: p, ips: ips}
	for _, ip := range ips {
		d.ix.Hold(ip)
		d.ix.MarkIncomplete(ip, index.ReasonOwner)
	}
	attach := func() error { _, err := d.rec.Attach(p.Netns, p.IfName); return err }
	if d.bs.attach != nil {
		attach = func() error { return d.bs.attach(p.Netns, p.IfName) }
	}
	err := attach()
	if err != nil {
		for _, ip := range ips {
			if errors.Is(err, recorder.ErrForget) {
				d.ix.MarkIncomplete(ip, recorder.ReasonForgetFailed)
			} else {
				d.ix.Unrecorded(ip, reasonFoundNotAttached)
			}
		}
		d.log.Error("attach the recorder to a pod no attachment names: its addresses stay incomplete", "netns", p.Netns, "ifname", p.IfName, "ips", ips, "err", err)
	} else {
		for _, ip := range ips {
			d.ix.Recorded(ip)
		}
	}
	return fp, err
}

// reasonFoundNotAttached marks the addresses of a pod found at start that
// the recorder could not attach to.
const reasonFoundNotAttached = "recorder could not attach to a pod found at start"

// coverRanges is the node's own pod ranges the pass may cover: the
// bridges' subnets (bridgeRanges) and Cilium's node range
// (ciliumHostRanges), those in the pod CIDRs, within index.MaxCover
// addresses in all.
func (d *Daemon) coverRanges(pods []PodInterface) []netip.Prefix {
	var ranges []netip.Prefix
	get := func() error {
		var err error
		ranges, err = bridgeRanges(pods)
		if err != nil {
			return err
		}
		cilium, err := ciliumHostRanges()
		ranges = append(ranges, cilium...)
		return err
	}
	var err error
	if d.bs.netns == "" {
		err = get()
	} else {
		err = nsexec.Do(d.bs.netns, get)
	}
	if err != nil {
		d.log.Warn("bootstrap: the bridges' ranges", "err", err)
		return nil
	}
	var out []netip.Prefix
	total := 0
	for _, p := range ranges {
		bits := p.Addr().BitLen() - p.Bits()
		if !d.ix.Owns(p.Addr()) || bits > 16 || total+1<<bits > index.MaxCover {
			continue
		}
		total += 1 << bits
		out = append(out, p)
	}
	return out
}

// healable are the marks made before the pass that the pass makes good:
// each says only that keys of the IP may be missing from its set, and the
// walk reads every entry older than the pass (docs/design.md).
func healable(reason string) bool {
	switch reason {
	case index.ReasonRestart, index.ReasonLost, index.ReasonCancelled, reasonStillRunning,
		index.ReasonAuditMiss, index.ReasonOwner, recorder.ReasonForgetFailed:
		return true
	}
	return false
}

// ciliumMaps are the Cilium backend's CT maps now (nil without it).
func (d *Daemon) ciliumMaps() *ctmap.Maps {
	for _, b := range d.backends {
		if m, ok := b.(interface{ Maps() *ctmap.Maps }); ok {
			return m.Maps()
		}
	}
	return nil
}

// runBootstrap makes the pass and declares complete what it vouches for
// and the rule trusts. It holds no lock a scrub needs (bootstrap.Run).
func (d *Daemon) runBootstrap(ctx context.Context) {
	maps := d.ciliumMaps()
	if maps == nil {
		d.log.Info("bootstrap: no Cilium CT maps: no pass")
		return
	}
	var forget func() error
	if f, ok := d.rec.(interface{ ForgetAll() error }); ok {
		forget = f.ForgetAll
	}
	_, err := bootstrap.Run(ctx, d.ix, maps, bootstrap.Options{Forget: forget, Progress: &d.boot, Cover: d.bs.cover,
		Heal: healable, Walked: d.bs.walked, Finish: d.finishBootstrap})
	if err != nil && ctx.Err() == nil {
		d.log.Error("bootstrap pass failed: nothing vouched for; addresses are known again as they come and go", "err", err)
	}
}

// finishBootstrap declares complete what a successful pass vouches for and
// the rule trusts (bootstrap.Options.Finish: before the pass shows done).
func (d *Daemon) finishBootstrap(res bootstrap.Result) {
	// Found again: a pod whose interface appeared since the find and that
	// no ADD attached (it ran outside ctscrub) is not recorded; it may
	// have sent towards any address no pod held.
	pods, missed, err := d.scanPods()
	freeNow := err == nil && len(missed) == 0
	journal := d.journalKeys()
	unrecorded := map[netip.Addr]bool{}
	var strangers []string
	for _, p := range pods {
		k, ok := keyOf(p.Netns, p.IfName)
		if !ok || d.bs.keys[k] || journal[k] || !slices.ContainsFunc(p.IPs, d.ix.Owns) {
			continue
		}
		freeNow = false
		strangers = append(strangers, p.Netns+"/"+p.IfName)
		for _, ip := range p.IPs {
			unrecorded[ip] = true
		}
	}
	trusted := 0
	tracked, dropped := d.ix.TrackFiled(res.Filing, func(ip netip.Addr) bool {
		ok := !unrecorded[ip] && d.bs.rule.Trust(ip, freeNow)
		if ok {
			trusted++
		}
		return ok
	})
	released := d.bs.rule.Release(tracked, freeNow)
	d.log.Info("bootstrap pass done", "duration_s", res.Duration().Seconds(), "entries", res.Visited, "keys", res.Pairs, "vouched", len(res.Addrs),
		"complete", len(tracked), "released", len(released), "dropped_slots", dropped, "free_addresses_trusted", freeNow,
		"missed_at_end", missed, "unattached_pods_at_end", strangers, "read", res.Read)
}

// adoptFound gives a pod found at start the attachment its CNI DEL (or a
// DEL scrub) names, matched by its network namespace and interface: the
// DEL is then that of a pod scrubd indexed since the attach step, with the
// epoch it was found in. It reports whether one matched.
func (d *Daemon) adoptFound(a api.Attachment, netns string) bool {
	if netns == "" || d.bs.found == nil {
		return false
	}
	k, ok := keyOf(netns, a.IfName)
	if !ok {
		return false
	}
	d.bs.mu.Lock()
	var fp foundPod
	for fa, f := range d.bs.found {
		if f.key == k {
			fp, ok = f, true
			delete(d.bs.found, fa)
			break
		}
	}
	d.bs.mu.Unlock()
	if !ok || !d.own.Rename(fp.a, a) {
		return false
	}
	pod := api.IndexedPod{Attachment: a, Netns: netns, IPs: fp.ips, Ifindex: fp.pod.Ifindex, Since: time.Now().UTC()}
	if _, err := d.pods.start(pod); err != nil {
		d.log.Error("bootstrap: record a found pod's attachment", "container_id", a.ContainerID, "err", err)
	}
	d.log.Info("bootstrap: a pod found at start is named by its DEL", "container_id", a.ContainerID, "ifname", a.IfName, "netns", netns, "ips", fp.ips)
	return true
}

// foundOf is the found pod whose interface is ifname in the namespace at
// netns, if any: an ADD for it is the found pod's own (its runtime's ADD
// was still in the chain while scrubd was down).
func (d *Daemon) foundOf(netns, ifname string) *api.Attachment {
	if netns == "" {
		return nil
	}
	k, ok := keyOf(netns, ifname)
	if !ok {
		return nil
	}
	d.bs.mu.Lock()
	defer d.bs.mu.Unlock()
	for a, f := range d.bs.found {
		if f.key == k {
			return &a
		}
	}
	return nil
}

// foundHolder is the found pod holding ip, if any.
func (d *Daemon) foundHolder(ip netip.Addr) *api.Attachment {
	d.bs.mu.Lock()
	defer d.bs.mu.Unlock()
	for a, f := range d.bs.found {
		if slices.Contains(f.ips, ip) {
			return &a
		}
	}
	return nil
}

// holderOf is the attachment, or the pod found at start, that holds ip.
func (d *Daemon) holderOf(ip netip.Addr) *api.Attachment {
	if a := d.pods.owner(ip); a != nil {
		return a
	}
	return d.foundHolder(ip)
}

// displaceFound drops the found pods holding one of ips (an index start
// took them: their DEL never came) and returns them for detaching.
func (d *Daemon) displaceFound(ips []netip.Addr) []api.IndexedPod {
	d.bs.mu.Lock()
	var out []api.IndexedPod
	for a, f := range d.bs.found {
		if slices.ContainsFunc(f.ips, func(ip netip.Addr) bool { return slices.Contains(ips, ip) }) {
			delete(d.bs.found, a)
			out = append(out, api.IndexedPod{Attachment: a, Netns: f.pod.Netns, IPs: f.ips, Ifindex: f.pod.Ifindex})
		}
	}
	d.bs.mu.Unlock()
	for _, p := range out {
		d.own.Stop(p.Attachment)
	}
	return out
}

// foundIPs are the addresses the pods found at start hold.
func (d *Daemon) foundIPs() []netip.Addr {
	d.bs.mu.Lock()
	defer d.bs.mu.Unlock()
	var out []netip.Addr
	for _, f := range d.bs.found {
		out = append(out, f.ips...)
	}
	return out
}
