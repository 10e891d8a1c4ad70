package main

import (
	"testing"

	"github.com/ctscrub/ctscrub/bench/internal/proccpu"
)

// Two sockets of kube-proxy's and one of the controller manager's, as
// `ss -tinpH state established` prints them (queue sizes first).
const ssOut = `0      0      172.18.0.2:40578 172.18.0.2:6443 users:(("kube-proxy",pid=1900,fd=7))
	 cubic wscale:7,7 rto:204 rtt:0.05/0.02 mss:32768 bytes_sent:1000 bytes_acked:1001 bytes_received:5000 segs_out:3
0      0      172.18.0.2:40590 172.18.0.2:6443 users:(("kube-controller",pid=700,fd=9))
	 cubic wscale:7,7 rto:204 bytes_sent:9 bytes_received:99999 segs_out:3
12     0      172.18.0.2:40602 172.18.0.2:6443 users:(("kube-proxy",pid=1900,fd=8))
	 cubic wscale:7,7 rto:204 bytes_sent:20 bytes_received:70 segs_out:3
`

func TestParseSS(t *testing.T) {
	got := parseSS(ssOut, "kube-proxy")
	want := map[string]sock{
		"172.18.0.2:40578 172.18.0.2:6443": {rx: 5000, tx: 1000},
		"172.18.0.2:40602 172.18.0.2:6443": {rx: 70, tx: 20},
	}
	if len(got) != len(want) {
		t.Fatalf("parseSS = %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("socket %s: %+v, want %+v", k, got[k], v)
		}
	}
	if s := parseSS("", "kube-proxy"); len(s) != 0 {
		t.Errorf("no output: %v", s)
	}
}

func TestSockDelta(t *testing.T) {
	before := map[string]sock{"a": {rx: 100, tx: 10}, "b": {rx: 50, tx: 5}, "gone": {rx: 7, tx: 7}}
	after := map[string]sock{
		"a": {rx: 350, tx: 15}, // the same connection: 250 and 5
		"c": {rx: 40, tx: 4},   // a new one (a reconnect): all of it
		"b": {rx: 10, tx: 1},   // counters lower: another connection on the same ports, all of it
	}
	if rx, tx := sockDelta(before, after); rx != 250+40+10 || tx != 5+4+1 {
		t.Errorf("sockDelta = %d, %d; want 300, 10", rx, tx)
	}
}

// The container's CPU between two readings of the same process is the
// difference, whatever that process's own ticks did; of another process
// (a restart), all of the new container's.
func TestCgroupDelta(t *testing.T) {
	a := cgroupCPU{pid: 10, start: 500, s: 100}
	for _, tc := range []struct {
		b    cgroupCPU
		want float64
	}{
		{cgroupCPU{pid: 10, start: 500, s: 130}, 30},
		{cgroupCPU{pid: 11, start: 900, s: 4}, 4},
		{cgroupCPU{pid: 10, start: 777, s: 5}, 5},
	} {
		if got := cgroupDelta(a, tc.b); got != tc.want {
			t.Errorf("cgroupDelta(%+v, %+v) = %v, want %v", a, tc.b, got, tc.want)
		}
	}
	ps := []proccpu.Proc{{PID: 300, Start: 90}, {PID: 12, Start: 95}, {PID: 40, Start: 50}, {PID: 41, Start: 50}}
	if o := oldest(ps); o.PID != 40 {
		t.Errorf("oldest = %+v, want pid 40", o)
	}
}
