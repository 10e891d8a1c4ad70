package main

import (
	"bufio"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"time"
)

// parseLogfmt splits one log line of key=value pairs (slog's and logrus's
// text formats; values may be quoted with Go escapes) into a map. Text before
// the first key (kubectl's --timestamps prefix, journald's) is skipped: a
// key starts at a letter.
func parseLogfmt(line string) map[string]string {
	out := map[string]string{}
	i := 0
	for i < len(line) {
		for i < len(line) && line[i] == ' ' {
			i++
		}
		start := i
		for i < len(line) && line[i] != '=' && line[i] != ' ' {
			i++
		}
		if i >= len(line) || line[i] != '=' {
			// A bare word (no '='): skip it.
			continue
		}
		key := line[start:i]
		i++ // '='
		var val string
		if i < len(line) && line[i] == '"' {
			j := i + 1
			var b strings.Builder
			for j < len(line) && line[j] != '"' {
				if line[j] == '\\' && j+1 < len(line) {
					j++
					switch line[j] {
					case 'n':
						b.WriteByte('\n')
					case 't':
						b.WriteByte('\t')
					default:
						b.WriteByte(line[j])
					}
				} else {
					b.WriteByte(line[j])
				}
				j++
			}
			val = b.String()
			i = j + 1
		} else {
			j := i
			for j < len(line) && line[j] != ' ' {
				j++
			}
			val = line[i:j]
			i = j
		}
		if key != "" {
			out[key] = val
		}
	}
	return out
}

// logTime parses a log line's time field: RFC 3339 with any fraction (slog's
// milliseconds, Cilium's and containerd's nanoseconds).
func logTime(f map[string]string) (time.Time, bool) {
	t, err := time.Parse(time.RFC3339Nano, f["time"])
	return t, err == nil
}

// regen is one "Completed endpoint regeneration" (or failed) line of the
// Cilium agent, logged at debug level with the regeneration's statistics
// (pkg/endpoint/policy.go, Cilium 1.18).
type regen struct {
	Pod         string // namespace/name
	EndpointID  string
	Time        time.Time
	CTClean     time.Duration // waitingForCTClean
	Total       time.Duration
	Failed      bool
	Reason      string
	HasStatsFor bool // the line carried waitingForCTClean
}

// parseRegens picks the regeneration lines of the pods whose
// "namespace/name" passes keep.
func parseRegens(logs string, keep func(pod string) bool) []regen {
	var out []regen
	sc := bufio.NewScanner(strings.NewReader(logs))
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.Contains(line, "endpoint regeneration") && !strings.Contains(line, "Regeneration of endpoint failed") {
			continue
		}
		f := parseLogfmt(line)
		msg := f["msg"]
		if msg != "Completed endpoint regeneration" && msg != "Regeneration of endpoint failed" {
			continue
		}
		pod := f["k8sPodName"]
		if !keep(pod) {
			continue
		}
		r := regen{Pod: pod, EndpointID: f["endpointID"], Failed: msg != "Completed endpoint regeneration", Reason: f["reason"]}
		r.Time, _ = logTime(f)
		if v, ok := f["waitingForCTClean"]; ok {
			r.CTClean, _ = time.ParseDuration(v)
			r.HasStatsFor = true
		}
		if v, ok := f["total"]; ok {
			r.Total, _ = time.ParseDuration(v)
		}
		out = append(out, r)
	}
	return out
}

// cniCall is one cilium-cni ADD or DEL, from its log file: from "Processing
// CNI ADD request" to "Endpoint successfully created", or from "Processing
// CNI DEL request" to "CNI DEL processing complete", paired by eventID.
type cniCall struct {
	Cmd         string // ADD or DEL
	Pod         string // namespace/name (from the lines after the CNI args are read)
	ContainerID string
	Start, End  time.Time
	Done        bool // the closing line was seen
}

func (c cniCall) Duration() time.Duration { return c.End.Sub(c.Start) }

var cniMsgs = map[string]struct {
	cmd   string
	start bool
}{
	"Processing CNI ADD request":    {"ADD", true},
	"Endpoint successfully created": {"ADD", false},
	"Processing CNI DEL request":    {"DEL", true},
	"CNI DEL processing complete":   {"DEL", false},
}

// parseCNILog pairs cilium-cni's debug lines (written with enable-debug, to
// its log-file) into calls, in the order they started.
func parseCNILog(logs string) []cniCall {
	byEvent := map[string]*cniCall{}
	var order []string
	sc := bufio.NewScanner(strings.NewReader(logs))
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.Contains(line, "CNI") && !strings.Contains(line, "Endpoint successfully created") {
			continue
		}
		f := parseLogfmt(line)
		m, ok := cniMsgs[f["msg"]]
		if !ok {
			continue
		}
		ev := f["eventID"]
		if ev == "" {
			continue
		}
		t, ok := logTime(f)
		if !ok {
			continue
		}
		c := byEvent[ev]
		if c == nil {
			c = &cniCall{Cmd: m.cmd}
			byEvent[ev] = c
			order = append(order, ev)
		}
		if id := f["containerID"]; id != "" {
			c.ContainerID = id
		}
		if ns, pod := f["k8sNamespace"], f["k8sPodName"]; pod != "" {
			c.Pod = ns + "/" + pod
		}
		if m.start {
			c.Start = t
		} else {
			c.End = t
			c.Done = true
		}
	}
	var out []cniCall
	for _, ev := range order {
		if c := byEvent[ev]; !c.Start.IsZero() {
			out = append(out, *c)
		}
	}
	return out
}

// sandbox is one pod's RunPodSandbox and StopPodSandbox as containerd's CRI
// plugin logs them (containerd 1.6, info level).
type sandbox struct {
	Pod       string // namespace/name
	Start     time.Time
	Ready     time.Time // first "returns sandbox id"
	ID        string
	Failures  int // "RunPodSandbox ... failed" lines (the kubelet retries)
	LastError string
	StopStart time.Time // first StopPodSandbox of the sandbox
	StopEnd   time.Time // its "returns successfully"
}

var (
	reRunMeta = regexp.MustCompile(`^RunPodSandbox for &PodSandboxMetadata\{Name:([^,]*),Uid:[^,]*,Namespace:([^,]*),`)
	reRunDone = regexp.MustCompile(`returns sandbox id "([0-9a-f]+)"$`)
	reStop    = regexp.MustCompile(`^StopPodSandbox for "([0-9a-f]+)"( returns successfully)?$`)
)

// parseContainerd reads containerd's log (journalctl -o cat) into the
// sandboxes of the pods keep selects.
func parseContainerd(logs string, keep func(pod string) bool) map[string]*sandbox {
	out := map[string]*sandbox{}
	byID := map[string]*sandbox{}
	sc := bufio.NewScanner(strings.NewReader(logs))
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.Contains(line, "PodSandbox for") {
			continue
		}
		f := parseLogfmt(line)
		msg := f["msg"]
		t, ok := logTime(f)
		if !ok {
			continue
		}
		if m := reRunMeta.FindStringSubmatch(msg); m != nil {
			pod := m[2] + "/" + m[1]
			if !keep(pod) {
				continue
			}
			s := out[pod]
			if s == nil {
				s = &sandbox{Pod: pod}
				out[pod] = s
			}
			switch {
			case strings.HasSuffix(msg, "failed, error"):
				s.Failures++
				s.LastError = f["error"]
			case reRunDone.MatchString(msg):
				if s.Ready.IsZero() {
					s.Ready = t
					s.ID = reRunDone.FindStringSubmatch(msg)[1]
					byID[s.ID] = s
				}
			default:
				if s.Start.IsZero() {
					s.Start = t
				}
			}
			continue
		}
		if m := reStop.FindStringSubmatch(msg); m != nil {
			s := byID[m[1]]
			if s == nil {
				continue
			}
			if m[2] == "" {
				if s.StopStart.IsZero() {
					s.StopStart = t
				}
			} else if s.StopEnd.IsZero() && !s.StopStart.IsZero() {
				s.StopEnd = t
			}
		}
	}
	return out
}

// dist summarises durations in seconds.
type dist struct {
	N   int     `json:"n"`
	P50 float64 `json:"p50_s"`
	Max float64 `json:"max_s"`
}

func summarise(ds []time.Duration) dist {
	if len(ds) == 0 {
		return dist{}
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	var p50 time.Duration
	if n := len(s); n%2 == 1 {
		p50 = s[n/2]
	} else {
		p50 = (s[n/2-1] + s[n/2]) / 2
	}
	return dist{N: len(s), P50: p50.Seconds(), Max: s[len(s)-1].Seconds()}
}

func (d dist) String() string {
	if d.N == 0 {
		return "none measured"
	}
	return fmt.Sprintf("p50 %.3fs max %.3fs (n=%d)", d.P50, d.Max, d.N)
}
