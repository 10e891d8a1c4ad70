package main

import (
	"fmt"
	"io"

	"github.com/ctscrub/ctscrub/internal/netnsnode"
)

type printer struct{ w io.Writer }

func (p *printer) f(format string, a ...any) { fmt.Fprintf(p.w, format, a...) }

func (p *printer) section(title string) { fmt.Fprintf(p.w, "\n== %s ==\n", title) }

func (p *printer) header(cfg Config, pods int) {
	mode := ""
	if cfg.Short {
		mode = " (short mode, DEMO_SHORT=1)"
	}
	p.f("ctscrub demo%s: one Kubernetes-like node on this machine\n", mode)
	p.f("  - Cilium-layout CT maps with %s entries (ENTRIES), in a private bpffs dir (%s), never Cilium's own\n", netnsnode.Num(cfg.Entries), netnsnode.BPFDir)
	p.f("  - scrubd, the node daemon, on those maps\n")
	p.f("  - a node = a network namespace; %d pods = network namespaces attached to it through the real\n", pods)
	p.f("    CNI chain: bridge + host-local + ctscrub\n")
	p.f("  - real TCP/UDP/ICMP traffic, v4 and v6; a stand-in for Cilium's datapath (test support) turns it into CT entries\n")
	p.f("  - pods deleted and recreated so host-local hands their IPs out again; each scrub printed beside\n")
	p.f("    one full walk of the same maps, the way Cilium scrubs an IP\n")
	p.f("  Everything is removed at the end, also on Ctrl-C.\n")
}
