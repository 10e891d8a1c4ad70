package main

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
	"time"
)

// The agent's and cilium-cni's lines are written here with log/slog's text
// handler, the handler both use (Cilium 1.18: pkg/logging for the agent, with
// time as an RFC 3339 string and the level lower-cased; hooks' file handler for
// cilium-cni), so quoting follows the real format.

func agentLogger(buf *bytes.Buffer) *slog.Logger {
	return slog.New(slog.NewTextHandler(buf, &slog.HandlerOptions{
		Level: slog.LevelDebug,
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			switch a.Key {
			case slog.TimeKey:
				return slog.String(slog.TimeKey, a.Value.Time().Format(time.RFC3339Nano))
			case slog.LevelKey:
				return slog.String(a.Key, strings.ToLower(a.Value.String()))
			}
			return a
		},
	}))
}

func TestParseRegens(t *testing.T) {
	var buf bytes.Buffer
	l := agentLogger(&buf)
	ep := func(pod, id string) *slog.Logger {
		return l.With("subsys", "endpoint", "ciliumEndpointName", pod, "containerID", "abc", "endpointID", id, "k8sPodName", pod, "ipv4", "10.244.1.7")
	}
	ep("ctscrub-bench/noexp-0", "101").Debug("Completed endpoint regeneration",
		"reason", "Initial build on endpoint creation", "waitingForLock", 2*time.Microsecond,
		"waitingForCTClean", 1500*time.Millisecond, "total", 1700*time.Millisecond, "mapSync", time.Millisecond)
	ep("ctscrub-bench/noexp-0", "101").Debug("Completed endpoint regeneration",
		"reason", "policy rules added", "waitingForCTClean", 3*time.Microsecond, "total", 20*time.Millisecond)
	ep("kube-system/coredns-1", "7").Debug("Completed endpoint regeneration",
		"reason", "x", "waitingForCTClean", 9*time.Second, "total", 9*time.Second)
	ep("ctscrub-bench/noexp-1", "102").Warn("Regeneration of endpoint failed",
		"reason", "Initial build on endpoint creation", "waitingForCTClean", 2*time.Second, "total", 3*time.Second, "error", "context canceled: \"x\"")
	l.Info("unrelated line", "k8sPodName", "ctscrub-bench/noexp-0")

	rs := parseRegens(buf.String(), func(p string) bool { return strings.HasPrefix(p, "ctscrub-bench/") })
	if len(rs) != 3 {
		t.Fatalf("parsed %d regenerations, want 3: %+v\n%s", len(rs), rs, buf.String())
	}
	if r := rs[0]; r.Pod != "ctscrub-bench/noexp-0" || r.EndpointID != "101" || r.CTClean != 1500*time.Millisecond || r.Total != 1700*time.Millisecond || r.Failed || r.Time.IsZero() || r.Reason != "Initial build on endpoint creation" {
		t.Errorf("first: %+v", r)
	}
	if r := rs[1]; r.CTClean != 3*time.Microsecond {
		t.Errorf("second: %+v", r)
	}
	if r := rs[2]; !r.Failed || r.CTClean != 2*time.Second {
		t.Errorf("failed one: %+v", r)
	}
}

func TestParseCNILog(t *testing.T) {
	var buf bytes.Buffer
	l := slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug})).With("subsys", "cilium-cni")
	add := l.With("eventID", "e1", "containerID", "c1", "netNSName", "/var/run/netns/cni-1", "interface", "eth0", "args", "K8S_POD_NAMESPACE=ctscrub-bench;K8S_POD_NAME=p-0", "path", "/opt/cni/bin")
	add.Debug("Processing CNI ADD request", "netConf", `&{NetConf:{CNIVersion:0.3.1 Name:cilium Type:cilium-cni} MTU:0 "quoted"}`)
	del := l.With("eventID", "e2", "containerID", "c0", "netNSName", "", "interface", "eth0")
	del.Debug("Processing CNI DEL request", "netConf", "{}")
	time.Sleep(5 * time.Millisecond)
	add.With("k8sNamespace", "ctscrub-bench", "k8sPodName", "p-0").Debug("Endpoint successfully created", "error", nil, "containerID", "c1")
	del.With("k8sNamespace", "ctscrub-bench", "k8sPodName", "p-9").Debug("CNI DEL processing complete")
	l.With("eventID", "e3", "containerID", "c3").Debug("Processing CNI ADD request")

	calls := parseCNILog(buf.String())
	if len(calls) != 3 {
		t.Fatalf("parsed %d calls, want 3: %+v\n%s", len(calls), calls, buf.String())
	}
	if c := calls[0]; c.Cmd != "ADD" || c.Pod != "ctscrub-bench/p-0" || c.ContainerID != "c1" || !c.Done || c.Duration() < 5*time.Millisecond || c.Duration() > time.Second {
		t.Errorf("ADD: %+v (%s)", c, c.Duration())
	}
	if c := calls[1]; c.Cmd != "DEL" || c.Pod != "ctscrub-bench/p-9" || !c.Done {
		t.Errorf("DEL: %+v", c)
	}
	if c := calls[2]; c.Done {
		t.Errorf("an ADD without its closing line reads as done: %+v", c)
	}
}

// containerd 1.6's CRI plugin logs through logrus's text formatter.
const containerdLog = `time="2026-11-30T22:00:00.100000000Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:p-0,Uid:u0,Namespace:ctscrub-bench,Attempt:0,}"
time="2026-11-30T22:00:00.200000000Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:p-1,Uid:u1,Namespace:ctscrub-bench,Attempt:0,}"
time="2026-11-30T22:00:00.300000000Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:other,Uid:u2,Namespace:default,Attempt:0,}"
time="2026-11-30T22:00:02.600000000Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:p-0,Uid:u0,Namespace:ctscrub-bench,Attempt:0,} returns sandbox id \"aaaa\""
time="2026-11-30T22:02:00.200000000Z" level=error msg="RunPodSandbox for &PodSandboxMetadata{Name:p-1,Uid:u1,Namespace:ctscrub-bench,Attempt:0,} failed, error" error="failed to setup network for sandbox \"bbbb\": plugin type=\"cilium-cni\" failed (add): context deadline exceeded"
time="2026-11-30T22:02:01.000000000Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:p-1,Uid:u1,Namespace:ctscrub-bench,Attempt:0,}"
time="2026-11-30T22:02:03.000000000Z" level=info msg="RunPodSandbox for &PodSandboxMetadata{Name:p-1,Uid:u1,Namespace:ctscrub-bench,Attempt:0,} returns sandbox id \"cccc\""
time="2026-11-30T22:03:00.000000000Z" level=info msg="StopPodSandbox for \"aaaa\""
time="2026-11-30T22:03:04.500000000Z" level=info msg="StopPodSandbox for \"aaaa\" returns successfully"
time="2026-11-30T22:03:05.000000000Z" level=info msg="StopPodSandbox for \"aaaa\""
time="2026-11-30T22:03:05.100000000Z" level=info msg="StopPodSandbox for \"aaaa\" returns successfully"
`

func TestParseContainerd(t *testing.T) {
	sbs := parseContainerd(containerdLog, func(p string) bool { return strings.HasPrefix(p, "ctscrub-bench/") })
	if len(sbs) != 2 {
		t.Fatalf("parsed %d sandboxes, want 2: %+v", len(sbs), sbs)
	}
	p0 := sbs["ctscrub-bench/p-0"]
	if p0 == nil || p0.ID != "aaaa" || p0.Ready.Sub(p0.Start) != 2500*time.Millisecond || p0.Failures != 0 {
		t.Errorf("p-0: %+v", p0)
	}
	if d := p0.StopEnd.Sub(p0.StopStart); d != 4500*time.Millisecond {
		t.Errorf("p-0 stop took %s, want 4.5s (the first stop)", d)
	}
	p1 := sbs["ctscrub-bench/p-1"]
	if p1 == nil || p1.Failures != 1 || p1.ID != "cccc" || p1.Ready.Sub(p1.Start) != 2*time.Minute+2800*time.Millisecond || !strings.Contains(p1.LastError, "context deadline exceeded") {
		t.Errorf("p-1 (failed once, then created; measured from its first attempt): %+v", p1)
	}
}

func TestSummarise(t *testing.T) {
	d := summarise([]time.Duration{3 * time.Second, time.Second, 2 * time.Second, 10 * time.Second})
	if d.N != 4 || d.P50 != 2.5 || d.Max != 10 {
		t.Errorf("%+v", d)
	}
	if d := summarise(nil); d.N != 0 || d.String() != "none measured" {
		t.Errorf("%+v", d)
	}
}
