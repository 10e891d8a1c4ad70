package daemon

import (
	"context"
	"errors"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/cilium"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

// CiliumStats reports the occupancy of Cilium's global CT maps through the
// Cilium backend's Count (the kernel's element counter where the kernel has
// one, else a counting walk in the kernel).
func CiliumStats(maps *ctmap.Maps, c *cilium.Backend) StatsSource {
	return ciliumStats{maps: maps, c: c}
}

type ciliumStats struct {
	maps *ctmap.Maps
	c    *cilium.Backend
}

func (s ciliumStats) CTStats(ctx context.Context) ([]api.MapStats, error) {
	var out []api.MapStats
	var errs []error
	maps := s.c.Maps() // the backend's: other ones once Cilium re-created them
	for _, k := range ctmap.Kinds {
		if maps.Map(k) == nil {
			continue
		}
		st := api.MapStats{Backend: s.c.Name(), Map: k.Name(), MaxEntries: int64(maps.MaxEntries(k)), Entries: -1}
		if ctx.Err() == nil {
			n, err := s.c.Count(k)
			if err != nil {
				errs = append(errs, err)
			} else {
				st.Entries = n
			}
		}
		out = append(out, st)
	}
	return out, errors.Join(errs...)
}
