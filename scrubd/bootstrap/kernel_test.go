package bootstrap

import (
	"context"
	"errors"
	"net/netip"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"unsafe"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// The program copies out exactly the keys holding an address of the pod
// CIDRs, in daddr or saddr, over several prefixes of both families, and
// every key when there are none.
func TestKernelReadCopiesPodKeys(t *testing.T) {
	needRoot(t)
	maps := pinnedMaps(t, 4096)
	second4 := netip.MustParsePrefix("172.16.5.0/24")
	second6 := netip.MustParsePrefix("fd00:99::/112")
	in4 := []netip.Addr{pod4(1), pod4(300), netip.MustParseAddr("172.16.5.7")}
	out4 := []netip.Addr{netip.MustParseAddr("10.245.0.1"), netip.MustParseAddr("172.16.6.7"), remote4}
	in6 := []netip.Addr{pod6(1), pod6(9), netip.MustParseAddr("fd00:99::1234")}
	out6 := []netip.Addr{netip.MustParseAddr("fd00:10:245::1"), netip.MustParseAddr("fd00:99::1:1"), remote6}
	var want4, none4 []ctmap.CTKey4
	var want6, none6 []ctmap.CTKey6
	for i, a := range in4 {
		want4 = append(want4,
			ctmap.NewKey4(a, remote4, 80, uint16(i), ctmap.ProtoTCP, ctmap.FlagOut),
			ctmap.NewKey4(remote4, a, 80, uint16(i), ctmap.ProtoTCP, ctmap.FlagIn),
			ctmap.NewKey4(vip4, a, 53, uint16(i), ctmap.ProtoUDP, ctmap.FlagService))
	}
	for i, a := range out4 {
		none4 = append(none4, ctmap.NewKey4(a, remote4, 80, uint16(i), ctmap.ProtoTCP, ctmap.FlagOut))
	}
	for i, a := range in6 {
		want6 = append(want6,
			ctmap.NewKey6(a, remote6, 80, uint16(i), ctmap.ProtoTCP, ctmap.FlagOut),
			ctmap.NewKey6(remote6, a, 80, uint16(i), ctmap.ProtoTCP, ctmap.FlagIn))
	}
	for i, a := range out6 {
		none6 = append(none6, ctmap.NewKey6(a, remote6, 80, uint16(i), ctmap.ProtoTCP, ctmap.FlagOut))
	}
	put4(t, maps, append(slices.Clone(want4), none4...)...)
	put6(t, maps, append(slices.Clone(want6), none6...)...)

	for _, tc := range []struct {
		name  string
		cidrs []netip.Prefix
		all   bool
	}{
		{"pod CIDRs", []netip.Prefix{podCIDR4, second4, podCIDR6, second6}, false},
		{"none: every address", nil, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			filter, err := newCIDRFilter(tc.cidrs)
			if err != nil {
				t.Fatal(err)
			}
			got4 := readKeys4(t, maps, filter)
			w4 := want4
			if tc.all {
				w4 = append(slices.Clone(want4), none4...)
			}
			if !slices.Equal(sorted4(got4), sorted4(w4)) {
				t.Fatalf("IPv4: copied %d keys %v, want %d", len(got4), got4, len(w4))
			}
			got6 := readKeys6(t, maps, filter)
			w6 := want6
			if tc.all {
				w6 = append(slices.Clone(want6), none6...)
			}
			if !slices.Equal(sorted6(got6), sorted6(w6)) {
				t.Fatalf("IPv6: copied %d keys %v, want %d", len(got6), got6, len(w6))
			}
		})
	}
}

// readKeys4 is what the program copies out of both IPv4 maps.
func readKeys4(t *testing.T, maps *ctmap.Maps, filter *cidrFilter) []ctmap.CTKey4 {
	t.Helper()
	var keys []ctmap.CTKey4
	for _, k := range []ctmap.Kind{ctmap.TCP4, ctmap.Any4} {
		kr, err := loadKernelRead(maps.Map(k), k, filter, 0)
		if err != nil {
			t.Fatal(err)
		}
		args, err := kr.run(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range kr.keys4(0, args.Written) {
			keys = append(keys, e.k)
		}
		kr.close()
	}
	return keys
}

func readKeys6(t *testing.T, maps *ctmap.Maps, filter *cidrFilter) []ctmap.CTKey6 {
	t.Helper()
	kr, err := loadKernelRead(maps.Map(ctmap.TCP6), ctmap.TCP6, filter, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer kr.close()
	args, err := kr.run(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var keys []ctmap.CTKey6
	for _, e := range kr.keys6(0, args.Written) {
		keys = append(keys, e.k)
	}
	return keys
}

// An output array too small for the map's pod keys (an entry made again
// during the walk can be visited twice) ends the run with "full", never a
// short list: the pass reads that map with the batch walk instead and
// files every key, IPv4 and IPv6.
func TestKernelReadFullOutput(t *testing.T) {
	needRoot(t)
	maps := pinnedMaps(t, 8192)
	const n = 1000
	for i := range n {
		put4(t, maps, ctmap.NewKey4(pod4(1+i%20), remote4, 443, uint16(i), ctmap.ProtoTCP, ctmap.FlagOut))
		put6(t, maps, ctmap.NewKey6(pod6(1+i%20), remote6, 443, uint16(i), ctmap.ProtoTCP, ctmap.FlagOut))
	}
	filter, err := newCIDRFilter([]netip.Prefix{podCIDR4, podCIDR6})
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []ctmap.Kind{ctmap.TCP4, ctmap.TCP6} {
		kr, err := loadKernelRead(maps.Map(k), k, filter, n-1)
		if err != nil {
			t.Fatal(err)
		}
		args, err := kr.run(context.Background())
		kr.close()
		if !errors.Is(err, errOutputFull) || args.Written != n-1 {
			t.Fatalf("%s: room for %d of %d keys: %v, %d written", k.Name(), n-1, n, err, args.Written)
		}
	}

	ix := fedIndex()
	res, err := Run(context.Background(), ix, maps, Options{outKeys: n - 1})
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []ctmap.Kind{ctmap.TCP4, ctmap.TCP6} {
		if how := res.Read[k.Name()]; !strings.HasPrefix(how, "batch: ") || !strings.Contains(how, "full") {
			t.Fatalf("%s read %q, want the batch walk after a full output", k.Name(), how)
		}
	}
	if how := res.Read[ctmap.Any4.Name()]; how != ReadKernel {
		t.Fatalf("the any map (empty) read %q", how)
	}
	if res.Pairs != 2*n || ix.Keys() != 2*n || len(res.Addrs) != 40 {
		t.Fatalf("filed %d pairs (index %d keys) under %d addresses, want %d under 40", res.Pairs, ix.Keys(), len(res.Addrs), 2*n)
	}
	checkWhole(t, ix, maps, res.Addrs)
}

// The stop flag ends a run at its first element; the pass's cancel sets it
// (TestFailedPassLeavesNoSlots cancels between runs).
func TestKernelReadStopFlag(t *testing.T) {
	needRoot(t)
	maps := pinnedMaps(t, 4096)
	put4(t, maps, cilium4(ctmap.NewKey4(pod4(1), remote4, 80, 1, ctmap.ProtoTCP, ctmap.FlagOut))...)
	filter, _ := newCIDRFilter(nil)
	kr, err := loadKernelRead(maps.Map(ctmap.TCP4), ctmap.TCP4, filter, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer kr.close()
	if err := kr.stop.Set(uint32(1)); err != nil {
		t.Fatal(err)
	}
	args, err := kr.run(context.Background())
	if !errors.Is(err, errStopped) || args.Visited != 0 || args.Written != 0 {
		t.Fatalf("a run with its stop flag set: %v, visited %d, written %d", err, args.Visited, args.Written)
	}
}

// A cancel while a run is in the kernel stops it at the next element: the
// pass over 1 M entries fails long before a whole read.
func TestKernelReadCancelledMidRun(t *testing.T) {
	needRoot(t)
	if testing.Short() {
		t.Skip("fills 1 M entries")
	}
	const entries = 1 << 20
	maps := pinnedMaps(t, entries*5/4)
	keys := make([]ctmap.CTKey4, 0, entries)
	for i := range entries {
		keys = append(keys, ctmap.NewKey4(pod4(1+i%1000), netip.AddrFrom4([4]byte{11, byte(i >> 16), byte(i >> 8), byte(i)}), 443, 1, ctmap.ProtoTCP, ctmap.FlagOut))
	}
	if _, err := maps.Map(ctmap.TCP4).BatchUpdate(keys, make([]ctmap.Entry, len(keys)), nil); err != nil {
		t.Fatal(err)
	}
	filter, _ := newCIDRFilter([]netip.Prefix{podCIDR4})
	// Each try on a fresh output array, whose first key turns non-zero
	// once the run is in the kernel; a goroutine not scheduled before the
	// run's end (a busy machine) makes the try whole: try again.
	for try := range 5 {
		kr, err := loadKernelRead(maps.Map(ctmap.TCP4), ctmap.TCP4, filter, 0)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		first := (*uint32)(unsafe.Pointer(&kr.mem[0]))
		go func() {
			for atomic.LoadUint32(first) == 0 && ctx.Err() == nil {
			}
			cancel()
		}()
		args, err := kr.run(ctx)
		cancel()
		kr.close()
		if err == nil && args.Visited == entries {
			t.Logf("try %d: the run ended before the cancel", try)
			continue
		}
		if !errors.Is(err, context.Canceled) || args.Visited >= entries {
			t.Fatalf("a run cancelled mid-way: %v, visited %d of %d", err, args.Visited, entries)
		}
		t.Logf("stopped after %d of %d entries", args.Visited, entries)
		return
	}
	t.Fatal("no run of 5 was stopped by its cancel")
}

// More pod CIDRs of a family than the program takes: every map is read
// with the batch walk, and the pass files as always.
func TestKernelReadFallsBack(t *testing.T) {
	needRoot(t)
	maps := pinnedMaps(t, 4096)
	cidrs := []netip.Prefix{podCIDR4}
	for i := range maxPrefixes {
		cidrs = append(cidrs, netip.PrefixFrom(netip.AddrFrom4([4]byte{172, 16, byte(i), 0}), 24))
	}
	put4(t, maps, cilium4(ctmap.NewKey4(pod4(1), remote4, 80, 1, ctmap.ProtoTCP, ctmap.FlagOut))...)
	put4(t, maps, ctmap.NewKey4(netip.MustParseAddr("172.16.15.9"), remote4, 80, 1, ctmap.ProtoTCP, ctmap.FlagOut))
	ix := index.New(index.Config{PodCIDRs: cidrs})
	ix.SetHooks(&index.Hooks{})
	res, err := Run(context.Background(), ix, maps, Options{})
	if err != nil {
		t.Fatal(err)
	}
	for m, how := range res.Read {
		if !strings.HasPrefix(how, "batch: more than 16 IPv4 pod CIDRs") {
			t.Fatalf("%s read %q", m, how)
		}
	}
	if res.Pairs != 3 || len(res.Addrs) != 2 {
		t.Fatalf("filed %d pairs under %v", res.Pairs, res.Addrs)
	}
}
