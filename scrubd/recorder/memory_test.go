package recorder

import (
	"net/netip"
	"runtime"
	"testing"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// TestIndexMemoryPerKey measures, for each family, the Go heap an indexed key costs when
// records go through Apply as the ring buffer reader puts them: 1,000 pod
// IPs with 500 flows each to outside peers, 2 keys per flow (the flow and
// its related ICMP key), 1,000,000 keys. The figure is quoted in
// docs/recorder.md and printed by make bench (index_bytes_per_key). The
// IPv4 bound is the target of issue 12 (at most 20 bytes per key; a key's
// record alone is index.RecSize4 = 11); the IPv6 one catches a gross
// regression (a record is index.RecSize6 = 23).
func TestIndexMemoryPerKey(t *testing.T) {
	if testing.Short() {
		t.Skip("allocates ~100 MB")
	}
	t.Run("IPv4", func(t *testing.T) { measureIndexMemory(t, 4, index.RecSize4, 20) })
	t.Run("IPv6", func(t *testing.T) { measureIndexMemory(t, 6, index.RecSize6, 45) })
}

func measureIndexMemory(t *testing.T, family uint8, lo, hi float64) {
	const pods, flows = 1000, 500
	ix := index.New(index.Config{PodCIDRs: []netip.Prefix{
		netip.MustParsePrefix("10.0.0.0/16"), netip.MustParsePrefix("fd00::/64")}})
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for p := range pods {
		for f := range flows {
			r := Record{Family: family, Kind: RecFlow}
			if family == 4 {
				pod := netip.AddrFrom4([4]byte{10, 0, byte(p >> 8), byte(p)})
				ix.Hold(pod)
				peer := netip.AddrFrom4([4]byte{192, 168, byte(f >> 8), byte(f)})
				k := ctmap.NewKey4(pod, peer, 443, uint16(32768+f), ctmap.ProtoTCP, ctmap.FlagOut)
				copy(r.Key[:], k[:])
			} else {
				pod := netip.AddrFrom16([16]byte{0: 0xfd, 14: byte(p >> 8), 15: byte(p)})
				ix.Hold(pod)
				peer := netip.AddrFrom16([16]byte{0: 0x20, 1: 0x01, 14: byte(f >> 8), 15: byte(f)})
				k := ctmap.NewKey6(pod, peer, 443, uint16(32768+f), ctmap.ProtoTCP, ctmap.FlagOut)
				copy(r.Key[:], k[:])
			}
			Apply(ix, &r)
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	keys := ix.Keys()
	if keys != 2*pods*flows {
		t.Fatalf("indexed %d keys, want %d", keys, 2*pods*flows)
	}
	perKey := float64(after.HeapAlloc-before.HeapAlloc) / float64(keys)
	t.Logf("index: %d keys, %.1f MB heap, %.1f bytes per key", keys, float64(after.HeapAlloc-before.HeapAlloc)/1e6, perKey)
	if perKey < lo || perKey > hi {
		t.Fatalf("%.1f bytes per key: outside [%.0f, %.0f]", perKey, lo, hi)
	}
	runtime.KeepAlive(ix)
}
