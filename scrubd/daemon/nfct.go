package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"os"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/nfct"
)

// Help of the index metrics, shared by every backend's series: a registry
// accepts one name with several backend labels only when the help matches.
const (
	HelpIndexKeys       = "(IP, CT entry) pairs in the index, per backend."
	HelpIndexIncomplete = "IPs whose index cannot prove completeness, per backend; their next scrub sweeps (nfct: falls back to the filtered flush or a dump)."
	HelpIndexLost       = "Index events lost, per backend (cilium: recorder records, ring buffer full; nfct: conntrack events the kernel dropped on the event socket); the IPs they may concern were marked incomplete."
)

// OpenNFCT starts the nf_conntrack backend on the host's table. With auto it
// returns (nil, nil), leaving the backend off, when nf_conntrack is not
// loaded, or when Cilium's maps are present and nf_conntrack holds no flow of
// a pod IP (Cilium with its kube-proxy replacement keeps pod flows in its own
// maps only).
//
// fallback is the nfct_fallback setting: "" or "auto", "flush", "dump".
func OpenNFCT(cidrs []netip.Prefix, fallback string, auto, ciliumPresent, peers bool, log *slog.Logger) (*nfct.NFCT, error) {
	fb := nfct.Fallback(fallback)
	switch fb {
	case "auto":
		fb = nfct.FallbackAuto
	case nfct.FallbackAuto, nfct.FallbackFlush, nfct.FallbackDump:
	default:
		return nil, fmt.Errorf("nfct_fallback %q: want auto, flush or dump", fallback)
	}
	if _, err := os.Stat("/proc/sys/net/netfilter/nf_conntrack_max"); err != nil {
		if auto {
			log.Info("nf_conntrack not loaded: nfct backend off")
			return nil, nil
		}
		return nil, fmt.Errorf("nfct backend: nf_conntrack is not loaded on this node (/proc/sys/net/netfilter/nf_conntrack_max: %v)", err)
	}
	n, err := nfct.New(nfct.Config{PodCIDRs: cidrs, Fallback: fb, Peers: peers})
	if err != nil {
		if auto {
			log.Warn("nfct backend off", "err", err)
			return nil, nil
		}
		return nil, fmt.Errorf("nfct backend: %w", err)
	}
	if st := n.Stats(); auto && ciliumPresent && st.Keys == 0 {
		n.Close()
		log.Info("nf_conntrack holds no pod flows beside Cilium's maps: nfct backend off")
		return nil, nil
	}
	st := n.Stats()
	log.Info("nfct backend on", "indexed_entries", st.Keys, "ips", st.IPs,
		"event_buffer_bytes", st.EventBuffer, "filtered_flush", st.FilteredFlush)
	return n, nil
}

// NFCTStats reports nf_conntrack's occupancy from the kernel's global stats
// (no walk): ctscrub_ct_entries / ctscrub_ct_max_entries{backend="nfct",map="nf_conntrack"}.
func NFCTStats(n *nfct.NFCT) StatsSource { return nfctStats{n} }

type nfctStats struct{ n *nfct.NFCT }

func (s nfctStats) CTStats(context.Context) ([]api.MapStats, error) {
	st := api.MapStats{Backend: s.n.Name(), Map: nfct.MapName, Entries: -1}
	entries, maxEntries, err := s.n.Count()
	if err == nil {
		st.Entries, st.MaxEntries = entries, maxEntries
	}
	return []api.MapStats{st}, err
}
