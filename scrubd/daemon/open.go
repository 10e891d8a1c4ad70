package daemon

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// Open builds the daemon a node needs from cfg: the index, the backends the
// config asks for (or finds, with backends: auto), and the recorder.
func Open(cfg Config, log *slog.Logger, version string) (*Daemon, error) {
	cidrs, err := cfg.Validate()
	if err != nil {
		return nil, err
	}
	want, _ := ParseBackends(cfg.Backends)
	auto := want == nil
	ix := index.New(index.Config{PodCIDRs: cidrs})
	opts := Options{Config: cfg, Index: ix, Logger: log, Version: version}
	var closers []func() error
	fail := func(err error) (*Daemon, error) {
		for _, c := range slices.Backward(closers) {
			c()
		}
		return nil, err
	}

	if auto || slices.Contains(want, "cilium") {
		maps, err := ctmap.Open(cfg.CTRoot)
		switch {
		case err == nil:
			closers = append(closers, maps.Close)
			c, err := scrub.NewCilium(maps, ix, scrub.CiliumOptions{})
			if err != nil {
				return fail(fmt.Errorf("cilium backend: load the sweep programs: %w", err))
			}
			opts.Backends = append(opts.Backends, closeMapsToo{c, maps})
			opts.Stats = append(opts.Stats, CiliumStats(maps, c))
			rec, err := openRecorder(cfg, log)
			if err != nil {
				c.Close()
				return fail(err)
			}
			opts.Recorder = rec
		case auto && errors.Is(err, os.ErrNotExist):
			log.Info("Cilium's CT maps not found: cilium backend off", "ct_root", cfg.CTRoot)
		default:
			return fail(fmt.Errorf("cilium backend: %w", err))
		}
	}
	if slices.Contains(want, "nfct") {
		return fail(errors.New("backend nfct: not built into this scrubd yet"))
	}
	d, err := New(opts)
	if err != nil {
		for _, b := range opts.Backends {
			b.Close()
		}
		if opts.Recorder != nil {
			opts.Recorder.Close()
		}
		return nil, err
	}
	return d, nil
}

// closeMapsToo closes the CT maps with the backend that uses them.
type closeMapsToo struct {
	*scrub.Cilium
	maps *ctmap.Maps
}

func (c closeMapsToo) Close() error { return errors.Join(c.Cilium.Close(), c.maps.Close()) }

// openRecorder loads the recorder (scrubd/recorder) with its maps and links
// pinned under cfg.PinDir, so they outlive a daemon restart.
func openRecorder(cfg Config, log *slog.Logger) (Recorder, error) {
	rec, err := recorder.Load(recorder.Options{PinDir: cfg.PinDir, CTRoot: cfg.CTRoot, Log: log})
	if err != nil {
		return nil, err
	}
	return rec, nil
}
