package nfct_test

import (
	"context"
	"fmt"
	"log"
	"net/netip"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/nfct"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// A node daemon watches the host's table for the node's pod range and
// scrubs a released pod IP.
func Example() {
	n, err := nfct.New(nfct.Config{
		PodCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.3.0/24")},
	})
	if err != nil {
		log.Fatal(err) // e.g. no CAP_NET_ADMIN, or nf_conntrack_events=0
	}
	defer n.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := n.Scrub(ctx, scrub.Request{IPs: []netip.Addr{netip.MustParseAddr("10.244.3.17")}, Reason: scrub.ReasonDel})
	if err != nil {
		log.Fatal(err)
	}
	// Method is "index" (deleted by tuple) unless events were lost since the
	// last re-seed, then "sweep" (filtered flush or dump).
	fmt.Println(res.Method, res.Deleted[nfct.MapName], res.Outcome)
}
