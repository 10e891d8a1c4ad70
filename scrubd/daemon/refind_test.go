package daemon

import (
	"context"
	"net/netip"
	"testing"

	"github.com/ctscrub/ctscrub/internal/testsupport/ownermodel"
	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// A pod that started while the CNI config did not chain ctscrub runs on
// after the re-chain; it sends towards an address no pod holds, one that a
// DEL released in the new epoch. The next pod on that address must not be
// answered complete: the entry is in no set (the rule is blind until a
// find). The shortest list the rule's walk found against the rule without
// blindness (17 of 20 seeds of TestOwnershipModel fail it), replayed on the
// daemon, whose walk is too short to reach it.
func TestUnseenPodSendingToAFreeAddressAfterRechain(t *testing.T) {
	steps := []ownermodel.Step{
		{Op: ownermodel.OpUnchain}, {Op: ownermodel.OpCreate, A: 18}, {Op: ownermodel.OpRechain},
		{Op: ownermodel.OpCreate, A: 13}, {Op: ownermodel.OpCreate, A: 28}, {Op: ownermodel.OpCreate, A: 19},
		{Op: ownermodel.OpDelete, A: 63}, {Op: ownermodel.OpTrafficFree, A: 11, B: 63}, {Op: ownermodel.OpCreate, A: 25},
	}
	if at, why := ownermodel.Walk(func() ownermodel.System { return newDaemonSystem(t) }, steps); at >= 0 {
		t.Fatalf("after step %d (%s): %s", at, steps[at], why)
	}
}

// The find after a sign attaches the pods no attachment names (they become
// found holders, recorded from then on) and ends the blindness; a DEL then
// releases again.
func TestRefindEndsBlindness(t *testing.T) {
	s := newDaemonSystem(t).(*daemonSystem)
	d := s.td.Daemon
	w := ownermodel.NewWorld(s)
	w.Run(ownermodel.Step{Op: ownermodel.OpUnchain})
	w.Run(ownermodel.Step{Op: ownermodel.OpCreate, A: 0}) // unseen: 10.244.0.10
	w.Run(ownermodel.Step{Op: ownermodel.OpRechain})
	if !d.own.Blind() {
		t.Fatal("after an unchained window the rule is not blind")
	}
	if v := counterValue(t, s.td, "ctscrub_ownership_blind", nil); v != 1 {
		t.Fatalf("ctscrub_ownership_blind %v while blind, want 1", v)
	}
	unseen := netip.MustParseAddr("10.244.0.10")
	if d.holderOf(unseen) != nil {
		t.Fatalf("the unseen pod's address has a holder before the find: %v", d.holderOf(unseen))
	}
	if !d.refind() {
		t.Fatal("the find did not end the blindness (it followed every pod)")
	}
	if d.own.Blind() {
		t.Fatal("blind after a find that followed every pod")
	}
	if v := counterValue(t, s.td, "ctscrub_ownership_blind", nil); v != 0 {
		t.Fatalf("ctscrub_ownership_blind %v after the find, want 0", v)
	}
	if a := d.holderOf(unseen); a == nil || a.IfName != "eth0" {
		t.Fatalf("the unseen pod is no found holder after the find: %v", a)
	}
	// A pod through the chain now: its DEL releases, and the next create
	// of its address is trusted.
	a := api.Attachment{ContainerID: "after", IfName: "eth0"}
	ip := netip.MustParseAddr("10.244.0.11")
	s.Born(a, ip)
	if !s.Add(a, ip, false) {
		t.Fatal("ADD after the find not complete")
	}
	s.Gone(a)
	if !s.Del(a, ip) {
		t.Fatal("DEL after the find not complete")
	}
	if _, ok := d.own.Released(ip); !ok {
		t.Fatal("a DEL after the find released nothing")
	}
}

// A DEL of an attachment scrubd never indexed whose pod's namespace went
// before it (the kubelet's DELs of the sandboxes of before a node reboot)
// is no sign of an unseen owner while the rule sees; with its namespace
// still there it is one (the pod ran unseen until now).
func TestUnknownDelOfAGonePodIsNoSign(t *testing.T) {
	s := newDaemonSystem(t).(*daemonSystem)
	d := s.td.Daemon
	epoch := d.own.Epoch()
	old := api.Attachment{ContainerID: "before-reboot", IfName: "eth0"}
	s.Del(old, netip.MustParseAddr("10.244.0.10")) // its netns file never existed
	if d.own.Epoch() != epoch || d.own.Blind() {
		t.Fatalf("a DEL of a pod gone before it was a sign: epoch %d -> %d, blind %v", epoch, d.own.Epoch(), d.own.Blind())
	}
	// Its address keeps the release the pass gave it: the next ADD on it
	// trusts the index.
	if _, ok := d.own.Released(netip.MustParseAddr("10.244.0.10")); !ok {
		t.Fatal("the DEL of a pod gone before it ended its address's release")
	}
	live := api.Attachment{ContainerID: "ran-unseen", IfName: "eth0"}
	s.Born(live, netip.MustParseAddr("10.244.0.11"))
	s.Del(live, netip.MustParseAddr("10.244.0.11"))
	if d.own.Epoch() != epoch+1 || !d.own.Blind() {
		t.Fatalf("a DEL of a pod that ran unseen until now was no sign: epoch %d -> %d, blind %v", epoch, d.own.Epoch(), d.own.Blind())
	}
	// While blind, even a gone pod's DEL is a sign.
	s.Del(old, netip.MustParseAddr("10.244.0.10"))
	if d.own.Epoch() != epoch+2 {
		t.Fatalf("a DEL while blind was no sign: epoch %d", d.own.Epoch())
	}
}

// A runtime's ADD still in the chain while scrubd was down: the find at
// start found its interface (the pod ran no app yet), and its ADD, once
// scrubd serves, is the found pod's own: trusted from the index after the
// pass, not swept (the day-2 node restart's ADDs).
func TestAddOfAFoundPodIsTrusted(t *testing.T) {
	s := newDaemonSystem(t).(*daemonSystem)
	a := api.Attachment{ContainerID: "in-flight", IfName: "eth0"}
	ip := netip.MustParseAddr("10.244.0.12")
	s.Born(a, ip)
	s.Restart(false, nil, nil, false)
	s.PassEnd()
	d := s.td.Daemon
	if d.foundOf(s.netnsOf(a), a.IfName) == nil {
		t.Fatal("the pod is not found at start")
	}
	res, err := s.td.c.Scrub(context.Background(), api.ScrubRequest{IPs: []netip.Addr{ip}, Reason: scrub.ReasonAdd, ContainerID: a.ContainerID, Netns: s.netnsOf(a), IfName: a.IfName})
	if err != nil {
		t.Fatal(err)
	}
	if r := res.Results[0]; r.Outcome != scrub.Complete || r.Method != scrub.MethodIndex {
		t.Fatalf("the found pod's own ADD: %s by %s (swept: %v), want complete by the index", r.Outcome, r.Method, r.SweptWhy)
	}
	// Another pod's ADD on an address a found pod holds sweeps.
	b := api.Attachment{ContainerID: "other", IfName: "eth0"}
	s.Born(b, netip.MustParseAddr("10.244.0.13"))
	res, err = s.td.c.Scrub(context.Background(), api.ScrubRequest{IPs: []netip.Addr{ip}, Reason: scrub.ReasonAdd, ContainerID: b.ContainerID, Netns: s.netnsOf(b), IfName: b.IfName})
	if err != nil {
		t.Fatal(err)
	}
	if r := res.Results[0]; r.Method != scrub.MethodSweep {
		t.Fatalf("another pod's ADD on a found pod's address: %s, want a sweep", r.Method)
	}
}
