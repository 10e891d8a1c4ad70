package owner

import (
	"net/netip"
	"testing"

	"github.com/ctscrub/ctscrub/scrubd/api"
)

// After a sign the rule is blind: nothing is trusted (even a pod's own DEL
// sweeps: its pod may have died before it, and a pod no recorder sees may
// have sent towards its address since), a DEL releases nothing, and a
// create completed meanwhile lets no ADD trust the index, until a find that began in the current epoch says every pod is
// recorded (Sight). A create made while blind still names its IP's pod
// unseen when no index start follows.
func TestBlindUntilSight(t *testing.T) {
	ip := netip.MustParseAddr("10.244.0.10")
	other := netip.MustParseAddr("10.244.0.11")
	a := api.Attachment{ContainerID: "a", IfName: "eth0"}
	r := New()
	if r.Blind() {
		t.Fatal("a new rule is blind")
	}
	r.SetChained(false)
	r.SetChained(true)
	if !r.Blind() {
		t.Fatal("not blind after an unchained window")
	}
	r.Start(a, []netip.Addr{ip})
	tk := r.Begin(Del, a, []netip.Addr{ip})
	if tk.Verdict(ip) != Sweep {
		t.Fatal("a pod's own DEL was trusted while blind")
	}
	if rel, _ := tk.End(true); len(rel) != 0 {
		t.Fatalf("a DEL released %v while blind", rel)
	}
	r.Stop(a)
	cr := r.Begin(Create, api.Attachment{}, []netip.Addr{other})
	cr.End(true)
	stale := r.Epoch()
	r.Unseen()
	if r.Sight(stale) {
		t.Fatal("a find that began before the last sign ended the blindness")
	}
	if !r.Sight(r.Epoch()) || r.Blind() {
		t.Fatal("a find of the current epoch did not end the blindness")
	}
	if v := r.Begin(Add, a, []netip.Addr{ip}).Verdict(ip); v != Sweep {
		t.Fatal("an ADD trusted a release made while blind")
	}
	// The create of before the sight: no trust for its ADD, and its delete
	// with no index start is an unseen pod's.
	if v := r.Begin(Delete, api.Attachment{}, []netip.Addr{other}).Verdict(other); v != Sweep {
		t.Fatal("the delete of a create no index start followed was trusted")
	}
	// Seeing again, a DEL is trusted and releases.
	r.Start(a, []netip.Addr{ip})
	tk = r.Begin(Del, a, []netip.Addr{ip})
	if tk.Verdict(ip) != Trust {
		t.Fatal("a pod's own DEL after the sight was not trusted")
	}
	if rel, _ := tk.End(true); len(rel) != 1 {
		t.Fatalf("a DEL after the sight released %v", rel)
	}
	if r.SetChained(false); r.Sight(r.Epoch()) {
		t.Fatal("the rule sees while the config does not chain ctscrub")
	}
}

// The DEL of a pod gone before it (DelGone): a released IP stays released
// and is trusted; an IP not released sweeps, and a bootstrap pass running
// meanwhile still vouches for it; while blind it sweeps.
func TestDelGone(t *testing.T) {
	ip := netip.MustParseAddr("10.244.0.10")
	other := netip.MustParseAddr("10.244.0.11")
	a := api.Attachment{ContainerID: "a", IfName: "eth0"}
	old := api.Attachment{ContainerID: "before-reboot", IfName: "eth0"}
	r := New()
	r.Start(a, []netip.Addr{ip})
	r.Begin(Del, a, []netip.Addr{ip}).End(true)
	r.Stop(a)
	tk := r.Begin(DelGone, old, []netip.Addr{ip, other})
	if tk.Verdict(ip) != Trust || tk.Verdict(other) != Sweep {
		t.Fatalf("verdicts %v / %v, want trust for the released IP, sweep for the other", tk.Verdict(ip), tk.Verdict(other))
	}
	if rel, _ := tk.End(true); len(rel) != 0 {
		t.Fatalf("a DEL of an attachment never indexed released %v", rel)
	}
	if _, ok := r.Released(ip); !ok {
		t.Fatal("the released IP lost its release")
	}
	if r.Epoch() != 0 {
		t.Fatal("DelGone started an epoch")
	}
	// During a bootstrap pass: the address it vouches for is still trusted
	// at its end.
	r2 := New()
	boot := r2.BeginBoot(nil, nil, false)
	if v := r2.Begin(DelGone, old, []netip.Addr{other}).Verdict(other); v != Sweep {
		t.Fatal("DelGone trusted an address the pass had not vouched for yet")
	}
	if !boot.Trust(other, true) {
		t.Fatal("a DelGone during the pass took its address from the pass")
	}
	r.Unseen()
	r.Start(a, []netip.Addr{ip})
	r.Sight(r.Epoch())
	r.Begin(Del, a, []netip.Addr{ip}).End(true)
	r.Stop(a)
	r.SetChained(false)
	r.SetChained(true)
	if v := r.Begin(DelGone, old, []netip.Addr{ip}).Verdict(ip); v != Sweep {
		t.Fatal("DelGone trusted while blind")
	}
}

// AddFound: the ADD of a found pod's own interface trusts the index while
// the found pod holds the IP in this epoch; not after a sign, nor for an
// IP it does not hold.
func TestAddFound(t *testing.T) {
	ip := netip.MustParseAddr("10.244.0.10")
	other := netip.MustParseAddr("10.244.0.11")
	found := api.Attachment{ContainerID: "found:1:2", IfName: "eth0"}
	r := New()
	r.BeginBoot(nil, []Found{{A: found, IPs: []netip.Addr{ip}}}, false)
	tk := r.Begin(AddFound, found, []netip.Addr{ip, other})
	if tk.Verdict(ip) != Trust || tk.Verdict(other) != Sweep {
		t.Fatalf("verdicts %v / %v, want trust for the found pod's IP only", tk.Verdict(ip), tk.Verdict(other))
	}
	r.Unseen()
	r.Sight(r.Epoch())
	if v := r.Begin(AddFound, found, []netip.Addr{ip}).Verdict(ip); v != Sweep {
		t.Fatal("AddFound trusted a holder of an earlier epoch")
	}
}
