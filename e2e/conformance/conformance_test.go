package conformance

import (
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/cilium"
)

// versionsToRun: CONFORMANCE_VERSIONS (comma-separated, "all" = Versions),
// default the versions `make test` runs.
func versionsToRun() []string {
	v := os.Getenv("CONFORMANCE_VERSIONS")
	switch v {
	case "", "default":
		return DefaultVersions
	case "all":
		return Versions
	}
	return strings.Split(v, ",")
}

// DefaultVersions run in `make test` (their build fits CI's time).
var DefaultVersions = []string{"v1.16.5", "v1.20.2"}

func requireRoot(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (BPF_PROG_TEST_RUN of Cilium's programs, bpffs)")
	}
}

func TestConformance(t *testing.T) {
	requireRoot(t)
	if _, err := exec.LookPath(Clang); err != nil {
		t.Skipf("%s not found (scripts/setup.sh installs it): Cilium's programs cannot be built", Clang)
	}
	// A scrub reads the routable services' backends as they are at that
	// moment (the daemon reuses a reading for up to a second).
	cilium.RoutableTTL = 0
	for _, v := range versionsToRun() {
		t.Run(v, func(t *testing.T) {
			start := time.Now()
			o, err := Build(v)
			if err != nil {
				t.Fatal(err)
			}
			built := time.Since(start)
			var nodes [numNodeConfigs]*Node
			for nc := range nodes {
				nodes[nc] = NewNode(t, o, NodeConfig(nc))
			}
			seq := 0
			ran := 0
			for _, fam := range []string{"IPv4", "IPv6"} {
				for _, c := range Cases {
					t.Run(fam+"/"+c.Name, func(t *testing.T) {
						n := nodes[c.Node]
						n.t = t
						e := &Env{N: n, V6: fam == "IPv6", seq: &seq, Fail: t.Errorf}
						n.SetNodeConfig(c.Defines)
						defer n.SetNodeConfig(nil)
						pods, reasons := c.Run(e)
						misses, wrong, entries := n.Check(pods, reasons...)
						var ips []string
						for _, p := range pods {
							ips = append(ips, e.IP(p).String())
						}
						switch {
						case c.NoEntries != "" && entries != 0:
							t.Errorf("Cilium created %d CT entries holding %v; the case expects none (%s)", entries, ips, c.NoEntries)
						case c.NoEntries != "":
							for _, ip := range ips {
								if st := n.Ix.State(netip.MustParseAddr(ip)); !st.Complete {
									t.Errorf("%s: state %+v, want complete (%s)", ip, st, c.NoEntries)
								}
							}
						case entries == 0:
							t.Errorf("Cilium created no CT entry holding %v: the case tests nothing", ips)
						}
						for _, m := range misses {
							t.Errorf("MISS %s", m)
						}
						for _, w := range wrong {
							t.Errorf("wrong reason: %s", w)
						}
						if c.After != nil {
							c.After(e, pods)
						}
						if c.Marks != "" {
							for _, ip := range ips {
								if st := n.Ix.State(netip.MustParseAddr(ip)); st.Incomplete != c.Marks {
									t.Errorf("%s: state %+v, want incomplete (%s)", ip, st, c.Marks)
								}
							}
						}
						if c.NotStandin == "" {
							oc, osi := n.CompareStandin(pods)
							for _, k := range oc {
								t.Errorf("STANDIN lacks Cilium's %s", k)
							}
							for _, k := range osi {
								t.Errorf("STANDIN has %s, Cilium does not", k)
							}
						}
						if t.Failed() || os.Getenv("CONFORMANCE_DUMP") != "" {
							t.Logf("drop counters so far: %v", n.Drops())
							for _, p := range pods {
								t.Logf("%s %s: %+v", p.Name, e.IP(p), n.Ix.State(e.IP(p)))
								for _, k := range n.Dump(e.IP(p)) {
									t.Logf("  cilium: %s", k)
								}
							}
						}
						ran++
					})
				}
			}
			t.Logf("cilium %s: %d cases, build %v (cached objects: %v), run %v", v, ran, o.BuildTime, o.BuildTime == 0, time.Since(start)-built)
		})
	}
}
