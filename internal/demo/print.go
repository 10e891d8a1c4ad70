package demo

import (
	"fmt"
	"io"
	"strings"
	"time"
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
	p.f("  - Cilium-layout CT maps with %s entries (ENTRIES), in a private bpffs dir (%s), never Cilium's own\n", num(cfg.Entries), BPFDir)
	p.f("  - scrubd, the node daemon, on those maps\n")
	p.f("  - a node = a network namespace; %d pods = network namespaces attached to it through the real\n", pods)
	p.f("    CNI chain: bridge + host-local + ctscrub\n")
	p.f("  - real TCP/UDP/ICMP traffic, v4 and v6; a stand-in for Cilium's datapath (test support) turns it into CT entries\n")
	p.f("  - pods deleted and recreated so host-local hands their IPs out again; each scrub printed beside\n")
	p.f("    one full walk of the same maps, the way Cilium scrubs an IP\n")
	p.f("  Everything is removed at the end, also on Ctrl-C.\n")
}

// num writes n with thousands separators.
func num(n int) string {
	s := fmt.Sprint(n)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}

// dur writes d with three significant digits in a unit a reader compares
// easily: µs, ms or s.
func dur(d time.Duration) string {
	switch {
	case d < time.Millisecond:
		return fmt.Sprintf("%.0f µs", float64(d)/float64(time.Microsecond))
	case d < 10*time.Millisecond:
		return fmt.Sprintf("%.2f ms", float64(d)/float64(time.Millisecond))
	case d < time.Second:
		return fmt.Sprintf("%.1f ms", float64(d)/float64(time.Millisecond))
	default:
		return fmt.Sprintf("%.2f s", d.Seconds())
	}
}
