package ciliumwalk

import (
	"context"
	"net/netip"
	"os"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// newMaps creates the four CT maps (hash maps of Cilium's key and value
// sizes, unpinned) and fills the IPv4 TCP one with n entries, every third
// holding pod; entries with an even source port have lifetime 10, others 100.
func newMaps(t *testing.T, n int, pod netip.Addr) [ctmap.NumKinds]*ebpf.Map {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: BPF maps")
	}
	var maps [ctmap.NumKinds]*ebpf.Map
	for _, k := range ctmap.Kinds {
		m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: k.KeySize(), ValueSize: ctmap.EntrySize, MaxEntries: uint32(2 * n)})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		maps[k] = m
	}
	other := netip.MustParseAddr("10.244.9.9")
	for i := range n {
		src := other
		if i%3 == 0 {
			src = pod
		}
		k := ctmap.NewKey4(netip.AddrFrom4([4]byte{198, 19, byte(i >> 8), byte(i)}), src, 443, uint16(i), ctmap.ProtoTCP, ctmap.FlagOut)
		var v ctmap.Entry
		v.SetLifetime(100)
		if i%2 == 0 {
			v.SetLifetime(10)
		}
		if err := maps[ctmap.TCP4].Put(&k, &v); err != nil {
			t.Fatal(err)
		}
	}
	return maps
}

func TestWalks(t *testing.T) {
	const n = 30000 // more than one batch chunk
	pod := netip.MustParseAddr("10.244.0.5")
	for name, walk := range map[string]func([ctmap.NumKinds]*ebpf.Map, Match, Options) (Stats, error){
		"nextkey": NextKey, "batch": Batch,
	} {
		t.Run(name, func(t *testing.T) {
			maps := newMaps(t, n, pod)
			st, err := walk(maps, HasIP(pod), Options{CountOnly: true, Ctx: context.Background()})
			if err != nil || st.Visited != n || st.Matched != n/3 || st.Deleted != 0 {
				t.Fatalf("count only: %+v, %v; want %d visited, %d matched, none deleted", st, err, n, n/3)
			}
			st, err = walk(maps, HasIP(pod), Options{})
			if err != nil || st.Visited != n || st.Deleted != n/3 {
				t.Fatalf("scrub: %+v, %v; want %d visited, %d deleted", st, err, n, n/3)
			}
			if st, _ := walk(maps, HasIP(pod), Options{CountOnly: true}); st.Matched != 0 || st.Visited != n-n/3 {
				t.Fatalf("after the scrub: %+v", st)
			}
			// Expiry: of the 2n/3 left, those with an even port (lifetime 10).
			st, err = walk(maps, ExpiredAt(50), Options{})
			if err != nil || st.Deleted != n/3 {
				t.Fatalf("expiry: %+v, %v; want %d deleted", st, err, n/3)
			}
		})
	}
	maps := newMaps(t, 1000, pod)
	st, err := NextKey(maps, HasIP(pod), Options{MaxVisits: 100})
	if err != nil || !st.Partial || st.Visited != 100 {
		t.Fatalf("MaxVisits 100: %+v, %v", st, err)
	}
}
