package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// Flags given on the command line win over the config file; the file wins
// over the defaults.
func TestRunConfigPrecedence(t *testing.T) {
	file := filepath.Join(t.TempDir(), "scrubd.yaml")
	os.WriteFile(file, []byte("pod_cidrs: [10.1.0.0/16]\nqueue_limit: 10\nmax_in_flight: 4\nshutdown_grace: 9s\nexpiry:\n  mode: report\n"), 0o600)
	cfg, err := runConfig([]string{"--config", file, "--queue-limit", "20", "--pod-cidr", "10.2.0.0/16,fd00::/104", "--expiry-mode", "off"})
	if err != nil {
		t.Fatal(err)
	}
	if cfg.QueueLimit != 20 || cfg.MaxInFlight != 4 || cfg.ShutdownGrace.Duration != 9*time.Second || cfg.Expiry.Mode != "off" {
		t.Errorf("config %+v: want queue 20 (flag), in flight 4 and grace 9s (file), expiry off (flag)", cfg)
	}
	cidrs, err := cfg.Validate()
	if err != nil || len(cidrs) != 2 || cidrs[0].String() != "10.2.0.0/16" {
		t.Errorf("pod CIDRs %v (%v): want the flag's two", cidrs, err)
	}
	cfg, err = runConfig([]string{"--config", file})
	if err != nil || len(cfg.PodCIDRs) != 1 || cfg.PodCIDRs[0] != "10.1.0.0/16" || cfg.Socket != "/run/ctscrub/scrubd.sock" {
		t.Errorf("file only: %+v, %v", cfg, err)
	}
	if _, err := runConfig([]string{"--shutdown-grace", "soon"}); err == nil || !strings.Contains(err.Error(), "soon") {
		t.Errorf("bad duration flag: %v", err)
	}
	if _, err := runConfig([]string{"extra"}); err == nil {
		t.Errorf("stray argument accepted")
	}
}
