package daemon

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/recorder"
)

// Defaults that work on a Cilium node.
const (
	DefaultPinDir      = "/sys/fs/bpf/ctscrub"
	DefaultStateFile   = "/run/ctscrub/attachments.json"
	DefaultMetricsAddr = "127.0.0.1:9967"
)

// Config is scrubd's configuration: flags, or a YAML/JSON file (JSON is YAML),
// with flags given on the command line winning over the file.
type Config struct {
	// Socket is the API's unix socket, created 0600 in a 0700 directory.
	Socket string `yaml:"socket"`
	// DelegateSocket, when set, serves the delegate API
	// (docs/delegate-api.md) for Cilium's agent on this unix socket of its
	// own, created 0600 (its directory 0700). "": off.
	DelegateSocket string `yaml:"delegate_socket"`
	// CTRoot is the bpffs directory holding Cilium's global CT maps.
	CTRoot string `yaml:"ct_root"`
	// CiliumNodeConfig is the Cilium agent's node_config.h (its CT
	// lifetimes): with it, a flow to a service without backends, which
	// Cilium drops before making any entry, keeps its pod's IP complete
	// (docs/recorder.md, "A service without backends").
	CiliumNodeConfig string `yaml:"cilium_node_config"`
	// PinDir is ctscrub's own bpffs directory (recorder maps and links).
	PinDir string `yaml:"pin_dir"`
	// NodeNetns is the network namespace the pods' host-side veths live in
	// (where the recorder's host-side links go): "" for scrubd's own, as
	// on a node where scrubd runs with hostNetwork.
	NodeNetns string `yaml:"node_netns"`
	// StateFile lists the attachments scrubd indexes, for restarts.
	StateFile string `yaml:"state_file"`
	// MetricsAddr serves /metrics, /healthz, /readyz ("" or "off": none).
	// Its host may name an environment variable, ${HOST_IP}:9967 (see
	// ExpandMetricsAddr).
	MetricsAddr string `yaml:"metrics_addr"`
	// PodCIDRs: scrubs of any other address are refused. Required: a scrub
	// deletes every flow of an address, and guessing the node's pod ranges
	// wrong would let a caller wipe the node's own connections.
	PodCIDRs []string `yaml:"pod_cidrs"`
	// Backends: auto, cilium, nfct, or a comma-separated list.
	Backends string `yaml:"backends"`
	// MaxInFlight bounds the scrubs running at once; more wait in the queue.
	MaxInFlight int `yaml:"max_in_flight"`
	// QueueLimit bounds the requests admitted (running or waiting); past it a
	// request is refused at once with try_again.
	QueueLimit int `yaml:"queue_limit"`
	// ShutdownGrace is how long SIGTERM lets in-flight scrubs finish before it
	// cancels them.
	ShutdownGrace Duration `yaml:"shutdown_grace"`
	// StoppedTTL is how long a stopped attachment's IPs are remembered for a
	// later DEL that comes without prevResult.
	StoppedTTL Duration `yaml:"stopped_ttl"`
	// StatsInterval is how often ctscrub_ct_entries is refreshed.
	StatsInterval Duration `yaml:"stats_interval"`
	// Pprof serves /debug/pprof on the metrics address.
	Pprof bool `yaml:"pprof"`
	// LogLevel: debug, info, warn, error.
	LogLevel string `yaml:"log_level"`
	// Expiry configures the expiry pass over Cilium's CT maps.
	Expiry ExpiryConfig `yaml:"expiry"`
	// CNIConfDir is the runtime's CNI config directory. When set, scrubd
	// watches it (inotify, conflist.go) for the config the runtime uses
	// chaining ctscrub; while it does not, or when a version it could not
	// read may not have, pods may start that the recorder never sees, and
	// no IP a DEL released is trusted by the next ADD (see ownership.go).
	// "": off, which the delegate API refuses.
	CNIConfDir string `yaml:"cni_conf_dir"`
	// CNIDefaultNetwork is CRI-O's cni_default_network, when the node's
	// runtime sets it: the config file whose "name" is that network must
	// chain ctscrub too (CRI-O uses it, not the first file). "": none.
	CNIDefaultNetwork string `yaml:"cni_default_network"`
	// NFCTFallback is how the nf_conntrack backend scrubs incomplete IPs:
	// "" (auto), flush or dump.
	NFCTFallback string `yaml:"nfct_fallback"`
	// RingBytes sizes the recorder's ring buffer (a power of two, at least a
	// page; 0: recorder.DefaultRingBytes, 8 MiB, about 150,000 records). A
	// burst of new flows bigger than the ring while the reader is behind
	// loses records: the IPs concerned sweep. Changing it needs the old
	// ring's pin removed (the recorder says so).
	RingBytes int `yaml:"ring_bytes"`
	// DaemonSet is "namespace/name" of the DaemonSet scrubd runs in. When
	// set, scrubd watches it through the API server, and a SIGTERM that
	// comes because it was deleted (an uninstall) takes ctscrub off the
	// node: the conflist entry and the recorder's filters (scrubd/main.go,
	// uninstall.go). "": never.
	DaemonSet string `yaml:"daemonset"`
	// RemoteBackends: watch EndpointSlices and delete this node's entries
	// towards backends that left the cluster (remote.go, docs/remote.md).
	RemoteBackends RemoteBackendsConfig `yaml:"remote_backends"`
	// Bootstrap: "on" (the default) attaches the recorder to every pod
	// interface of the node at start and makes one pass over Cilium's CT
	// maps, after which each address's index is whole (boot.go,
	// docs/design.md "The bootstrap pass"); "off": only the restored
	// attachments are recorded, and addresses are known again only after
	// they were seen to come and go.
	Bootstrap string `yaml:"bootstrap"`
}

// ExpiryConfig configures the expiry pass (scrubd/expiry).
type ExpiryConfig struct {
	// Mode: off, report (count live/expired only) or sweep (delete expired).
	Mode string `yaml:"mode"`
	// Interval between passes (fixed, never adaptive).
	Interval Duration `yaml:"interval"`
	// Clock of ct_entry.lifetime: auto, ktime or jiffies.
	Clock string `yaml:"clock"`
	// MaxLifetime is Cilium's longest CT timeout plus slack.
	MaxLifetime Duration `yaml:"max_lifetime"`
}

// Duration reads "5s" style durations from the config file.
type Duration struct{ time.Duration }

// UnmarshalText parses a Go duration ("500ms", "5s").
func (d *Duration) UnmarshalText(b []byte) error {
	v, err := time.ParseDuration(string(b))
	if err != nil {
		return fmt.Errorf("duration %q: %v (write it like 5s or 500ms)", b, err)
	}
	d.Duration = v
	return nil
}

// MarshalText writes the duration as Go prints it.
func (d Duration) MarshalText() ([]byte, error) { return []byte(d.Duration.String()), nil }

// DefaultConfig returns the defaults for a Cilium node. PodCIDRs has none:
// it must be configured.
func DefaultConfig() Config {
	return Config{
		Socket:           api.DefaultSocket,
		CTRoot:           ctmap.DefaultRoot,
		CiliumNodeConfig: recorder.DefaultNodeConfig,
		PinDir:           DefaultPinDir,
		StateFile:        DefaultStateFile,
		MetricsAddr:      DefaultMetricsAddr,
		Backends:         "auto",
		MaxInFlight:      64,
		QueueLimit:       1024,
		ShutdownGrace:    Duration{5 * time.Second},
		StoppedTTL:       Duration{time.Hour},
		StatsInterval:    Duration{30 * time.Second},
		LogLevel:         "info",
		Bootstrap:        "on",
		Expiry:           ExpiryConfig{Mode: "sweep", Clock: "auto", Interval: Duration{60 * time.Second}},
	}
}

// LoadConfigFile reads a YAML or JSON file over cfg. Unknown keys are errors,
// so a typo does not silently fall back to a default.
func LoadConfigFile(path string, cfg *Config) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("read config file: %w", err)
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(cfg); err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("config file %s: %v (see conf/scrubd.yaml for the keys)", path, err)
	}
	return nil
}

// ExpandMetricsAddr replaces $NAME or ${NAME} in the host of a metrics
// address with that environment variable's value. scrubd runs on the host's
// network: the DaemonSet passes the node's IP (status.hostIP) as HOST_IP, so
// ${HOST_IP}:9967 is reachable by an in-cluster Prometheus without listening
// on every address of the node. An unset or empty variable is an error, not
// a silent ":9967" (every address).
func ExpandMetricsAddr(addr string, getenv func(string) string) (string, error) {
	if !strings.Contains(addr, "$") {
		return addr, nil
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", fmt.Errorf("metrics_addr %q: %v (write it like ${HOST_IP}:9967)", addr, err)
	}
	var unset []string
	host = os.Expand(host, func(name string) string {
		v := getenv(name)
		if v == "" {
			unset = append(unset, name)
		}
		return v
	})
	if len(unset) > 0 {
		return "", fmt.Errorf("metrics_addr %q: environment variable %s is empty or not set (the DaemonSet sets HOST_IP from the downward API, status.hostIP)", addr, strings.Join(unset, ", "))
	}
	return net.JoinHostPort(host, port), nil
}

// Validate checks cfg and returns the parsed pod CIDRs.
func (c *Config) Validate() ([]netip.Prefix, error) {
	if len(c.PodCIDRs) == 0 {
		return nil, errors.New("no pod CIDRs configured: set --pod-cidr (repeatable) or pod_cidrs in the config file to this node's pod ranges (the Node's spec.podCIDRs, or the CiliumNode's spec.ipam.podCIDRs)")
	}
	var out []netip.Prefix
	for _, s := range c.PodCIDRs {
		for _, part := range strings.Split(s, ",") {
			part = strings.TrimSpace(part)
			if part == "" {
				continue
			}
			p, err := netip.ParsePrefix(part)
			if err != nil {
				return nil, fmt.Errorf("pod CIDR %q: %v (write it like 10.0.0.0/16 or fd00::/104)", part, err)
			}
			if p.Bits() == 0 {
				return nil, fmt.Errorf("pod CIDR %q covers every address: give the node's pod ranges, not a default route", part)
			}
			out = append(out, p.Masked())
		}
	}
	if len(out) == 0 {
		return nil, errors.New("pod CIDRs are empty: give at least one range")
	}
	if c.Socket == "" {
		return nil, errors.New("socket path is empty")
	}
	if c.DelegateSocket != "" && filepath.Clean(filepath.Dir(c.DelegateSocket)) == filepath.Clean(filepath.Dir(c.Socket)) {
		return nil, fmt.Errorf("delegate_socket %s is in the API socket's directory %s: give it a directory of its own (the agent's pod mounts that directory, and must not reach the main API)", c.DelegateSocket, filepath.Dir(c.Socket))
	}
	if c.DelegateSocket != "" && c.CNIConfDir == "" {
		// A delegate answer of "complete" lets Cilium's agent skip its walk
		// on the index's word, and the index vouches for an IP only while
		// every pod that held it ran through ctscrub: the conflist watch is
		// what tells when pods may start unseen.
		return nil, fmt.Errorf("delegate_socket %s is set but cni_conf_dir is empty: the delegate answers for the index, which scrubd can vouch for only while it watches the runtime's CNI config chaining ctscrub; set cni_conf_dir (--cni-conf-dir) to the runtime's CNI config dir as scrubd sees it (the DaemonSet's /host/etc/cni/net.d), or turn the delegate off", c.DelegateSocket)
	}
	if c.MaxInFlight < 1 {
		return nil, fmt.Errorf("max_in_flight %d: must be at least 1", c.MaxInFlight)
	}
	if c.QueueLimit < c.MaxInFlight {
		return nil, fmt.Errorf("queue_limit %d is below max_in_flight %d: the queue holds the running scrubs too", c.QueueLimit, c.MaxInFlight)
	}
	if c.RemoteBackends.Hold.Duration < 0 {
		return nil, errors.New("remote_backends.hold is negative")
	}
	if c.ShutdownGrace.Duration < 0 {
		return nil, errors.New("shutdown_grace is negative")
	}
	if _, err := ParseBackends(c.Backends); err != nil {
		return nil, err
	}
	if c.RingBytes != 0 && (c.RingBytes < os.Getpagesize() || c.RingBytes&(c.RingBytes-1) != 0) {
		return nil, fmt.Errorf("ring_bytes %d: must be a power of two of at least %d (a page), or 0 for the default", c.RingBytes, os.Getpagesize())
	}
	if c.Bootstrap != "" && c.Bootstrap != "on" && c.Bootstrap != "off" {
		return nil, fmt.Errorf("bootstrap %q: want on or off", c.Bootstrap)
	}
	return out, nil
}

// ParseBackends parses the backends setting: "auto" (nil) or a list of names.
func ParseBackends(s string) ([]string, error) {
	s = strings.TrimSpace(s)
	if s == "" || s == "auto" {
		return nil, nil
	}
	var out []string
	for _, b := range strings.Split(s, ",") {
		b = strings.TrimSpace(b)
		switch b {
		case "cilium", "nfct":
			out = append(out, b)
		default:
			return nil, fmt.Errorf("backend %q: want auto, cilium, nfct or cilium,nfct", b)
		}
	}
	return out, nil
}
