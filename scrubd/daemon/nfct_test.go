package daemon

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/netip"
	"os"
	"os/exec"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/scrubd/nfct"
)

// The nfct backend's table size and index figures, read the way the daemon
// reads them, on the conntrack table of a private network namespace.
func TestNFCTStatsAndCollectors(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates a network namespace and writes its conntrack table")
	}
	b := make([]byte, 4)
	rand.Read(b)
	name := "ctscrub-dnfct-" + hex.EncodeToString(b)
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add: %v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	path := "/var/run/netns/" + name

	tab, err := nfct.OpenTable(path)
	if err != nil {
		t.Fatal(err)
	}
	defer tab.Close()
	var es []nfct.Entry
	for i := 0; i < 10; i++ {
		src := netip.AddrFrom4([4]byte{10, 244, 0, byte(1 + i%2)})
		dst := netip.MustParseAddr("192.168.0.1")
		es = append(es, nfct.Entry{
			Orig:  nfct.Tuple{Src: src, Dst: dst, Proto: unix.IPPROTO_UDP, Ports: true, SPort: uint16(1000 + i), DPort: 53},
			Reply: nfct.Tuple{Src: dst, Dst: src, Proto: unix.IPPROTO_UDP, Ports: true, SPort: 53, DPort: uint16(1000 + i)},
		})
	}
	if n, err := tab.Create(es, 300); err != nil || n != len(es) {
		t.Fatalf("create: %d, %v", n, err)
	}
	n, err := nfct.New(nfct.Config{PodCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}, Netns: path})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()

	ms, err := NFCTStats(n).CTStats(context.Background())
	if err != nil || len(ms) != 1 {
		t.Fatalf("CTStats: %v, %v", ms, err)
	}
	if ms[0].Backend != "nfct" || ms[0].Map != nfct.MapName || ms[0].Entries != int64(len(es)) || ms[0].MaxEntries <= 0 {
		t.Errorf("CTStats = %+v, want nfct/nf_conntrack with %d entries and a max", ms[0], len(es))
	}

	if st := n.Stats(); st.Keys != len(es) || st.Lost != 0 || st.IncompleteIPs != 0 || st.IPs != 2 {
		t.Errorf("index figures %+v, want %d keys for 2 IPs, nothing lost or incomplete", st, len(es))
	}
	if _, err := OpenNFCT(nil, "sideways", true, false, false, nil); err == nil {
		t.Error("an unknown nfct_fallback must be refused, even with backends: auto")
	}
}
