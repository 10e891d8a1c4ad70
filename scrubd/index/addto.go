package index

import (
	"net/netip"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// AddTo4 is Add4 under one of the key's addresses only: the recorder's
// record of a forged source files the key under its receiver and never
// under the address the sender claimed. Nothing when ip is not in the key
// or not in the pod CIDRs.
func (ix *Index) AddTo4(ip netip.Addr, k ctmap.CTKey4) {
	if !ix.Owns(ip) || (k.DAddr() != ip && k.SAddr() != ip) {
		return
	}
	e := ix.entry(ip, true)
	e.mu.Lock()
	if e.size() >= ix.cfg.MaxKeysPerIP && !e.has4(&k) {
		ix.markLocked(e, ReasonFull)
	} else if e.add4(&k) {
		ix.keys.Add(1)
	}
	e.mu.Unlock()
}

// AddTo6 is AddTo4 for IPv6 keys.
func (ix *Index) AddTo6(ip netip.Addr, k ctmap.CTKey6) {
	if !ix.Owns(ip) || (k.DAddr() != ip && k.SAddr() != ip) {
		return
	}
	e := ix.entry(ip, true)
	e.mu.Lock()
	if e.size() >= ix.cfg.MaxKeysPerIP && !e.has6(&k) {
		ix.markLocked(e, ReasonFull)
	} else if e.add6(&k) {
		ix.keys.Add(1)
	}
	e.mu.Unlock()
}
