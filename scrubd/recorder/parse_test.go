package recorder

import (
	"encoding/binary"
	"net/netip"
	"testing"
	"time"

	"github.com/cilium/ebpf/ringbuf"

	"github.com/ctscrub/ctscrub/bpf"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// These tests run the recorder's real programs with BPF_PROG_TEST_RUN on
// crafted frames (header layouts real traffic in the netns tests does not
// produce on demand: extension headers, fragments, ICMP errors, ND) and
// read what they put in the ring buffer.

type frameBuilder struct{ b []byte }

func eth(etherType uint16) *frameBuilder {
	f := &frameBuilder{b: make([]byte, 14)}
	binary.BigEndian.PutUint16(f.b[12:], etherType)
	return f
}

func (f *frameBuilder) add(b ...byte) *frameBuilder { f.b = append(f.b, b...); return f }

func ipv4(proto uint8, fragOff uint16, src, dst netip.Addr) []byte {
	h := make([]byte, 20)
	h[0] = 0x45
	binary.BigEndian.PutUint16(h[6:], fragOff)
	h[8] = 64
	h[9] = proto
	s, d := src.As4(), dst.As4()
	copy(h[12:], s[:])
	copy(h[16:], d[:])
	return h
}

func ipv6(next uint8, src, dst netip.Addr) []byte {
	h := make([]byte, 40)
	h[0] = 0x60
	h[6] = next
	h[7] = 64
	s, d := src.As16(), dst.As16()
	copy(h[8:], s[:])
	copy(h[24:], d[:])
	return h
}

func ports(sport, dport uint16, n int) []byte {
	b := make([]byte, n)
	binary.BigEndian.PutUint16(b[0:], sport)
	binary.BigEndian.PutUint16(b[2:], dport)
	return b
}

func icmpMsg(typ uint8, id uint16) []byte {
	b := make([]byte, 8)
	b[0] = typ
	binary.BigEndian.PutUint16(b[4:], id)
	return b
}

type private struct {
	objs bpf.RecorderObjects
	rd   *ringbuf.Reader
}

func loadPrivate(t *testing.T) *private {
	t.Helper()
	requireRoot(t)
	spec, err := bpf.LoadRecorder()
	if err != nil {
		t.Fatal(err)
	}
	p := &private{}
	if err := setSourceCheck(spec); err != nil {
		t.Fatal(err)
	}
	if err := spec.LoadAndAssign(&p.objs, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.objs.Close() })
	// The pods send from their own addresses.
	if err := ownTestRun(p.objs.RecOwner, pod4, pod6); err != nil {
		t.Fatal(err)
	}
	if p.rd, err = ringbuf.NewReader(p.objs.RecEvents); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.rd.Close() })
	return p
}

// run feeds one frame to the egress (pod sends) or ingress program and
// returns the records it emitted.
func (p *private) run(t *testing.T, egress bool, frame []byte) []Record {
	t.Helper()
	prog := p.objs.RecorderIngress
	if egress {
		prog = p.objs.RecorderEgress
	}
	ret, _, err := prog.Test(frame)
	if err != nil {
		t.Fatal(err)
	}
	if int32(ret) != -1 {
		t.Fatalf("program returned %d, want TCX_NEXT (-1)", int32(ret))
	}
	var out []Record
	for {
		p.rd.SetDeadline(time.Now().Add(10 * time.Millisecond))
		r, err := p.rd.Read()
		if err != nil {
			return out
		}
		rc, err := ParseRecord(r.RawSample)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, rc)
	}
}

var (
	pod4  = netip.MustParseAddr("10.244.0.10")
	peer4 = netip.MustParseAddr("192.0.2.2")
	pod6  = netip.MustParseAddr("fd00:244::a")
	peer6 = netip.MustParseAddr("2001:db8:2::2")
	// router4 sends nothing else in TestParseKeys: its flow is fresh.
	router4 = netip.MustParseAddr("192.0.2.254")
)

func TestParseKeys(t *testing.T) {
	p := loadPrivate(t)
	hbh := []byte{17, 0, 0, 0, 0, 0, 0, 0}         // hop-by-hop, next UDP, 8 bytes
	dst := []byte{6, 1, 0, 0, 0, 0, 0, 0}          // destination options, next TCP, 16 bytes
	dst = append(dst, make([]byte, 8)...)          //
	frag0 := []byte{17, 0, 0x00, 0x01, 0, 0, 0, 1} // fragment, offset 0, more fragments
	frag1 := []byte{17, 0, 0x00, 0xb9, 0, 0, 0, 1} // fragment, offset 23 (x8 bytes)

	for _, tc := range []struct {
		name   string
		egress bool
		frame  []byte
		want   []byte // the record's key; nil: no record
	}{
		{"tcp4 out", true, eth(0x0800).add(ipv4(6, 0, pod4, peer4)...).add(ports(40000, 443, 20)...).b,
			k4(ctmap.NewKey4(pod4, peer4, 443, 40000, ctmap.ProtoTCP, ctmap.FlagOut))},
		{"udp4 in", false, eth(0x0800).add(ipv4(17, 0, peer4, pod4)...).add(ports(53000, 53, 8)...).b,
			k4(ctmap.NewKey4(peer4, pod4, 53, 53000, ctmap.ProtoUDP, ctmap.FlagIn))},
		{"sctp4 out", true, eth(0x0800).add(ipv4(132, 0, pod4, peer4)...).add(ports(5000, 5001, 12)...).b,
			k4(ctmap.NewKey4(pod4, peer4, 5001, 5000, 132, ctmap.FlagOut))},
		{"icmp4 echo request out", true, eth(0x0800).add(ipv4(1, 0, pod4, peer4)...).add(icmpMsg(8, 0x1234)...).b,
			k4(ctmap.NewKey4(pod4, peer4, 0, 0x1234, ctmap.ProtoICMP, ctmap.FlagOut))},
		{"icmp4 echo request in", false, eth(0x0800).add(ipv4(1, 0, peer4, pod4)...).add(icmpMsg(8, 0x4321)...).b,
			k4(ctmap.NewKey4(peer4, pod4, 0, 0x4321, ctmap.ProtoICMP, ctmap.FlagIn))},
		// An ICMP error that matches no related entry makes Cilium create
		// one: sender -> receiver, ports 0, direction | RELATED
		// (e2e/conformance: icmp-error-*).
		{"icmp4 unreachable", false, eth(0x0800).add(ipv4(1, 0, peer4, pod4)...).add(icmpMsg(3, 0)...).b,
			k4(ctmap.NewKey4(peer4, pod4, 0, 0, ctmap.ProtoICMP, ctmap.FlagIn|ctmap.FlagRelated))},
		{"icmp4 time exceeded sent", true, eth(0x0800).add(ipv4(1, 0, pod4, router4)...).add(icmpMsg(11, 0)...).b,
			k4(ctmap.NewKey4(pod4, router4, 0, 0, ctmap.ProtoICMP, ctmap.FlagOut|ctmap.FlagRelated))},
		{"ipv4 first fragment", true, eth(0x0800).add(ipv4(17, 0x2000, pod4, peer4)...).add(ports(1111, 2222, 8)...).b,
			k4(ctmap.NewKey4(pod4, peer4, 2222, 1111, ctmap.ProtoUDP, ctmap.FlagOut))},
		{"ipv4 later fragment", true, eth(0x0800).add(ipv4(17, 0x0010, pod4, peer4)...).add(ports(3333, 4444, 8)...).b, nil},
		{"ipv4 options", true, eth(0x0800).add(func() []byte {
			h := ipv4(17, 0, pod4, peer4)
			h[0] = 0x46 // 24-byte header
			return append(h, 1, 1, 1, 0)
		}()...).add(ports(5555, 6666, 8)...).b,
			k4(ctmap.NewKey4(pod4, peer4, 6666, 5555, ctmap.ProtoUDP, ctmap.FlagOut))},
		{"tcp6 out", true, eth(0x86dd).add(ipv6(6, pod6, peer6)...).add(ports(40000, 443, 20)...).b,
			k6(ctmap.NewKey6(pod6, peer6, 443, 40000, ctmap.ProtoTCP, ctmap.FlagOut))},
		{"udp6 behind hop-by-hop", true, eth(0x86dd).add(ipv6(0, pod6, peer6)...).add(hbh...).add(ports(1000, 2000, 8)...).b,
			k6(ctmap.NewKey6(pod6, peer6, 2000, 1000, ctmap.ProtoUDP, ctmap.FlagOut))},
		{"tcp6 behind 16-byte dest options", false, eth(0x86dd).add(ipv6(60, peer6, pod6)...).add(dst...).add(ports(3000, 4000, 20)...).b,
			k6(ctmap.NewKey6(peer6, pod6, 4000, 3000, ctmap.ProtoTCP, ctmap.FlagIn))},
		{"udp6 first fragment", true, eth(0x86dd).add(ipv6(44, pod6, peer6)...).add(frag0...).add(ports(1234, 5678, 8)...).b,
			k6(ctmap.NewKey6(pod6, peer6, 5678, 1234, ctmap.ProtoUDP, ctmap.FlagOut))},
		{"udp6 later fragment", true, eth(0x86dd).add(ipv6(44, pod6, peer6)...).add(frag1...).add(ports(4321, 8765, 8)...).b, nil},
		{"icmp6 echo request", true, eth(0x86dd).add(ipv6(58, pod6, peer6)...).add(icmpMsg(128, 0x0707)...).b,
			k6(ctmap.NewKey6(pod6, peer6, 0, 0x0707, ctmap.ProtoICMPv6, ctmap.FlagOut))},
		{"icmp6 echo reply seen first", false, eth(0x86dd).add(ipv6(58, peer6, pod6)...).add(icmpMsg(129, 0x0808)...).b,
			k6(ctmap.NewKey6(peer6, pod6, 0x0808, 0, ctmap.ProtoICMPv6, ctmap.FlagIn))},
		{"icmp6 neighbour solicitation", true, eth(0x86dd).add(ipv6(58, pod6, peer6)...).add(icmpMsg(135, 0)...).b, nil},
		{"icmp6 router solicitation", true, eth(0x86dd).add(ipv6(58, pod6, peer6)...).add(icmpMsg(133, 0)...).b, nil},
		{"icmp6 packet too big", false, eth(0x86dd).add(ipv6(58, peer6, pod6)...).add(icmpMsg(2, 0)...).b,
			k6(ctmap.NewKey6(peer6, pod6, 0, 0, ctmap.ProtoICMPv6, ctmap.FlagIn|ctmap.FlagRelated))},
		{"icmp6 MLD report", true, eth(0x86dd).add(ipv6(58, pod6, peer6)...).add(icmpMsg(143, 0)...).b,
			k6(ctmap.NewKey6(pod6, peer6, 0, 0, ctmap.ProtoICMPv6, ctmap.FlagOut))},
		{"gre", true, eth(0x0800).add(ipv4(47, 0, pod4, peer4)...).add(make([]byte, 8)...).b, nil},
		{"truncated udp", true, eth(0x0800).add(ipv4(17, 0, pod4, peer4)...).add(1, 2).b, nil},
		{"arp", true, eth(0x0806).add(make([]byte, 28)...).b, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			recs := p.run(t, tc.egress, tc.frame)
			if tc.want == nil {
				if len(recs) != 0 {
					t.Fatalf("got %d records, want none", len(recs))
				}
				return
			}
			if len(recs) != 1 {
				t.Fatalf("got %d records, want 1", len(recs))
			}
			got := recs[0].Key[:len(tc.want)]
			if string(got) != string(tc.want) || recs[0].Kind != RecFlow {
				t.Fatalf("record kind %d key %x, want flow key %x", recs[0].Kind, got, tc.want)
			}
			// A second packet of the flow, either way, is a seen-cache hit.
			if again := p.run(t, tc.egress, tc.frame); len(again) != 0 {
				t.Fatalf("second packet of the flow emitted %d records", len(again))
			}
		})
	}
}

func k4(k ctmap.CTKey4) []byte { return k[:] }
func k6(k ctmap.CTKey6) []byte { return k[:] }

// A reply (the other direction) of a recorded flow emits nothing; a SYN
// opening the same 5-tuple from the other side emits the key with the other
// initiator.
func TestReplyAndReopenedSYN(t *testing.T) {
	p := loadPrivate(t)
	syn := func(src, dst netip.Addr, sport, dport uint16) []byte {
		l4 := ports(sport, dport, 20)
		l4[13] = 0x02
		return eth(0x0800).add(ipv4(6, 0, src, dst)...).add(l4...).b
	}
	synack := func(src, dst netip.Addr, sport, dport uint16) []byte {
		b := syn(src, dst, sport, dport)
		b[14+20+13] = 0x12
		return b
	}
	if n := len(p.run(t, true, syn(pod4, peer4, 40000, 80))); n != 1 {
		t.Fatalf("SYN out: %d records", n)
	}
	if n := len(p.run(t, false, synack(peer4, pod4, 80, 40000))); n != 0 {
		t.Fatalf("SYN-ACK in: %d records, want 0", n)
	}
	recs := p.run(t, false, syn(peer4, pod4, 80, 40000))
	want := ctmap.NewKey4(peer4, pod4, 40000, 80, ctmap.ProtoTCP, ctmap.FlagIn)
	if len(recs) != 1 || string(recs[0].Key[:ctmap.KeySize4]) != string(want[:]) {
		t.Fatalf("SYN in on a recorded 5-tuple: %v, want one record %s", recs, want)
	}
}
