package recorder

import (
	"os"
	"testing"
)

func requireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: BPF programs, maps and network namespaces")
	}
}

// The cost figures themselves are checked by `make bench`; this test only
// proves the measurement runs and yields positive, ordered numbers.
func TestMeasurePacketCost(t *testing.T) {
	requireRoot(t)
	newNs, estNs, err := MeasurePacketCost(2000)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("recorder per packet: new flow %.0f ns, established flow %.0f ns", newNs, estNs)
	if estNs <= 0 || newNs <= 0 {
		t.Fatalf("non-positive cost: new %.1f established %.1f", newNs, estNs)
	}
}

func TestMeasureEstablishedCosts(t *testing.T) {
	requireRoot(t)
	c, err := MeasureEstablishedCosts(100000)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("established flow per packet: TCP4 %.0f ns, UDP4 %.0f ns, TCP6 %.0f ns; to a VIP: TCP4 %.0f ns, UDP4 %.0f ns, TCP6 %.0f ns; empty program %.0f ns",
		c.TCP4, c.UDP4, c.TCP6, c.TCP4Svc, c.UDP4Svc, c.TCP6Svc, c.Empty)
	if c.TCP4 <= 0 || c.UDP4 <= 0 || c.TCP6 <= 0 || c.TCP4Svc <= 0 || c.UDP4Svc <= 0 || c.TCP6Svc <= 0 || c.Empty < 0 {
		t.Fatalf("implausible figures: %+v", c)
	}
}
