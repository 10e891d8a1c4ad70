package recorder

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/ebpf/ringbuf"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// TestSyncWaitsForRecordsInTheRing: a burst of new flows leaves records in
// the ring buffer that the reader has not applied yet. A scrub that trusted
// the index right then would miss them (found by the soak: a DEL scrub took
// the index path, deleted nothing and called the IP complete). After
// Index.Sync every record produced before it must be in the index.
func TestSyncWaitsForRecordsInTheRing(t *testing.T) {
	requireRoot(t)
	dir, err := os.MkdirTemp("/sys/fs/bpf", "ctscrub-test-")
	if err != nil {
		t.Fatalf("bpffs dir (is bpffs mounted at /sys/fs/bpf?): %v", err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	r, err := Load(Options{PinDir: filepath.Join(dir, "ctscrub"), CTRoot: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	ix := index.New(index.Config{PodCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}})
	ix.Hold(pod4) // a pod of this node, as after its index start

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx, ix) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})

	// A pod sends UDP from sport to peer4:53 (the key Cilium creates: pod
	// in daddr, OUT).
	send := func(sport uint16) {
		t.Helper()
		frame := eth(0x0800).add(ipv4(17, 0, pod4, peer4)...).add(ports(sport, 53, 8)...).b
		if err := r.RunFrame(true, frame); err != nil {
			t.Fatal(err)
		}
	}
	key := func(sport uint16) ctmap.CTKey4 {
		return ctmap.NewKey4(pod4, peer4, 53, sport, 17, ctmap.FlagOut)
	}
	has := func(sport uint16) bool {
		k4, _, _ := ix.ScrubKeys(pod4)
		for _, k := range k4 {
			if k == key(sport) {
				return true
			}
		}
		return false
	}

	// Wait until Run reads the ring (its hooks are then installed).
	send(1000)
	for deadline := time.Now().Add(10 * time.Second); !has(1000); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the reader never applied the first record")
		}
	}

	for round := 0; round < 5; round++ {
		first := uint16(2000 + round*6000)
		for p := first; p < first+5000; p++ {
			send(p)
		}
		sctx, scancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := ix.Sync(sctx)
		scancel()
		if err != nil {
			t.Fatalf("round %d: Sync: %v", round, err)
		}
		// Sync returned: the last flow of the burst must be indexed now,
		// with no waiting.
		if !has(first + 4999) {
			t.Fatalf("round %d: Sync returned before the burst's last record was applied", round)
		}
	}

	// The reader has caught up: a Sync finds the ring's producer position
	// where the reader noted its last record and returns without waking it.
	fast := r.FastSyncs()
	if err := ix.Sync(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := r.FastSyncs(); got != fast+1 {
		t.Errorf("Sync with the ring empty and every record applied: %d fast syncs, want %d", got, fast+1)
	}
}

// TestSyncFastPathNeedsAppliedRecords: Sync's fast path (caughtUp) must
// not pass while a record is in the ring, nor while one is consumed and
// not yet applied (the reader between ReadInto and Apply); only once the
// reader notes it applied.
func TestSyncFastPathNeedsAppliedRecords(t *testing.T) {
	l := loadPinned(t, Options{})
	r, rd := l.Recorder, l.rd
	b := &barrier{rd: rd, pos: mapPositions(r.objs.RecEvents)}
	t.Cleanup(b.pos.close)
	if b.pos == nil {
		t.Fatal("the ring buffer's position pages could not be mapped read-only")
	}
	if !b.caughtUp() {
		t.Fatal("an empty ring that never held a record: not caught up")
	}
	frame := eth(0x0800).add(ipv4(17, 0, pod4, peer4)...).add(ports(1000, 53, 8)...).b
	if err := r.RunFrame(true, frame); err != nil {
		t.Fatal(err)
	}
	if b.caughtUp() {
		t.Fatal("a record in the ring, none applied: caught up")
	}
	// Consumed but not noted as applied (the reader between ReadInto and
	// Apply): still not caught up.
	var rec ringbuf.Record
	if err := rd.ReadInto(&rec); err != nil {
		t.Fatal(err)
	}
	if b.caughtUp() {
		t.Fatal("a record consumed and not applied: caught up")
	}
	b.appliedUpTo()
	if !b.caughtUp() {
		t.Fatal("every record consumed and applied: not caught up")
	}
}
