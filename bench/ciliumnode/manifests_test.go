package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The operator's files still template the way the benchmark needs.
func TestManifests(t *testing.T) {
	root := filepath.Join("..", "..")
	raw, err := os.ReadFile(filepath.Join(root, "conf", "scrubd.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, mode := range []string{"off", "sweep"} {
		c, err := scrubdConf(string(raw), "10.244.0.0/16", mode)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(c, "mode: "+mode) || strings.Contains(c, "10.0.0.0/8") {
			t.Errorf("mode %s:\n%s", mode, c)
		}
	}
	if _, err := scrubdConf("pod_cidrs: [10.1.0.0/16]\n", "10.244.0.0/16", "off"); err == nil {
		t.Error("a config without the example range and an expiry mode was templated without complaint")
	}
	raw, err = os.ReadFile(filepath.Join(root, "conf", "daemonset.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	ds, err := daemonSet(string(raw), "ctscrub:bench")
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(ds, "image: ctscrub:bench"); n < 2 {
		t.Errorf("%d containers on the bench image", n)
	}
	if p := benchPods("ns", "x", "node", "pause:1", 3); strings.Count(p, "kind: Pod") != 3 || !strings.Contains(p, "name: x-2") {
		t.Errorf("benchPods:\n%s", p)
	}
}
