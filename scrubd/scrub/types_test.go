package scrub

import (
	"errors"
	"net/netip"
	"testing"
)

func TestCheckIPs(t *testing.T) {
	got, err := CheckIPs([]netip.Addr{
		netip.MustParseAddr("10.0.0.1"),
		netip.MustParseAddr("::ffff:10.0.0.1"), // the same IP, mapped
		netip.MustParseAddr("fd00::1"),
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0] != netip.MustParseAddr("10.0.0.1") || got[1] != netip.MustParseAddr("fd00::1") {
		t.Fatalf("CheckIPs = %v, want the IPv4 address once, unmapped, and the IPv6 one", got)
	}
	for name, ips := range map[string][]netip.Addr{
		"none":        nil,
		"zero value":  {{}},
		"0.0.0.0":     {netip.IPv4Unspecified()},
		"::":          {netip.IPv6Unspecified()},
		"with a zone": {netip.MustParseAddr("fe80::1%eth0")},
	} {
		if _, err := CheckIPs(ips); !errors.Is(err, ErrBadRequest) {
			t.Errorf("%s: err %v, want ErrBadRequest", name, err)
		}
	}
}
