package main

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"
)

// What the runtime hands the plugin beside its own keys can carry pod data:
// runtimeConfig (port mappings, pod annotations, bandwidth, ...), args (labels),
// CNI_ARGS (K8S_POD_* and whatever else a runtime adds) and the process
// environment. The plugin uses none of it; it must never echo it into its
// output (stdout is the runtime's result or error JSON, stderr the runtime's
// log), nor pass it to scrubd (whose log would then hold it). The binary runs
// through skel, as the runtime runs it, for every command, with a scrubd that
// fails each way the plugin reports (unreachable, refusing, internal error,
// too slow) under both failure policies, and with a malformed config beside
// the secret.
func TestSecretsNeverLeaveThePlugin(t *testing.T) {
	const secret = "S3CR3T-do-not-log-4f1c"
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var bodies []string
	mode := "internal"
	sock, _ := startFaultDaemon(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		bodies = append(bodies, r.URL.String()+" "+string(b))
		m := mode
		mu.Unlock()
		switch m {
		case "internal":
			w.WriteHeader(500)
			w.Write([]byte(`{"code":"internal","error":"backend failed"}`))
		case "refuse":
			w.WriteHeader(400)
			w.Write([]byte(`{"code":"not_pod_ip","error":"IP outside the pod CIDRs"}`))
		case "slow":
			select {
			case <-r.Context().Done():
			case <-time.After(5 * time.Second):
			}
		}
	})
	exe := func(cmd, ver string, fields map[string]any, prev map[string]any) string {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		c := exec.CommandContext(ctx, self)
		c.Env = []string{"CTSCRUB_TEST_AS_PLUGIN=1", "CNI_COMMAND=" + cmd, "CNI_PATH=/opt/cni/bin", "CNI_CONTAINERID=c0ffee", "CNI_IFNAME=eth0",
			"CNI_NETNS=/var/run/netns/pod1",
			"CNI_ARGS=IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=c0ffee;DB_PASSWORD=" + secret,
			"DB_PASSWORD=" + secret, "AWS_SECRET_ACCESS_KEY=" + secret}
		m := map[string]any{
			"runtimeConfig": map[string]any{
				"portMappings":                      []any{map[string]any{"hostPort": 8080, "containerPort": 80, "protocol": "tcp"}},
				"podAnnotations":                    map[string]any{"vault.example/token": secret},
				"io.kubernetes.cri.pod-annotations": map[string]any{"secret": secret},
			},
			"args": map[string]any{"cni": map[string]any{"labels": []any{map[string]any{"key": "token", "value": secret}}}},
		}
		for k, v := range fields {
			m[k] = v
		}
		var out, errOut bytes.Buffer
		c.Stdin = bytes.NewReader(stdin(t, ver, m, prev))
		c.Stdout, c.Stderr = &out, &errOut
		_ = c.Run()
		return out.String() + "\n" + errOut.String()
	}
	check := func(what, printed string) {
		t.Helper()
		if strings.Contains(printed, secret) {
			t.Errorf("%s: the plugin printed the secret:\n%s", what, printed)
		}
	}
	for _, m := range []string{"internal", "refuse", "slow", "unreachable"} {
		mu.Lock()
		mode = m
		mu.Unlock()
		s := sock
		if m == "unreachable" {
			s = missingSocket(t)
		}
		for _, policy := range []string{"fail", "ignore"} {
			f := map[string]any{"socket": s, "failurePolicy": policy, "timeout": "1s"}
			vers := []string{"0.3.1", "1.0.0", "1.1.0"}
			if m == "slow" {
				vers = []string{"1.0.0"} // 1 s per call
			}
			for _, ver := range vers {
				check(m+" ADD "+policy+" "+ver, exe("ADD", ver, f, prevResult(ver)))
				check(m+" DEL "+policy+" "+ver, exe("DEL", ver, f, prevResult(ver)))
				check(m+" DEL without prevResult "+policy+" "+ver, exe("DEL", ver, f, nil))
			}
			check(m+" CHECK "+policy, exe("CHECK", "1.0.0", f, prevResult("1.0.0")))
			check(m+" STATUS "+policy, exe("STATUS", "1.1.0", f, nil))
			gc := map[string]any{"socket": s, "failurePolicy": policy, "timeout": "1s",
				"cni.dev/valid-attachments": []any{map[string]any{"containerID": "c0ffee", "ifname": "eth0"}}}
			check(m+" GC "+policy, exe("GC", "1.1.0", gc, nil))
		}
	}
	// Malformed configs beside the secret: the error names the fault, not
	// the config's content.
	for name, f := range map[string]map[string]any{
		"unknown key":     {"socket": sock, "token": secret},
		"bad timeout":     {"socket": sock, "timeout": 5},
		"bad policy":      {"socket": sock, "failurePolicy": "maybe"},
		"relative socket": {"socket": "scrubd.sock"},
	} {
		check("config "+name, exe("ADD", "1.0.0", f, prevResult("1.0.0")))
	}
	mu.Lock()
	defer mu.Unlock()
	if len(bodies) == 0 {
		t.Fatal("no request reached the stand-in scrubd: the test checked nothing there")
	}
	for _, b := range bodies {
		if strings.Contains(b, secret) {
			t.Errorf("the plugin sent the secret to scrubd: %s", b)
		}
	}
}
