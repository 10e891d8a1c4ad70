package daemon

import (
	"context"
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// auditDaemon runs a daemon whose expiry pass (report mode, one pass at the
// start, then hourly) carries the audit, and waits for that first pass.
func auditDaemon(t *testing.T) (*ctRoot, *testDaemon) {
	root := newCTRoot(t, 1<<14)
	cfg := testConfig(t, root)
	cfg.Expiry.Mode = "report"
	cfg.Expiry.Interval = Duration{time.Hour}
	td := startDaemon(t, cfg)
	waitFor(t, "the first expiry pass", func() bool {
		return counterValue(t, td, "ctscrub_expiry_passes_total", nil) > 0
	})
	return root, td
}

// scrubd audit --ip: the keys in the kernel, the index's, missing and
// extra, the verdict; read-only (the IP stays complete).
func TestAuditAPI(t *testing.T) {
	root, td := auditDaemon(t)
	ip := mustAddr("10.244.0.7")
	flows := podFlows(ip, 20)
	root.put4(t, background(1000))
	root.put4(t, flows)
	indexFlows(td.Daemon, ip, flows)
	ctx := context.Background()

	resp, err := td.c.Audit(ctx, []netip.Addr{ip})
	if err != nil {
		t.Fatal(err)
	}
	a := resp.IPs[0]
	if resp.Missing != 0 || a.Verdict != api.VerdictCovered || len(a.Found) != len(flows) || len(a.Indexed) != len(flows) || len(a.Extra) != 0 {
		t.Fatalf("clean audit: missing %d, %+v", resp.Missing, a)
	}

	// An entry the recorder never saw, and an indexed key Cilium dropped.
	miss := ctmap.NewKey4(mustAddr("203.0.113.9"), ip, 8080, 5555, ctmap.ProtoTCP, ctmap.FlagIn)
	root.put4(t, []ctmap.CTKey4{miss})
	if err := root.maps[flows[0].Kind()].Delete(flows[0]); err != nil {
		t.Fatal(err)
	}
	resp, err = td.c.Audit(ctx, []netip.Addr{ip})
	if err == nil {
		a = resp.IPs[0]
	}
	if err != nil || resp.Missing != 1 || a.Verdict != api.VerdictMissing || len(a.Missing) != 1 || a.Missing[0].Key != miss.String() ||
		len(a.Extra) != 1 || a.Extra[0].Key != flows[0].String() {
		t.Fatalf("audit with a missing and a stale key: %v, %+v", err, resp)
	}
	if st := td.Index().State(ip); !st.Complete {
		t.Errorf("the on-demand audit changed the index: %+v", st)
	}

	// Not a pod IP: refused.
	if _, err := td.c.Audit(ctx, []netip.Addr{mustAddr("127.0.0.1")}); err == nil {
		t.Error("audit of 127.0.0.1 accepted")
	}
	// An incomplete IP's keys are not counted missing: its scrub sweeps.
	td.Index().MarkIncomplete(ip, index.ReasonLost)
	resp, err = td.c.Audit(ctx, []netip.Addr{ip})
	if err != nil || resp.Missing != 0 || resp.IPs[0].Verdict != api.VerdictIncomplete {
		t.Fatalf("audit of an incomplete IP: %v, %+v", err, resp)
	}
}

// The continuous audit runs in the daemon's expiry pass: an entry of a
// complete IP the recorder never saw is counted and the IP turns incomplete
// within a pass (and the confirm wait), and `scrubd audit` lists the miss.
func TestContinuousAuditInDaemon(t *testing.T) {
	root := newCTRoot(t, 1<<14)
	cfg := testConfig(t, root)
	cfg.Expiry.Mode = "report"
	cfg.Expiry.Interval = Duration{time.Second}
	td := startDaemon(t, cfg)
	ip := mustAddr("10.244.0.9")
	flows := podFlows(ip, 10)
	root.put4(t, flows)
	indexFlows(td.Daemon, ip, flows)
	miss := ctmap.NewKey4(mustAddr("203.0.113.9"), ip, 8080, 5556, ctmap.ProtoTCP, ctmap.FlagIn)
	root.put4(t, []ctmap.CTKey4{miss})
	deadline := time.Now().Add(60 * time.Second)
	for counterValue(t, td, "ctscrub_audit_missing_keys_total", map[string]string{"direction": "in", "protocol": "tcp"}) != 1 {
		if time.Now().After(deadline) {
			t.Fatal("the audit did not count the unrecorded entry within 60 s")
		}
		time.Sleep(50 * time.Millisecond)
	}
	if st := td.Index().State(ip); st.Complete || st.Incomplete != index.ReasonAuditMiss {
		t.Errorf("%s after the audit: %+v", ip, st)
	}
	resp, err := td.c.Audit(context.Background(), nil)
	if err != nil || len(resp.Recent) != 1 || resp.Recent[0].Key != miss.String() || resp.Recent[0].IP != ip {
		t.Errorf("recent misses: %+v, %v", resp, err)
	}
}

// scrubd audit --ip: the verdict and keys; exit 1 when keys are missing.
func TestAuditCLI(t *testing.T) {
	root, td := auditDaemon(t)
	bin := buildScrubd(t)
	ip := mustAddr("10.244.0.8")
	flows := podFlows(ip, 3)
	root.put4(t, flows)
	indexFlows(td.Daemon, ip, flows)
	cli := func(args ...string) (string, error) {
		out, err := exec.Command(bin, append(args, "--socket", td.cfg.Socket)...).CombinedOutput()
		return string(out), err
	}
	out, err := cli("audit", "--ip", ip.String())
	if err != nil || !strings.Contains(out, ip.String()+": covered") || !strings.Contains(out, "in the kernel 6, indexed 6, missing 0") {
		t.Errorf("scrubd audit of a covered IP: %v\n%s", err, out)
	}
	miss := ctmap.NewKey4(mustAddr("203.0.113.9"), ip, 8080, 5557, ctmap.ProtoTCP, ctmap.FlagIn)
	root.put4(t, []ctmap.CTKey4{miss})
	out, err = cli("audit", "--ip", ip.String())
	if err == nil || !strings.Contains(out, "MISSING") || !strings.Contains(out, miss.String()) {
		t.Errorf("scrubd audit with a missing key: %v\n%s", err, out)
	}
	out, err = cli("audit", "--ip", ip.String(), "--json")
	if err == nil || !strings.Contains(out, `"verdict": "missing"`) {
		t.Errorf("scrubd audit --json: %v\n%s", err, out)
	}
}
