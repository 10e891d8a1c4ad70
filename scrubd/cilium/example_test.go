package cilium_test

import (
	"context"
	"fmt"
	"log"
	"net/netip"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/cilium"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// Scrub one pod IP out of Cilium's CT maps with a deadline, as the daemon
// does for a CNI DEL. (Needs root and Cilium's pinned maps; not run by go test.)
func ExampleBackend_Scrub() {
	maps, err := ctmap.Open(ctmap.DefaultRoot)
	if err != nil {
		log.Fatal(err) // e.g. "... cilium_ct4_global: open CT map: file does not exist (is Cilium running ...?)"
	}
	defer maps.Close()
	ix := index.New(index.Config{PodCIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}})
	c, err := cilium.New(maps, ix, cilium.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := c.Scrub(ctx, scrub.Request{IPs: []netip.Addr{netip.MustParseAddr("10.0.1.23")}, Reason: scrub.ReasonDel})
	if err != nil {
		log.Printf("scrub %s: %v (deleted %d so far)", res.Outcome, err, res.Total)
		return
	}
	// An IP the index has not tracked since the daemon started takes the
	// sweep; later scrubs of it use the index.
	fmt.Println(res.Method, res.Total, res.Deleted[ctmap.TCP4.Name()])
}
