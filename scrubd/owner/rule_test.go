package owner

import (
	"net/netip"
	"testing"

	"github.com/ctscrub/ctscrub/scrubd/api"
)

// After a sign the rule is blind: a DEL of a pod indexed in the new epoch
// releases nothing, and a create completed meanwhile lets no ADD trust the
// index, until a find that began in the current epoch says every pod is
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
	if tk.Verdict(ip) != Trust {
		t.Fatal("the pod's own DEL is not trusted while blind (its holder records what reaches it)")
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
	// Seeing again, a DEL releases.
	r.Start(a, []netip.Addr{ip})
	if rel, _ := r.Begin(Del, a, []netip.Addr{ip}).End(true); len(rel) != 1 {
		t.Fatalf("a DEL after the sight released %v", rel)
	}
	if r.SetChained(false); r.Sight(r.Epoch()) {
		t.Fatal("the rule sees while the config does not chain ctscrub")
	}
}
