package main

import (
	"encoding/json"
	"errors"
	"io"
	"net/netip"
	"testing"

	"github.com/containernetworking/cni/pkg/types"
)

// FuzzPrevResult wraps an arbitrary prevResult in a valid config at each
// cniVersion and runs what ADD and DEL do with it (parseConfig, then
// prevResultAddrs): no input may panic; a refusal is a code-7 error; an
// accepted one yields only valid, unmapped, distinct IPs, and ADD's output
// (prevResult converted to the config's version) does not panic either.
func FuzzPrevResult(f *testing.F) {
	for _, v := range allVersions {
		b, _ := json.Marshal(prevResult(v))
		f.Add(uint8(len(v)), b)
	}
	f.Add(uint8(0), []byte(`{"cniVersion":"1.0.0","ips":[{"address":"::ffff:10.1.0.2/120","interface":7}]}`))
	f.Add(uint8(1), []byte(`{"cniVersion":"0.4.0","interfaces":[null],"ips":[null,{"version":"4","address":"10.1.0.2/24","interface":-1}]}`))
	f.Add(uint8(2), []byte(`{"cniVersion":"9.9.9"}`))
	f.Add(uint8(3), []byte(`[]`))
	out := stdout
	stdout = io.Discard // ADD's output of every input
	f.Cleanup(func() { stdout = out })
	f.Fuzz(func(t *testing.T, which uint8, prev []byte) {
		ver := allVersions[int(which)%len(allVersions)]
		conf := append([]byte(`{"cniVersion":"`+ver+`","name":"pods","type":"ctscrub","prevResult":`), prev...)
		conf = append(conf, '}')
		c, err := parseConfig(conf)
		if err != nil {
			var e *types.Error
			if !errors.As(err, &e) || e.Code != types.ErrInvalidNetworkConfig || e.Msg == "" {
				t.Fatalf("error %v (%T) is not a CNI invalid-config error", err, err)
			}
			return
		}
		ips, ifname, err := prevResultAddrs(c, "eth0")
		if err != nil {
			var e *types.Error
			if !errors.As(err, &e) || e.Code != types.ErrInvalidNetworkConfig {
				t.Fatalf("prevResult error %v is not a CNI invalid-config error", err)
			}
			return
		}
		if c.PrevResult != nil && ifname == "" {
			t.Fatal("no interface name chosen")
		}
		seen := map[netip.Addr]bool{}
		for _, ip := range ips {
			if !ip.IsValid() || ip.Is4In6() || seen[ip] {
				t.Fatalf("IPs %v: invalid, mapped or repeated", ips)
			}
			seen[ip] = true
		}
		if c.PrevResult != nil {
			if err := printPrevResult(c); err != nil {
				var e *types.Error
				if !errors.As(err, &e) || e.Code != types.ErrInvalidNetworkConfig {
					t.Fatalf("printing prevResult: %v is not a CNI invalid-config error", err)
				}
			}
		}
	})
}
