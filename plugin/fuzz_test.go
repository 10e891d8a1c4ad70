package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"slices"
	"testing"

	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"
)

// FuzzPrevResult wraps an arbitrary prevResult in a valid config at each
// cniVersion and runs what ADD and DEL do with it (parseConfig, then
// prevResultAddrs): no input may panic; a refusal is a code-7 error; an
// accepted one yields only valid, unmapped, distinct IPs, and ADD's output
// (prevResult converted to the config's version) does not panic either.
// The plugin reads prevResult itself (config.go, prevSeen); the CNI
// library's reading of the same input is the reference: whatever both
// accept must give the same IPs and interface, and the plugin refuses
// nothing the library accepts.
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
		libIPs, libIf, libErr := libraryAddrs(ver, prev, "eth0")
		c, err := parseConfig(conf)
		if err != nil && libErr == nil && json.Valid(prev) {
			t.Fatalf("refused %s (%v), which the CNI library reads as IPs %v on %q", prev, err, libIPs, libIf)
		}
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
		if c.HasPrevResult() && ifname == "" {
			t.Fatal("no interface name chosen")
		}
		if libErr == nil && c.HasPrevResult() && (!slices.Equal(ips, libIPs) || ifname != libIf) {
			t.Fatalf("%s: IPs %v on %q; the CNI library reads %v on %q", prev, ips, ifname, libIPs, libIf)
		}
		seen := map[netip.Addr]bool{}
		for _, ip := range ips {
			if !ip.IsValid() || ip.Is4In6() || seen[ip] {
				t.Fatalf("IPs %v: invalid, mapped or repeated", ips)
			}
			seen[ip] = true
		}
		if c.HasPrevResult() {
			if err := printPrevResult(c); err != nil {
				var e *types.Error
				if !errors.As(err, &e) || e.Code != types.ErrInvalidNetworkConfig {
					t.Fatalf("printing prevResult: %v is not a CNI invalid-config error", err)
				}
			}
		}
	})
}

// libraryAddrs is the pod's IPs and interface as read through the CNI
// library's types (what the plugin did before it read prevResult itself).
func libraryAddrs(ver string, prev []byte, ifname string) (ips []netip.Addr, name string, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("library panicked: %v", p)
		}
	}()
	nc := types.NetConf{CNIVersion: ver}
	if err := json.Unmarshal(prev, &nc.RawPrevResult); err != nil {
		return nil, "", err
	}
	if nc.RawPrevResult == nil {
		return nil, "", errors.New("no prevResult")
	}
	if err := version.ParsePrevResult(&nc); err != nil {
		return nil, "", err
	}
	r, err := current.NewResultFromResult(nc.PrevResult)
	if err != nil {
		return nil, "", err
	}
	sandbox := map[int]bool{}
	chosen := -1
	for i, in := range r.Interfaces {
		if in == nil || in.Sandbox == "" {
			continue
		}
		sandbox[i] = true
		if chosen < 0 || (in.Name == ifname && r.Interfaces[chosen].Name != ifname) {
			chosen = i
		}
	}
	name = ifname
	if chosen >= 0 && r.Interfaces[chosen].Name != "" {
		name = r.Interfaces[chosen].Name
	}
	for _, ipc := range r.IPs {
		if ipc == nil || (ipc.Interface != nil && len(sandbox) > 0 && !sandbox[*ipc.Interface]) {
			continue
		}
		if a, ok := netip.AddrFromSlice(ipc.Address.IP); ok && !slices.Contains(ips, a.Unmap()) {
			ips = append(ips, a.Unmap())
		}
	}
	return ips, name, nil
}
