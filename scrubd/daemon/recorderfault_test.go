package daemon

import (
	"context"
	"errors"
	"net/netip"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// faultyRecorder is the real recorder whose reader the test stops with an
// error, or holds back at start. A fault injection: the reader's ring-buffer
// read failing cannot be caused on demand for real, and a slow start cannot
// be timed; the kernel side, the ring and every other call are the real
// recorder's.
type faultyRecorder struct {
	Recorder
	fail  chan struct{} // a send ends the running reader with an error
	delay time.Duration // the first Run starts this late
	runs  chan struct{} // one value per Run started
}

func (f *faultyRecorder) Run(ctx context.Context, ix *index.Index) error {
	if f.delay > 0 {
		d := f.delay
		f.delay = 0
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(d):
		}
	}
	f.runs <- struct{}{}
	inner, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- f.Recorder.Run(inner, ix) }()
	select {
	case err := <-done:
		return err
	case <-f.fail:
		cancel()
		<-done
		return errors.New("injected: ring buffer read failed")
	}
}

func withFaultyRecorder(f *faultyRecorder) func(*Daemon) {
	return func(d *Daemon) {
		f.Recorder = d.rec
		d.rec = f
	}
}

// scrubOne scrubs ip as a DEL would and returns the Cilium backend's result.
func scrubOne(t *testing.T, td *testDaemon, ip netip.Addr) scrub.Result {
	t.Helper()
	resp, err := td.c.Scrub(context.Background(), api.ScrubRequest{IPs: []netip.Addr{ip}, Reason: scrub.ReasonDel})
	if err != nil {
		t.Fatal(err)
	}
	return resp.Results[0]
}

// While the recorder's reader is down, no IP's index is trusted: a scrub of
// a complete IP sweeps and says why, /readyz and the metrics say the
// recorder is not running, and the daemon restarts the reader, after which
// the index path serves again.
func TestScrubWhileRecorderStoppedSweeps(t *testing.T) {
	root := newCTRoot(t, 1<<14)
	f := &faultyRecorder{fail: make(chan struct{}), runs: make(chan struct{}, 8)}
	td := startDaemonWith(t, testConfig(t, root), withFaultyRecorder(f), true)
	<-f.runs

	ip := mustAddr("10.244.0.30")
	flows := podFlows(ip, 20)
	root.put4(t, flows)
	indexFlows(td.Daemon, ip, flows)
	if !td.Index().State(ip).Complete {
		t.Fatal("set-up: the IP is not complete")
	}

	f.fail <- struct{}{}
	waitFor(t, "the recorder to be reported down", func() bool {
		return counterValue(t, td, "ctscrub_recorder_running", nil) == 0 && !td.Status().Ready
	})
	r := scrubOne(t, td, ip)
	if r.Outcome != scrub.Complete || r.PerIP[ip.String()] != scrub.MethodSweep || r.SweptWhy[ip.String()] != index.ReasonNotFed {
		t.Fatalf("scrub with the recorder down: %+v, want a complete sweep because %q", r, index.ReasonNotFed)
	}
	if n := root.present4(t, flows); n != 0 {
		t.Fatalf("%d of the IP's entries left after its sweep", n)
	}

	// Restarted by the daemon after its backoff.
	select {
	case <-f.runs:
	case <-time.After(10 * time.Second):
		t.Fatal("the recorder was not restarted within 10 s")
	}
	waitFor(t, "the recorder to run again", func() bool { return td.Status().Ready })
	if v := counterValue(t, td, "ctscrub_recorder_restarts_total", nil); v != 1 {
		t.Fatalf("ctscrub_recorder_restarts_total = %v, want 1", v)
	}
	ip2 := mustAddr("10.244.0.31")
	flows2 := podFlows(ip2, 20)
	root.put4(t, flows2)
	indexFlows(td.Daemon, ip2, flows2)
	if r := scrubOne(t, td, ip2); r.PerIP[ip2.String()] != scrub.MethodIndex || r.Outcome != scrub.Complete {
		t.Fatalf("scrub after the restart: %+v, want the index path", r)
	}
}

// The API serves before the recorder has installed its hooks (and applied
// what the ring holds from while scrubd was down): a scrub then must not
// trust the index, even for an IP it believes complete.
func TestScrubWhileRecorderStartsDoesNotTrustIndex(t *testing.T) {
	root := newCTRoot(t, 1<<14)
	f := &faultyRecorder{fail: make(chan struct{}), runs: make(chan struct{}, 8), delay: 4 * time.Second}
	td := startDaemonWith(t, testConfig(t, root), withFaultyRecorder(f), false)
	if td.Status().Ready {
		t.Fatal("ready before the recorder runs")
	}
	ip := mustAddr("10.244.0.32")
	flows := podFlows(ip, 20)
	root.put4(t, flows)
	indexFlows(td.Daemon, ip, flows)
	r := scrubOne(t, td, ip)
	if r.PerIP[ip.String()] != scrub.MethodSweep || r.SweptWhy[ip.String()] != index.ReasonNotFed {
		t.Fatalf("scrub before the recorder started: %+v, want a sweep because %q", r, index.ReasonNotFed)
	}
	if n := root.present4(t, flows); n != 0 {
		t.Fatalf("%d of the IP's entries left after its sweep", n)
	}
}
