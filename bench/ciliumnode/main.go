// Command ciliumnode (make bench-cilium-node) reproduces the incident on a
// kind node running real Cilium: the worker's real CT maps, filled to ENTRIES
// with a share EXPIRED expired in Cilium's own clock (as after a GC interval
// that drifted to hours; EXPIRED=0: a table of live flows), then PODS pods
// created and deleted on that node all at once, once per variant: ctscrub
// with its expiry pass off, with it on (its first pass done before the pods
// start), no ctscrub, no ctscrub but Cilium's GC every 60 s (the one-line
// fix), Cilium patched to coalesce its own concurrent endpoint scrubs into
// one walk, off the endpoint's lock (cilium/patches/coalesce-v*, no ctscrub:
// the in-agent baseline of issue 38), and Cilium patched to ask ctscrub's
// delegate instead of walking its maps (issue 22). Every figure comes from Cilium, the runtime or the
// kernel: the agent's per-endpoint regeneration statistics
// (waitingForCTClean, the wait for Cilium's own CT scrub of the new IP),
// cilium-cni's ADD and DEL, containerd's RunPodSandbox and StopPodSandbox,
// the pods' Ready condition, the agent's and scrubd's CPU time from
// /proc/<pid>/stat. See docs/cilium-node.md.
//
// It expects the cluster bench/ciliumnode/run.sh makes (KUBECONFIG set,
// Cilium installed from CILIUM_CHART with CILIUM_VALUES: debug logs, maps
// sized for ENTRIES) and runs as root on the machine whose kernel holds the
// node's maps.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"math"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/ctscrub/ctscrub/bench/internal/ctfill"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/expiry"
)

const (
	benchNS   = "ctscrub-bench"
	ctRoot    = "/sys/fs/bpf/tc/globals"
	cniLog    = "/var/run/cilium/cilium-cni.log"
	conflist  = "/etc/cni/net.d/05-cilium.conflist"
	agentSel  = "k8s-app=cilium"
	scrubdSel = "app.kubernetes.io/name=ctscrub"
)

// The variants, in the order they run: the three on stock Cilium with
// run.sh's GC interval first, then those that upgrade Cilium.
var variantNames = []string{"ctscrub_no_expiry", "ctscrub", "cilium_only", "cilium_gc60", "cilium_coalesced", "ctscrub_delegate",
	"ctscrub_delegate_restart", "ctscrub_delegate_upgrade"}

var variantPrefix = map[string]string{"ctscrub_no_expiry": "noexp", "ctscrub": "sweep", "cilium_only": "only",
	"cilium_gc60": "gc60", "cilium_coalesced": "coal", "ctscrub_delegate": "deleg", "ctscrub_delegate_restart": "delrs", "ctscrub_delegate_upgrade": "delup"}

// isDelegate: the variants that run the patched agent with the delegate
// flag and ctscrub installed as its delegate. Cold (without WARMUP=1)
// each starts scrubd right before the pods, on the full table: installed
// (ctscrub_delegate), installed and then killed with SIGKILL
// (_restart), installed and then rolled (_upgrade); its bootstrap pass
// runs while the pods start.
func isDelegate(variant string) bool { return strings.HasPrefix(variant, "ctscrub_delegate") }

type config struct {
	entries      int
	expired      float64
	pods         int
	worker       string
	podCIDR      string
	ctscrubImage string
	podImage     string
	serverImage  string
	clientImage  string
	root         string // the repository (conf/)
	podTimeout   time.Duration
	variants     []string
	// Cilium as run.sh installed it, and what the variants upgrade to.
	ciliumChart    string
	ciliumValues   string
	ciliumImage    string // stock agent
	delegateImage  string // agent with cilium/patches/v* (the delegate)
	coalescedImage string // agent with cilium/patches/coalesce-v*
	gcInterval     string // run.sh's conntrackGCInterval
	// warmup (WARMUP=1): before ctscrub_delegate, remove the worker's
	// dead sandboxes and give every free address of its range a pod once,
	// so scrubd has seen each come and go. Off by default: an operator
	// does neither, and a node after an install, upgrade or restart is
	// cold (issue 36).
	warmup bool
}

func envInt(name string, def int) (int, error) {
	v := os.Getenv(name)
	if v == "" {
		return def, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("%s=%q: want a positive integer", name, v)
	}
	return n, nil
}

func envStr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func loadConfig() (config, error) {
	c := config{
		worker:       envStr("WORKER", envStr("CLUSTER", "ctscrub-bench-node")+"-worker"),
		podCIDR:      envStr("POD_CIDR", "10.244.0.0/16"),
		ctscrubImage: os.Getenv("CTSCRUB_IMAGE"),
		podImage:     os.Getenv("POD_IMAGE"),
		serverImage:  os.Getenv("SERVER_IMAGE"),
		clientImage:  os.Getenv("CLIENT_IMAGE"),

		ciliumChart:    os.Getenv("CILIUM_CHART"),
		ciliumValues:   os.Getenv("CILIUM_VALUES"),
		ciliumImage:    os.Getenv("CILIUM_IMAGE"),
		delegateImage:  os.Getenv("CILIUM_DELEGATE_IMAGE"),
		coalescedImage: os.Getenv("CILIUM_COALESCED_IMAGE"),
		gcInterval:     envStr("CT_GC_INTERVAL", "12h"),
	}
	var err error
	if c.entries, err = envInt("ENTRIES", 4<<20); err != nil {
		return c, err
	}
	if c.pods, err = envInt("PODS", 20); err != nil {
		return c, err
	}
	t, err := envInt("POD_TIMEOUT_S", 300)
	if err != nil {
		return c, err
	}
	c.podTimeout = time.Duration(t) * time.Second
	switch v := os.Getenv("WARMUP"); v {
	case "", "0":
	case "1":
		c.warmup = true
	default:
		return c, fmt.Errorf("WARMUP=%q: want 1 (warm-up and dead-sandbox removal before ctscrub) or 0 (cold, the default)", v)
	}
	c.expired = 0.8
	if v := os.Getenv("EXPIRED"); v != "" {
		if c.expired, err = strconv.ParseFloat(v, 64); err != nil || c.expired < 0 || c.expired > 1 {
			return c, fmt.Errorf("EXPIRED=%q: want a share between 0 and 1", v)
		}
	}
	c.variants = variantNames
	if v := os.Getenv("VARIANTS"); v != "" {
		c.variants = strings.Split(v, ",")
		for _, n := range c.variants {
			if !slices.Contains(variantNames, n) {
				return c, fmt.Errorf("VARIANTS: unknown variant %q (have %s)", n, strings.Join(variantNames, ", "))
			}
		}
	}
	need := map[string]string{"CTSCRUB_IMAGE": c.ctscrubImage, "CLIENT_IMAGE": c.clientImage}
	if slices.Contains(c.variants, "cilium_gc60") || slices.Contains(c.variants, "cilium_coalesced") || slices.ContainsFunc(c.variants, isDelegate) {
		// Variants that upgrade Cilium need what it was installed with.
		need["CILIUM_CHART"], need["CILIUM_VALUES"], need["CILIUM_IMAGE"] = c.ciliumChart, c.ciliumValues, c.ciliumImage
	}
	if slices.ContainsFunc(c.variants, isDelegate) {
		need["CILIUM_DELEGATE_IMAGE"] = c.delegateImage
	}
	if slices.Contains(c.variants, "cilium_coalesced") {
		need["CILIUM_COALESCED_IMAGE"] = c.coalescedImage
	}
	for name, v := range need {
		if v == "" {
			return c, fmt.Errorf("%s is not set: bench/ciliumnode/run.sh sets it (make bench-cilium-node)", name)
		}
	}
	if c.serverImage == "" {
		c.serverImage = c.clientImage
	}
	wd, _ := os.Getwd()
	for d := wd; d != "/"; d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "conf", "daemonset.yaml")); err == nil {
			c.root = d
			break
		}
	}
	if c.root == "" {
		return c, errors.New("run from the repository (conf/daemonset.yaml not found above the working directory)")
	}
	return c, nil
}

// variantResult is one variant's figures.
type variantResult struct {
	CTCleanP50 float64 `json:"ct_clean_p50_s"`
	CTCleanMax float64 `json:"ct_clean_max_s"`
	ReadyAllS  float64 `json:"ready_all_s"` // pods created to every one Ready
	FailedPods int     `json:"failed_pods"`
	// CPU seconds (utime+stime of the process and its reaped children, from
	// /proc/<pid>/stat) from the start of the fill to the last pod gone, over
	// CPUWindowS; scrubd's is 0 where ctscrub is not installed.
	AgentCPUS  float64 `json:"agent_cpu_s"`
	ScrubdCPUS float64 `json:"scrubd_cpu_s"`
	CPUWindowS float64 `json:"cpu_window_s"`

	SandboxP50      float64 `json:"sandbox_p50_s"`
	SandboxMax      float64 `json:"sandbox_max_s"`
	RegenTotalP50   float64 `json:"regen_total_p50_s"`
	RegenTotalMax   float64 `json:"regen_total_max_s"`
	CNIAddP50       float64 `json:"cni_add_p50_s"`
	CNIAddMax       float64 `json:"cni_add_max_s"`
	CNIDelP50       float64 `json:"cni_del_p50_s"`
	CNIDelMax       float64 `json:"cni_del_max_s"`
	StopP50         float64 `json:"sandbox_stop_p50_s"`
	StopMax         float64 `json:"sandbox_stop_max_s"`
	SandboxFailures int     `json:"sandbox_failures"`
	AllGoneS        float64 `json:"all_gone_s"`
	EntriesBefore   int64   `json:"entries_before"`
	ExpiredBefore   uint64  `json:"expired_before"`
	Measured        struct {
		Regens, CNIAdd, CNIDel, Sandboxes, Stops int
	} `json:"measured"`
	MetricCTClean struct {
		Count float64 `json:"count"`
		SumS  float64 `json:"sum_s"`
	} `json:"metric_ct_clean"`
	// Cilium's counters over the window: its walks of a CT map
	// (cilium_datapath_conntrack_gc_runs_total: the periodic GC's and each
	// endpoint scrub's, one per map), and with the delegate the endpoint
	// scrubs it left to scrubd and those it walked after asking.
	CiliumGCRuns    float64            `json:"cilium_gc_runs"`
	DelegatedScrubs float64            `json:"delegated_scrubs"`
	FallbackWalks   float64            `json:"fallback_walks"`
	FallbackCauses  map[string]float64 `json:"fallback_causes,omitempty"`
	// scrubd's over the window: scrubs by "reason/method", delegate
	// answers by "event/outcome".
	ScrubdScrubs    map[string]float64 `json:"scrubd_scrubs,omitempty"`
	DelegateAnswers map[string]float64 `json:"delegate_answers,omitempty"`
	// DelegateWithin: scrubd's own time for the delegate's requests, from
	// its histogram (ctscrub_delegate_request_duration_seconds): requests
	// per "event le=<s>" answered within 10 ms, 100 ms, and in all (+Inf).
	// Beside waitingForCTClean it tells scrubd's share of a slow wait.
	DelegateWithin map[string]float64 `json:"delegate_within,omitempty"`
	// ctscrub_delegate: the free addresses of the worker's range given a
	// pod in the warm-up, and the measured pods' addresses not among them.
	WarmIPs int `json:"warm_ips,omitempty"`
	ColdIPs int `json:"cold_ips"`

	// The delegate variants, cold (issue 36): scrubd's bootstrap pass on
	// the full table, started right before the pods (scrubd's
	// ctscrub_bootstrap_duration_seconds, and scrubd's CPU from its start
	// to the pass's end); the Cilium batch walk of the same maps, timed
	// from this host right before scrubd starts, as the floor; the share
	// of the creates scrubd answered complete; Cilium's walks after asking
	// (fallback_walks, above).
	BootstrapS          float64 `json:"bootstrap_s,omitempty"`
	BootstrapScrubdCPUS float64 `json:"bootstrap_scrubd_cpu_s,omitempty"`
	BatchWalkS          float64 `json:"batch_walk_s,omitempty"`
	CompleteShare       float64 `json:"delegated_complete_share"`
	Walks               float64 `json:"walks"`

	// cilium_coalesced (the agent's cilium_datapath_conntrack_scrub_*
	// metrics, absent from other agents): the endpoint scrubs answered and
	// the walks that did them over the window, and the seconds from the
	// deletes' start until the agent had answered every scrub (a deleted
	// endpoint's scrub is queued, not waited for, so it may end after the
	// pod is gone: all_gone_s; the CPU window ends only then). An upper
	// bound by up to 3 s: it is checked after the sandboxes stopped, every
	// second.
	ScrubRequests float64 `json:"scrub_requests,omitempty"`
	ScrubWalks    float64 `json:"scrub_walks,omitempty"`
	ScrubDrainS   float64 `json:"scrub_drain_s,omitempty"`
}

type result struct {
	Date                 string                    `json:"date"`
	Load                 string                    `json:"load"`
	Machine              string                    `json:"machine"`
	Entries              int                       `json:"entries"`
	ExpiredShare         float64                   `json:"expired_share"`
	Warmup               bool                      `json:"warmup"` // WARMUP=1
	Pods                 int                       `json:"pods"`
	Clock                string                    `json:"clock"`
	CTMax                map[string]uint32         `json:"ct_max"`
	RealEntries          int64                     `json:"real_entries"`
	TableAfterExpiryPass int64                     `json:"table_after_expiry_pass"`
	Variants             map[string]*variantResult `json:"-"`
}

// MarshalJSON puts the variants at the top level, by name.
func (r result) MarshalJSON() ([]byte, error) {
	type plain result
	b, err := json.Marshal(plain(r))
	if err != nil {
		return nil, err
	}
	m := map[string]json.RawMessage{}
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, err
	}
	for name, v := range r.Variants {
		vb, err := json.Marshal(v)
		if err != nil {
			return nil, err
		}
		m[name] = vb
	}
	return json.Marshal(m)
}

func main() {
	log.SetFlags(0)
	log.SetPrefix("bench-cilium-node: ")
	cfg, err := loadConfig()
	if err != nil {
		log.Fatal(err)
	}
	if os.Geteuid() != 0 {
		log.Fatal("needs root: opens the node's CT maps in this kernel and enters the node's namespaces")
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := bench(ctx, cfg); err != nil {
		log.Fatal(err)
	}
}

func bench(ctx context.Context, cfg config) error {
	k := &kube{ctx: ctx, worker: cfg.worker}
	pid, err := run(ctx, time.Minute, "", "docker", "inspect", "-f", "{{.State.Pid}}", cfg.worker)
	if err != nil {
		return fmt.Errorf("the worker node's container: %w", err)
	}
	if k.nodePID, err = strconv.Atoi(strings.TrimSpace(pid)); err != nil || k.nodePID == 0 {
		return fmt.Errorf("worker %s: no running container (pid %q)", cfg.worker, pid)
	}
	id, err := run(ctx, time.Minute, "", "docker", "inspect", "-f", "{{.Id}}", cfg.worker)
	if err != nil {
		return err
	}
	k.containerID = strings.TrimSpace(id)
	if cfg.podImage == "" {
		if cfg.podImage, err = pauseImage(k); err != nil {
			return err
		}
	}

	// The worker's own CT maps, through its bpffs.
	maps, err := ctmap.Open(k.nodeFile(ctRoot))
	if err != nil {
		return fmt.Errorf("the worker's Cilium CT maps: %w", err)
	}
	defer func() { maps.Close() }() // the one open at the end (upgrades reopen it)
	res := result{
		Date: time.Now().UTC().Format(time.RFC3339), Entries: cfg.entries, ExpiredShare: cfg.expired, Pods: cfg.pods, Warmup: cfg.warmup,
		Machine: fmt.Sprintf("%d CPUs, Linux %s", runtime.NumCPU(), kernelRelease()),
		CTMax:   map[string]uint32{}, Variants: map[string]*variantResult{},
	}
	for _, kind := range ctmap.Kinds {
		if maps.Map(kind) != nil {
			res.CTMax[kind.Name()] = maps.MaxEntries(kind)
		}
	}
	log.Printf("worker %s: CT maps %v (pid %d)", cfg.worker, res.CTMax, k.nodePID)

	// Real flows from running pods, for the whole run.
	if _, err := k.kubectl(time.Minute, "create", "namespace", benchNS); err != nil && !strings.Contains(err.Error(), "AlreadyExists") {
		return err
	}
	if err := k.apply(trafficPods(benchNS, cfg.worker, cfg.serverImage, cfg.clientImage)); err != nil {
		return err
	}
	if _, err := k.kubectl(5*time.Minute, "-n", benchNS, "wait", "--for=condition=Ready", "pod/traffic-server", "pod/traffic-client", "--timeout=5m"); err != nil {
		return fmt.Errorf("traffic pods: %w", err)
	}

	// Cilium's clock, as ctscrub detects it (scrubd/expiry), checked
	// against what the agent says it chose.
	clock, now, unitsPerSec, err := detectClock(ctx, k, maps)
	if err != nil {
		return err
	}
	res.Clock = string(clock)
	if res.RealEntries, err = ctfill.CountAll(maps); err != nil {
		return err
	}
	synthetic := cfg.entries - int(res.RealEntries)
	if synthetic < 2 {
		return fmt.Errorf("the maps already hold %d entries, ENTRIES=%d", res.RealEntries, cfg.entries)
	}
	f, err := newFiller(maps, synthetic, cfg.expired, now, unitsPerSec)
	if err != nil {
		return err
	}
	if err := f.capacity(); err != nil {
		return err
	}
	log.Printf("clock %s (now %d, %.3g units/s); real entries %d; filling %d synthetic entries, %.0f%% expired", clock, now, unitsPerSec, res.RealEntries, 2*f.flows, 100*cfg.expired)

	current := setupFor(cfg, "cilium_only") // as run.sh installed it
	for _, name := range cfg.variants {
		if err := ctx.Err(); err != nil {
			return err
		}
		if s := setupFor(cfg, name); s != current {
			if err := upgradeCilium(k, cfg, s, &maps); err != nil {
				return fmt.Errorf("variant %s: %w", name, err)
			}
			current, f.maps = s, maps
		}
		v, after, err := runVariant(ctx, cfg, k, maps, f, clock, name)
		if err != nil {
			return fmt.Errorf("variant %s: %w", name, err)
		}
		res.Variants[name] = v
		if name == "ctscrub" {
			res.TableAfterExpiryPass = after
		}
	}
	if err := uninstallCtscrub(k); err != nil {
		log.Printf("warning: uninstall ctscrub at the end: %v", err)
	}

	res.Load = loadAvg()
	fmt.Println()
	fmt.Printf("%-26s %-26s %-9s %-26s %-6s %-10s %-10s %s\n", "variant", "waitingForCTClean", "all Ready", "RunPodSandbox", "failed", "agent CPU", "scrubd CPU", "delegated/fallbacks")
	for _, name := range cfg.variants {
		v := res.Variants[name]
		fmt.Printf("%-26s %-26s %-9s %-26s %-6d %-10s %-10s %.0f/%.0f\n", name,
			pm(v.CTCleanP50, v.CTCleanMax), fmt.Sprintf("%.1fs", v.ReadyAllS), pm(v.SandboxP50, v.SandboxMax), v.FailedPods,
			fmt.Sprintf("%.1fs", v.AgentCPUS), fmt.Sprintf("%.1fs", v.ScrubdCPUS), v.DelegatedScrubs, v.FallbackWalks)
	}
	if res.TableAfterExpiryPass > 0 {
		fmt.Printf("table after ctscrub's expiry pass: %d entries (of %d)\n", res.TableAfterExpiryPass, res.Variants["ctscrub"].EntriesBefore)
	}
	b, err := json.Marshal(res)
	if err != nil {
		return err
	}
	fmt.Println(string(b))
	return nil
}

func pm(p50, max float64) string { return fmt.Sprintf("p50 %.3fs max %.3fs", p50, max) }

// detectClock runs ctscrub's own clock detection (an expiry pass in report
// mode over the node's maps, clock auto) once the real flows give it
// evidence, and checks it against Cilium's "Clock Source for BPF".
func detectClock(ctx context.Context, k *kube, maps *ctmap.Maps) (expiry.Clock, uint32, float64, error) {
	r, err := expiry.New(maps, expiry.Config{Mode: expiry.ModeReport, Clock: expiry.ClockAuto, PassTimeout: 5 * time.Minute}, expiry.Options{})
	if err != nil {
		return "", 0, 0, err
	}
	defer r.Close()
	var rep expiry.Report
	deadline := time.Now().Add(2 * time.Minute)
	for {
		if rep, err = r.Pass(ctx); err != nil {
			return "", 0, 0, err
		}
		if rep.Decision.Confirmed || time.Now().After(deadline) {
			break
		}
		time.Sleep(5 * time.Second)
	}
	if !rep.Decision.Confirmed {
		return "", 0, 0, fmt.Errorf("ctscrub could not tell Cilium's clock from the node's entries: %s", rep.Decision.Why)
	}
	clock := rep.Decision.Clock
	// What the agent says (cilium-dbg status --verbose: "Clock Source for
	// BPF: ktime" or "jiffies [250 Hz]").
	agent, err := podOn(k, "kube-system", agentSel)
	if err != nil {
		return "", 0, 0, err
	}
	st, err := k.kubectl(time.Minute, "-n", "kube-system", "exec", agent, "-c", "cilium-agent", "--", "cilium-dbg", "status", "--verbose")
	if err != nil {
		return "", 0, 0, err
	}
	m := regexp.MustCompile(`Clock Source for BPF:\s*(\w+)`).FindStringSubmatch(st)
	if m == nil {
		log.Printf("warning: cilium-dbg status does not name its BPF clock; going by ctscrub's detection (%s)", clock)
	} else if !strings.EqualFold(m[1], string(clock)) {
		return "", 0, 0, fmt.Errorf("ctscrub detected clock %s, Cilium says %s", clock, m[1])
	}
	now := rep.NowIn(clock)
	units := 1.0
	if clock == expiry.ClockJiffies {
		// jiffies_64 = 2^32 + HZ*(uptime - 300 s); the clock is jiffies >> 8.
		up := float64(rep.NowIn(expiry.ClockKtime))
		hz := (float64(now)*256 - math.Exp2(32)) / (up - 300)
		for _, c := range []float64{100, 250, 300, 1000} {
			if math.Abs(hz-c) < c*0.05 {
				hz = c
			}
		}
		units = hz / 256
	}
	return clock, now, units, nil
}

// podOn names the pod matching sel on the worker.
func podOn(k *kube, ns, sel string) (string, error) {
	out, err := k.kubectl(time.Minute, "-n", ns, "get", "pods", "-l", sel, "--field-selector", "spec.nodeName="+k.worker, "-o", "jsonpath={.items[*].metadata.name}")
	if err != nil {
		return "", err
	}
	f := strings.Fields(out)
	if len(f) != 1 {
		return "", fmt.Errorf("pods %s on %s: %q, want one", sel, k.worker, out)
	}
	return f[0], nil
}

// pauseImage is the sandbox image the node has (pods run it as their one
// container: nothing to pull, nothing to start but the sandbox).
func pauseImage(k *kube) (string, error) {
	out, err := run(k.ctx, time.Minute, "", "docker", "exec", k.worker, "crictl", "images", "-o", "json")
	if err != nil {
		return "", err
	}
	var imgs struct {
		Images []struct {
			RepoTags []string `json:"repoTags"`
		} `json:"images"`
	}
	if err := json.Unmarshal([]byte(out), &imgs); err != nil {
		return "", err
	}
	for _, i := range imgs.Images {
		for _, t := range i.RepoTags {
			if strings.Contains(t, "/pause:") {
				return t, nil
			}
		}
	}
	return "", errors.New("no pause image on the worker node: set POD_IMAGE")
}

func kernelRelease() string {
	b, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	return strings.TrimSpace(string(b))
}

func loadAvg() string {
	b, _ := os.ReadFile("/proc/loadavg")
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return ""
	}
	return strings.Join(f[:3], " ")
}
