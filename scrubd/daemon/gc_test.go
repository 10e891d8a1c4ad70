package daemon

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"testing"

	"github.com/ctscrub/ctscrub/internal/testsupport/netpods"
	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// rawPost sends body to path on the daemon's socket as is (fields missing or
// empty, which the typed client cannot send), and returns the status and the
// decoded error (nil on 2xx).
func rawPost(t *testing.T, socket, path, body string) (int, *api.Error) {
	t.Helper()
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", socket)
	}}}
	resp, err := hc.Post("http://scrubd"+path, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatalf("POST %s: %v", path, err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	if resp.StatusCode/100 == 2 {
		return resp.StatusCode, nil
	}
	var e api.Error
	if err := json.Unmarshal(data, &e); err != nil {
		t.Fatalf("POST %s: %d %q is not an api.Error", path, resp.StatusCode, data)
	}
	return resp.StatusCode, &e
}

// A GC speaks for one network and must name what stays. Before GC was
// scoped, `{"valid_attachments":[]}` (or no list) dropped and scrubbed every
// pod of the node, and a GC for one network dropped every other network's
// pods. Three real pods (netns + veth, recorder attached through index
// start), two in network "a", one in "b", each with CT entries:
//   - empty list, missing list, missing network: refused, nothing dropped,
//     every entry kept;
//   - GC of "a" listing a1: a2 dropped and scrubbed; b1 (network "b") and
//     a1 kept with their entries.
func TestGCRefusedWhenUnscopedAndScopedByNetwork(t *testing.T) {
	root, _ := standinRoot(t, 1<<16)
	node := netpods.NewNode(t)
	type member struct {
		a       api.Attachment
		network string
		pod     *netpods.Pod
		keys    []ctmap.CTKey4
	}
	ms := []*member{
		{a: api.Attachment{ContainerID: "a1", IfName: "eth0"}, network: "a"},
		{a: api.Attachment{ContainerID: "a2", IfName: "eth0"}, network: "a"},
		{a: api.Attachment{ContainerID: "b1", IfName: "eth0"}, network: "b"},
	}
	td := startDaemon(t, podConfig(t, root, node))
	ctx := context.Background()
	for _, m := range ms {
		m.pod = node.AddPod()
		if err := td.c.IndexStart(ctx, api.IndexStartRequest{Attachment: m.a, Netns: m.pod.Path, IPs: []netip.Addr{m.pod.Addr4}, Network: m.network}); err != nil {
			t.Fatalf("index start %s: %v", m.a.ContainerID, err)
		}
		m.keys = podFlows(m.pod.Addr4, 50)
		root.put4(t, m.keys)
	}
	indexed := func() map[string]bool {
		l, err := td.c.IndexList(ctx)
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]bool{}
		for _, p := range l.Pods {
			out[p.ContainerID] = true
		}
		return out
	}
	for _, tc := range []struct{ name, body, want string }{
		{"empty list", `{"network":"a","valid_attachments":[]}`, `has no "valid_attachments"`},
		{"no list", `{"network":"a"}`, `has no "valid_attachments"`},
		{"null list", `{"network":"a","valid_attachments":null}`, `has no "valid_attachments"`},
		{"no network", `{"valid_attachments":[{"container_id":"a1","ifname":"eth0"}]}`, `has no "network"`},
		{"attachment without ifname", `{"network":"a","valid_attachments":[{"container_id":"a1"}]}`, `lacks container_id or ifname`},
	} {
		status, e := rawPost(t, td.cfg.Socket, api.PathGC, tc.body)
		if status != http.StatusBadRequest || e == nil || e.Code != api.CodeBadRequest || !strings.Contains(e.Message, tc.want) {
			t.Errorf("GC %s: status %d, error %+v; want 400 bad_request mentioning %q", tc.name, status, e, tc.want)
		}
		if got := indexed(); len(got) != 3 {
			t.Fatalf("GC %s dropped attachments: indexed now %v", tc.name, got)
		}
		for _, m := range ms {
			if n := root.present4(t, m.keys); n != len(m.keys) {
				t.Fatalf("GC %s deleted %d CT entries of %s", tc.name, len(m.keys)-n, m.a.ContainerID)
			}
		}
	}

	gc, err := td.c.GC(ctx, "a", []api.Attachment{ms[0].a})
	if err != nil {
		t.Fatalf("GC of network a: %v", err)
	}
	if len(gc.Dropped) != 1 || gc.Dropped[0] != ms[1].a {
		t.Errorf("GC of network a dropped %v, want only a2", gc.Dropped)
	}
	if got := indexed(); !got["a1"] || got["a2"] || !got["b1"] {
		t.Errorf("indexed after the GC of a: %v, want a1 and b1", got)
	}
	for i, m := range ms {
		want := len(m.keys)
		if i == 1 {
			want = 0
		}
		if n := root.present4(t, m.keys); n != want {
			t.Errorf("%s: %d of %d CT entries left after the GC of a, want %d", m.a.ContainerID, n, len(m.keys), want)
		}
	}
}

// A GC decides from one listing which IPs to scrub; an ADD of one of them
// after that listing gives it a new owner whose entries are live. Before the
// GC re-checked ownership per IP under the backend's scrub lock, it deleted
// the new pod's entries and then released the IP (its next ADD would trust
// the index). Deterministic: the test holds the only run slot, so the GC's
// scrub waits, listed and decided, while the ADD runs; then lets it go.
func TestGCLeavesIPAnAddTookAlone(t *testing.T) {
	root, _ := standinRoot(t, 1<<16)
	node := netpods.NewNode(t)
	pod := node.AddPod()
	cfg := podConfig(t, root, node)
	cfg.MaxInFlight = 1
	td := startDaemon(t, cfg)
	ctx := context.Background()
	ip := pod.Addr4
	old := api.Attachment{ContainerID: "old", IfName: "eth0"}
	if err := td.c.IndexStart(ctx, api.IndexStartRequest{Attachment: old, Netns: pod.Path, IPs: []netip.Addr{ip}, Network: "n"}); err != nil {
		t.Fatalf("index start of the old pod: %v", err)
	}
	root.put4(t, podFlows(ip, 20))

	td.slots <- struct{}{} // the GC's flight queues behind it
	type answer struct {
		resp *api.GCResponse
		err  error
	}
	gcDone := make(chan answer, 1)
	go func() {
		r, err := td.c.GC(ctx, "n", []api.Attachment{{ContainerID: "other", IfName: "eth0"}})
		gcDone <- answer{r, err}
	}()
	waitFor(t, "the GC's scrub to queue", func() bool { return td.flights.running() == 1 })

	// The ADD of a new pod with the same IP, in the same namespace, and its
	// live flows.
	add := api.Attachment{ContainerID: "new", IfName: "eth0"}
	if err := td.c.IndexStart(ctx, api.IndexStartRequest{Attachment: add, Netns: pod.Path, IPs: []netip.Addr{ip}, Network: "n"}); err != nil {
		t.Fatalf("index start of the new pod: %v", err)
	}
	live := make([]ctmap.CTKey4, 0, 20)
	for i := range 10 {
		k := ctmap.NewKey4(ip, netip.AddrFrom4([4]byte{198, 51, 100, byte(i)}), 443, uint16(40000+i), ctmap.ProtoTCP, ctmap.FlagOut)
		live = append(live, k, k.Related())
	}
	root.put4(t, live)
	<-td.slots

	a := <-gcDone
	if a.err != nil {
		t.Fatalf("GC: %v", a.err)
	}
	if len(a.resp.Dropped) != 1 || a.resp.Dropped[0] != old {
		t.Errorf("GC dropped %v, want only the old pod", a.resp.Dropped)
	}
	if n := root.present4(t, live); n != len(live) {
		t.Errorf("the GC deleted %d of the new pod's %d live entries", len(live)-n, len(live))
	}
	if _, ok := td.own.Released(ip); ok {
		t.Errorf("the GC released %s, which the new pod owns", ip)
	}
	if len(a.resp.Skipped) != 1 || a.resp.Skipped[0] != ip {
		t.Errorf("GC skipped %v, want [%s]", a.resp.Skipped, ip)
	}
}
