package daemon

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// enableConflistWatch adds the conflist watch (cni_conf_dir) to the tasks.
func (d *Daemon) enableConflistWatch() error {
	dir := d.cfg.CNIConfDir
	if dir == "" {
		return nil
	}
	d.chained = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "ctscrub_cni_chained",
		Help: "1 when the runtime's CNI config (cni_conf_dir) chains ctscrub; 0 when pods may start unseen.",
	})
	if err := d.m.reg.Register(d.chained); err != nil {
		return err
	}
	d.tasks = append(d.tasks, Task{Name: "conflist", Run: func(ctx context.Context) error {
		d.watchConflist(ctx, dir, 5*time.Second)
		return nil
	}})
	return nil
}

// watchConflist checks every interval that the runtime's CNI config (the
// first config file in dir, as containerd and CRI-O pick it) chains ctscrub;
// while it does not, pods are created that the recorder never sees.
func (d *Daemon) watchConflist(ctx context.Context, dir string, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		chained, file := conflistChains(dir)
		d.noteConflist(chained, file)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// conflistChains reports whether the first CNI config file in dir (sorted by
// name: the one the runtime uses) has a plugin of type ctscrub. No config at
// all is "not chained" (pods cannot start then, but the next one may come
// without ctscrub).
func conflistChains(dir string) (bool, string) {
	path, ok := conflistRuns(dir, "ctscrub")
	return ok, path
}

// conflistRuns reports whether the first CNI config file in dir runs a
// plugin of type typ, and names the file ("" when there is none).
func conflistRuns(dir, typ string) (string, bool) {
	if dir == "" {
		return "", false
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return "", false
	}
	var names []string
	for _, e := range ents {
		n := e.Name()
		if !e.IsDir() && (strings.HasSuffix(n, ".conflist") || strings.HasSuffix(n, ".conf") || strings.HasSuffix(n, ".json")) {
			names = append(names, n)
		}
	}
	slices.Sort(names)
	if len(names) == 0 {
		return "", false
	}
	path := filepath.Join(dir, names[0])
	data, err := os.ReadFile(path)
	if err != nil {
		return path, false
	}
	var conf struct {
		Type    string `json:"type"`
		Plugins []struct {
			Type string `json:"type"`
		} `json:"plugins"`
	}
	if json.Unmarshal(data, &conf) != nil {
		return path, false
	}
	for _, p := range conf.Plugins {
		if p.Type == typ {
			return path, true
		}
	}
	return path, conf.Type == typ
}

// noteConflist records one check of the runtime's CNI config: the state
// ownership keeps (own.chained), the gauge, and, while the config does not
// chain ctscrub, the sign of an unseen owner. All of the watch's effects on
// ownership go through here.
func (d *Daemon) noteConflist(chained bool, file string) {
	dir := d.cfg.CNIConfDir
	d.own.mu.Lock()
	was := d.own.chained
	d.own.chained = &chained
	d.own.mu.Unlock()
	d.chained.Set(b2f(chained))
	if !chained {
		if was == nil || *was {
			d.unseenOwner("the CNI config does not chain ctscrub", "conf_dir", dir, "file", file)
		} else {
			d.own.distrust()
		}
	} else if was != nil && !*was {
		d.log.Info("the CNI config chains ctscrub again", "conf_dir", dir, "file", file)
	}
}
