package bootstrap

import (
	"context"
	"encoding/binary"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
)

// udpFrame is an Ethernet frame of a UDP packet from src:sport to dst:dport.
func udpFrame(src, dst netip.Addr, sport, dport uint16) []byte {
	b := make([]byte, 14+20+8)
	binary.BigEndian.PutUint16(b[12:], 0x0800)
	h := b[14:]
	h[0], h[8], h[9] = 0x45, 64, 17
	binary.BigEndian.PutUint16(h[2:], 28)
	s, d := src.As4(), dst.As4()
	copy(h[12:], s[:])
	copy(h[16:], d[:])
	u := h[20:]
	binary.BigEndian.PutUint16(u[0:], sport)
	binary.BigEndian.PutUint16(u[2:], dport)
	binary.BigEndian.PutUint16(u[4:], 8)
	return b
}

// runReader runs the recorder's reader into ix until the returned stop.
func runReader(t *testing.T, r *recorder.Recorder, ix *index.Index) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx, ix) }()
	for deadline := time.Now().Add(10 * time.Second); !ix.Fed(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the recorder's reader did not start")
		}
	}
	return func() {
		cancel()
		if err := <-done; err != nil && ctx.Err() == nil {
			t.Errorf("recorder reader: %v", err)
		}
	}
}

// missing counts the keys of the maps holding one of ips that are not in
// that address's set.
func missing(t *testing.T, ix *index.Index, maps *ctmap.Maps, ips []netip.Addr) int {
	t.Helper()
	sets := map[netip.Addr]map[ctmap.CTKey4]bool{}
	for _, ip := range ips {
		k4, _, _ := ix.KeysOf(ip)
		s := map[ctmap.CTKey4]bool{}
		for _, k := range k4 {
			s[k] = true
		}
		sets[ip] = s
	}
	n := 0
	k4, _ := allKeys(t, maps)
	for _, k := range k4 {
		for _, a := range []netip.Addr{k.DAddr(), k.SAddr()} {
			if s, ok := sets[a]; ok && !s[k] {
				n++
			}
		}
	}
	return n
}

// The real recorder during the pass. Flows a previous scrubd recorded (the
// recorder's pinned cache still holds them; their records went with that
// process) whose entries Cilium evicted and makes again while the walk
// runs, some behind its cursor: only the recorder can file those, and it
// records them again only because the pass made it forget every cached
// flow before the walk (Options.Forget). The same pass without Forget
// misses some: the test shows both.
func TestPassWithTheRecorder(t *testing.T) {
	needRoot(t)
	for _, w := range walks {
		t.Run(w.name, func(t *testing.T) { testPassWithTheRecorder(t, w.walk) })
	}
}

func testPassWithTheRecorder(t *testing.T, walk Walk) {
	for _, forget := range []bool{true, false} {
		maps := pinnedMaps(t, 1<<16)
		pinDir, err := os.MkdirTemp("/sys/fs/bpf", "ctscrub-test-rec-")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(pinDir) })
		r, err := recorder.Load(recorder.Options{PinDir: filepath.Join(pinDir, "ctscrub"), CTRoot: pinDir})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { r.Close() })

		pod := pod4(1)
		peer := netip.MustParseAddr("192.0.2.99")
		const flows = 300
		key := func(i int) ctmap.CTKey4 {
			return ctmap.NewKey4(pod, peer, 53, uint16(20000+i), ctmap.ProtoUDP, ctmap.FlagOut)
		}
		send := func(i int) {
			if err := r.RunFrame(true, udpFrame(pod, peer, uint16(20000+i), 53)); err != nil {
				t.Fatal(err)
			}
		}
		// The previous scrubd: it recorded the flows and is gone.
		old := fedIndex()
		old.Hold(pod)
		stop := runReader(t, r, old)
		for i := range flows {
			send(i)
		}
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			k4, _, _ := old.KeysOf(pod)
			if len(k4) == flows+1 { // each flow, and their one RELATED key (ports 0)
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the old reader applied %d keys, want %d", len(k4), flows+1)
			}
		}
		if k4, _, _ := old.KeysOf(pod); !slices.Contains(k4, key(0)) {
			t.Fatalf("the recorder filed %v..., not the key this test makes for its flow (%v)", k4[:2], key(0))
		}
		stop()

		// This scrubd: the node's other entries, then the pass.
		ix := index.New(index.Config{PodCIDRs: []netip.Prefix{podCIDR4}})
		ix.Hold(pod)
		stop = runReader(t, r, ix)
		for i := range 8000 {
			// UDP: the any map, where the evicted flows' entries go.
			put4(t, maps, cilium4(ctmap.NewKey4(pod4(2+i%50), remote4, 443, uint16(i), ctmap.ProtoUDP, ctmap.FlagOut))...)
		}
		opts := Options{Walk: walk, Batch: 256, afterBatch: func(k ctmap.Kind, batch int) {
			if k != ctmap.Any4 || batch != readAt(walk, 16) {
				return
			}
			// Cilium makes the evicted flows' entries again; their
			// packets pass the recorder.
			for i := range flows {
				put4(t, maps, key(i), key(i).Related())
				send(i)
			}
		}}
		if forget {
			opts.Forget = r.ForgetAll
		}
		res, err := Run(context.Background(), ix, maps, opts)
		stop()
		if err != nil {
			t.Fatal(err)
		}
		checkRead(t, res, walk)
		n := missing(t, ix, maps, res.Addrs)
		t.Logf("forget=%v: %d addresses vouched for, %d keys of them missing", forget, len(res.Addrs), n)
		switch {
		case forget && n > 0:
			t.Fatalf("with ForgetAll before the walk: %d keys missing", n)
		case !forget && n == 0:
			t.Fatalf("without ForgetAll no key went missing: the test did not make entries behind the walk")
		}
		if forget && !slices.Contains(res.Addrs, pod) {
			t.Fatalf("%v not vouched for: %v", pod, res.Addrs)
		}
	}
}
