package daemon

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"sync"
	"testing"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// guardBackend records every IP a request got through to a backend; the fuzz
// target checks none of them is one the daemon must refuse. It deletes
// nothing: the target exercises the API's decoding and checks, not the CT
// backends (their own tests run them on real maps).
type guardBackend struct {
	mu  sync.Mutex
	ips []netip.Addr
}

func (g *guardBackend) Name() string { return "guard" }
func (g *guardBackend) Close() error { return nil }
func (g *guardBackend) Scrub(_ context.Context, req scrub.Request) (scrub.Result, error) {
	g.mu.Lock()
	g.ips = append(g.ips, req.IPs...)
	g.mu.Unlock()
	return scrub.Result{Backend: "guard", Method: scrub.MethodIndex, Outcome: scrub.Complete, Deleted: map[string]int{}}, nil
}

var fuzzPaths = []struct{ method, path string }{
	{"POST", api.PathScrub},
	{"POST", api.PathIndexStart},
	{"POST", api.PathIndexStop},
	{"POST", api.PathGC},
	{"GET", api.PathIndexIP},
	{"GET", api.PathIndexPod},
	{"GET", api.PathIndexList},
	{"GET", api.PathStatus},
}

// FuzzAPI sends arbitrary bodies, query strings and deadline headers to every
// path of the daemon's API handler, with one attachment already indexed. No
// input may panic; every answer is JSON (an api.Error with a known code
// unless 2xx); no IP outside the pod CIDRs (or unspecified, loopback,
// link-local, multicast, zoned, the host's own) reaches a backend; a GC is
// served only for a named network with a non-empty list, and never drops an
// attachment of another network.
func FuzzAPI(f *testing.F) {
	seeds := []struct {
		sel  uint8
		body string
	}{
		{0, `{"ips":["10.244.0.5"],"reason":"del"}`},
		{0, `{"ips":["10.244.0.5","fd00::5"],"reason":"add","container_id":"c","netns":"/var/run/netns/x","ifname":"eth0","dry_run":true}`},
		{0, `{"ips":["0.0.0.0"],"reason":"gc"}`},
		{0, `{"ips":["::ffff:10.244.0.5"],"reason":"del"}`},
		{0, `{"ips":["fe80::1%eth0"],"reason":"del"}`},
		{1, `{"container_id":"c","ifname":"eth0","netns":"/var/run/netns/x","ips":["10.244.0.6"],"network":"pods"}`},
		{2, `{"container_id":"c","ifname":"eth0"}`},
		{3, `{"network":"pods","valid_attachments":[{"container_id":"c","ifname":"eth0"}]}`},
		{3, `{"network":"other","valid_attachments":[{"container_id":"x","ifname":"eth0"}]}`},
		{3, `{"valid_attachments":[]}`},
		{4, `10.244.0.5`},
		{5, `container_id=keep&ifname=eth0`},
		{0, `{"ips": [`},
		{0, `{"ips":["10.244.0.5"],"reason":"del"} {}`},
	}
	for _, s := range seeds {
		f.Add(s.sel, []byte(s.body), "")
	}
	f.Add(uint8(0), []byte(`{"ips":["10.244.0.5"],"reason":"del"}`), "2000-01-01T00:00:00Z")
	f.Add(uint8(0), []byte(`{"ips":["10.244.0.5"],"reason":"del"}`), "soon")
	cidrs := []string{"10.244.0.0/16", "fd00::/64"}
	f.Fuzz(func(t *testing.T, sel uint8, body []byte, deadline string) {
		cfg := DefaultConfig()
		cfg.PodCIDRs = cidrs
		cfg.StateFile = ""
		cfg.MetricsAddr = "off"
		g := &guardBackend{}
		d, err := New(Options{Config: cfg, Index: index.New(index.Config{}), Backends: []scrub.Backend{g},
			Logger: slog.New(slog.NewJSONHandler(io.Discard, nil))})
		if err != nil {
			t.Fatal(err)
		}
		keep := api.IndexedPod{Attachment: api.Attachment{ContainerID: "keep", IfName: "eth0"}, Netns: "/var/run/netns/keep",
			IPs: []netip.Addr{netip.MustParseAddr("10.244.0.9")}, Network: "other"}
		if _, err := d.pods.start(keep); err != nil {
			t.Fatal(err)
		}
		h := d.apiHandler()
		p := fuzzPaths[int(sel)%len(fuzzPaths)]
		target := "http://scrubd" + p.path
		var rd io.Reader = bytes.NewReader(body)
		if p.method == "GET" {
			switch p.path {
			case api.PathIndexIP:
				target += "?ip=" + url.QueryEscape(string(body))
			case api.PathIndexPod:
				target += "?" + string(body)
			}
			rd = nil
		}
		req, err := http.NewRequest(p.method, target, rd)
		if err != nil {
			return // not a request a client can send
		}
		if deadline != "" {
			req.Header.Set(api.DeadlineHeader, deadline)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)

		res := rec.Result()
		data, _ := io.ReadAll(res.Body)
		if res.StatusCode/100 != 2 {
			var e api.Error
			if err := json.Unmarshal(data, &e); err != nil || e.Message == "" {
				t.Fatalf("%s %s: %d %q is not an api.Error", p.method, p.path, res.StatusCode, data)
			}
			switch e.Code {
			case api.CodeBadRequest, api.CodeNotPodIP, api.CodeTryAgain, api.CodeCancelled, api.CodeInternal, api.CodeNotFound:
			default:
				t.Fatalf("%s %s: unknown error code %q", p.method, p.path, e.Code)
			}
		} else if !json.Valid(data) {
			t.Fatalf("%s %s: 2xx body %q is not JSON", p.method, p.path, data)
		}
		for _, ip := range g.ips {
			if e := d.checkPodIP(ip); e != nil {
				t.Fatalf("%s %s: a backend was asked to scrub %s: %s", p.method, p.path, ip, e.Message)
			}
		}
		if p.path == api.PathGC {
			if _, ok := d.pods.get(keep.Attachment); !ok {
				var req api.GCRequest
				json.Unmarshal(body, &req)
				if req.Network != keep.Network {
					t.Fatalf("GC %q of network %q dropped an attachment of network %q", body, req.Network, keep.Network)
				}
			}
			if res.StatusCode/100 == 2 {
				var req api.GCRequest
				if json.Unmarshal(body, &req) != nil || req.Network == "" || len(req.ValidAttachments) == 0 {
					t.Fatalf("GC %q served", body)
				}
			}
		}
	})
}
