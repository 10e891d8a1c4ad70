package recorder

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/index"
)

// A ring overflow marks the IPs whose records it lost before any scrub
// trusts them: Index.Sync reads the lost counters itself, so a scrub right
// after a burst (many pods starting at once, the ring full) does not wait
// for the once-a-second poll. Real losses: a one-page ring and the reader
// stopped while the pod opens more flows than the ring holds.
func TestSyncSeesLossesAtOnce(t *testing.T) {
	r := loadForRun(t, Options{RingBytes: os.Getpagesize()})
	ix := index.New(index.Config{PodCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}})
	ix.Hold(pod4)
	ix.Track(pod4) // complete: swept at its ADD

	// The burst, with no reader: more new flows than the ring holds.
	for sport := range uint16(400) {
		frame := eth(0x0800).add(ipv4(17, 0, pod4, peer4)...).add(ports(10000+sport, 53, 8)...).b
		if err := r.RunFrame(true, frame); err != nil {
			t.Fatal(err)
		}
	}
	if r.Lost() == 0 {
		t.Fatal("no record lost: the burst did not overflow the ring")
	}

	runReader(t, r, ix)
	// The scrub's first step, as soon as the reader runs.
	sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer scancel()
	began := time.Now()
	if err := ix.Sync(sctx); err != nil {
		t.Fatal(err)
	}
	if st := ix.State(pod4); st.Complete || st.Incomplete != index.ReasonLost {
		t.Fatalf("%s right after Sync (%v after the reader started), %d records lost: %+v, want incomplete (%s)",
			pod4, time.Since(began), r.Lost(), st, index.ReasonLost)
	}
}

// Real records of a pod's flows to thousands of peers inside the pod CIDRs
// (other nodes' pods) give the peers no slot: the index stays as many IPs
// as this node's pods, and scrubd's memory with it.
func TestPeersOfRecordedFlowsGetNoSlot(t *testing.T) {
	r := loadForRun(t, Options{})
	ix := index.New(index.Config{PodCIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}})
	ix.Hold(pod4)
	ix.Track(pod4)
	runReader(t, r, ix)
	const peers = 3000
	for i := range peers {
		peer := netip.AddrFrom4([4]byte{10, 9, byte(i >> 8), byte(i)})
		frame := eth(0x0800).add(ipv4(17, 0, pod4, peer)...).add(ports(40000, 53, 8)...).b
		if err := r.RunFrame(true, frame); err != nil {
			t.Fatal(err)
		}
	}
	sctx, scancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer scancel()
	if err := ix.Sync(sctx); err != nil {
		t.Fatal(err)
	}
	if n := ix.Slots(); n != 1 {
		t.Fatalf("%d IP slots after flows to %d peers in the pod CIDRs, want 1 (the pod)", n, peers)
	}
	if st := ix.State(pod4); !st.Complete || st.Keys < peers {
		t.Fatalf("pod after its flows: %+v, want complete with at least %d keys", st, peers)
	}
}

// loadForRun loads a recorder pinned in a fresh bpffs directory, with no
// Cilium maps, for tests that run its reader (Run).
func loadForRun(t *testing.T, opts Options) *Recorder {
	t.Helper()
	requireRoot(t)
	dir, err := os.MkdirTemp("/sys/fs/bpf", "ctscrub-test-")
	if err != nil {
		t.Fatalf("bpffs dir (is bpffs mounted at /sys/fs/bpf?): %v", err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	opts.PinDir, opts.CTRoot = filepath.Join(dir, "ctscrub"), t.TempDir()
	r, err := Load(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

// runReader runs r's reader into ix until the test ends.
func runReader(t *testing.T, r *Recorder, ix *index.Index) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx, ix) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
}
