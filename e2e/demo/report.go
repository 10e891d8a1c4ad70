package main

// What the demo prints at the end: the summary of every scrub beside the
// walks, a few of scrubd's metrics, and the RESULT line.

import (
	"bufio"
	"context"
	"encoding/json"
	"net/http"
	"sort"
	"strings"
	"time"

	"github.com/ctscrub/ctscrub/internal/netnsnode"
)

// row is one scrub for the summary.
type row struct {
	Step     string        `json:"step"`
	Pod      string        `json:"pod"`
	IPs      string        `json:"ips"`
	Reason   string        `json:"reason"`
	Method   string        `json:"method"`
	Deleted  int           `json:"deleted"`
	Latency  time.Duration `json:"latency_ns"`
	Result   string        `json:"result"`
	CNITotal time.Duration `json:"cni_ns"`
}

// reuseCheck is what a new pod found on an IP a deleted pod had.
type reuseCheck struct {
	IP        string `json:"ip"`
	OldPod    string `json:"old_pod"`
	NewPod    string `json:"new_pod"`
	OldHad    int    `json:"old_entries_before_del"`
	LeftAtDel int    `json:"left_after_del"`
	Inherited int    `json:"inherited_by_new_pod"`
}

func (s *session) summary() {
	p := s.p
	p.section("Summary: every scrub, beside one full walk of the same maps")
	if len(s.rows) == 0 {
		p.f("   no scrubs were logged (is bin/ctscrub in the chain?)\n")
		return
	}
	p.f("   %-4s %-6s %-13s %-7s %-8s %10s %12s %-10s %12s\n", "CNI", "pod", "IPv4", "reason", "method", "deleted", "latency", "result", "CNI call")
	var idx []time.Duration
	for _, r := range s.rows {
		p.f("   %-4s %-6s %-13s %-7s %-8s %10s %12s %-10s %12s\n", r.Step, r.Pod, strings.Fields(r.IPs + " -")[0], r.Reason, r.Method, netnsnode.Num(r.Deleted), netnsnode.Dur(r.Latency), r.Result, netnsnode.Dur(r.CNITotal))
		if r.Method == "index" && r.Deleted > 0 {
			idx = append(idx, r.Latency)
		}
	}
	p.f("   one full walk of the same maps, for comparison (what Cilium does for each of the scrubs above):\n")
	p.f("   %-4s %-6s %-13s %-7s %-8s %10s %12s   (found; %s entries read)\n", "-", "-", "-", "-", "nextkey", netnsnode.Num(s.walkNK.Matches), netnsnode.Dur(s.walkNK.Duration), netnsnode.Num(s.walkNK.Entries))
	p.f("   %-4s %-6s %-13s %-7s %-8s %10s %12s   (found; %s entries read)\n", "-", "-", "-", "-", "batch", netnsnode.Num(s.walkB.Matches), netnsnode.Dur(s.walkB.Duration), netnsnode.Num(s.walkB.Entries))
	if len(idx) > 0 {
		// Compare the slowest index scrub that deleted a pod's entries (the
		// DELs): the conservative ratio, not a best case.
		sort.Slice(idx, func(i, j int) bool { return idx[i] < idx[j] })
		worst := max(idx[len(idx)-1], time.Microsecond)
		p.f("   slowest index scrub that deleted a pod's entries: %s, %s faster than Cilium 1.16's walk and\n",
			netnsnode.Dur(worst), ratio(s.walkNK.Duration, worst))
		p.f("   %s faster than the batch walk of the same maps in the same run; the walk grows with ENTRIES, the index scrub does not.\n",
			ratio(s.walkB.Duration, worst))
	}
}

func ratio(a, b time.Duration) string { return netnsnode.Num(int(float64(a)/float64(b))) + "x" }

// metrics prints where scrubd's metrics are and a few of their lines.
func (s *session) metrics(ctx context.Context) {
	p := s.p
	url := "http://" + s.d.Metrics + "/metrics"
	p.section("Metrics: " + url + " (curl it while the demo runs)")
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		p.f("   could not read them: %v\n", err)
		return
	}
	defer resp.Body.Close()
	// A few families a newcomer reads first, in this order.
	want := []string{"ctscrub_scrub_duration_seconds_count", "ctscrub_index_keys", "ctscrub_index_incomplete_ips", "ctscrub_ct_entries"}
	shown := make([][]string, len(want))
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		l := sc.Text()
		if strings.HasPrefix(l, "#") || strings.Contains(l, `state="expired"`) {
			continue
		}
		for i, w := range want {
			if strings.HasPrefix(l, w+"{") || strings.HasPrefix(l, w+" ") {
				shown[i] = append(shown[i], l)
			}
		}
	}
	for _, lines := range shown {
		for _, l := range lines {
			p.f("   %s\n", l)
		}
	}
	p.f("   (and ctscrub_scrub_deleted_entries_total per map and method, histograms, ...: curl the URL)\n")
}

// printJSON ends the output with one JSON line for scripts and the CI test.
func (s *session) printJSON() {
	b, _ := json.Marshal(map[string]any{
		"entries":        s.cfg.Entries,
		"scrubs":         s.rows,
		"nextkey_walk_s": s.walkNK.Duration.Seconds(),
		"batch_walk_s":   s.walkB.Duration.Seconds(),
		"walk_entries":   s.walkNK.Entries,
		"reuse":          s.reuse,
		"audit_ips":      s.audited.IPs,
		"audit_missing":  s.audited.Missing,
		"metrics":        "http://" + s.d.Metrics + "/metrics",
	})
	s.p.f("\nRESULT %s\n", b)
}
