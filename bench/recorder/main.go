// Command recorder (make bench-recorder) measures the recorder on the CNI
// path and on the datapath, with real packets through its real filters:
//
//   - attach/detach: Attach and Detach of a veth in a network namespace, as
//     scrubd does at CNI ADD (and GC), with the flow caches full of flows;
//   - ns per packet, hot: one packet repeated with BPF_PROG_TEST_RUN
//     (recorder.MeasureEstablishedCosts, MeasurePacketCost), the established
//     ones also on flows to a per-packet load-balanced VIP, side by side;
//   - ns per packet under a realistic mix (FLOWS concurrent flows, default
//     10,000, half TCP and half UDP, half initiated by the pod; NEW_PER_S of
//     them replaced every second, default 1 %), for established TCP,
//     established UDP and a new flow's first packet. Frames are sent with
//     AF_PACKET sockets through the pod's eth0 (egress filter) and into it
//     from its veth peer (ingress filter), and the kernel's own program
//     statistics (BPF_ENABLE_STATS run time) are read per phase. An empty
//     filter behind the recorder's, timed the same way, gives the floor (the
//     statistics' own cost); *_net_ns subtract it.
//
// The last line is JSON.
package main

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/internal/machcost"
	"github.com/ctscrub/ctscrub/internal/nsexec"
	"github.com/ctscrub/ctscrub/internal/testsupport/standin"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
)

type result struct {
	Flows     int     `json:"flows"`
	NewPerS   float64 `json:"new_per_s"`
	AttachP50 float64 `json:"attach_p50_s"`
	AttachP99 float64 `json:"attach_p99_s"`
	DetachP50 float64 `json:"detach_p50_s"`
	TCPNs     float64 `json:"tcp_est_ns"`
	UDPNs     float64 `json:"udp_est_ns"`
	NewNs     float64 `json:"new_flow_ns"`
	MixNs     float64 `json:"mix_ns"`
	FloorNs   float64 `json:"floor_ns"`
	TCPNetNs  float64 `json:"tcp_est_net_ns"`
	UDPNetNs  float64 `json:"udp_est_net_ns"`
	NewNetNs  float64 `json:"new_flow_net_ns"`
	MixNetNs  float64 `json:"mix_net_ns"`
	// The same packet run repeatedly with BPF_PROG_TEST_RUN (warm caches).
	HotTCP4  float64 `json:"hot_tcp4_ns"`
	HotUDP4  float64 `json:"hot_udp4_ns"`
	HotTCP6  float64 `json:"hot_tcp6_ns"`
	HotEmpty float64 `json:"hot_empty_ns"`
	// The same established packets on flows to a VIP Cilium load-balances
	// per packet (they read their SERVICE entry on every packet), in the
	// same run.
	HotTCP4Svc  float64 `json:"hot_tcp4_svc_ns"`
	HotUDP4Svc  float64 `json:"hot_udp4_svc_ns"`
	HotTCP6Svc  float64 `json:"hot_tcp6_svc_ns"`
	HotNewNs    float64 `json:"hot_new_flow_ns"`
	LoadAverage string  `json:"loadavg"`
	// What the machine charged for a page fault, a syscall and a process
	// start (internal/machcost), measured after the phases.
	MachineCosts machcost.Costs `json:"machine_costs"`
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "bench-recorder:", err)
		os.Exit(1)
	}
}

func run() error {
	res := result{Flows: envInt("FLOWS", 10000), NewPerS: 0.01}
	if v, err := strconv.ParseFloat(os.Getenv("NEW_PER_S"), 64); err == nil {
		res.NewPerS = v
	}
	l := &lab{}
	defer l.close()
	if err := l.setUp(); err != nil {
		return err
	}
	if err := l.timeAttach(&res); err != nil {
		return err
	}
	if err := l.attachWithFloor(); err != nil {
		return err
	}
	// Hot figures first: the statistics below would add their own cost.
	hot, err := recorder.MeasureEstablishedCosts(1_000_000)
	if err != nil {
		return err
	}
	res.HotTCP4, res.HotUDP4, res.HotTCP6, res.HotEmpty = hot.TCP4, hot.UDP4, hot.TCP6, hot.Empty
	res.HotTCP4Svc, res.HotUDP4Svc, res.HotTCP6Svc = hot.TCP4Svc, hot.UDP4Svc, hot.TCP6Svc
	if res.HotNewNs, _, err = recorder.MeasurePacketCost(20000); err != nil {
		return err
	}
	if err := l.timeMix(&res); err != nil {
		return err
	}
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		res.LoadAverage = string(b[:len(b)-1])
	}
	mc, err := machcost.Measure()
	if err != nil {
		return fmt.Errorf("machine costs: %w", err)
	}
	res.MachineCosts = mc
	res.print()
	out, _ := json.Marshal(res)
	fmt.Println(string(out))
	return nil
}

// lab is the pod the recorder is measured on: a netns with two veth pairs
// (eth0/p0 carries the measured packets, eth1/p1 the attach cycles), the
// recorder loaded over a private bpffs dir, an empty filter behind its own
// (the floor) and an AF_PACKET socket on each end of eth0/p0.
type lab struct {
	ns    string // the netns path
	rec   *recorder.Recorder
	empty *ebpf.Program
	idx   [2]int // ifindex of eth0, p0
	sock  [2]int // AF_PACKET sockets bound to them
	undo  []func()
}

// close undoes what the lab set up, newest first.
func (l *lab) close() {
	for i := len(l.undo) - 1; i >= 0; i-- {
		l.undo[i]()
	}
}

// setUp creates the netns, the bpffs dir with Cilium's service maps (new
// flows look them up), the recorder and the veths.
func (l *lab) setUp() error {
	name := fmt.Sprintf("ctscrub-benchrec-%d", os.Getpid())
	ns, err := nsexec.Create(name)
	if err != nil {
		return err
	}
	l.ns = ns
	l.undo = append(l.undo, func() { os.Remove(ns) }, func() { unix.Unmount(ns, unix.MNT_DETACH) })
	dir, err := os.MkdirTemp("/sys/fs/bpf", "ctscrub-benchrec-")
	if err != nil {
		return err
	}
	l.undo = append(l.undo, func() { os.RemoveAll(dir) })
	if err := standin.CreateMaps(dir, 1<<16); err != nil { // Cilium's service maps: new flows look them up
		return err
	}
	rec, err := recorder.Load(recorder.Options{PinDir: filepath.Join(dir, "ctscrub"), CTRoot: dir, RingBytes: 64 << 20})
	if err != nil {
		return err
	}
	l.rec = rec
	l.undo = append(l.undo, func() { rec.Close() })

	err = nsexec.Do(ns, func() error {
		for _, pair := range [][2]string{{"eth0", "p0"}, {"eth1", "p1"}} {
			if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: pair[0]}, PeerName: pair[1]}); err != nil {
				return err
			}
			for _, n := range pair {
				link, err := netlink.LinkByName(n)
				if err != nil {
					return err
				}
				if err := netlink.LinkSetUp(link); err != nil {
					return err
				}
			}
		}
		link, err := netlink.LinkByName("eth1")
		if err != nil {
			return err
		}
		return netlink.AddrAdd(link, &netlink.Addr{IPNet: netlink.NewIPNet(netipToIP(netip.MustParseAddr("10.244.0.5")))})
	})
	if err != nil {
		return fmt.Errorf("veths: %w", err)
	}
	return nil
}

// timeAttach times 200 Attach/Detach cycles on eth1 (it has an address:
// Attach bumps it).
func (l *lab) timeAttach(res *result) error {
	var att, det []time.Duration
	for range 200 {
		t0 := time.Now()
		if _, err := l.rec.Attach(l.ns, "eth1"); err != nil {
			return err
		}
		t1 := time.Now()
		if err := l.rec.Detach(l.ns, "eth1"); err != nil {
			return err
		}
		att, det = append(att, t1.Sub(t0)), append(det, time.Since(t1))
	}
	slices.Sort(att)
	slices.Sort(det)
	res.AttachP50, res.AttachP99 = att[len(att)/2].Seconds(), att[len(att)*99/100].Seconds()
	res.DetachP50 = det[len(det)/2].Seconds()
	return nil
}

// attachWithFloor attaches the recorder to eth0, puts the empty filter
// behind it on both directions, and opens the AF_PACKET sockets.
func (l *lab) attachWithFloor() error {
	// The live mix's 100 pod IPs are eth0's own, so Attach records them
	// as its addresses and the pod's new flows take the owner check as a
	// real pod's do (not the forged-source path).
	err := nsexec.Do(l.ns, func() error {
		link, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		for i := range 100 {
			ip := netip.AddrFrom4([4]byte{10, 244, 0, byte(10 + i)})
			if err := netlink.AddrAdd(link, &netlink.Addr{IPNet: netlink.NewIPNet(netipToIP(ip))}); err != nil {
				return fmt.Errorf("add %s to eth0: %w", ip, err)
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("pod addresses: %w", err)
	}
	if _, err := l.rec.Attach(l.ns, "eth0"); err != nil {
		return err
	}
	empty, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:         ebpf.SchedCLS,
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, -1), asm.Return()},
		License:      "Dual BSD/GPL",
	})
	if err != nil {
		return err
	}
	l.empty = empty
	l.undo = append(l.undo, func() { empty.Close() })
	idx, sock := &l.idx, &l.sock
	err = nsexec.Do(l.ns, func() error {
		for i, n := range []string{"eth0", "p0"} {
			link, err := netlink.LinkByName(n)
			if err != nil {
				return err
			}
			idx[i] = link.Attrs().Index
			if i == 0 {
				for _, parent := range []uint32{netlink.HANDLE_MIN_INGRESS, netlink.HANDLE_MIN_EGRESS} {
					f := &netlink.BpfFilter{FilterAttrs: netlink.FilterAttrs{LinkIndex: idx[0], Parent: parent, Handle: 1, Priority: 2, Protocol: unix.ETH_P_ALL},
						Fd: empty.FD(), Name: "floor", DirectAction: true}
					if err := netlink.FilterAdd(f); err != nil {
						return fmt.Errorf("floor filter: %w", err)
					}
				}
			}
			s, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, 0)
			if err != nil {
				return err
			}
			if err := unix.Bind(s, &unix.SockaddrLinklayer{Protocol: 0, Ifindex: idx[i]}); err != nil {
				return err
			}
			sock[i] = s
		}
		return nil
	})
	if err != nil {
		return err
	}
	l.undo = append(l.undo, func() { unix.Close(sock[0]) }, func() { unix.Close(sock[1]) })
	return nil
}

// send sends frame out of the pod (eth0's egress) or into it (from p0).
func (l *lab) send(out bool, frame []byte) error {
	i := 1
	if out {
		i = 0
	}
	return unix.Sendto(l.sock[i], frame, 0, &unix.SockaddrLinklayer{Ifindex: l.idx[i], Halen: 6})
}

// timeMix sends FLOWS flows' first packets, then times the recorder per
// packet with the kernel's program statistics in four phases: one second
// of the mix, established TCP, established UDP, new flows; the empty
// filter behind it gives the floor each phase subtracts.
func (l *lab) timeMix(res *result) error {
	stats, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		return fmt.Errorf("enable BPF statistics: %w", err)
	}
	l.undo = append(l.undo, func() { stats.Close() }) // on until the end, as the figures after it ran
	in, eg := l.rec.Programs()
	snap := func() (rt time.Duration, n uint64, floor time.Duration, fn uint64) {
		for _, p := range []*ebpf.Program{in, eg} {
			if s, err := p.Stats(); err == nil {
				rt += s.Runtime
				n += s.RunCount
			}
		}
		if s, err := l.empty.Stats(); err == nil {
			floor, fn = s.Runtime, s.RunCount
		}
		return
	}

	rnd := rand.New(rand.NewPCG(7, 11))
	type flow struct {
		out, in []byte
		udp     bool
		podInit bool
	}
	next := 0
	newFlow := func() *flow {
		next++
		pod := netip.AddrFrom4([4]byte{10, 244, 0, byte(10 + next%100)})
		peer := netip.AddrFrom4([4]byte{byte(11 + rnd.IntN(200)), byte(rnd.IntN(256)), byte(rnd.IntN(256)), byte(1 + rnd.IntN(254))})
		pp, rp := uint16(1024+rnd.IntN(60000)), uint16(1+rnd.IntN(1024))
		f := &flow{udp: next%2 == 0, podInit: rnd.IntN(2) == 0}
		if !f.podInit {
			pp, rp = rp, pp
		}
		proto := uint8(6)
		if f.udp {
			proto = 17
		}
		f.out, f.in = frame(pod, peer, pp, rp, proto, 0x10), frame(peer, pod, rp, pp, proto, 0x10)
		return f
	}
	first := func(f *flow) error {
		out, fr := f.podInit, f.out
		if !f.podInit {
			fr = f.in
		}
		if !f.udp {
			fr = slices.Clone(fr)
			fr[14+20+13] = 0x02 // SYN
		}
		if err := l.send(out, fr); err != nil {
			return err
		}
		// The handshake's second packet.
		if f.podInit {
			return l.send(false, f.in)
		}
		return l.send(true, f.out)
	}
	live := make([]*flow, res.Flows)
	for i := range live {
		live[i] = newFlow()
		if err := first(live[i]); err != nil {
			return fmt.Errorf("send: %w", err)
		}
	}
	phase := func(packets int, pick func() error) (ns, floor float64, err error) {
		rt0, n0, f0, fn0 := snap()
		for range packets {
			if err := pick(); err != nil {
				return 0, 0, err
			}
		}
		rt1, n1, f1, fn1 := snap()
		if n1 == n0 || fn1 == fn0 {
			return 0, 0, errors.New("no program runs counted (BPF statistics off?)")
		}
		return float64(rt1-rt0) / float64(n1-n0), float64(f1-f0) / float64(fn1-fn0), nil
	}
	est := func(udp bool) func() error {
		return func() error {
			for {
				f := live[rnd.IntN(len(live))]
				if f.udp != udp {
					continue
				}
				if rnd.IntN(2) == 0 {
					return l.send(true, f.out)
				}
				return l.send(false, f.in)
			}
		}
	}
	replace := func() error {
		i := rnd.IntN(len(live))
		live[i] = newFlow()
		f := live[i]
		out, fr := f.podInit, f.out
		if !f.podInit {
			fr = f.in
		}
		if !f.udp {
			fr = slices.Clone(fr)
			fr[14+20+13] = 0x02
		}
		return l.send(out, fr)
	}
	// One second of the mix at 10 packets per flow: NEW_PER_S x FLOWS new
	// flows among FLOWS x 10 packets.
	pps := 10
	mixNew := max(1, int(res.NewPerS*float64(res.Flows)))
	mix := func() error {
		if rnd.IntN(res.Flows*pps) < mixNew {
			return replace()
		}
		return est(rnd.IntN(2) == 0)()
	}
	var floors []float64
	for _, p := range []struct {
		out  *float64
		n    int
		pick func() error
	}{
		{&res.MixNs, res.Flows * pps, mix},
		{&res.TCPNs, 100000, est(false)},
		{&res.UDPNs, 100000, est(true)},
		{&res.NewNs, 20000, replace},
	} {
		ns, floor, err := phase(p.n, p.pick)
		if err != nil {
			return err
		}
		*p.out = ns
		floors = append(floors, floor)
	}
	res.FloorNs = median(floors)
	res.TCPNetNs, res.UDPNetNs = res.TCPNs-res.FloorNs, res.UDPNs-res.FloorNs
	res.NewNetNs, res.MixNetNs = res.NewNs-res.FloorNs, res.MixNs-res.FloorNs
	return nil
}

// print is the human-readable summary above the JSON line.
func (res result) print() {
	fmt.Printf("recorder, %d concurrent flows (TCP and UDP), %.0f%% new per second, %d CPUs:\n", res.Flows, res.NewPerS*100, runtime.NumCPU())
	fmt.Printf("  attach %.2f ms (p99 %.2f), detach %.2f ms\n", res.AttachP50*1e3, res.AttachP99*1e3, res.DetachP50*1e3)
	fmt.Printf("  ns/packet (kernel run time; minus the %.1f ns floor): established TCP %.1f (%.1f), established UDP %.1f (%.1f), new flow %.1f (%.1f), mix %.1f (%.1f)\n",
		res.FloorNs, res.TCPNs, res.TCPNetNs, res.UDPNs, res.UDPNetNs, res.NewNs, res.NewNetNs, res.MixNs, res.MixNetNs)
	fmt.Printf("  hot (one packet repeated, BPF_PROG_TEST_RUN; empty program %.1f ns): established TCP4 %.1f, UDP4 %.1f, TCP6 %.1f, new flow %.0f\n",
		res.HotEmpty, res.HotTCP4, res.HotUDP4, res.HotTCP6, res.HotNewNs)
	fmt.Printf("  hot, the same flows to a per-packet load-balanced VIP: TCP4 %.1f (x%.2f), UDP4 %.1f (x%.2f), TCP6 %.1f (x%.2f)\n",
		res.HotTCP4Svc, res.HotTCP4Svc/res.HotTCP4, res.HotUDP4Svc, res.HotUDP4Svc/res.HotUDP4, res.HotTCP6Svc, res.HotTCP6Svc/res.HotTCP6)
	fmt.Println("  this machine now:", res.MachineCosts)
}

func median(v []float64) float64 {
	slices.Sort(v)
	return v[len(v)/2]
}

func netipToIP(a netip.Addr) []byte { b := a.As4(); return b[:] }

// frame builds Ethernet + IPv4 + TCP/UDP with 32 bytes of payload, addressed
// to a MAC no interface has (the receiving stack drops it after the filter).
func frame(src, dst netip.Addr, sport, dport uint16, proto, tcpFlags uint8) []byte {
	b := make([]byte, 14+20+20+32)
	copy(b[0:6], []byte{0x02, 0, 0, 0, 0, 0x99})
	copy(b[6:12], []byte{0x02, 0, 0, 0, 0, 0x98})
	binary.BigEndian.PutUint16(b[12:], 0x0800)
	ip := b[14:]
	ip[0] = 0x45
	binary.BigEndian.PutUint16(ip[2:], uint16(len(b)-14))
	ip[8], ip[9] = 64, proto
	s, d := src.As4(), dst.As4()
	copy(ip[12:16], s[:])
	copy(ip[16:20], d[:])
	l4 := ip[20:]
	binary.BigEndian.PutUint16(l4[0:], sport)
	binary.BigEndian.PutUint16(l4[2:], dport)
	if proto == 6 {
		l4[12] = 5 << 4
		l4[13] = tcpFlags
	}
	return b
}
