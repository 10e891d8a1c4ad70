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
//     statistics' own cost); *_net_ns subtract it;
//   - the host-side link (recorder_host, tcx at the head of the pod's
//     host-side veth's ingress): ns per packet in the same phases (what the
//     pod sends crosses both hooks), and per new flow a pod sends with
//     PACKET_QDISC_BYPASS (the host side alone records it), beside an empty
//     tcx program at the tail of the same hook;
//   - attach at 1, 20 and 50 pods at once: one tcx link on a host-side veth
//     alone, Attach with the host-side link, and Attach of the container
//     side only (the recorder before host-side recording), p50 and p99.
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
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
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
	HotTCP4Svc float64 `json:"hot_tcp4_svc_ns"`
	HotUDP4Svc float64 `json:"hot_udp4_svc_ns"`
	HotTCP6Svc float64 `json:"hot_tcp6_svc_ns"`
	HotNewNs   float64 `json:"hot_new_flow_ns"`
	// The host-side link, same phases (kernel run time per packet the pod
	// sent), and the empty tcx program behind it on the same hook.
	HostMixNs    float64 `json:"host_mix_ns"`
	HostTCPNs    float64 `json:"host_tcp_est_ns"`
	HostUDPNs    float64 `json:"host_udp_est_ns"`
	HostNewNs    float64 `json:"host_new_flow_ns"`
	HostBypassNs float64 `json:"host_bypass_new_flow_ns"`
	HostFloorNs  float64 `json:"host_floor_ns"`
	// Attach at 1, 20 and 50 pods at once, p50/p99 in seconds.
	Concurrent  []attachRound `json:"concurrent_attach"`
	LoadAverage string        `json:"loadavg"`
	// What the machine charged for a page fault, a syscall and a process
	// start (internal/machcost), measured after the phases.
	MachineCosts machcost.Costs `json:"machine_costs"`
}

// attachRound is one concurrency level of the attach measurement.
type attachRound struct {
	Pods             int     `json:"pods"`
	TCXP50           float64 `json:"tcx_link_p50_s"`
	TCXP99           float64 `json:"tcx_link_p99_s"`
	AttachP50        float64 `json:"attach_p50_s"`
	AttachP99        float64 `json:"attach_p99_s"`
	ContainerOnlyP50 float64 `json:"container_only_p50_s"`
	ContainerOnlyP99 float64 `json:"container_only_p99_s"`
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
	if err := l.timeConcurrentAttach(&res); err != nil {
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

// lab is the pod the recorder is measured on: a pod netns and a node netns
// joined by two veth pairs (eth0/p0 carries the measured packets, eth1/p1
// the attach cycles; p0 and p1 are the host sides, in the node netns), the
// recorder loaded over a private bpffs dir, an empty filter behind its own
// filters and an empty tcx program behind its host-side link (the floors),
// and AF_PACKET sockets on eth0 (one with PACKET_QDISC_BYPASS) and p0.
type lab struct {
	ns     string // the pod's netns path
	nodeNS string // the node's
	dir    string // the bpffs dir
	rec    *recorder.Recorder
	empty  *ebpf.Program
	// hostEmpty: the empty program behind the host-side link.
	hostEmpty *ebpf.Program
	idx       [2]int // ifindex of eth0 (pod netns), p0 (node netns)
	sock      [2]int // AF_PACKET sockets bound to them
	bypass    int    // on eth0, with PACKET_QDISC_BYPASS
	undo      []func()
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
	nodeNS, err := nsexec.Create(name + "-node")
	if err != nil {
		return err
	}
	l.nodeNS = nodeNS
	l.undo = append(l.undo, func() { os.Remove(nodeNS) }, func() { unix.Unmount(nodeNS, unix.MNT_DETACH) })
	dir, err := os.MkdirTemp("/sys/fs/bpf", "ctscrub-benchrec-")
	if err != nil {
		return err
	}
	l.undo = append(l.undo, func() { os.RemoveAll(dir) })
	if err := standin.CreateMaps(dir, 1<<16); err != nil { // Cilium's service maps: new flows look them up
		return err
	}
	l.dir = dir
	rec, err := recorder.Load(recorder.Options{PinDir: filepath.Join(dir, "ctscrub"), CTRoot: dir, RingBytes: 64 << 20, NodeNetns: nodeNS})
	if err != nil {
		return err
	}
	l.rec = rec
	l.undo = append(l.undo, func() { rec.Close() })

	for _, pair := range [][2]string{{"eth0", "p0"}, {"eth1", "p1"}} {
		if err := podVeth(ns, nodeNS, pair[0], pair[1]); err != nil {
			return fmt.Errorf("veths: %w", err)
		}
	}
	err = nsexec.Do(ns, func() error {
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

// podVeth creates podIf in the netns at pod and its peer hostIf in the one
// at node, both up: a pod's veth as a CNI plugin leaves it.
func podVeth(pod, node, podIf, hostIf string) error {
	return nsexec.Do(node, func() error {
		podNS, err := os.Open(pod)
		if err != nil {
			return err
		}
		defer podNS.Close()
		if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: hostIf}, PeerName: podIf, PeerNamespace: netlink.NsFd(int(podNS.Fd()))}); err != nil {
			return err
		}
		l, err := netlink.LinkByName(hostIf)
		if err != nil {
			return err
		}
		if err := netlink.LinkSetUp(l); err != nil {
			return err
		}
		return nsexec.Do(pod, func() error {
			l, err := netlink.LinkByName(podIf)
			if err != nil {
				return err
			}
			return netlink.LinkSetUp(l)
		})
	})
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

// timeConcurrentAttach times, for 1, 20 and 50 pods at once (each its
// own netns with eth0, its host side hN in the node netns), what a pod's
// ADD pays for the host side: one tcx link on hN's ingress alone; Attach
// with the host-side link; Attach of the container side only (a second
// recorder loaded with ContainerSideOnly). At least 200 samples each.
func (l *lab) timeConcurrentAttach(res *result) error {
	const most = 50
	var pods []string
	for i := range most {
		ns, err := nsexec.Create(fmt.Sprintf("ctscrub-benchrec-%d-pod%d", os.Getpid(), i))
		if err != nil {
			return err
		}
		l.undo = append(l.undo, func() { os.Remove(ns) }, func() { unix.Unmount(ns, unix.MNT_DETACH) })
		if err := podVeth(ns, l.nodeNS, "eth0", fmt.Sprintf("h%d", i)); err != nil {
			return fmt.Errorf("pod %d veth: %w", i, err)
		}
		err = nsexec.Do(ns, func() error {
			lk, err := netlink.LinkByName("eth0")
			if err != nil {
				return err
			}
			return netlink.AddrAdd(lk, &netlink.Addr{IPNet: netlink.NewIPNet(netipToIP(netip.AddrFrom4([4]byte{10, 245, 0, byte(10 + i)})))})
		})
		if err != nil {
			return err
		}
		pods = append(pods, ns)
	}
	hostIdx := make([]int, most)
	err := nsexec.Do(l.nodeNS, func() error {
		for i := range most {
			lk, err := netlink.LinkByName(fmt.Sprintf("h%d", i))
			if err != nil {
				return err
			}
			hostIdx[i] = lk.Attrs().Index
		}
		return nil
	})
	if err != nil {
		return err
	}
	co, err := recorder.Load(recorder.Options{PinDir: filepath.Join(l.dir, "ctscrub-container-only"), CTRoot: l.dir, RingBytes: 1 << 20, ContainerSideOnly: true})
	if err != nil {
		return err
	}
	defer co.Close()
	host := l.rec.HostProgram()
	// round runs do(i) for pods 0..n-1 at once, then undo(i) (untimed),
	// until it has at least 200 samples.
	round := func(n int, do func(i int) error, undo func(i int)) (p50, p99 float64, err error) {
		var took []time.Duration
		for len(took) < 200 {
			d := make([]time.Duration, n)
			errs := make([]error, n)
			var wg sync.WaitGroup
			start := make(chan struct{})
			for i := range n {
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					t0 := time.Now()
					errs[i] = do(i)
					d[i] = time.Since(t0)
				}()
			}
			close(start)
			wg.Wait()
			for i := range n {
				undo(i)
			}
			if err := errors.Join(errs...); err != nil {
				return 0, 0, err
			}
			took = append(took, d...)
		}
		slices.Sort(took)
		return took[len(took)/2].Seconds(), took[len(took)*99/100].Seconds(), nil
	}
	links := make([]link.Link, most)
	for _, n := range []int{1, 20, 50} {
		r := attachRound{Pods: n}
		r.TCXP50, r.TCXP99, err = round(n, func(i int) error {
			return nsexec.Do(l.nodeNS, func() error {
				var err error
				links[i], err = link.AttachTCX(link.TCXOptions{Interface: hostIdx[i], Program: host, Attach: ebpf.AttachTCXIngress, Anchor: link.Head()})
				return err
			})
		}, func(i int) {
			if links[i] != nil {
				links[i].Close()
				links[i] = nil
			}
		})
		if err != nil {
			return fmt.Errorf("tcx links, %d at once: %w", n, err)
		}
		r.AttachP50, r.AttachP99, err = round(n, func(i int) error {
			_, err := l.rec.Attach(pods[i], "eth0")
			return err
		}, func(i int) { l.rec.Detach(pods[i], "eth0") })
		if err != nil {
			return fmt.Errorf("Attach, %d at once: %w", n, err)
		}
		r.ContainerOnlyP50, r.ContainerOnlyP99, err = round(n, func(i int) error {
			_, err := co.Attach(pods[i], "eth0")
			return err
		}, func(i int) { co.Detach(pods[i], "eth0") })
		if err != nil {
			return fmt.Errorf("Attach of the container side only, %d at once: %w", n, err)
		}
		res.Concurrent = append(res.Concurrent, r)
	}
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
	hostEmpty, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:         ebpf.SchedCLS,
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, -1), asm.Return()},
		License:      "Dual BSD/GPL",
	})
	if err != nil {
		return err
	}
	l.hostEmpty = hostEmpty
	l.undo = append(l.undo, func() { hostEmpty.Close() })
	idx, sock := &l.idx, &l.sock
	for i, n := range []string{"eth0", "p0"} {
		ns := l.ns
		if i == 1 {
			ns = l.nodeNS
		}
		err = nsexec.Do(ns, func() error {
			lk, err := netlink.LinkByName(n)
			if err != nil {
				return err
			}
			idx[i] = lk.Attrs().Index
			if i == 0 {
				for _, parent := range []uint32{netlink.HANDLE_MIN_INGRESS, netlink.HANDLE_MIN_EGRESS} {
					f := &netlink.BpfFilter{FilterAttrs: netlink.FilterAttrs{LinkIndex: idx[0], Parent: parent, Handle: 1, Priority: 2, Protocol: unix.ETH_P_ALL},
						Fd: empty.FD(), Name: "floor", DirectAction: true}
					if err := netlink.FilterAdd(f); err != nil {
						return fmt.Errorf("floor filter: %w", err)
					}
				}
				b, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, 0)
				if err != nil {
					return err
				}
				l.bypass = b
				if err := unix.SetsockoptInt(b, unix.SOL_PACKET, unix.PACKET_QDISC_BYPASS, 1); err != nil {
					return fmt.Errorf("PACKET_QDISC_BYPASS: %w", err)
				}
				if err := unix.Bind(b, &unix.SockaddrLinklayer{Protocol: 0, Ifindex: idx[0]}); err != nil {
					return err
				}
			} else {
				// Behind the recorder's host-side link, as Cilium's
				// program is: the hook's floor.
				tl, err := link.AttachTCX(link.TCXOptions{Interface: idx[1], Program: hostEmpty, Attach: ebpf.AttachTCXIngress, Anchor: link.Tail()})
				if err != nil {
					return fmt.Errorf("empty tcx program on p0: %w", err)
				}
				l.undo = append(l.undo, func() { tl.Close() })
			}
			s, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, 0)
			if err != nil {
				return err
			}
			if err := unix.Bind(s, &unix.SockaddrLinklayer{Protocol: 0, Ifindex: idx[i]}); err != nil {
				return err
			}
			sock[i] = s
			return nil
		})
		if err != nil {
			return err
		}
	}
	l.undo = append(l.undo, func() { unix.Close(sock[0]) }, func() { unix.Close(sock[1]) }, func() { unix.Close(l.bypass) })
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
	host := l.rec.HostProgram()
	hostSnap := func() (rt time.Duration, n uint64, floor time.Duration, fn uint64) {
		if s, err := host.Stats(); err == nil {
			rt, n = s.Runtime, s.RunCount
		}
		if s, err := l.hostEmpty.Stats(); err == nil {
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
	// A phase's figures on the pod's hooks (ns, floor) and on the
	// host-side hook (hostNs, hostFloor: the packets the pod sent).
	phase := func(packets int, pick func() error) (ns, floor, hostNs, hostFloor float64, err error) {
		rt0, n0, f0, fn0 := snap()
		h0, hn0, hf0, hfn0 := hostSnap()
		for range packets {
			if err := pick(); err != nil {
				return 0, 0, 0, 0, err
			}
		}
		rt1, n1, f1, fn1 := snap()
		h1, hn1, hf1, hfn1 := hostSnap()
		if hn1 == hn0 || hfn1 == hfn0 {
			return 0, 0, 0, 0, errors.New("no host-side program runs counted (BPF statistics off?)")
		}
		hostNs, hostFloor = float64(h1-h0)/float64(hn1-hn0), float64(hf1-hf0)/float64(hfn1-hfn0)
		if n1 == n0 || fn1 == fn0 {
			return 0, 0, hostNs, hostFloor, nil // bypassed: the pod's hooks ran nothing
		}
		return float64(rt1-rt0) / float64(n1-n0), float64(f1-f0) / float64(fn1-fn0), hostNs, hostFloor, nil
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
	// A new flow the pod sends with PACKET_QDISC_BYPASS: the host side
	// alone sees (and records) it.
	bypassed := func() error {
		i := rnd.IntN(len(live))
		live[i] = newFlow()
		live[i].podInit = true
		fr := live[i].out
		if !live[i].udp {
			fr = slices.Clone(fr)
			fr[14+20+13] = 0x02
		}
		return unix.Sendto(l.bypass, fr, 0, &unix.SockaddrLinklayer{Ifindex: l.idx[0], Halen: 6})
	}
	var floors, hostFloors []float64
	var ignored float64
	for _, p := range []struct {
		out, host *float64
		n         int
		pick      func() error
	}{
		{&res.MixNs, &res.HostMixNs, res.Flows * pps, mix},
		{&res.TCPNs, &res.HostTCPNs, 100000, est(false)},
		{&res.UDPNs, &res.HostUDPNs, 100000, est(true)},
		{&res.NewNs, &res.HostNewNs, 20000, replace},
		{&ignored, &res.HostBypassNs, 20000, bypassed},
	} {
		ns, floor, hostNs, hostFloor, err := phase(p.n, p.pick)
		if err != nil {
			return err
		}
		*p.out, *p.host = ns, hostNs
		if floor > 0 {
			floors = append(floors, floor)
		}
		hostFloors = append(hostFloors, hostFloor)
	}
	res.FloorNs = median(floors)
	res.HostFloorNs = median(hostFloors)
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
	fmt.Printf("  host-side link (tcx, host-side veth ingress; empty tcx program behind it %.1f ns): established TCP %.1f, established UDP %.1f, new flow %.1f, mix %.1f, new flow sent with PACKET_QDISC_BYPASS %.1f\n",
		res.HostFloorNs, res.HostTCPNs, res.HostUDPNs, res.HostNewNs, res.HostMixNs, res.HostBypassNs)
	for _, c := range res.Concurrent {
		fmt.Printf("  %2d pods at once: one tcx link %.2f ms (p99 %.2f), Attach with the host-side link %.2f ms (p99 %.2f), container side only %.2f ms (p99 %.2f)\n",
			c.Pods, c.TCXP50*1e3, c.TCXP99*1e3, c.AttachP50*1e3, c.AttachP99*1e3, c.ContainerOnlyP50*1e3, c.ContainerOnlyP99*1e3)
	}
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
