package daemon

import (
	"bytes"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/api"
)

// The state survives a restart through the file and its journal: changes
// are journal lines (O(1) each), replayed in order at load; a torn last
// line (a crash while writing an unacknowledged change) is ignored; the
// journal is folded into the file before it exceeds twice the attachments.
func TestStateJournal(t *testing.T) {
	path := filepath.Join(t.TempDir(), "attachments.json")
	pod := func(id string, ip string) api.IndexedPod {
		return api.IndexedPod{Attachment: api.Attachment{ContainerID: id, IfName: "eth0"}, Netns: "/var/run/netns/" + id,
			IPs: []netip.Addr{netip.MustParseAddr(ip)}, Since: time.Now().UTC().Truncate(time.Second)}
	}
	p := newPods(path, time.Hour)
	a, b, c := pod("a", "10.244.0.1"), pod("b", "10.244.0.2"), pod("c", "10.244.0.1")
	for _, step := range []func() error{
		func() error { _, err := p.start(a); return err },
		func() error { _, err := p.start(b); return err },
		func() error { _, err := p.start(c); return err }, // displaces a
		func() error { _, _, err := p.stop(b.Attachment); return err },
		func() error { return p.forget(b.Attachment) },
	} {
		if err := step(); err != nil {
			t.Fatal(err)
		}
	}
	check := func(what string) *pods {
		t.Helper()
		q := newPods(path, time.Hour)
		if err := q.load(); err != nil {
			t.Fatalf("%s: load: %v", what, err)
		}
		wantA, wantS := p.list()
		gotA, gotS := q.list()
		if len(gotA) != len(wantA) || len(gotS) != len(wantS) {
			t.Fatalf("%s: loaded %d active, %d stopped; want %d, %d", what, len(gotA), len(gotS), len(wantA), len(wantS))
		}
		for i := range gotA {
			if gotA[i].ContainerID != wantA[i].ContainerID || !gotA[i].Since.Equal(wantA[i].Since) {
				t.Fatalf("%s: active %+v, want %+v", what, gotA[i], wantA[i])
			}
		}
		for i := range gotS {
			if gotS[i].ContainerID != wantS[i].ContainerID || !gotS[i].Stopped.Equal(wantS[i].Stopped) {
				t.Fatalf("%s: stopped %+v, want %+v", what, gotS[i], wantS[i])
			}
		}
		return q
	}
	check("journal only")
	if _, err := os.Stat(path); err == nil {
		t.Errorf("the state file was rewritten for 5 changes")
	}

	f, err := os.OpenFile(path+".log", os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString(`{"op":"active","pod":{"container_id":"torn"`)
	f.Close()
	if q := check("torn last line"); q.owner(netip.MustParseAddr("10.244.0.1")) == nil {
		t.Errorf("c lost")
	}
	if err := os.Truncate(path+".log", int64(bytes.LastIndexByte(mustRead(t, path+".log"), '\n')+1)); err != nil {
		t.Fatal(err)
	}

	for range 100 {
		if _, err := p.start(b); err != nil {
			t.Fatal(err)
		}
		if _, _, err := p.stop(b.Attachment); err != nil {
			t.Fatal(err)
		}
		if p.logLines > 64 {
			t.Fatalf("journal of %d lines for %d attachments", p.logLines, len(p.active)+len(p.stopped))
		}
	}
	if _, err := os.Stat(path); err != nil {
		t.Errorf("the journal was never folded into the state file: %v", err)
	}
	check("after folding")
}

func mustRead(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
