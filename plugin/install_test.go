package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// What Cilium's agent writes (v1.16, default options).
const ciliumConflist = `{
  "cniVersion": "0.3.1",
  "name": "cilium",
  "plugins": [
    {
       "type": "cilium-cni",
       "enable-debug": false,
       "log-file": "/var/run/cilium/cilium-cni.log"
    }
  ]
}
`

func pluginTypes(t *testing.T, path string) []string {
	t.Helper()
	list, err := readConflist(path)
	if err != nil {
		t.Fatal(err)
	}
	var types []string
	for _, p := range list["plugins"].([]any) {
		types = append(types, p.(map[string]any)["type"].(string))
	}
	return types
}

func TestInstallChainsAfterCilium(t *testing.T) {
	bin, conf := t.TempDir(), t.TempDir()
	path := filepath.Join(conf, "05-cilium.conflist")
	os.WriteFile(path, []byte(ciliumConflist), 0o644)
	// A config that sorts after Cilium's and has no cilium-cni: left alone.
	other := filepath.Join(conf, "10-other.conflist")
	os.WriteFile(other, []byte(`{"cniVersion":"1.0.0","name":"x","plugins":[{"type":"bridge"}]}`), 0o644)

	var out bytes.Buffer
	if err := runSubcommand("install", []string{"--bin-dir", bin, "--conf-dir", conf}, &out); err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(pluginTypes(t, path), ","); got != "cilium-cni,ctscrub" {
		t.Fatalf("plugins %s, want cilium-cni,ctscrub", got)
	}
	list, _ := readConflist(path)
	cilium := list["plugins"].([]any)[0].(map[string]any)
	if cilium["log-file"] != "/var/run/cilium/cilium-cni.log" || list["cniVersion"] != "0.3.1" {
		t.Fatalf("Cilium's own settings changed: %v", list)
	}
	entry, _ := json.Marshal(list["plugins"].([]any)[1])
	if _, err := parseConfig(append(entry[:len(entry)-1], []byte(`,"cniVersion":"0.3.1","name":"cilium"}`)...)); err != nil {
		t.Fatalf("inserted entry %s does not parse: %v", entry, err)
	}
	st, err := os.Stat(filepath.Join(bin, "ctscrub"))
	if err != nil || st.Mode().Perm() != 0o755 {
		t.Fatalf("plugin binary: %v, %v", st, err)
	}
	if b, _ := os.ReadFile(other); !strings.Contains(string(b), `"bridge"`) || strings.Contains(string(b), "ctscrub") {
		t.Fatalf("other conflist changed: %s", b)
	}

	// Idempotent: a second run changes nothing and says nothing.
	first, _ := os.ReadFile(path)
	out.Reset()
	if err := runSubcommand("install", []string{"--bin-dir", bin, "--conf-dir", conf}, &out); err != nil {
		t.Fatal(err)
	}
	if again, _ := os.ReadFile(path); !bytes.Equal(first, again) || out.Len() != 0 {
		t.Fatalf("second install changed the file or wrote %q", out.String())
	}

	// Cilium rewrites its file (agent restart): install puts the entry back.
	os.WriteFile(path, []byte(ciliumConflist), 0o644)
	if err := runSubcommand("install", []string{"--bin-dir", bin, "--conf-dir", conf}, &out); err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(pluginTypes(t, path), ","); got != "cilium-cni,ctscrub" {
		t.Fatalf("after Cilium's rewrite: %s", got)
	}

	// An entry the operator tuned stays, unless --replace.
	os.WriteFile(path, []byte(strings.Replace(ciliumConflist, `"log-file": "/var/run/cilium/cilium-cni.log"
    }`, `"log-file": "/var/run/cilium/cilium-cni.log"
    },
    {"type": "ctscrub", "failurePolicy": "ignore"}`, 1)), 0o644)
	tuned, _ := os.ReadFile(path)
	if err := runSubcommand("install", []string{"--bin-dir", bin, "--conf-dir", conf}, &out); err != nil {
		t.Fatal(err)
	}
	if again, _ := os.ReadFile(path); !bytes.Equal(tuned, again) {
		t.Fatalf("install changed an entry the operator tuned:\n%s", again)
	}
	if err := runSubcommand("install", []string{"--bin-dir", bin, "--conf-dir", conf, "--replace"}, &out); err != nil {
		t.Fatal(err)
	}
	if again, _ := os.ReadFile(path); bytes.Contains(again, []byte("ignore")) || !bytes.Contains(again, []byte(`"fail"`)) {
		t.Fatalf("--replace kept the old entry:\n%s", again)
	}

	if err := runSubcommand("uninstall", []string{"--conf-dir", conf, "--bin-dir", bin, "--remove-binary"}, &out); err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(pluginTypes(t, path), ","); got != "cilium-cni" {
		t.Fatalf("after uninstall: %s", got)
	}
	if _, err := os.Stat(filepath.Join(bin, "ctscrub")); !os.IsNotExist(err) {
		t.Fatalf("binary still there: %v", err)
	}
}

func TestInstallErrors(t *testing.T) {
	conf := t.TempDir()
	os.WriteFile(filepath.Join(conf, "10-bridge.conflist"), []byte(`{"cniVersion":"1.0.0","name":"x","plugins":[{"type":"bridge"}]}`), 0o644)
	for name, tc := range map[string]struct {
		args []string
		want string
	}{
		"no cilium conflist": {nil, `no *.conflist in ` + conf + ` has a plugin of type "cilium-cni"`},
		"bad entry":          {[]string{"--entry", `{"type":"ctscrub","failurePolicy":"maybe"}`}, `failurePolicy "maybe"`},
		"entry not ctscrub":  {[]string{"--entry", `{"type":"bridge"}`}, `"type": "ctscrub"`},
	} {
		err := runSubcommand("install", append([]string{"--bin-dir", t.TempDir(), "--conf-dir", conf}, tc.args...), &bytes.Buffer{})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want it to say %q", name, err, tc.want)
		}
	}
}

// An init container started before Cilium wrote its conflist: with --wait
// install keeps trying and chains ctscrub as soon as the conflist appears,
// saying once why it waits; without a conflist it fails when --wait is up.
func TestInstallWaitsForConflist(t *testing.T) {
	bin, conf := t.TempDir(), t.TempDir()
	path := filepath.Join(conf, "05-cilium.conflist")
	go func() {
		time.Sleep(1500 * time.Millisecond)
		os.WriteFile(path, []byte(ciliumConflist), 0o644)
	}()
	var out bytes.Buffer
	if err := runSubcommand("install", []string{"--bin-dir", bin, "--conf-dir", conf, "--wait", "1m"}, &out); err != nil {
		t.Fatalf("install --wait: %v\n%s", err, out.String())
	}
	if got := strings.Join(pluginTypes(t, path), ","); got != "cilium-cni,ctscrub" {
		t.Fatalf("plugins %s, want cilium-cni,ctscrub", got)
	}
	if n := strings.Count(out.String(), "trying again every"); n != 1 {
		t.Errorf("the wait was reported %d times, want once:\n%s", n, out.String())
	}

	empty := t.TempDir()
	start := time.Now()
	err := runSubcommand("install", []string{"--bin-dir", bin, "--conf-dir", empty, "--wait", "1500ms"}, &out)
	if err == nil || !strings.Contains(err.Error(), "cilium-cni") {
		t.Fatalf("install --wait without a conflist: %v, want the error naming what is missing", err)
	}
	if took := time.Since(start); took < 1500*time.Millisecond {
		t.Errorf("gave up after %s, before --wait's 1.5s", took)
	}
}
