package ctmap

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"
)

// The SNAT maps are optional: Open finds them beside the CT maps when
// pinned, says why one it cannot use is not used, and Replaced notices one
// that appears, is re-created or goes.
func TestOpenNAT(t *testing.T) {
	root := privateRoot(t)
	for _, k := range Kinds {
		pin(t, root, k.Spec(1024))
	}
	m, err := Open(root)
	if err != nil {
		t.Fatal(err)
	}
	if m.NAT(false) != nil || m.NATError(false) != nil {
		t.Fatalf("no SNAT map pinned: NAT %v, error %v", m.NAT(false), m.NATError(false))
	}
	// Pinned after Open (Cilium restarted with NodePort on): replaced.
	pin(t, root, NATSpec(false, 1024))
	if r, err := m.Replaced(); !r || err != nil {
		t.Errorf("SNAT map pinned after Open: Replaced %v, %v; want true", r, err)
	}
	m.Close()

	m, err = Open(root)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if m.NAT(false) == nil || m.NAT(true) != nil {
		t.Fatalf("NAT(v4) %v, NAT(v6) %v: want the v4 map only", m.NAT(false), m.NAT(true))
	}
	if r, err := m.Replaced(); r || err != nil {
		t.Errorf("nothing changed: Replaced %v, %v", r, err)
	}
	// Unpinned (NodePort and masquerade turned off): replaced, so the
	// programs holding it move on.
	if err := os.Remove(filepath.Join(root, NATName4)); err != nil {
		t.Fatal(err)
	}
	if r, err := m.Replaced(); !r || err != nil {
		t.Errorf("SNAT map unpinned: Replaced %v, %v; want true", r, err)
	}
}

func TestOpenNATWrongLayout(t *testing.T) {
	root := privateRoot(t)
	for _, k := range Kinds {
		pin(t, root, k.Spec(1024))
	}
	bad := NATSpec(false, 1024)
	bad.ValueSize = 48
	pin(t, root, bad)
	m, err := Open(root)
	if err != nil {
		t.Fatalf("a SNAT map of another layout must not fail Open (CT scrubs do not need it): %v", err)
	}
	defer m.Close()
	if m.NAT(false) != nil || m.NATError(false) == nil {
		t.Errorf("SNAT map of another layout: NAT %v, error %v; want none and the reason", m.NAT(false), m.NATError(false))
	}
	if r, err := m.Replaced(); r || err != nil {
		t.Errorf("unchanged unusable SNAT map: Replaced %v, %v; want false", r, err)
	}
}

func TestSetNATChecks(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root for BPF maps")
	}
	ct, err := ebpf.NewMap(TCP4.Spec(64))
	if err != nil {
		t.Fatal(err)
	}
	defer ct.Close()
	m, err := FromMaps([NumKinds]*ebpf.Map{TCP4: ct})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.SetNAT(ct, nil); err == nil {
		t.Error("SetNAT took a CT map as the SNAT map")
	}
}
