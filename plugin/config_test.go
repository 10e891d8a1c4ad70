package main

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/ctscrub/ctscrub/scrubd/api"
)

func TestParseConfigDefaults(t *testing.T) {
	conf, err := parseConfig([]byte(`{"cniVersion":"1.0.0","name":"pods","type":"ctscrub"}`))
	if err != nil {
		t.Fatal(err)
	}
	if conf.Socket != api.DefaultSocket || time.Duration(conf.Timeout) != DefaultTimeout ||
		conf.FailurePolicy != PolicyFail || !conf.ScrubsOnAdd() || !conf.ScrubsOnDel() {
		t.Fatalf("defaults: socket %q timeout %s policy %q scrubOnAdd %v scrubOnDel %v",
			conf.Socket, time.Duration(conf.Timeout), conf.FailurePolicy, conf.ScrubsOnAdd(), conf.ScrubsOnDel())
	}
}

func TestParseConfigOwnFields(t *testing.T) {
	conf, err := parseConfig([]byte(`{"cniVersion":"1.0.0","name":"pods","type":"ctscrub",
		"socket":"/run/x/s.sock","timeout":"1500ms","failurePolicy":"ignore","scrubOnAdd":false,"scrubOnDel":true}`))
	if err != nil {
		t.Fatal(err)
	}
	if conf.Socket != "/run/x/s.sock" || time.Duration(conf.Timeout) != 1500*time.Millisecond ||
		conf.FailurePolicy != PolicyIgnore || conf.ScrubsOnAdd() || !conf.ScrubsOnDel() {
		t.Fatalf("got %+v", conf)
	}
}

// The runtime injects keys the operator never writes; they must not trip the
// unknown-field check.
func TestParseConfigAcceptsRuntimeKeys(t *testing.T) {
	in := `{"cniVersion":"1.1.0","name":"pods","type":"ctscrub",
		"capabilities":{"portMappings":true},
		"runtimeConfig":{"portMappings":[{"hostPort":80,"containerPort":8080}]},
		"args":{"cni":{"ips":["10.0.0.5"]}},
		"dns":{"nameservers":["10.96.0.10"]},
		"cni.dev/valid-attachments":[{"containerID":"abc","ifname":"eth0"}],
		"cni.dev/attachments":[{"containerID":"abc","ifname":"eth0"}],
		"prevResult":{"cniVersion":"1.1.0","ips":[{"address":"10.0.0.5/24"}]}}`
	conf, err := parseConfig([]byte(in))
	if err != nil {
		t.Fatal(err)
	}
	if !conf.HasPrevResult() || len(conf.ValidAttachments) != 1 {
		t.Fatalf("prevResult %s, valid attachments %v", conf.RawPrevResult, conf.ValidAttachments)
	}
}

func TestParseConfigErrors(t *testing.T) {
	for _, tc := range []struct {
		name, in, want string
	}{
		{"unknown field", `{"cniVersion":"1.0.0","name":"n","type":"ctscrub","sokcet":"/run/x.sock"}`, `unknown field "sokcet"`},
		{"bad failurePolicy", `{"cniVersion":"1.0.0","name":"n","type":"ctscrub","failurePolicy":"retry"}`, `failurePolicy "retry": must be "fail" or "ignore"`},
		{"timeout number", `{"cniVersion":"1.0.0","name":"n","type":"ctscrub","timeout":30}`, `duration string`},
		{"timeout unparsable", `{"cniVersion":"1.0.0","name":"n","type":"ctscrub","timeout":"soon"}`, `timeout "soon"`},
		{"timeout negative", `{"cniVersion":"1.0.0","name":"n","type":"ctscrub","timeout":"-1s"}`, `must be above 0`},
		{"timeout above runtime", `{"cniVersion":"1.0.0","name":"n","type":"ctscrub","timeout":"5m"}`, `below the runtime's own deadline`},
		{"relative socket", `{"cniVersion":"1.0.0","name":"n","type":"ctscrub","socket":"scrubd.sock"}`, `absolute path`},
		{"bool as string", `{"cniVersion":"1.0.0","name":"n","type":"ctscrub","scrubOnAdd":"yes"}`, `scrubOnAdd`},
		{"trailing data", `{"cniVersion":"1.0.0","name":"n","type":"ctscrub"} {}`, `trailing data`},
		{"bad prevResult", `{"cniVersion":"1.0.0","name":"n","type":"ctscrub","prevResult":{"ips":[{"address":"not-an-ip"}]}}`, `prevResult`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parseConfig([]byte(tc.in))
			e := mustCNIError(t, err, types.ErrInvalidNetworkConfig)
			if !strings.Contains(e.Msg, tc.want) {
				t.Fatalf("error %q does not say %q", e.Msg, tc.want)
			}
			if !strings.Contains(e.Details, "/etc/cni/net.d") {
				t.Fatalf("error details %q do not say where to fix it", e.Details)
			}
		})
	}
}

// mustCNIError fails unless err is a CNI error with code.
func mustCNIError(t *testing.T, err error, code uint) *types.Error {
	t.Helper()
	var e *types.Error
	if !errors.As(err, &e) {
		t.Fatalf("got %v (%T), want a CNI error with code %d", err, err, code)
	}
	if e.Code != code {
		t.Fatalf("code %d (%s), want %d", e.Code, e.Msg, code)
	}
	if e.Msg == "" {
		t.Fatal("empty error message")
	}
	return e
}

func FuzzParseConfig(f *testing.F) {
	for _, s := range []string{
		`{"cniVersion":"1.0.0","name":"pods","type":"ctscrub"}`,
		`{"cniVersion":"0.3.1","name":"pods","type":"ctscrub","socket":"/run/ctscrub/scrubd.sock","timeout":"10s","failurePolicy":"ignore","scrubOnAdd":true,"scrubOnDel":false}`,
		`{"cniVersion":"0.4.0","name":"pods","type":"ctscrub","prevResult":{"cniVersion":"0.4.0","interfaces":[{"name":"eth0","sandbox":"/var/run/netns/p"}],"ips":[{"version":"4","address":"10.1.0.2/24","interface":0}]}}`,
		`{"cniVersion":"1.1.0","name":"pods","type":"ctscrub","cni.dev/valid-attachments":[{"containerID":"a","ifname":"eth0"}],"runtimeConfig":{}}`,
		`{"cniVersion":"1.0.0","name":"pods","type":"ctscrub","prevResult":{"ips":[{"address":"fd00::2/64","gateway":"fd00::1"}],"routes":[{"dst":"0.0.0.0/0"}]}}`,
		`{"timeout":"1h"}`, `[]`, `null`, ``,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		conf, err := parseConfig(data)
		if err != nil {
			var e *types.Error
			if !errors.As(err, &e) || e.Code != types.ErrInvalidNetworkConfig || e.Msg == "" {
				t.Fatalf("error %v (%T) is not a CNI invalid-config error", err, err)
			}
			return
		}
		if !filepath.IsAbs(conf.Socket) {
			t.Fatalf("accepted socket %q", conf.Socket)
		}
		if d := time.Duration(conf.Timeout); d <= 0 || d > MaxTimeout {
			t.Fatalf("accepted timeout %s", d)
		}
		if conf.FailurePolicy != PolicyFail && conf.FailurePolicy != PolicyIgnore {
			t.Fatalf("accepted failurePolicy %q", conf.FailurePolicy)
		}
		if conf.HasPrevResult() {
			// What ADD does with it must not panic either.
			_, _, _ = prevResultAddrs(conf, "eth0")
		}
	})
}
