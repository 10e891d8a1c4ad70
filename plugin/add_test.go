package main

import (
	"encoding/json"
	"io"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/ctscrub/ctscrub/scrubd/api"
)

// ADD is one request: scrubd scrubs the IPs and then attaches
// (api.IndexStartRequest.Scrub), one round trip instead of two.
func TestAddIsOneRequest(t *testing.T) {
	var got api.IndexStartRequest
	sock, d := startFaultDaemon(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == api.PathIndexStart {
			json.NewDecoder(r.Body).Decode(&got)
		}
		w.Write([]byte(`{}`))
	})
	if _, _, err := run(t, cmdAdd, cmdArgs(stdin(t, "1.0.0", map[string]any{"socket": sock}, prevResult("1.0.0")))); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(d.paths, []string{api.PathIndexStart}) || !got.Scrub || len(got.IPs) != 2 {
		t.Errorf("daemon saw %v, index start %+v; want one index start with scrub set and both IPs", d.paths, got)
	}
	// scrubOnAdd false: the start alone.
	d.paths, got = nil, api.IndexStartRequest{}
	if _, _, err := run(t, cmdAdd, cmdArgs(stdin(t, "1.0.0", map[string]any{"socket": sock, "scrubOnAdd": false}, prevResult("1.0.0")))); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(d.paths, []string{api.PathIndexStart}) || got.Scrub {
		t.Errorf("scrubOnAdd false: daemon saw %v, scrub %v", d.paths, got.Scrub)
	}
}

// A scrubd older than the plugin (mid-upgrade) refuses the "scrub" field as
// its strict decoder refuses any unknown one: the plugin then scrubs and
// starts in two requests, and the ADD succeeds.
func TestAddAgainstOlderScrubd(t *testing.T) {
	var bodies []string
	sock, d := startFaultDaemon(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		bodies = append(bodies, string(b))
		var m map[string]any
		json.Unmarshal(b, &m)
		if _, ok := m["scrub"]; ok && r.URL.Path == api.PathIndexStart {
			w.WriteHeader(http.StatusBadRequest)
			json.NewEncoder(w).Encode(api.Error{Code: api.CodeBadRequest, Message: `decode index start request: json: unknown field "scrub" (send a JSON object as in scrubd/api)`})
			return
		}
		w.Write([]byte(`{"results":[]}`))
	})
	if _, _, err := run(t, cmdAdd, cmdArgs(stdin(t, "1.0.0", map[string]any{"socket": sock}, prevResult("1.0.0")))); err != nil {
		t.Fatalf("ADD against an older scrubd: %v", err)
	}
	if want := []string{api.PathIndexStart, api.PathScrub, api.PathIndexStart}; !slices.Equal(d.paths, want) {
		t.Errorf("daemon saw %v, want %v (bodies %q)", d.paths, want, bodies)
	}
}

// DEL is one request too (api.CNIDel), with prevResult's IPs; the IPs
// another attachment holds now, which scrubd skips, are named on stderr.
func TestDelIsOneRequest(t *testing.T) {
	var got api.IndexStopRequest
	sock, d := startFaultDaemon(t, func(w http.ResponseWriter, r *http.Request) {
		json.NewDecoder(r.Body).Decode(&got)
		json.NewEncoder(w).Encode(api.DelResponse{Skipped: []api.IPOwner{{IP: netip.MustParseAddr("10.22.0.5"), Owner: api.Attachment{ContainerID: "newpod", IfName: "eth0"}}}})
	})
	_, logged, err := run(t, cmdDel, cmdArgs(stdin(t, "1.0.0", map[string]any{"socket": sock}, prevResult("1.0.0"))))
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(d.paths, []string{api.PathIndexStop}) || got.Del == nil || !got.Del.Scrub || len(got.Del.IPs) != 2 || got.ContainerID != "c0ffee" {
		t.Errorf("daemon saw %v, %+v; want one index stop with del, scrub and both IPs", d.paths, got)
	}
	if !strings.Contains(logged, "not scrubbing 10.22.0.5: it belongs to container newpod") {
		t.Errorf("stderr %q does not name the skipped IP", logged)
	}
}

// Against a scrubd older than the plugin, DEL falls back to its separate
// requests: look up, scrub, stop.
func TestDelAgainstOlderScrubd(t *testing.T) {
	sock, d := startFaultDaemon(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		var m map[string]any
		json.Unmarshal(b, &m)
		switch {
		case m["del"] != nil:
			w.WriteHeader(http.StatusBadRequest)
			json.NewEncoder(w).Encode(api.Error{Code: api.CodeBadRequest, Message: `decode index stop request: json: unknown field "del" (send a JSON object as in scrubd/api)`})
		case r.URL.Path == api.PathIndexPod:
			json.NewEncoder(w).Encode(api.IndexedPod{Attachment: api.Attachment{ContainerID: "c0ffee", IfName: "eth0"}, IPs: []netip.Addr{netip.MustParseAddr("10.22.0.5")}})
		default:
			w.Write([]byte(`{"results":[]}`))
		}
	})
	if _, _, err := run(t, cmdDel, cmdArgs(stdin(t, "1.0.0", map[string]any{"socket": sock}, prevResult("1.0.0")))); err != nil {
		t.Fatalf("DEL against an older scrubd: %v", err)
	}
	if want := []string{api.PathIndexStop, api.PathIndexPod, api.PathScrub, api.PathIndexStop}; !slices.Equal(d.paths, want) {
		t.Errorf("daemon saw %v, want %v", d.paths, want)
	}
}
