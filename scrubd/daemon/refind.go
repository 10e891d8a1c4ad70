package daemon

import (
	"context"
	"errors"
	"os"
	"time"
)

// After a sign of an unseen owner the rule is blind (owner.Rule.Sight): a
// pod that started while the CNI config did not chain ctscrub may still
// run, and no recorder sees what it sends towards an address no pod holds.
// The find of the bootstrap, run again, ends that: it puts the recorder on
// every pod interface of the node that no attachment or earlier find names
// (they become found pods, as at start), and when it followed every pod
// veth the rule sees again. Nothing else: no pass (the addresses stay
// untrusted until a scrub sweeps them, as after any sign).

// refindEvery is how often a blind rule's find is tried again when the
// last one could not end it (a pod veth it could not follow, the config
// not chaining ctscrub); a sign wakes it at once.
const refindEvery = 10 * time.Second

// sightLoop runs the find whenever the rule is blind, until ctx ends.
func (d *Daemon) sightLoop(ctx context.Context) {
	t := time.NewTicker(refindEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-d.bs.poke:
		case <-t.C:
		}
		if d.own.Blind() {
			d.refind()
		}
	}
}

// pokeSight wakes sightLoop (a sign came).
func (d *Daemon) pokeSight() {
	select {
	case d.bs.poke <- struct{}{}:
	default:
	}
}

// refind is one find after a sign; it reports whether the rule sees again.
// A pod in the middle of its ADD (its interface made, its index start to
// come) may be taken for a stranger: it is attached and held as found
// until its index start displaces it, its address marked; a sweep more,
// never a trust less.
func (d *Daemon) refind() bool {
	epoch := d.own.Epoch()
	pods, missed, err := d.scanPods()
	if err != nil {
		missed = append(missed, "(error: "+err.Error()+")")
	}
	fr := d.findStrangers(pods, d.journalKeys())
	missed = append(missed, fr.missed...)
	for _, fp := range fr.found {
		d.own.Start(fp.a, fp.ips)
	}
	seen := len(missed) == 0 && d.own.Sight(epoch)
	d.log.Info("find after a sign of an unseen owner", "attached", len(fr.found), "missed", missed, "sees_again", seen, "epoch", epoch)
	return seen
}

// goneBeforeDel reports whether a DEL of an attachment scrubd never indexed
// is no sign of an unseen owner: its pod's network namespace was gone
// before the DEL (netns empty or not there: the pods of before a node's
// reboot, which the kubelet DELs after it, or a pod that died while scrubd
// was down), and the rule is not blind, so every pod running was found and
// is recorded (the find at start, or one after the last sign). Such a pod
// runs no more. What it made while it ran unseen is older than what scrubd
// trusts: it died before the find at start (the pass read its entries), or
// during an unchained window or before a sign, whose epoch ended every
// release, and an address is released again only by a sweep that began
// after the find that ended the blindness. The DEL's own IPs sweep as
// before. A pod whose DEL comes while its namespace still exists ran until
// now unseen: a sign, as before (the conflist watch missed its ADD).
// Without the bootstrap there is no find: always a sign.
func (d *Daemon) goneBeforeDel(netns string) bool {
	if !d.bootOn() || d.own.Blind() {
		return false
	}
	if netns == "" {
		return true
	}
	_, err := os.Stat(netns)
	return errors.Is(err, os.ErrNotExist)
}
