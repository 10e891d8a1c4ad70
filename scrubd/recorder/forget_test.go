package recorder

import (
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// ForgetIPs over a full-size seen cache: exactly the flows with a given IP
// as local or remote address go, the others stay.
func TestForgetIPs(t *testing.T) {
	requireRoot(t)
	dir, err := os.MkdirTemp("/sys/fs/bpf", "ctscrub-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	r, err := Load(Options{PinDir: filepath.Join(dir, "ctscrub"), CTRoot: dir})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })

	target := netip.MustParseAddr("10.244.0.10")
	other := netip.MustParseAddr("10.244.0.11")
	tg, ot := target.As4(), other.As4()
	const fill = 200_000
	var keys []seenKey4
	vals := make([]uint64, 0, fill)
	wantGone := 0
	for i := range fill {
		peer := [4]byte{192, byte(i >> 16), byte(i >> 8), byte(i)}
		local, remote := ot[:], peer[:]
		switch i % 100 {
		case 0: // the target's own flows
			local = tg[:]
			wantGone++
		case 1: // a live pod's flows towards the target
			remote = tg[:]
			wantGone++
		}
		p := [2]byte{byte(i >> 8), byte(i)}
		keys = append(keys, newSeenKey4(local, remote, p[:], []byte{0, 53}, 17))
		vals = append(vals, 0)
	}
	if _, err := r.objs.RecSeen4.BatchUpdate(keys, vals, nil); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	n, err := r.ForgetIPs(target, netip.MustParseAddr("fd00:244::a"))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("forgot %d of %d cached flows in %v", n, fill, time.Since(start))
	if n != wantGone {
		t.Fatalf("forgot %d flows, want %d", n, wantGone)
	}
	var k seenKey4
	var v [8]byte
	left := 0
	it := r.objs.RecSeen4.Iterate()
	for it.Next(&k, &v) {
		left++
		if [4]byte(k[0:4]) == tg || [4]byte(k[4:8]) == tg {
			t.Fatalf("flow of %s left: %x", target, k)
		}
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	if left != fill-wantGone {
		t.Fatalf("%d flows left, want %d", left, fill-wantGone)
	}
}

// ForgetKeys forgets every cached flow of the keys, skipping keys whose
// flow is not cached; its cost is quoted in docs/recorder.md (a scrub's
// index path pays it through the Taken hook).
func TestForgetKeysCost(t *testing.T) {
	requireRoot(t)
	dir, err := os.MkdirTemp("/sys/fs/bpf", "ctscrub-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	r, err := Load(Options{PinDir: filepath.Join(dir, "ctscrub"), CTRoot: dir})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	pod := netip.MustParseAddr("10.244.0.10")
	var k4 []ctmap.CTKey4
	var seen []seenKey4
	for i := range 1000 {
		peer := netip.AddrFrom4([4]byte{192, 0, byte(i >> 8), byte(i)})
		k := ctmap.NewKey4(pod, peer, 443, uint16(30000+i), ctmap.ProtoTCP, ctmap.FlagOut)
		k4 = append(k4, k, k.Related())
		seen = append(seen, newSeenKey4(k[0:4], k[4:8], k[10:12], k[8:10], ctmap.ProtoTCP))
	}
	if _, err := r.objs.RecSeen4.BatchUpdate(seen, make([]uint64, len(seen)), nil); err != nil {
		t.Fatal(err)
	}
	// Keys whose flows are not cached (evicted, or already forgotten) in
	// the middle and at the end: the batch skips them.
	gone := ctmap.NewKey4(pod, netip.MustParseAddr("198.51.100.1"), 53, 5353, ctmap.ProtoUDP, ctmap.FlagOut)
	k4 = append(k4[:500], append([]ctmap.CTKey4{gone, gone.WithFlags(ctmap.FlagIn)}, k4[500:]...)...)
	k4 = append(k4, gone)
	start := time.Now()
	if err := r.ForgetKeys(k4, nil); err != nil {
		t.Fatal(err)
	}
	t.Logf("ForgetKeys: %d keys (%d flows) in %v", len(k4), len(seen), time.Since(start))
	var k seenKey4
	var v [8]byte
	if it := r.objs.RecSeen4.Iterate(); it.Next(&k, &v) {
		t.Fatalf("flow %x still cached", k)
	}
}

// Concurrent ForgetIPs calls share passes over the cache.
func TestForgetIPsShared(t *testing.T) {
	requireRoot(t)
	dir, err := os.MkdirTemp("/sys/fs/bpf", "ctscrub-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	r, err := Load(Options{PinDir: filepath.Join(dir, "ctscrub"), CTRoot: dir})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	// 50 pod IPs with 1,000 flows each, plus 100,000 flows of others.
	const pods = 50
	var keys []seenKey4
	for i := range pods*1000 + 100_000 {
		local := [4]byte{10, 244, 0, byte(i % pods)}
		if i >= pods*1000 {
			local = [4]byte{10, 245, byte(i >> 8), byte(i)}
		}
		remote := [4]byte{192, byte(i >> 16), byte(i >> 8), byte(i)}
		keys = append(keys, newSeenKey4(local[:], remote[:], []byte{1, 1}, []byte{0, 80}, 6))
	}
	if _, err := r.objs.RecSeen4.BatchUpdate(keys, make([]uint64, len(keys)), nil); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, pods)
	for p := range pods {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := r.ForgetIPs(netip.AddrFrom4([4]byte{10, 244, 0, byte(p)})); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	passes := r.forgetQ.passes.Load()
	t.Logf("50 concurrent ForgetIPs over %d cached flows: %d passes, %v", len(keys), passes, time.Since(start))
	if passes >= pods {
		t.Fatalf("%d passes for %d concurrent callers: not shared", passes, pods)
	}
	var k seenKey4
	var v [8]byte
	left := 0
	it := r.objs.RecSeen4.Iterate()
	for it.Next(&k, &v) {
		left++
		if k[0] == 10 && k[1] == 244 {
			t.Fatalf("flow of a forgotten IP left: %x", k)
		}
	}
	if left != 100_000 {
		t.Fatalf("%d flows left, want the 100,000 of other IPs", left)
	}
}
