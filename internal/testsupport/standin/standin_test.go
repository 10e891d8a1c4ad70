package standin_test

import (
	"errors"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/internal/testsupport/netpods"
	"github.com/ctscrub/ctscrub/internal/testsupport/standin"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

func setup(t *testing.T, lt *standin.Lifetimes) (*netpods.Node, *netpods.Pod, *standin.Datapath, *ctmap.Maps) {
	t.Helper()
	node := netpods.NewNode(t) // skips when not root
	dir := standin.TempDir(t)
	if err := standin.CreateMaps(dir, 4096); err != nil {
		t.Fatal(err)
	}
	dp, err := standin.Load(dir, lt)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dp.Close() })
	ct, err := dp.Maps()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ct.Close() })
	pod := node.AddPod()
	if err := node.Do(func() error { return dp.AttachHostSide(pod.HostVeth) }); err != nil {
		t.Fatal(err)
	}
	node.Remote.ServeEcho()
	return node, pod, dp, ct
}

func entry(t *testing.T, m *ebpf.Map, k any) (ctmap.Entry, bool) {
	t.Helper()
	var v ctmap.Entry
	err := m.Lookup(k, &v)
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return v, false
	}
	if err != nil {
		t.Fatal(err)
	}
	return v, true
}

func monoSeconds(t *testing.T) uint32 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		t.Fatal(err)
	}
	return uint32(ts.Sec)
}

// A UDP exchange pod -> remote creates exactly the OUT entry and its related
// entry (the reply refreshes, it creates no IN entry), with the configured
// lifetime in ktime seconds.
func TestOutEntryAndLifetime(t *testing.T) {
	node, pod, _, ct := setup(t, &standin.Lifetimes{NonTCP: 30})
	if err := pod.UDP(node.Remote.Addr4, netpods.EchoPort); err != nil {
		t.Fatal(err)
	}
	var out ctmap.CTKey4
	var n int
	var k ctmap.CTKey4
	var v ctmap.Entry
	it := ct.Map(ctmap.Any4).Iterate()
	for it.Next(&k, &v) {
		if k.Has(pod.Addr4) {
			n++
			if k.NextHdr() == ctmap.ProtoUDP {
				out = k
			}
		}
	}
	if n != 2 || out.Flags() != ctmap.FlagOut || out.DAddr() != pod.Addr4 || out.DPort() != netpods.EchoPort {
		t.Fatalf("want an OUT UDP entry (pod in daddr, dport %d) and its related entry; got %d entries, UDP key %s", netpods.EchoPort, n, out)
	}
	_, ok := entry(t, ct.Map(ctmap.Any4), out.Related())
	if !ok {
		t.Fatalf("no related entry %s", out.Related())
	}
	f, _ := entry(t, ct.Map(ctmap.Any4), out)
	now := monoSeconds(t)
	if lt := f.Decode().Lifetime; lt < now+25 || lt > now+31 {
		t.Fatalf("lifetime %d, want about now (%d) + 30", lt, now)
	}
	if f.Decode().Packets < 2 {
		t.Fatalf("packets %d: the reply did not refresh the entry", f.Decode().Packets)
	}
}

// A packet to a registered VIP creates a SERVICE entry (pod in saddr, VIP in
// daddr, not reversed) and an OUT entry towards the backend, with the
// service's rev-NAT index.
func TestServiceEntries(t *testing.T) {
	_, pod, dp, ct := setup(t, nil)
	vip := netip.MustParseAddrPort("10.96.0.10:80")
	backend := netip.MustParseAddrPort("10.244.0.99:8080")
	if err := dp.AddService(ctmap.ProtoTCP, vip, backend); err != nil {
		t.Fatal(err)
	}
	// Nothing answers on the VIP: the SYN is enough.
	go pod.TCP(vip.Addr(), vip.Port())
	deadline := time.Now().Add(3 * time.Second)
	for {
		var k ctmap.CTKey4
		var v ctmap.Entry
		var svc, out bool
		it := ct.Map(ctmap.TCP4).Iterate()
		for it.Next(&k, &v) {
			switch {
			case k.Flags() == ctmap.FlagService && k.DAddr() == vip.Addr() && k.SAddr() == pod.Addr4 && k.SPort() == vip.Port():
				svc = v.Decode().RevNATIndex != 0
			case k.Flags() == ctmap.FlagOut && k.DAddr() == pod.Addr4 && k.SAddr() == backend.Addr() && k.DPort() == backend.Port():
				out = v.Decode().RevNATIndex != 0
			}
		}
		if svc && out {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("SERVICE entry %v, OUT entry to the backend %v", svc, out)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// With Cilium's close timeout set, a TCP connection that closed (FIN)
// leaves entries that live the close timeout, not TCP's 6 h; without it
// they keep TCP's lifetime, as before.
func TestCloseTimeout(t *testing.T) {
	for _, timeout := range []uint32{0, 10} {
		node, pod, _, ct := setup(t, &standin.Lifetimes{Close: timeout})
		if err := pod.TCP(node.Remote.Addr4, netpods.EchoPort); err != nil {
			t.Fatal(err)
		}
		time.Sleep(200 * time.Millisecond) // the last ACK of the close
		var k ctmap.CTKey4
		var v ctmap.Entry
		n := 0
		it := ct.Map(ctmap.TCP4).Iterate()
		for it.Next(&k, &v) {
			if !k.Has(pod.Addr4) {
				continue
			}
			n++
			want, now := uint32(21600), monoSeconds(t)
			if timeout != 0 {
				want = timeout
			}
			if lt := v.Decode().Lifetime; lt+2 < now+want || lt > now+want+1 {
				t.Errorf("close timeout %d: entry %s lifetime %d, want about now (%d) + %d", timeout, k, lt, now, want)
			}
		}
		if err := it.Err(); err != nil || n == 0 {
			t.Fatalf("close timeout %d: %d TCP entries of the pod (%v)", timeout, n, err)
		}
	}
}
