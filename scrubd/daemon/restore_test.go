package daemon

import (
	"context"
	"net/netip"
	"testing"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// A pod restored at start that the recorder cannot re-attach to (here its
// interface is gone while its namespace stays) is not recorded: its IPs must
// sweep. Before restore() failed closed it only logged the failed attach,
// and after a clean restart the IPs stayed complete from the snapshot.
func TestRestoreFailsClosedWhenReattachFails(t *testing.T) {
	root, node, pod := standinPod(t, 1<<16)
	cfg := podConfig(t, root, node)
	ctx := context.Background()
	ip := pod.Addr4
	first := startDaemon(t, cfg)
	a := api.Attachment{ContainerID: "restored", IfName: "eth0"}
	if err := first.c.IndexStart(ctx, api.IndexStartRequest{Attachment: a, Netns: pod.Path, IPs: []netip.Addr{ip}}); err != nil {
		t.Fatal(err)
	}
	if _, err := first.c.Scrub(ctx, api.ScrubRequest{IPs: []netip.Addr{ip}, Reason: scrub.ReasonAdd}); err != nil {
		t.Fatal(err)
	}
	if st := first.Index().State(ip); !st.Complete {
		t.Fatalf("%s after its ADD scrub: %+v, want complete", ip, st)
	}
	first.stop() // a clean stop: the snapshot keeps the IP complete
	removeInterface(t, node, pod)

	second := startDaemon(t, cfg)
	if st := second.Index().State(ip); st.Complete || st.Incomplete != reasonNotReattached {
		t.Errorf("%s of a pod the recorder could not re-attach to: %+v, want incomplete (%s)", ip, st, reasonNotReattached)
	}
	// A sweep does not make it complete: nothing records the pod's flows
	// after it, so its next scrub must sweep again.
	resp, err := second.c.Scrub(ctx, api.ScrubRequest{IPs: []netip.Addr{ip}, Reason: scrub.ReasonAdd})
	if err != nil {
		t.Fatal(err)
	}
	if r := resp.Results[0]; r.PerIP[ip.String()] != scrub.MethodSweep || r.SweptWhy[ip.String()] != reasonNotReattached {
		t.Errorf("scrub of the unrecorded pod's IP: %+v, want a sweep because %q", r, reasonNotReattached)
	}
	if st := second.Index().State(ip); st.Complete || st.Incomplete != reasonNotReattached {
		t.Errorf("%s after a sweep, its pod still unrecorded: %+v, want incomplete (%s)", ip, st, reasonNotReattached)
	}
}
