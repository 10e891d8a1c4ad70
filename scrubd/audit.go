package main

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/client"
)

// cliAudit is `scrubd audit`: an on-demand audit of pod IPs (one read-only
// pass over the CT maps in the kernel, compared with the index), and the
// continuous audit's recent misses.
func cliAudit(args []string) error {
	fs, socket, timeout, asJSON := cliFlags("audit")
	var ips multiFlag
	fs.Var(&ips, "ip", "pod IP to audit (repeatable, or comma-separated)")
	if err := parseCLI(fs, args); err != nil {
		return err
	}
	var addrs []netip.Addr
	for _, s := range ips {
		for _, p := range strings.Split(s, ",") {
			ip, err := netip.ParseAddr(strings.TrimSpace(p))
			if err != nil {
				return fmt.Errorf("--ip %q: %v", p, err)
			}
			addrs = append(addrs, ip)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	resp, err := client.New(*socket).Audit(ctx, addrs)
	if err != nil {
		return err
	}
	var missing error
	if resp.Missing > 0 {
		missing = fmt.Errorf("%d CT keys of complete IPs are missing from the index (the IPs' next scrub would leave them)", resp.Missing)
	}
	if *asJSON {
		printJSON(resp)
		return missing
	}
	for _, a := range resp.IPs {
		fmt.Printf("%s: %s", a.IP, a.Verdict)
		if a.Incomplete != "" {
			fmt.Printf(" (%s: next scrub sweeps)", a.Incomplete)
		}
		if a.Owner != nil {
			fmt.Printf(", pod %s/%s", a.Owner.ContainerID, a.Owner.IfName)
		} else {
			fmt.Print(", no owner")
		}
		fmt.Printf("; in the kernel %d, indexed %d, missing %d, extra (stale) %d\n", len(a.Found), len(a.Indexed), len(a.Missing), len(a.Extra))
		printKeys("found", a.Found)
		printKeys("indexed", a.Indexed)
		printKeys("MISSING", a.Missing)
		printKeys("extra", a.Extra)
	}
	if len(addrs) == 0 || len(resp.Recent) > 0 {
		fmt.Printf("recent misses of the continuous audit: %d\n", len(resp.Recent))
		for _, m := range resp.Recent {
			fmt.Printf("  %s %s %s %s\n", m.At.Format(time.RFC3339), m.IP, m.Map, m.Key)
		}
	}
	return missing
}

func printKeys(what string, keys []api.AuditKey) {
	for _, k := range keys {
		fmt.Printf("  %-8s %-22s %s\n", what, k.Map, k.Key)
	}
}
