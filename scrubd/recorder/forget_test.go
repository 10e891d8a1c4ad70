package recorder

import (
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"
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
