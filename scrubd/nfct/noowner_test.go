package nfct

import (
	"context"
	"net"
	"net/netip"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/internal/nsexec"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// nf_conntrack creates entries for packets to a routed pod IP that no pod
// holds (a client still sending to a deleted pod, a route to a range whose
// addresses are not all in use). The decision (docs/nfct.md, "IPs with no
// owner"): the index assumes nothing about ownership. It is fed by the
// kernel's own events for every address in the pod CIDRs, so such entries are
// indexed like any other, the IP stays complete, and the next owner's ADD
// scrub deletes them by the index.
func TestEntriesOfIPWithNoOwner(t *testing.T) {
	ns := privateNetns(t)
	name := filepath.Base(ns)
	if _, err := exec.LookPath("iptables"); err != nil {
		t.Skip("iptables missing (scripts/setup.sh): a conntrack match makes the namespace track its packets")
	}
	for _, args := range [][]string{
		{"ip", "link", "set", "lo", "up"},
		// A pod range routed on this node (towards a veth, as to a
		// bridge of pods), with no pod behind 10.244.5.77.
		{"ip", "link", "add", "pods0", "type", "veth", "peer", "name", "pods1"},
		{"ip", "addr", "add", "10.244.0.1/24", "dev", "pods0"},
		{"ip", "link", "set", "pods0", "up"},
		{"ip", "link", "set", "pods1", "up"},
		{"ip", "route", "add", "10.244.5.0/24", "dev", "pods0"},
		{"iptables", "-A", "OUTPUT", "-m", "conntrack", "--ctstate", "NEW", "-j", "ACCEPT"},
	} {
		if out, err := exec.Command("ip", append([]string{"netns", "exec", name}, args...)...).CombinedOutput(); err != nil {
			t.Fatalf("%v: %v: %s", args, err, out)
		}
	}
	tab, err := OpenTable(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer tab.Close()
	n, err := New(Config{PodCIDRs: []netip.Prefix{podNet}, Netns: ns})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()

	unowned := netip.MustParseAddr("10.244.5.77")
	// Real packets: UDP from several ports, and TCP SYNs.
	err = nsexec.Do(ns, func() error {
		for i := range 5 {
			c, err := net.Dial("udp", "10.244.5.77:53")
			if err != nil {
				return err
			}
			c.Write([]byte{byte(i)})
			c.Close()
		}
		for range 3 {
			d := net.Dialer{Timeout: 50 * time.Millisecond}
			if c, err := d.Dial("tcp", "10.244.5.77:80"); err == nil {
				c.Close()
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	before := snapshot(t, tab)
	inKernel := 0
	for _, e := range before {
		if holds(e, unowned) {
			inKernel++
		}
	}
	if inKernel < 6 {
		t.Fatalf("the kernel holds %d entries of %s, want at least 6 (5 UDP, TCP)", inKernel, unowned)
	}
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if k, _ := n.IndexIP(unowned); k == inKernel {
			break
		}
	}
	if k, c := n.IndexIP(unowned); k != inKernel || !c {
		t.Fatalf("index holds %d of the %d entries of %s (complete %v): want all, complete", k, inKernel, unowned, c)
	}
	// A new pod gets the IP: its ADD scrub goes by the index and leaves nothing.
	res, err := n.Scrub(context.Background(), scrub.Request{IPs: []netip.Addr{unowned}, Reason: scrub.ReasonAdd})
	if err != nil || res.Method != scrub.MethodIndex || res.Outcome != scrub.Complete {
		t.Fatalf("ADD scrub of %s: %+v, %v", unowned, res, err)
	}
	checkScrubbed(t, tab, before, unowned)
}
