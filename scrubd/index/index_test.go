package index

import (
	"net/netip"
	"runtime"
	"sync"
	"testing"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

var (
	podA   = netip.MustParseAddr("10.244.0.10")
	podB   = netip.MustParseAddr("10.244.0.11")
	remote = netip.MustParseAddr("192.0.2.1")
	cidrs  = []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16"), netip.MustParsePrefix("fd00:244::/64")}
)

func TestAddIndexesPodAddressesOnly(t *testing.T) {
	ix := New(Config{PodCIDRs: cidrs})
	ix.Hold(podA)
	ix.Hold(podB)
	ix.Hold(remote) // outside the pod CIDRs: no slot
	ix.Add4(ctmap.NewKey4(podA, remote, 443, 40000, ctmap.ProtoTCP, ctmap.FlagOut))
	ix.Add4(ctmap.NewKey4(podA, podB, 80, 40001, ctmap.ProtoTCP, ctmap.FlagOut))
	if got := ix.State(podA).Keys; got != 2 {
		t.Fatalf("podA keys %d, want 2", got)
	}
	if got := ix.State(podB).Keys; got != 1 {
		t.Fatalf("podB keys %d, want 1", got)
	}
	if got := ix.State(remote); got.Keys != 0 || got.Complete {
		t.Fatalf("remote must not be indexed: %+v", got)
	}
	if ix.Keys() != 3 {
		t.Fatalf("Keys() %d, want 3", ix.Keys())
	}
}

func TestCompleteness(t *testing.T) {
	ix := New(Config{PodCIDRs: cidrs})
	ix.Hold(podA)
	k := ctmap.NewKey4(podA, remote, 53, 5353, ctmap.ProtoUDP, ctmap.FlagOut)
	ix.Add4(k)
	if st := ix.State(podA); st.Complete || st.Incomplete != ReasonUnknown {
		t.Fatalf("an IP never swept must be incomplete: %+v", st)
	}
	ix.Track(podA)
	if st := ix.State(podA); !st.Complete {
		t.Fatalf("tracked IP must be complete: %+v", st)
	}
	ix.MarkIncomplete(podA, ReasonLost)
	if st := ix.State(podA); st.Complete || st.Incomplete != ReasonLost || ix.IncompleteIPs() != 1 {
		t.Fatalf("marked IP must be incomplete: %+v (%d)", st, ix.IncompleteIPs())
	}
	ix.Track(podA)
	if ix.IncompleteIPs() != 0 || !ix.State(podA).Complete {
		t.Fatal("Track must clear the mark")
	}
}

func TestTakeReturn(t *testing.T) {
	ix := New(Config{PodCIDRs: cidrs})
	ix.Hold(podA)
	ix.Hold(netip.MustParseAddr("fd00:244::a"))
	for p := range uint16(10) {
		ix.Add4(ctmap.NewKey4(podA, remote, 80, 1000+p, ctmap.ProtoTCP, ctmap.FlagOut))
	}
	ix.Add6(ctmap.NewKey6(netip.MustParseAddr("fd00:244::a"), netip.MustParseAddr("2001:db8::1"), 80, 1, ctmap.ProtoTCP, ctmap.FlagOut))
	k4, k6, _ := ix.Take(podA)
	if len(k4) != 10 || len(k6) != 0 || ix.State(podA).Keys != 0 {
		t.Fatalf("took %d/%d keys", len(k4), len(k6))
	}
	ix.Return(podA, k4[:3], nil)
	if ix.State(podA).Keys != 3 || ix.Keys() != 4 {
		t.Fatalf("after Return: %d keys, total %d", ix.State(podA).Keys, ix.Keys())
	}
}

func TestFullMarksIncomplete(t *testing.T) {
	ix := New(Config{PodCIDRs: cidrs, MaxKeysPerIP: 5})
	ix.Hold(podA)
	ix.Track(podA)
	for p := range uint16(8) {
		ix.Add4(ctmap.NewKey4(podA, remote, 80, p, ctmap.ProtoTCP, ctmap.FlagOut))
	}
	st := ix.State(podA)
	if st.Keys != 5 || st.Complete || st.Incomplete != ReasonFull {
		t.Fatalf("full index: %+v", st)
	}
}

func TestPrune(t *testing.T) {
	ix := New(Config{PodCIDRs: cidrs})
	ix.Track(podA)
	for p := range uint16(2048) {
		ix.Add4(ctmap.NewKey4(podA, remote, 80, p, ctmap.ProtoTCP, ctmap.FlagOut))
	}
	if !ix.NeedsPrune(podA) {
		t.Fatal("2048 keys should pass the first prune threshold")
	}
	dropped := ix.Prune(podA, func(k ctmap.CTKey4) bool { return k.SPort()%2 == 0 }, nil)
	if dropped != 1024 || ix.State(podA).Keys != 1024 || ix.NeedsPrune(podA) {
		t.Fatalf("dropped %d, left %d", dropped, ix.State(podA).Keys)
	}
}

// Adds and takes of different IPs from many goroutines: run with -race.
func TestConcurrentIPs(t *testing.T) {
	ix := New(Config{PodCIDRs: cidrs})
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ip := netip.AddrFrom4([4]byte{10, 244, 1, byte(g)})
			ix.Hold(ip)
			for p := range uint16(1000) {
				ix.Add4(ctmap.NewKey4(ip, remote, 80, p, ctmap.ProtoTCP, ctmap.FlagOut))
				if p%100 == 0 {
					k4, _, _ := ix.Take(ip)
					ix.Return(ip, k4, nil)
				}
			}
		}()
	}
	wg.Wait()
	if ix.Keys() != 8000 || len(ix.IPs()) != 8 {
		t.Fatalf("keys %d, ips %d", ix.Keys(), len(ix.IPs()))
	}
}

// The memory bound of the design (<= 100 bytes per indexed key) on a node-like
// shape: many pods, each with many flows, every key indexed under its pod IP.
func TestMemoryPerKey(t *testing.T) {
	if testing.Short() {
		t.Skip("allocates ~100 MB")
	}
	const pods, perPod = 1000, 1000
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	ix := New(Config{PodCIDRs: cidrs})
	for p := range pods {
		ip := netip.AddrFrom4([4]byte{10, 244, byte(p >> 8), byte(p)})
		ix.Hold(ip)
		for f := range perPod {
			ix.Add4(ctmap.NewKey4(ip, remote, 443, uint16(f), ctmap.ProtoTCP, ctmap.FlagOut))
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	per := float64(after.HeapAlloc-before.HeapAlloc) / float64(ix.Keys())
	t.Logf("index: %d keys, %.1f bytes per key", ix.Keys(), per)
	if per > 100 {
		t.Fatalf("%.1f bytes per indexed key, design bound is 100", per)
	}
	runtime.KeepAlive(ix)
}
