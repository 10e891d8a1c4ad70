package recorder

import (
	"encoding/binary"
	"fmt"
	"math/bits"
	"net/netip"

	"github.com/ctscrub/ctscrub/bpf"
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
	spec.Maps["rec_events"].MaxEntries = uint32(ring)
	spec.Maps["rec_seen4"].MaxEntries = uint32(max(DefaultSeenEntries, 2*repeat))
	var objs bpf.RecorderObjects
	if err := spec.LoadAndAssign(&objs, nil); err != nil {
		return 0, 0, fmt.Errorf("measure recorder cost: load: %w", err)
	}
	defer objs.Close()
	prog := objs.RecorderEgress

	src := netip.MustParseAddr("10.0.0.2")
	est := tcp4Frame(src, netip.MustParseAddr("10.1.0.1"), 40000, 443)
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
