package daemon

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/cilium"
	"github.com/ctscrub/ctscrub/scrubd/client"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/nfct"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// One scrub request runs on every backend: Cilium's maps and nf_conntrack
// (here the table of a private network namespace), one result each, and
// each backend deletes the IP's entries in its own table.
func TestEveryBackendScrubs(t *testing.T) {
	root := newCTRoot(t, 1<<12)
	if _, err := os.Stat("/proc/sys/net/netfilter/nf_conntrack_max"); err != nil {
		t.Skip("nf_conntrack not loaded (modprobe nf_conntrack)")
	}
	b := make([]byte, 4)
	rand.Read(b)
	name := "ctscrub-d2b-" + hex.EncodeToString(b)
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add: %v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	nsPath := "/var/run/netns/" + name

	ip := mustAddr("10.244.9.1")
	other := mustAddr("10.244.9.2")
	keys := podFlows(ip, 20)
	root.put4(t, keys)
	tab, err := nfct.OpenTable(nsPath)
	if err != nil {
		t.Fatal(err)
	}
	defer tab.Close()
	var es []nfct.Entry
	for i := range 20 {
		src := ip
		if i%2 == 1 {
			src = other
		}
		dst := mustAddr("192.168.0.1")
		es = append(es, nfct.Entry{
			Orig:  nfct.Tuple{Src: src, Dst: dst, Proto: unix.IPPROTO_UDP, Ports: true, SPort: uint16(1000 + i), DPort: 53},
			Reply: nfct.Tuple{Src: dst, Dst: src, Proto: unix.IPPROTO_UDP, Ports: true, SPort: 53, DPort: uint16(1000 + i)},
		})
	}
	if n, err := tab.Create(es, 300); err != nil || n != len(es) {
		t.Fatalf("create conntrack entries: %d, %v", n, err)
	}

	cfg := testConfig(t, root)
	cidrs, err := cfg.Validate()
	if err != nil {
		t.Fatal(err)
	}
	ix := index.New(index.Config{PodCIDRs: cidrs})
	maps, err := ctmap.Open(root.dir)
	if err != nil {
		t.Fatal(err)
	}
	defer maps.Close()
	c, err := cilium.New(maps, ix, cilium.Options{})
	if err != nil {
		t.Fatal(err)
	}
	n, err := nfct.New(nfct.Config{PodCIDRs: cidrs, Netns: nsPath})
	if err != nil {
		t.Fatal(err)
	}
	d, err := New(Options{
		Config: cfg, Index: ix, Backends: []scrub.Backend{c, n},
		Stats:  []StatsSource{CiliumStats(maps, c), NFCTStats(n)},
		Logger: slog.New(slog.DiscardHandler), Version: "test",
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Error("daemon did not stop")
		}
		d.Close()
	})
	cl := client.New(cfg.Socket)
	waitServing(t, cl, done)

	resp, err := cl.Scrub(context.Background(), api.ScrubRequest{IPs: []netip.Addr{ip}, Reason: scrub.ReasonDel})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]scrub.Result{}
	for _, r := range resp.Results {
		got[r.Backend] = r
	}
	if len(got) != 2 || got["cilium"].Total != len(keys) || got["nfct"].Total != 10 || got["nfct"].Deleted[nfct.MapName] != 10 {
		t.Errorf("results %+v: want cilium %d and nfct 10", resp.Results, len(keys))
	}
	if left := root.present4(t, keys); left != 0 {
		t.Errorf("%d Cilium entries left", left)
	}
	remaining := 0
	if err := tab.Dump(func(e nfct.Entry) {
		if e.Orig.Src == ip || e.Reply.Src == ip {
			t.Errorf("conntrack entry of %s left: %+v", ip, e)
		}
		if e.Orig.Src == other {
			remaining++
		}
	}); err != nil {
		t.Fatal(err)
	}
	if remaining != 10 {
		t.Errorf("%d entries of the other pod left, want all 10", remaining)
	}
	st, err := cl.CTStats(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	backends := map[string]bool{}
	for _, m := range st.Maps {
		backends[m.Backend] = true
	}
	if !backends["cilium"] || !backends["nfct"] {
		t.Errorf("ct stats cover %v, want both backends", backends)
	}
}
