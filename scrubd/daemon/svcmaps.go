package daemon

import (
	"context"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ctscrub/ctscrub/scrubd/index"
)

// reasonNotReloaded marks the IPs of a pod whose interface kept the programs
// over Cilium's old service maps.
const reasonNotReloaded = "the recorder's reloaded programs could not be put on the pod's interface after Cilium's service maps changed"

// ServiceMapsCheckEvery is how often scrubd compares Cilium's service maps
// pinned under --ct-root with the ones the recorder's programs read.
const ServiceMapsCheckEvery = time.Second

// serviceReloader is the recorder's part in following Cilium's service maps
// (recorder.Recorder has it).
type serviceReloader interface {
	ServiceMapsChanged() bool
	ReloadPrograms() error
}

// enableServiceMapsWatch adds the service-maps watch to the tasks when the
// recorder can reload its programs.
func (d *Daemon) enableServiceMapsWatch() error {
	sr, ok := d.rec.(serviceReloader)
	if !ok {
		return nil
	}
	d.svcReloads = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "ctscrub_service_maps_reloaded_total",
		Help: "Times Cilium's service maps changed under the recorder (re-created, or pinned after scrubd started) and its programs were reloaded over the new ones; every indexed IP is then incomplete.",
	})
	if err := d.m.reg.Register(d.svcReloads); err != nil {
		return err
	}
	d.tasks = append(d.tasks, Task{Name: "service-maps-watch", Run: func(ctx context.Context) error {
		t := time.NewTicker(ServiceMapsCheckEvery)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return nil
			case <-t.C:
			}
			d.followServiceMaps(sr)
		}
	}})
	return nil
}

// followServiceMaps moves the recorder to Cilium's service maps when they
// changed: the programs are reloaded over the maps pinned now and put on
// every indexed interface, then every indexed IP is marked incomplete. Until
// the reload, a flow to a service the old maps lack was recorded as a flow
// to its VIP, a key Cilium never makes (docs/recorder.md, "Services"), so no
// IP can be trusted complete until a sweep proves it.
func (d *Daemon) followServiceMaps(sr serviceReloader) {
	if !sr.ServiceMapsChanged() {
		return
	}
	if err := sr.ReloadPrograms(); err != nil {
		// The old programs go on reading maps Cilium no longer fills: no
		// IP indexed meanwhile can be trusted either.
		n := 0
		for _, ip := range d.ix.IPs() {
			d.ix.MarkIncomplete(ip, index.ReasonServiceMaps)
			n++
		}
		d.log.Error("Cilium's service maps changed but the recorder could not reload its programs; every indexed IP marked incomplete, retrying every second",
			"err", err, "ips_marked_incomplete", n)
		return
	}
	active, _ := d.pods.list()
	moved, failed := 0, 0
	for _, pod := range active {
		if pod.Netns == "" {
			continue
		}
		if _, err := os.Stat(pod.Netns); err != nil {
			continue // the pod is going; its DEL will scrub it
		}
		if _, err := d.rec.Attach(pod.Netns, pod.IfName); err != nil {
			failed++
			// The pod keeps programs that read maps Cilium no longer fills:
			// no sweep may make its IPs complete while it lives (the sticky
			// mark restore uses).
			for _, ip := range pod.IPs {
				d.ix.Unrecorded(ip, reasonNotReloaded)
			}
			d.log.Warn("service maps changed: could not put the reloaded programs on an interface; its IPs stay incomplete while the pod lives",
				"container_id", pod.ContainerID, "ifname", pod.IfName, "netns", pod.Netns, "err", err)
			continue
		}
		for _, ip := range pod.IPs {
			d.ix.Recorded(ip)
		}
		moved++
	}
	n := 0
	for _, ip := range d.ix.IPs() {
		d.ix.MarkIncomplete(ip, index.ReasonServiceMaps)
		n++
	}
	d.svcReloads.Inc()
	d.log.Warn("Cilium's service maps changed (agent restart, or Cilium started after scrubd): recorder reloaded over the new ones; every indexed IP marked incomplete, their next scrubs sweep",
		"interfaces_moved", moved, "interfaces_failed", failed, "ips_marked_incomplete", n)
}
