package daemon

import (
	"strings"
	"testing"
)

// The chart's metrics_addr, ${HOST_IP}:9967, becomes the node's address; an
// unset variable is refused rather than widened to every address.
func TestExpandMetricsAddr(t *testing.T) {
	env := map[string]string{"HOST_IP": "172.18.0.3", "HOST_IP6": "fd00::3"}
	getenv := func(k string) string { return env[k] }
	for _, c := range []struct{ in, want, err string }{
		{in: "127.0.0.1:9967", want: "127.0.0.1:9967"},
		{in: "off", want: "off"},
		{in: "", want: ""},
		{in: "${HOST_IP}:9967", want: "172.18.0.3:9967"},
		{in: "$HOST_IP:9967", want: "172.18.0.3:9967"},
		{in: "${HOST_IP6}:9967", want: "[fd00::3]:9967"},
		{in: "${NODE_IP}:9967", err: "NODE_IP is empty or not set"},
		{in: "${HOST_IP}", err: "missing port"},
	} {
		got, err := ExpandMetricsAddr(c.in, getenv)
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("%q: %q, %v; want an error with %q", c.in, got, err, c.err)
			}
			continue
		}
		if err != nil || got != c.want {
			t.Errorf("%q: %q, %v; want %q", c.in, got, err, c.want)
		}
	}
}

// The delegate socket needs a directory of its own: Cilium's pod mounts it,
// and must not reach the main API through it.
func TestDelegateSocketOwnDirectory(t *testing.T) {
	cfg := DefaultConfig()
	cfg.PodCIDRs = []string{"10.244.0.0/16"}
	cfg.CNIConfDir = "/host/etc/cni/net.d"
	cfg.DelegateSocket = "/run/ctscrub/delegate.sock"
	if _, err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "directory of its own") {
		t.Errorf("delegate socket beside the API socket: %v, want refused", err)
	}
	cfg.DelegateSocket = "/run/ctscrub-delegate/delegate.sock"
	if _, err := cfg.Validate(); err != nil {
		t.Errorf("delegate socket in its own directory: %v", err)
	}
}

// The delegate answers for the index, which vouches for an IP only while the
// conflist watch runs: no delegate without cni_conf_dir.
func TestDelegateNeedsConflistWatch(t *testing.T) {
	cfg := DefaultConfig()
	cfg.PodCIDRs = []string{"10.244.0.0/16"}
	cfg.DelegateSocket = "/run/ctscrub-delegate/delegate.sock"
	if _, err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "cni_conf_dir is empty") {
		t.Errorf("delegate socket without cni_conf_dir: %v, want refused naming cni_conf_dir", err)
	}
	cfg.CNIConfDir = "/host/etc/cni/net.d"
	if _, err := cfg.Validate(); err != nil {
		t.Errorf("delegate socket with cni_conf_dir: %v", err)
	}
	cfg.DelegateSocket, cfg.CNIConfDir = "", ""
	if _, err := cfg.Validate(); err != nil {
		t.Errorf("neither delegate nor cni_conf_dir: %v", err)
	}
}
