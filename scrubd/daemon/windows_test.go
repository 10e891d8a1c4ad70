package daemon

import (
	"context"
	"encoding/json"
	"net/http"
	"net/netip"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/ctscrub/ctscrub/internal/testsupport/standin"
	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/owner"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// The windows of issue 34: sequences in which the delegate answered
// complete with a dead pod's entries left, or a scrub deleted a live pod's
// entries. Each test drives the real daemon over real CT maps; the pods
// scrubd never saw leave their entries in the maps only (unseenFlows).

// delegateAsk sends one delegate request for ip and returns its answer.
func delegateAsk(t *testing.T, sock, event string, ip netip.Addr) api.DelegateIP {
	t.Helper()
	b, _ := json.Marshal(map[string]any{"api_version": 1, "caller": "cilium-agent", "event": event,
		"endpoint_id": 7, "ips": []string{ip.String()}, "timeout_ms": 5000})
	status, body, err := delegatePost(sock, string(b))
	if err != nil || status != http.StatusOK {
		t.Fatalf("%s of %s: %d %s %v", event, ip, status, body, err)
	}
	var resp api.DelegateResponse
	if err := json.Unmarshal(body, &resp); err != nil || len(resp.IPs) != 1 {
		t.Fatalf("%s of %s: answer %s (%v)", event, ip, body, err)
	}
	return resp.IPs[0]
}

// checkAnswer fails the test when a complete answer left keys of the IP.
func checkAnswer(t *testing.T, root *ctRoot, what string, a api.DelegateIP, keys []ctmap.CTKey4) {
	t.Helper()
	if left := root.present4(t, keys); a.Complete && left != 0 {
		t.Errorf("%s: complete with %d of %d entries of a pod scrubd never saw left (%+v)", what, left, len(keys), a)
	}
}

// peerFlows are flows of a local pod peer towards ip, recorded on the
// peer's interface: indexed under ip too.
func peerFlows(peer, ip netip.Addr, n int) []ctmap.CTKey4 {
	out := make([]ctmap.CTKey4, 0, 2*n)
	for i := range n {
		k := ctmap.NewKey4(peer, ip, 8080, uint16(40000+i), ctmap.ProtoTCP, ctmap.FlagOut)
		out = append(out, k, k.Related())
	}
	return out
}

// Item 1: P1's DEL bypassed ctscrub, so scrubd still holds P1 active; P2,
// also unseen, got X. A GC listing P2 but not P1 drops P1. It must neither
// release X (P2's delete and P3's create would trust the index) nor delete
// P2's live flows with its local peers.
func TestGCDoesNotReleaseAnIPAnUnseenPodHolds(t *testing.T) {
	root := newCTRoot(t, 1<<16)
	td, sock := startDelegate(t, root)
	x, peer := mustAddr("10.244.5.10"), mustAddr("10.244.5.99")
	p1 := api.Attachment{ContainerID: "p1", IfName: "eth0"}
	if _, err := td.startPod(api.IndexedPod{Attachment: p1, IPs: []netip.Addr{x}, Since: time.Now(), Network: "pods"}); err != nil {
		t.Fatal(err)
	}
	indexFlows(td.Daemon, x, podFlows(x, 10))
	// P1's DEL ran without ctscrub (the conflist did not chain it), and P2
	// took X unseen.
	td.unseenOwner("test: the conflist did not chain ctscrub")
	p2 := unseenFlows(x)
	root.put4(t, p2)
	live := peerFlows(peer, x, 25)
	root.put4(t, live)
	indexFlows(td.Daemon, peer, live)

	status, e := rawPost(t, td.cfg.Socket, api.PathGC, `{"network":"pods","valid_attachments":[{"container_id":"p2","ifname":"eth0"}]}`)
	if status != http.StatusOK {
		t.Fatalf("gc: %d %+v", status, e)
	}
	if n := root.present4(t, live); n != len(live) {
		t.Errorf("the GC deleted %d live entries of P2 with its local peer", len(live)-n)
	}
	// P2's endpoint-delete, then P3's endpoint-create.
	checkAnswer(t, root, "P2's endpoint-delete", delegateAsk(t, sock, api.DelegateEventDelete, x), p2)
	root.put4(t, p2) // had P2's delete been wrong, P3 would inherit these
	checkAnswer(t, root, "P3's endpoint-create", delegateAsk(t, sock, api.DelegateEventCreate, x), p2)
}

// Item 2: P1 (seen) stopped and X released; a sign of an unseen owner; P2 is
// created unseen (its create sweeps) and opens flows; at P2's
// endpoint-delete P1's stopped record must not vouch for X.
func TestDelegateDeleteIgnoresStoppedHolders(t *testing.T) {
	root := newCTRoot(t, 1<<16)
	td, sock := startDelegate(t, root)
	x := mustAddr("10.244.5.20")
	ownedIP(t, td, root, x, "p1")()
	td.unseenOwner("test: the conflist was rewritten")
	if a := delegateAsk(t, sock, api.DelegateEventCreate, x); !a.Complete {
		t.Fatalf("P2's create: %+v, want complete (a sweep)", a)
	}
	p2 := podFlows(x, 50)
	root.put4(t, p2)
	checkAnswer(t, root, "P2's endpoint-delete", delegateAsk(t, sock, api.DelegateEventDelete, x), p2)
}

// Item 3: a pod created at a released X without ctscrub's ADD (the conflist
// watch missed the rewrite); its DEL also bypasses ctscrub. Its delete and
// the next create must not be answered from an index that never saw it.
func TestDelegateCreateWithoutIndexStartIsDistrusted(t *testing.T) {
	root := newCTRoot(t, 1<<16)
	td, sock := startDelegate(t, root)
	x := mustAddr("10.244.5.30")
	ownedIP(t, td, root, x, "p1")()
	if a := delegateAsk(t, sock, api.DelegateEventCreate, x); !a.Complete {
		t.Fatalf("P2's create: %+v, want complete", a)
	}
	// No index start: P2 runs outside ctscrub.
	p2 := podFlows(x, 50)
	root.put4(t, p2)
	checkAnswer(t, root, "P2's endpoint-delete", delegateAsk(t, sock, api.DelegateEventDelete, x), p2)
	root.put4(t, p2)
	checkAnswer(t, root, "P3's endpoint-create", delegateAsk(t, sock, api.DelegateEventCreate, x), p2)
	// The normal order still trusts the index: a create, then ctscrub's ADD
	// scrub and index start, then its DEL, then the delete.
	y := mustAddr("10.244.5.31")
	ownedIP(t, td, root, y, "q1")()
	if a := delegateAsk(t, sock, api.DelegateEventCreate, y); !a.Complete {
		t.Fatalf("Q2's create: %+v", a)
	}
	if r := addScrub(t, td, y, "q2"); r.Method != scrub.MethodIndex {
		t.Errorf("Q2's ADD after its trusted create: method %s, want index", r.Method)
	}
}

// Item 6: an unknown event is judged by the strictest rule: an IP an
// attachment holds, with entries the index lacks, is not answered complete
// from the index as a delete would be.
func TestDelegateUnknownEventIsStrict(t *testing.T) {
	root := newCTRoot(t, 1<<16)
	td, sock := startDelegate(t, root)
	x := mustAddr("10.244.5.40")
	ownedIP(t, td, root, x, "p1")
	extra := unseenFlows(x)
	root.put4(t, extra)
	checkAnswer(t, root, "an unknown event", delegateAsk(t, sock, "endpoint-regenerate", x), extra)
}

// Item 6: a delegate request must not take the answer of a flight whose
// index decision was made before the request's own ownership check. A
// flight that already deleted the index's keys (the backend returns only
// when released) is running when a sign of an unseen owner and the unseen
// pod's entries come; the delegate's delete must not share its answer.
func TestDelegateDoesNotJoinAnEarlierFlight(t *testing.T) {
	root := newCTRoot(t, 1<<16)
	gate := make(chan struct{})
	entered := make(chan struct{}, 1)
	cfg := testConfig(t, root)
	cfg.DelegateSocket = t.TempDir() + "/delegate/delegate.sock"
	cfg.CNIConfDir = chainedConfDir(t)
	td := startDaemonWith(t, cfg, func(d *Daemon) {
		for i, b := range d.backends {
			if b.Name() == "cilium" {
				d.backends[i] = &gatedBackend{Backend: b, gate: gate, entered: entered}
			}
		}
	}, true)
	sock := cfg.DelegateSocket
	x := mustAddr("10.244.5.50")
	ownedIP(t, td, root, x, "p1")
	done := make(chan error, 1)
	go func() {
		_, err := td.c.Scrub(context.Background(), api.ScrubRequest{IPs: []netip.Addr{x}, Reason: scrub.ReasonDel})
		done <- err
	}()
	<-entered // the operator's flight took and deleted X's indexed keys
	td.unseenOwner("test: a pod outside the chain")
	extra := unseenFlows(x)
	root.put4(t, extra)
	answer := make(chan api.DelegateIP, 1)
	go func() { answer <- delegateAsk(t, sock, api.DelegateEventDelete, x) }()
	time.Sleep(100 * time.Millisecond) // the request arrives while the flight runs
	close(gate)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	checkAnswer(t, root, "a delete during an earlier flight", <-answer, extra)
}

// gatedBackend runs the real backend's scrub, then tells entered and waits
// for gate before returning: its flight stays running after its decision.
type gatedBackend struct {
	scrub.Backend
	gate    chan struct{}
	entered chan struct{}
}

func (g *gatedBackend) Scrub(ctx context.Context, req scrub.Request) (scrub.Result, error) {
	res, err := g.Backend.Scrub(ctx, req)
	select {
	case g.entered <- struct{}{}:
	default:
	}
	<-g.gate
	return res, err
}

// Item 4: Cilium's service maps change, the recorder reloads, and its
// programs cannot be put back on a pod's interface: the pod keeps programs
// that read orphaned maps. Its IPs must stay incomplete through any number
// of sweeps (the sticky Unrecorded mark, as restore uses), not only until
// the next sweep makes them complete again.
func TestServiceMapsReattachFailureIsSticky(t *testing.T) {
	root, node, pod := standinPod(t, 1<<14)
	td := startDaemon(t, podConfig(t, root, node))
	ctx := context.Background()
	a := api.Attachment{ContainerID: "svcsticky", IfName: "eth0"}
	if err := td.c.IndexStart(ctx, api.IndexStartRequest{Attachment: a, Netns: pod.Path, IPs: []netip.Addr{pod.Addr4}, Network: "pods", Scrub: true}); err != nil {
		t.Fatalf("index start: %v", err)
	}
	// The interface is renamed under scrubd, so the re-attach fails.
	if err := recorder.InNetns(pod.Path, func() error {
		l, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		if err := netlink.LinkSetDown(l); err != nil {
			return err
		}
		return netlink.LinkSetName(l, "eth9")
	}); err != nil {
		t.Fatal(err)
	}
	if err := standin.RecreateServiceMap4(root.dir); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "scrubd to notice the re-created service map", func() bool {
		return counterValue(t, td, "ctscrub_service_maps_reloaded_total", nil) == 1
	})
	if _, err := td.c.Scrub(ctx, api.ScrubRequest{IPs: []netip.Addr{pod.Addr4}, Reason: scrub.ReasonDel}); err != nil {
		t.Fatal(err)
	}
	if st := td.Index().State(pod.Addr4); st.Complete {
		t.Errorf("%s after the failed re-attach and a sweep: complete; want incomplete while no program records it", pod.Addr4)
	}
}

// releaseIP releases ip as an indexed attachment's completed DEL does.
func releaseIP(d *Daemon, ip netip.Addr) {
	a := api.Attachment{ContainerID: "released-" + ip.String(), IfName: "eth0"}
	d.own.Start(a, []netip.Addr{ip})
	d.own.Begin(owner.Del, a, []netip.Addr{ip}).End(true)
	d.own.Stop(a)
}

// Item 6: the deadline is the agent's, not the request's arrival plus
// timeout_ms: a request read after the agent's own deadline (it queued in
// the socket, the agent has walked already) is not answered, and nothing of
// it runs; one with a deadline close ahead is answered by then.
func TestDelegateHonoursAgentDeadline(t *testing.T) {
	root := newCTRoot(t, 1<<20)
	root.put4(t, background(1<<19))
	_, sock := startDelegate(t, root)
	ask := func(deadline time.Time) (int, []byte, error, time.Duration) {
		b, _ := json.Marshal(map[string]any{"api_version": 1, "caller": "cilium-agent", "event": api.DelegateEventCreate,
			"endpoint_id": 9, "ips": []string{"10.244.9.10"}, "timeout_ms": 5000, "deadline_unix_ms": deadline.UnixMilli()})
		start := time.Now()
		status, body, err := delegatePost(sock, string(b))
		return status, body, err, time.Since(start)
	}
	if status, body, err, _ := ask(time.Now().Add(-time.Second)); err == nil {
		t.Errorf("a request past the agent's deadline was answered: %d %s", status, body)
	}
	deadline := time.Now().Add(30 * time.Millisecond)
	status, body, err, took := ask(deadline)
	if err == nil {
		var resp api.DelegateResponse
		if status != http.StatusOK || json.Unmarshal(body, &resp) != nil || len(resp.IPs) != 1 {
			t.Fatalf("%d %s", status, body)
		}
		if resp.IPs[0].Complete && time.Now().After(deadline.Add(200*time.Millisecond)) {
			t.Errorf("answered complete %v after the agent's deadline", time.Since(deadline))
		}
	}
	if took > time.Second {
		t.Errorf("the request with a deadline 30 ms ahead took %v (timeout_ms 5000 ruled, not the agent's deadline)", took)
	}
}
