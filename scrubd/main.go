// Command scrubd is ctscrub's node daemon and its operator CLI.
//
//	scrubd [run] [flags]          run the daemon
//	scrubd status                 daemon status
//	scrubd scrub --ip X [--ip Y] [--dry-run] [--reason del]
//	scrubd index [--ip X]         indexed pods, or one IP's index state
//	scrubd ct stats               entries and capacity per CT table
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/client"
	"github.com/ctscrub/ctscrub/scrubd/daemon"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// version is set with -ldflags "-X main.version=...".
var version = "dev"

func main() {
	args := os.Args[1:]
	cmd := "run"
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		cmd, args = args[0], args[1:]
	}
	var err error
	switch cmd {
	case "run":
		err = run(args)
	case "status":
		err = cliStatus(args)
	case "scrub":
		err = cliScrub(args)
	case "index":
		err = cliIndex(args)
	case "audit":
		err = cliAudit(args)
	case "ct":
		if len(args) == 0 || args[0] != "stats" {
			err = errors.New(`usage: scrubd ct stats`)
		} else {
			err = cliCTStats(args[1:])
		}
	case "version":
		fmt.Println(version)
	case "help", "-h", "--help":
		usage(os.Stdout)
	default:
		usage(os.Stderr)
		err = fmt.Errorf("unknown command %q", cmd)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "scrubd:", err)
		os.Exit(1)
	}
}

func usage(w io.Writer) {
	fmt.Fprint(w, `usage:
  scrubd [run] [flags]                 run the node daemon (scrubd run -h for flags)
  scrubd status                        daemon status (exit 1 when not ready)
  scrubd scrub --ip X [--ip Y] [--dry-run] [--reason del]
                                       delete every CT entry of pod IPs (dry run: count)
  scrubd index [--ip X]                indexed pods, or what the index holds for one IP
  scrubd ct stats                      entries and capacity of each CT table
  scrubd audit [--ip X [--ip Y]]       compare IPs' CT entries in the kernel with the index
                                       (read-only; exit 1 if keys are missing); no --ip: recent misses
CLI commands take --socket (default `+api.DefaultSocket+`), --timeout and --json.
`)
}

// multiFlag collects a repeatable flag.
type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(s string) error { *m = append(*m, s); return nil }

type durationFlag struct{ d *daemon.Duration }

func (f durationFlag) String() string {
	if f.d == nil {
		return ""
	}
	return f.d.Duration.String()
}
func (f durationFlag) Set(s string) error { return f.d.UnmarshalText([]byte(s)) }

func run(args []string) error {
	cfg, err := runConfig(args)
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	if err != nil {
		return err
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(cfg.LogLevel)); err != nil {
		return fmt.Errorf("log level %q: want debug, info, warn or error", cfg.LogLevel)
	}
	log := slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: level}))

	var dsw *daemonSetWatch
	if cfg.DaemonSet != "" {
		if dsw, err = newInClusterDaemonSetWatch(cfg.DaemonSet, log); err != nil {
			return err
		}
	}
	d, err := daemon.Open(cfg, log, version)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if dsw == nil {
		defer d.Close()
		return d.Run(ctx)
	}
	watchCtx, stopWatch := context.WithCancel(context.Background())
	defer stopWatch()
	go dsw.run(watchCtx)
	// At SIGTERM, while the daemon drains its in-flight scrubs: an
	// uninstall takes the conflist entry out first, so pods created from
	// now on no longer call a scrubd that is going away.
	uninstalling := make(chan bool, 1)
	go func() {
		<-ctx.Done()
		askCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		removed, why, err := dsw.decide(askCtx)
		cancel()
		stopWatch()
		switch {
		case err != nil:
			log.Warn("cannot tell whether scrubd's DaemonSet was deleted: ctscrub stays chained on this node; if this is an uninstall, run `ctscrub uninstall` on the node",
				"daemonset", cfg.DaemonSet, "err", err)
		case !removed:
			log.Info("stopping with ctscrub chained", "daemonset", cfg.DaemonSet, "why", why)
		default:
			log.Info("uninstall: taking ctscrub off this node", "daemonset", cfg.DaemonSet, "why", why)
			if err := uninstallStep(context.Background(), log, "conflist", "--conf-dir", cfg.CNIConfDir, "--keep-recorders"); err != nil {
				log.Error("uninstall: the conflist still chains ctscrub: run `ctscrub uninstall` on the node", "err", err)
			}
		}
		uninstalling <- removed && err == nil
	}()
	runErr := d.Run(ctx)
	closeErr := d.Close()
	// Run returned at once when it failed before SIGTERM: then this is no
	// uninstall, and the decision is not waited for.
	if ctx.Err() != nil && <-uninstalling {
		// The recorder's filters stay on pods' interfaces after the
		// process (tc holds them): `ctscrub uninstall` takes them off now
		// that scrubd no longer answers on its socket.
		if err := uninstallStep(context.Background(), log, "recorder filters", "--conf-dir", cfg.CNIConfDir,
			"--state-file", cfg.StateFile, "--run-dir", filepath.Dir(cfg.Socket)); err != nil {
			log.Error("uninstall: recorder filters may be left on pods' interfaces: run `ctscrub uninstall` on the node", "err", err)
		}
	}
	return errors.Join(runErr, closeErr)
}

// runConfig builds the daemon's config: defaults, then the config file, then
// the flags given on the command line.
func runConfig(args []string) (daemon.Config, error) {
	fs := flag.NewFlagSet("scrubd run", flag.ContinueOnError)
	var (
		configPath = fs.String("config", "", "YAML or JSON config file (see conf/scrubd.yaml); flags given here win over it")
		flagCfg    = daemon.DefaultConfig()
		cidrs      multiFlag
	)
	fs.StringVar(&flagCfg.Socket, "socket", flagCfg.Socket, "API unix socket (created 0600, directory 0700)")
	fs.StringVar(&flagCfg.DelegateSocket, "delegate-socket", flagCfg.DelegateSocket, "serve the delegate API for Cilium's agent (docs/delegate-api.md) on this unix socket, in a directory of its own (e.g. "+api.DefaultDelegateSocket+"; empty: off)")
	fs.StringVar(&flagCfg.CTRoot, "ct-root", flagCfg.CTRoot, "bpffs directory with Cilium's global CT maps")
	fs.StringVar(&flagCfg.PinDir, "pin-dir", flagCfg.PinDir, "ctscrub's own bpffs directory (recorder maps and links)")
	fs.StringVar(&flagCfg.NodeNetns, "node-netns", flagCfg.NodeNetns, "network namespace of the pods' host-side veths, for the recorder's host-side links (empty: scrubd's own)")
	fs.StringVar(&flagCfg.StateFile, "state-file", flagCfg.StateFile, "attachments state file, for restarts")
	fs.StringVar(&flagCfg.MetricsAddr, "metrics-addr", flagCfg.MetricsAddr, "address of /metrics, /healthz, /readyz (off: none; ${HOST_IP}:9967 takes the host from the environment)")
	fs.Var(&cidrs, "pod-cidr", "pod CIDR of this node, repeatable or comma-separated (REQUIRED): scrubs of other IPs are refused")
	fs.StringVar(&flagCfg.Backends, "backends", flagCfg.Backends, "auto, cilium, nfct or cilium,nfct")
	fs.IntVar(&flagCfg.MaxInFlight, "max-in-flight", flagCfg.MaxInFlight, "scrubs running at once (more wait in the queue)")
	fs.IntVar(&flagCfg.QueueLimit, "queue-limit", flagCfg.QueueLimit, "scrub requests admitted at once; past it: try again later")
	fs.Var(durationFlag{&flagCfg.ShutdownGrace}, "shutdown-grace", "on SIGTERM, time in-flight scrubs get before they are cancelled")
	fs.Var(durationFlag{&flagCfg.StoppedTTL}, "stopped-ttl", "how long a stopped attachment's IPs are remembered")
	fs.Var(durationFlag{&flagCfg.StatsInterval}, "stats-interval", "refresh interval of ctscrub_ct_entries")
	fs.BoolVar(&flagCfg.Pprof, "pprof", false, "serve /debug/pprof on the metrics address")
	fs.StringVar(&flagCfg.LogLevel, "log-level", flagCfg.LogLevel, "debug, info, warn or error")
	fs.BoolVar(&flagCfg.RemoteBackends.Enabled, "remote-backends", false, "watch EndpointSlices and delete this node's CT entries towards backends that left the cluster (docs/remote.md)")
	fs.Var(durationFlag{&flagCfg.RemoteBackends.Hold}, "remote-backends-hold", "how long a backend address must be in no EndpointSlice before it counts as gone (default 1s)")
	fs.StringVar(&flagCfg.Expiry.Mode, "expiry-mode", flagCfg.Expiry.Mode, "expiry pass over Cilium's CT maps: off, report or sweep")
	fs.Var(durationFlag{&flagCfg.Expiry.Interval}, "expiry-interval", "fixed interval between expiry passes")
	fs.StringVar(&flagCfg.Expiry.Clock, "expiry-clock", flagCfg.Expiry.Clock, "clock of Cilium's CT lifetimes: auto, ktime or jiffies")
	fs.StringVar(&flagCfg.CNIConfDir, "cni-conf-dir", flagCfg.CNIConfDir, "the runtime's CNI config dir: watch that it chains ctscrub (empty: off)")
	fs.StringVar(&flagCfg.CNIDefaultNetwork, "cni-default-network", flagCfg.CNIDefaultNetwork, "CRI-O's cni_default_network, when set: its config file in --cni-conf-dir must chain ctscrub too (empty: none)")
	fs.IntVar(&flagCfg.RingBytes, "ring-bytes", flagCfg.RingBytes, "recorder ring buffer size in bytes, a power of two (0: 8 MiB)")
	fs.StringVar(&flagCfg.DaemonSet, "daemonset", flagCfg.DaemonSet, "namespace/name of scrubd's DaemonSet: when it is deleted, SIGTERM takes ctscrub off the node (empty: never)")
	fs.StringVar(&flagCfg.Bootstrap, "bootstrap", flagCfg.Bootstrap, "on: at start, attach the recorder to every pod interface of the node and make one pass over Cilium's CT maps (off: only restored attachments)")
	fs.StringVar(&flagCfg.NFCTFallback, "nfct-fallback", flagCfg.NFCTFallback, "nf_conntrack scrub of incomplete IPs: auto (empty), flush or dump")
	if err := fs.Parse(args); err != nil {
		return daemon.Config{}, err
	}
	if fs.NArg() > 0 {
		return daemon.Config{}, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	flagCfg.PodCIDRs = cidrs

	cfg := daemon.DefaultConfig()
	if *configPath != "" {
		if err := daemon.LoadConfigFile(*configPath, &cfg); err != nil {
			return daemon.Config{}, err
		}
	}
	// Flags given on the command line win over the file.
	fs.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "socket":
			cfg.Socket = flagCfg.Socket
		case "delegate-socket":
			cfg.DelegateSocket = flagCfg.DelegateSocket
		case "ct-root":
			cfg.CTRoot = flagCfg.CTRoot
		case "pin-dir":
			cfg.PinDir = flagCfg.PinDir
		case "node-netns":
			cfg.NodeNetns = flagCfg.NodeNetns
		case "state-file":
			cfg.StateFile = flagCfg.StateFile
		case "metrics-addr":
			cfg.MetricsAddr = flagCfg.MetricsAddr
		case "pod-cidr":
			cfg.PodCIDRs = flagCfg.PodCIDRs
		case "backends":
			cfg.Backends = flagCfg.Backends
		case "max-in-flight":
			cfg.MaxInFlight = flagCfg.MaxInFlight
		case "queue-limit":
			cfg.QueueLimit = flagCfg.QueueLimit
		case "shutdown-grace":
			cfg.ShutdownGrace = flagCfg.ShutdownGrace
		case "stopped-ttl":
			cfg.StoppedTTL = flagCfg.StoppedTTL
		case "stats-interval":
			cfg.StatsInterval = flagCfg.StatsInterval
		case "pprof":
			cfg.Pprof = flagCfg.Pprof
		case "log-level":
			cfg.LogLevel = flagCfg.LogLevel
		case "expiry-mode":
			cfg.Expiry.Mode = flagCfg.Expiry.Mode
		case "expiry-interval":
			cfg.Expiry.Interval = flagCfg.Expiry.Interval
		case "expiry-clock":
			cfg.Expiry.Clock = flagCfg.Expiry.Clock
		case "nfct-fallback":
			cfg.NFCTFallback = flagCfg.NFCTFallback
		case "cni-conf-dir":
			cfg.CNIConfDir = flagCfg.CNIConfDir
		case "cni-default-network":
			cfg.CNIDefaultNetwork = flagCfg.CNIDefaultNetwork
		case "ring-bytes":
			cfg.RingBytes = flagCfg.RingBytes
		case "daemonset":
			cfg.DaemonSet = flagCfg.DaemonSet
		case "remote-backends":
			cfg.RemoteBackends.Enabled = flagCfg.RemoteBackends.Enabled
		case "remote-backends-hold":
			cfg.RemoteBackends.Hold = flagCfg.RemoteBackends.Hold
		case "bootstrap":
			cfg.Bootstrap = flagCfg.Bootstrap
		}
	})
	var err error
	cfg.MetricsAddr, err = daemon.ExpandMetricsAddr(cfg.MetricsAddr, os.Getenv)
	return cfg, err
}

// cliFlags are the flags every CLI command takes.
func cliFlags(name string) (*flag.FlagSet, *string, *time.Duration, *bool) {
	fs := flag.NewFlagSet("scrubd "+name, flag.ContinueOnError)
	socket := fs.String("socket", api.DefaultSocket, "scrubd's API socket")
	timeout := fs.Duration("timeout", 2*time.Minute, "give up (and cancel the work) after this long")
	asJSON := fs.Bool("json", false, "print the answer as JSON")
	return fs, socket, timeout, asJSON
}

func parseCLI(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	return nil
}

func printJSON(v any) error {
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func cliStatus(args []string) error {
	fs, socket, timeout, asJSON := cliFlags("status")
	if err := parseCLI(fs, args); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	st, err := client.New(*socket).Status(ctx)
	if err != nil {
		return err
	}
	// Not ready is an error, so that `scrubd status` serves as a readiness probe.
	var notReady error
	if !st.Ready {
		notReady = errors.New("not ready: CT maps not open, programs not loaded, recorder stopped, or shutting down")
	}
	if *asJSON {
		printJSON(st)
		return notReady
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "version\t%s\nready\t%v\nbackends\t%s\npod CIDRs\t%v\nindexed pods\t%d\nindex keys\t%d\nincomplete IPs\t%d\nin flight\t%d (queue limit %d)\nuptime\t%s\nmetrics\t%s\nuncovered features\t%s\n",
		st.Version, st.Ready, strings.Join(st.Backends, ","), st.PodCIDRs, st.IndexedPods, st.IndexKeys, st.IncompleteIPs, st.InFlight, st.QueueLimit, st.Uptime, st.Metrics, uncoveredText(st.UncoveredFeatures))
	if b := st.Bootstrap; b != nil {
		state := fmt.Sprintf("done %s", b.Done.Format(time.RFC3339))
		if b.Running {
			state = "running"
		}
		if b.Error != "" {
			state = "failed: " + b.Error
		}
		fmt.Fprintf(tw, "bootstrap pass\t%s, %.1f s, %d entries read, %d keys filed, %d addresses whole\n",
			state, b.DurationS, b.Visited, b.Keys, b.Addresses)
	}
	tw.Flush()
	return notReady
}

// uncoveredText lists the uncovered Cilium features for scrubd status.
func uncoveredText(f []string) string {
	if len(f) == 0 {
		return "none"
	}
	return strings.Join(f, ",") + " (the IPs they reach are incomplete: their scrubs sweep, the delegate answers incomplete)"
}

func cliScrub(args []string) error {
	fs, socket, timeout, asJSON := cliFlags("scrub")
	var ips multiFlag
	fs.Var(&ips, "ip", "pod IP to scrub (repeatable)")
	dry := fs.Bool("dry-run", false, "count the entries, delete nothing")
	reason := fs.String("reason", string(scrub.ReasonDel), "add, del or gc (labels metrics and logs)")
	if err := parseCLI(fs, args); err != nil {
		return err
	}
	req := api.ScrubRequest{Reason: scrub.Reason(*reason), DryRun: *dry}
	for _, s := range ips {
		for _, p := range strings.Split(s, ",") {
			ip, err := netip.ParseAddr(strings.TrimSpace(p))
			if err != nil {
				return fmt.Errorf("--ip %q: %v", p, err)
			}
			req.IPs = append(req.IPs, ip)
		}
	}
	if len(req.IPs) == 0 {
		return errors.New("give at least one --ip")
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	resp, err := client.New(*socket).Scrub(ctx, req)
	var results []scrub.Result
	if err == nil {
		results = resp.Results
	} else if e, ok := client.APIError(err); ok {
		results = e.Results
	}
	if *asJSON && results != nil {
		printJSON(results)
	} else {
		for _, r := range results {
			verb := "deleted"
			if *dry {
				verb = "would delete"
			}
			fmt.Printf("%s: %s %d entries by %s in %s (%s)", r.Backend, verb, r.Total, r.Method, r.Duration.Round(time.Microsecond), r.Outcome)
			for m, n := range r.Deleted {
				if n > 0 {
					fmt.Printf(" %s=%d", m, n)
				}
			}
			fmt.Println()
		}
	}
	return err
}

func cliIndex(args []string) error {
	fs, socket, timeout, asJSON := cliFlags("index")
	ipFlag := fs.String("ip", "", "show what the index holds for this IP")
	if err := parseCLI(fs, args); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	c := client.New(*socket)
	if *ipFlag != "" {
		ip, err := netip.ParseAddr(*ipFlag)
		if err != nil {
			return fmt.Errorf("--ip %q: %v", *ipFlag, err)
		}
		st, err := c.IndexIP(ctx, ip)
		if err != nil {
			return err
		}
		if *asJSON {
			return printJSON(st)
		}
		fmt.Printf("%s: %d keys, ", st.IP, st.Keys)
		if st.Complete {
			fmt.Print("complete (next scrub: index)")
		} else {
			fmt.Printf("incomplete: %s (next scrub: sweep)", st.Incomplete)
		}
		if st.Owner != nil {
			fmt.Printf(", pod %s/%s", st.Owner.ContainerID, st.Owner.IfName)
		}
		fmt.Println()
		return nil
	}
	list, err := c.IndexList(ctx)
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSON(list)
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "CONTAINER\tIFNAME\tIFINDEX\tIPS\tSINCE\tSTOPPED")
	for _, groups := range [][]api.IndexedPod{list.Pods, list.Stopped} {
		for _, p := range groups {
			stopped := "-"
			if !p.Stopped.IsZero() {
				stopped = p.Stopped.Format(time.RFC3339)
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%v\t%s\t%s\n", p.ContainerID, p.IfName, p.Ifindex, p.IPs, p.Since.Format(time.RFC3339), stopped)
		}
	}
	return tw.Flush()
}

func cliCTStats(args []string) error {
	fs, socket, timeout, asJSON := cliFlags("ct stats")
	if err := parseCLI(fs, args); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	st, err := client.New(*socket).CTStats(ctx)
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSON(st)
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "BACKEND\tMAP\tENTRIES\tMAX\tUSED\t")
	for _, m := range st.Maps {
		used := "-"
		entries := "?"
		if m.Entries >= 0 {
			entries = fmt.Sprint(m.Entries)
			if m.MaxEntries > 0 {
				used = fmt.Sprintf("%.1f%%", 100*float64(m.Entries)/float64(m.MaxEntries))
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t\n", m.Backend, m.Map, entries, m.MaxEntries, used)
	}
	return tw.Flush()
}
