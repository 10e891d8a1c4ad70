package recorder

import (
	"encoding/binary"
	"fmt"
	"math/bits"
	"net/netip"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/ringbuf"

	"github.com/ctscrub/ctscrub/bpf"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// MeasurePacketCost runs the recorder's egress program with BPF_PROG_TEST_RUN
// on a private instance (no pins, nothing attached) and returns its cost per
// packet in nanoseconds:
//   - established: one IPv4 TCP packet of a flow already recorded, run
//     `repeat` times in one syscall (the kernel's average);
//   - new flow: `repeat` packets of distinct flows, one syscall each (each
//     misses the seen cache, queries the service maps, emits a record and
//     inserts into the cache). A single run's timer overhead is measured
//     with the established packet run once per syscall and subtracted.
//
// The `make bench` program prints both next to the sweep's figures.
func MeasurePacketCost(repeat int) (newFlowNs, establishedNs float64, err error) {
	if repeat < 1 {
		return 0, 0, fmt.Errorf("measure recorder cost: repeat %d: must be positive", repeat)
	}
	spec, err := bpf.LoadRecorder()
	if err != nil {
		return 0, 0, fmt.Errorf("measure recorder cost: %w", err)
	}
	// Room for every record: they are never read here.
	ring := max(1<<20, 1<<bits.Len(uint(repeat*64)))
	if ring > 1<<28 {
		return 0, 0, fmt.Errorf("measure recorder cost: repeat %d too large (ring buffer would exceed 256 MiB)", repeat)
	}
	if err := setSourceCheck(spec); err != nil {
		return 0, 0, fmt.Errorf("measure recorder cost: %w", err)
	}
	spec.Maps["rec_events"].MaxEntries = uint32(ring)
	spec.Maps["rec_flows4"].MaxEntries = uint32(max(DefaultSeenEntries, 2*repeat))
	var objs bpf.RecorderObjects
	if err := spec.LoadAndAssign(&objs, nil); err != nil {
		return 0, 0, fmt.Errorf("measure recorder cost: load: %w", err)
	}
	defer objs.Close()
	prog := objs.RecorderEgress

	src := netip.MustParseAddr("10.0.0.2")
	est := tcp4Frame(src, netip.MustParseAddr("10.1.0.1"), 40000, 443)
	// The pod sends from its own address: new flows take the owner check
	// and are recorded as flows, as on a real interface.
	if err := ownTestRunSource(objs.RecOwner, est); err != nil {
		return 0, 0, fmt.Errorf("measure recorder cost: %w", err)
	}
	if _, _, err := prog.Benchmark(est, 1, nil); err != nil {
		return 0, 0, fmt.Errorf("measure recorder cost: test run: %w", err)
	}
	_, d, err := prog.Benchmark(est, repeat, nil)
	if err != nil {
		return 0, 0, fmt.Errorf("measure recorder cost: test run: %w", err)
	}
	establishedNs = float64(d.Nanoseconds()) // the kernel's average per run

	// Per-syscall timer overhead: the same established packet, one run
	// per syscall.
	var once float64
	for range repeat {
		_, d, err := prog.Benchmark(est, 1, nil)
		if err != nil {
			return 0, 0, fmt.Errorf("measure recorder cost: test run: %w", err)
		}
		once += float64(d)
	}
	overhead := once/float64(repeat) - establishedNs

	var sum float64
	for i := range repeat {
		dst := netip.AddrFrom4([4]byte{10, 2, byte(i >> 16), byte(i >> 8)})
		frame := tcp4Frame(src, dst, uint16(1024+i%60000), uint16(1+i%251))
		_, d, err := prog.Benchmark(frame, 1, nil)
		if err != nil {
			return 0, 0, fmt.Errorf("measure recorder cost: test run: %w", err)
		}
		sum += float64(d)
	}
	newFlowNs = sum/float64(repeat) - overhead
	return newFlowNs, establishedNs, nil
}

// tcp4Frame builds an Ethernet + IPv4 + TCP (ACK) frame with 32 bytes of
// payload. Checksums are left zero: the recorder does not check them.
func tcp4Frame(src, dst netip.Addr, sport, dport uint16) []byte {
	b := make([]byte, 14+20+20+32)
	binary.BigEndian.PutUint16(b[12:], 0x0800)
	ip := b[14:]
	ip[0] = 0x45
	binary.BigEndian.PutUint16(ip[2:], uint16(len(b)-14))
	ip[8] = 64
	ip[9] = 6
	s, d := src.As4(), dst.As4()
	copy(ip[12:16], s[:])
	copy(ip[16:20], d[:])
	tcp := ip[20:]
	binary.BigEndian.PutUint16(tcp[0:], sport)
	binary.BigEndian.PutUint16(tcp[2:], dport)
	tcp[12] = 5 << 4
	tcp[13] = 0x10 // ACK
	return b
}

// EstablishedCost is the per-packet cost of an established flow by kind of
// packet, and of an empty tc program run the same way (the floor of
// BPF_PROG_TEST_RUN itself), in nanoseconds.
type EstablishedCost struct {
	TCP4, UDP4, TCP6, Empty float64
	// The same packets on flows the pod sends to a VIP Cilium
	// load-balances per packet: never in the front cache, each reads its
	// SERVICE entry's backend_id in Cilium's CT map (the backend
	// unchanged, so no record).
	TCP4Svc, UDP4Svc, TCP6Svc float64
}

// MeasureEstablishedCosts measures an established flow's packet for IPv4
// TCP (touches nothing), IPv4 UDP (notes the packet's time at most once a
// second) and IPv6 TCP (40-byte cache key), each run `repeat` times in one
// syscall, next to an empty program.
func MeasureEstablishedCosts(repeat int) (EstablishedCost, error) {
	var c EstablishedCost
	if repeat < 1 {
		return c, fmt.Errorf("measure recorder cost: repeat %d: must be positive", repeat)
	}
	spec, err := bpf.LoadRecorder()
	if err != nil {
		return c, fmt.Errorf("measure recorder cost: %w", err)
	}
	if err := setSourceCheck(spec); err != nil {
		return c, fmt.Errorf("measure recorder cost: %w", err)
	}
	for _, n := range []string{"cilium_ct4_global", "cilium_ct_any4_global", "cilium_ct6_global", "cilium_lb4_services_v2", "cilium_lb6_services_v2"} {
		spec.Maps[n].MaxEntries = 16 // the placeholders hold 1
	}
	var objs bpf.RecorderObjects
	if err := spec.LoadAndAssign(&objs, nil); err != nil {
		return c, fmt.Errorf("measure recorder cost: load: %w", err)
	}
	defer objs.Close()
	empty, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:         ebpf.SchedCLS,
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, -1), asm.Return()},
		License:      "Dual BSD/GPL",
	})
	if err != nil {
		return c, fmt.Errorf("measure recorder cost: load empty program: %w", err)
	}
	defer empty.Close()

	src4, dst4 := netip.MustParseAddr("10.0.0.2"), netip.MustParseAddr("10.1.0.1")
	src6, dst6 := netip.MustParseAddr("fd00::2"), netip.MustParseAddr("2001:db8::1")
	vip4, vip6 := netip.MustParseAddr("10.96.0.10"), netip.MustParseAddr("fd00:96::10")
	udp := tcp4Frame(src4, dst4, 40001, 53)
	udp[14+9] = 17 // the L4 header's first 8 bytes read as UDP
	udpSvc := tcp4Frame(src4, vip4, 40003, 53)
	udpSvc[14+9] = 17
	for _, v := range []struct {
		vip   netip.Addr
		port  uint16
		proto uint8
		key   []byte
	}{
		{vip4, 80, ctmap.ProtoTCP, svcCTKey4(vip4, src4, 40002, 80, ctmap.ProtoTCP)},
		{vip4, 53, ctmap.ProtoUDP, svcCTKey4(vip4, src4, 40003, 53, ctmap.ProtoUDP)},
		{vip6, 80, ctmap.ProtoTCP, svcCTKey6(vip6, src6, 40002, 80, ctmap.ProtoTCP)},
	} {
		if err := addMeasureService(&objs, v.vip, v.port, v.proto, v.key); err != nil {
			return c, fmt.Errorf("measure recorder cost: %w", err)
		}
	}
	rd, err := ringbuf.NewReader(objs.RecEvents)
	if err != nil {
		return c, fmt.Errorf("measure recorder cost: %w", err)
	}
	defer rd.Close()
	for _, m := range []struct {
		prog  *ebpf.Program
		frame []byte
		out   *float64
		svc   bool
	}{
		{objs.RecorderEgress, tcp4Frame(src4, dst4, 40000, 443), &c.TCP4, false},
		{objs.RecorderEgress, tcp4Frame(src4, vip4, 40002, 80), &c.TCP4Svc, true},
		{objs.RecorderEgress, udp, &c.UDP4, false},
		{objs.RecorderEgress, udpSvc, &c.UDP4Svc, true},
		{objs.RecorderEgress, tcp6Frame(src6, dst6, 40000, 443), &c.TCP6, false},
		{objs.RecorderEgress, tcp6Frame(src6, vip6, 40002, 80), &c.TCP6Svc, true},
		{empty, tcp4Frame(src4, dst4, 40000, 443), &c.Empty, false},
	} {
		if err := ownTestRunSource(objs.RecOwner, m.frame); err != nil {
			return c, fmt.Errorf("measure recorder cost: %w", err)
		}
		if _, _, err := m.prog.Benchmark(m.frame, 1, nil); err != nil { // records the flow
			return c, fmt.Errorf("measure recorder cost: test run: %w", err)
		}
		if m.prog != empty {
			// The flow's record: a service flow must have been taken for
			// one (its SERVICE entry read), or the figure is a plain flow's.
			rd.SetDeadline(time.Now().Add(time.Second))
			var rec ringbuf.Record
			if err := rd.ReadInto(&rec); err != nil {
				return c, fmt.Errorf("measure recorder cost: read the flow's record: %w", err)
			}
			r, err := ParseRecord(rec.RawSample)
			if err != nil {
				return c, fmt.Errorf("measure recorder cost: %w", err)
			}
			if got := r.Kind == RecServiceEntry && r.Backend == measureBackend; got != m.svc {
				return c, fmt.Errorf("measure recorder cost: record kind %d backend %d; service flow: %v", r.Kind, r.Backend, m.svc)
			}
		}
		_, d, err := m.prog.Benchmark(m.frame, repeat, nil)
		if err != nil {
			return c, fmt.Errorf("measure recorder cost: test run: %w", err)
		}
		*m.out = float64(d.Nanoseconds())
	}
	return c, nil
}

// measureBackend is the backend_id of the SERVICE entries the measurement
// puts in the program's own CT maps (Cilium's are not involved).
const measureBackend = 7

func svcCTKey4(vip, pod netip.Addr, podPort, vipPort uint16, proto uint8) []byte {
	k := ctmap.NewKey4(vip, pod, podPort, vipPort, proto, ctmap.FlagService)
	return k[:]
}

func svcCTKey6(vip, pod netip.Addr, podPort, vipPort uint16, proto uint8) []byte {
	k := ctmap.NewKey6(vip, pod, podPort, vipPort, proto, ctmap.FlagService)
	return k[:]
}

// addMeasureService puts a frontend (struct lb4_key / lb6_key: slot 0,
// protocol 0, scope external) in the program's own service map and the
// flow's SERVICE entry, naming measureBackend, in its own CT map.
func addMeasureService(objs *bpf.RecorderObjects, vip netip.Addr, port uint16, proto uint8, ctKey []byte) error {
	svc, ct := objs.CiliumLb4ServicesV2, objs.CiliumCt4Global
	if proto != ctmap.ProtoTCP {
		ct = objs.CiliumCtAny4Global
	}
	if vip.Is6() {
		svc, ct = objs.CiliumLb6ServicesV2, objs.CiliumCt6Global
	}
	key := append(vip.AsSlice(), 0, 0, 0, 0, 0, 0, 0, 0)
	binary.BigEndian.PutUint16(key[len(key)-8:], port)
	if err := svc.Put(key, make([]byte, svc.ValueSize())); err != nil {
		return fmt.Errorf("service %s:%d: %w", vip, port, err)
	}
	e := ctmap.EncodeEntry(ctmap.EntryFields{BackendID: measureBackend})
	if err := ct.Put(ctKey, e[:]); err != nil {
		return fmt.Errorf("SERVICE entry of %s:%d: %w", vip, port, err)
	}
	return nil
}

// tcp6Frame is tcp4Frame for IPv6.
func tcp6Frame(src, dst netip.Addr, sport, dport uint16) []byte {
	b := make([]byte, 14+40+20+32)
	binary.BigEndian.PutUint16(b[12:], 0x86dd)
	ip := b[14:]
	ip[0] = 0x60
	binary.BigEndian.PutUint16(ip[4:], 20+32)
	ip[6] = 6
	ip[7] = 64
	s, d := src.As16(), dst.As16()
	copy(ip[8:24], s[:])
	copy(ip[24:40], d[:])
	tcp := ip[40:]
	binary.BigEndian.PutUint16(tcp[0:], sport)
	binary.BigEndian.PutUint16(tcp[2:], dport)
	tcp[12] = 5 << 4
	tcp[13] = 0x10 // ACK
	return b
}
