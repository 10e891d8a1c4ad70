package recorder

import (
	"net/netip"
	"runtime"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/ringbuf"
	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/bpf"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// bpf_get_netns_cookie in a tc program names the network namespace of the
// packet's socket (BPF_PROG_TEST_RUN's, made in the caller's namespace),
// the value SO_NETNS_COOKIE gives for a socket of that namespace (what
// Attach records): checked in a fresh namespace, whose cookie differs from
// the test's own. Skips where the kernel refuses the
// helper to tc programs (Load then checks the ifindex only).
func TestNetnsCookieInTC(t *testing.T) {
	requireRoot(t)
	if !netnsCookieInTC() {
		t.Skip("this kernel's tc programs cannot call bpf_get_netns_cookie: the recorder checks the ifindex only")
	}
	out, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 8, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	// out[0] = bpf_get_netns_cookie(ctx)
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.SchedCLS, License: "GPL", Instructions: asm.Instructions{
		asm.FnGetNetnsCookie.Call(),
		asm.StoreMem(asm.RFP, -8, asm.R0, asm.DWord),
		asm.StoreImm(asm.RFP, -12, 0, asm.Word),
		asm.LoadMapPtr(asm.R1, out.FD()),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, -12),
		asm.Mov.Reg(asm.R3, asm.RFP),
		asm.Add.Imm(asm.R3, -8),
		asm.Mov.Imm(asm.R4, 0),
		asm.FnMapUpdateElem.Call(),
		asm.Mov.Imm(asm.R0, -1),
		asm.Return(),
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer prog.Close()
	host, err := netnsCookie()
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		want, got uint64
		err       error
	}
	done := make(chan result)
	go func() {
		// The thread never leaves the new namespace: Go discards it
		// when this goroutine ends locked.
		runtime.LockOSThread()
		var r result
		defer func() { done <- r }()
		if r.err = unix.Unshare(unix.CLONE_NEWNET); r.err != nil {
			return
		}
		if r.want, r.err = netnsCookie(); r.err != nil {
			return
		}
		frame := make([]byte, 64)
		if _, r.err = prog.Run(&ebpf.RunOptions{Data: frame}); r.err != nil {
			return
		}
		r.err = out.Lookup(uint32(0), &r.got)
	}()
	r := <-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	if r.got != r.want || r.want == host {
		t.Fatalf("tc program saw netns cookie %d; the namespace's is %d, the test's own %d", r.got, r.want, host)
	}
}

// A foreign-source record files its key under the receiver only (here a
// pod CIDR address too) and marks the claimed source incomplete; a flow
// record of the same key files it under both.
func TestApplyForeign(t *testing.T) {
	claimed, peer := netip.MustParseAddr("10.244.0.5"), netip.MustParseAddr("10.244.0.9")
	k := ctmap.NewKey4(claimed, peer, 53, 40000, ctmap.ProtoUDP, ctmap.FlagOut)
	pods := []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}

	ix := index.New(index.Config{PodCIDRs: pods})
	ix.Hold(claimed) // pods of this node: a mark keeps their slots
	ix.Hold(peer)
	ix.TrackAll([]netip.Addr{claimed, peer})
	r := Record{Family: 4, Kind: RecForeign}
	copy(r.Key[:], k[:])
	Apply(ix, &r)
	if k4, _, st := ix.KeysOf(claimed); len(k4) != 0 || st.Incomplete != index.ReasonForeignSource {
		t.Errorf("claimed source: keys %v, state %+v; want none, incomplete (%s)", k4, st, index.ReasonForeignSource)
	}
	if k4, _, st := ix.KeysOf(peer); len(k4) != 2 || !st.Complete {
		t.Errorf("receiver: keys %v, state %+v; want the key and its related key, complete", k4, st)
	}

	ix = index.New(index.Config{PodCIDRs: pods})
	ix.Hold(claimed)
	r.Kind = RecFlow
	Apply(ix, &r)
	if k4, _, _ := ix.KeysOf(claimed); len(k4) == 0 {
		t.Error("a flow record filed nothing under its source")
	}
}

// Without the namespace comparison (kernels whose tc programs cannot call
// bpf_get_netns_cookie) the programs load and still check the ifindex: a
// source owned on the test run's device is a flow, one owned on another
// interface or not at all is foreign.
func TestSourceCheckIfindexOnly(t *testing.T) {
	requireRoot(t)
	spec, err := bpf.LoadRecorder()
	if err != nil {
		t.Fatal(err)
	}
	if err := spec.Variables["owner_netns"].Set(uint8(0)); err != nil {
		t.Fatal(err)
	}
	p := &private{}
	if err := spec.LoadAndAssign(&p.objs, nil); err != nil {
		t.Fatal(err)
	}
	defer p.objs.Close()
	if p.rd, err = ringbuf.NewReader(p.objs.RecEvents); err != nil {
		t.Fatal(err)
	}
	defer p.rd.Close()
	elsewhere := netip.MustParseAddr("10.244.0.11")
	if err := ownTestRun(p.objs.RecOwner, pod4); err != nil {
		t.Fatal(err)
	}
	v := ownerValue{Ifindex: 7}
	if err := p.objs.RecOwner.Update(mapped(elsewhere), &v, ebpf.UpdateAny); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		src  netip.Addr
		kind uint8
	}{
		{pod4, RecFlow},
		{elsewhere, RecForeign},
		{netip.MustParseAddr("10.244.0.12"), RecForeign},
	} {
		recs := p.run(t, true, eth(0x0800).add(ipv4(17, 0, tc.src, peer4)...).add(ports(40000, 53, 8)...).b)
		if len(recs) != 1 || recs[0].Kind != tc.kind {
			t.Errorf("from %s: %+v, want one record of kind %d", tc.src, recs, tc.kind)
		}
	}
	var n uint64
	if err := p.objs.RecForeignTotal.Lookup(uint32(0), &n); err != nil || n != 2 {
		t.Errorf("foreign counter %d (%v), want 2", n, err)
	}
}
