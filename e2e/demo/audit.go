package main

import (
	"context"
	"fmt"
	"net/netip"
)

// auditResult is the end-of-run audit for the RESULT line.
type auditResult struct {
	IPs     int
	Missing int
}

// audit asks scrubd to audit every pod IP at the end of the run: one
// read-only pass over the CT maps, each IP's keys compared with the index.
// A key of a complete IP that the index does not cover is one its next scrub
// would leave behind.
func (s *session) audit(ctx context.Context) (auditResult, error) {
	list, err := s.d.Client.IndexList(ctx)
	if err != nil {
		return auditResult{}, fmt.Errorf("audit: list the indexed pods: %w", err)
	}
	var ips []netip.Addr
	for _, pd := range list.Pods {
		ips = append(ips, pd.IPs...)
	}
	s.p.section("7. The audit: every pod IP's CT entries in the kernel against the index")
	resp, err := s.d.Client.Audit(ctx, ips)
	if err != nil {
		return auditResult{}, fmt.Errorf("audit: %w", err)
	}
	res := auditResult{IPs: len(resp.IPs), Missing: resp.Missing}
	for _, a := range resp.IPs {
		s.p.f("   %-24s %-10s %6d in the kernel, %6d indexed, %d missing\n", a.IP, a.Verdict, len(a.Found), len(a.Indexed), len(a.Missing))
		for _, k := range a.Missing {
			s.p.f("      MISSING %s %s\n", k.Map, k.Key)
		}
	}
	s.p.f("audit: %d IPs audited, %d keys missing\n", res.IPs, res.Missing)
	return res, nil
}
