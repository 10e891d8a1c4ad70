package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/ctscrub/ctscrub/scrubd/api"
)

// FailurePolicy says what the plugin does when scrubd cannot do its part.
type FailurePolicy string

const (
	// PolicyFail returns the error to the runtime: the pod does not start (ADD)
	// or its IP is not released (DEL) until scrubd has scrubbed it.
	PolicyFail FailurePolicy = "fail"
	// PolicyIgnore logs the error to stderr and lets the chain go on, at the
	// price of possibly stale CT entries for the IP.
	PolicyIgnore FailurePolicy = "ignore"
)

// Defaults, also listed in plugin/README.md.
const (
	DefaultTimeout       = 30 * time.Second
	DefaultFailurePolicy = PolicyFail
	// MaxTimeout keeps the plugin's deadline below kubelet's default runtime
	// request timeout (2m), so the plugin reports a clean error before the
	// runtime gives up on the whole chain.
	MaxTimeout = 2 * time.Minute
)

// Duration is a time.Duration written as a Go duration string ("30s").
type Duration time.Duration

func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("timeout must be a duration string such as \"30s\", got %s", b)
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("timeout %q: %v (write it like \"30s\" or \"1m\")", s, err)
	}
	*d = Duration(v)
	return nil
}

func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(time.Duration(d).String()) }

// Config is the ctscrub entry of a conflist, as the runtime hands it over.
type Config struct {
	types.NetConf

	// Keys the runtime injects that types.NetConf does not declare. They are
	// accepted (unknown keys are an error) and not used.
	RuntimeConfig     json.RawMessage `json:"runtimeConfig,omitempty"`
	Args              json.RawMessage `json:"args,omitempty"`
	LegacyAttachments json.RawMessage `json:"cni.dev/attachments,omitempty"` // libcni sends the spec's old GC key too

	Socket        string        `json:"socket,omitempty"`
	Timeout       Duration      `json:"timeout,omitempty"`
	FailurePolicy FailurePolicy `json:"failurePolicy,omitempty"`
	ScrubOnAdd    *bool         `json:"scrubOnAdd,omitempty"`
	ScrubOnDel    *bool         `json:"scrubOnDel,omitempty"`

	// RawPrevResult is prevResult as the runtime sent it (it shadows
	// types.NetConf's decoded map): ADD prints it back byte for byte, and
	// only the parts ctscrub reads are decoded (prev), not the whole result
	// through the CNI library's typed conversions, which cost a fresh
	// process over half a millisecond per call (docs/bench.md).
	RawPrevResult json.RawMessage `json:"prevResult,omitempty"`
	prev          *prevSeen
}

// prevSeen is what ctscrub reads of the result before it in the chain: the
// interfaces (which are the pod's) and the IPs. Pointers keep a null element
// apart from an empty one.
type prevSeen struct {
	CNIVersion string `json:"cniVersion"`
	Interfaces []*struct {
		Name    string `json:"name"`
		Sandbox string `json:"sandbox"`
	} `json:"interfaces"`
	IPs []*struct {
		Interface *int   `json:"interface"`
		Address   string `json:"address"`
	} `json:"ips"`
}

// HasPrevResult reports whether the config carries a prevResult.
func (c *Config) HasPrevResult() bool { return c.prev != nil }

// ownKeys names the keys ctscrub adds to the standard ones, for error messages.
const ownKeys = "socket, timeout, failurePolicy, scrubOnAdd, scrubOnDel"

// ScrubsOnAdd reports whether ADD scrubs the pod's IPs (default true).
func (c *Config) ScrubsOnAdd() bool { return c.ScrubOnAdd == nil || *c.ScrubOnAdd }

// ScrubsOnDel reports whether DEL scrubs the pod's IPs (default true).
func (c *Config) ScrubsOnDel() bool { return c.ScrubOnDel == nil || *c.ScrubOnDel }

// configError is a CNI "invalid network config" (7) error whose message says
// where the config lives so an operator knows what to edit.
func configError(format string, a ...any) *types.Error {
	return types.NewError(types.ErrInvalidNetworkConfig,
		"ctscrub: invalid config: "+fmt.Sprintf(format, a...),
		"fix the ctscrub entry of the conflist in the runtime's CNI config dir (usually /etc/cni/net.d); see plugin/README.md")
}

// parseConfig decodes and checks the plugin's stdin, fills in defaults and
// parses prevResult when present. Every error it returns is a *types.Error
// with code 7.
func parseConfig(data []byte) (*Config, error) {
	conf := &Config{}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(conf); err != nil {
		if strings.Contains(err.Error(), "unknown field") {
			return nil, configError("%v: the ctscrub entry accepts only the standard CNI keys and %s", err, ownKeys)
		}
		return nil, configError("%v", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, configError("trailing data after the JSON object")
	}

	if conf.Socket == "" {
		conf.Socket = api.DefaultSocket
	}
	if !filepath.IsAbs(conf.Socket) {
		return nil, configError("socket %q must be an absolute path to scrubd's unix socket (default %s)", conf.Socket, api.DefaultSocket)
	}
	switch {
	case conf.Timeout == 0:
		conf.Timeout = Duration(DefaultTimeout)
	case conf.Timeout < 0 || time.Duration(conf.Timeout) > MaxTimeout:
		return nil, configError("timeout %s must be above 0 and at most %s: it must stay below the runtime's own deadline (kubelet --runtime-request-timeout, default 2m)",
			time.Duration(conf.Timeout), MaxTimeout)
	}
	switch conf.FailurePolicy {
	case "":
		conf.FailurePolicy = DefaultFailurePolicy
	case PolicyFail, PolicyIgnore:
	default:
		return nil, configError("failurePolicy %q: must be %q or %q (default %q)", conf.FailurePolicy, PolicyFail, PolicyIgnore, DefaultFailurePolicy)
	}

	if len(conf.RawPrevResult) > 0 && string(conf.RawPrevResult) != "null" {
		if err := conf.parsePrevResult(); err != nil {
			return nil, configError("prevResult: %v (it comes from the plugin before ctscrub in the chain)", err)
		}
	}
	return conf, nil
}

// parsePrevResult decodes and checks the parts of prevResult ctscrub reads.
// The rest (routes, dns, MACs, gateways) is passed on as it came; the runtime
// checks the chain's final result.
func (c *Config) parsePrevResult() error {
	p := &prevSeen{}
	if err := json.Unmarshal(c.RawPrevResult, p); err != nil {
		// The CNI library reads prevResult through a map, where a repeated
		// key counts once (the last): read it so before refusing it.
		var m map[string]any
		if json.Unmarshal(c.RawPrevResult, &m) != nil {
			return err
		}
		b, _ := json.Marshal(m)
		p = &prevSeen{}
		if err := json.Unmarshal(b, p); err != nil {
			return err
		}
	}
	for i, ipc := range p.IPs {
		// A null entry, or one without an address, holds nothing of the
		// pod's (the CNI library reads them so too).
		if ipc == nil || ipc.Address == "" {
			continue
		}
		if _, _, err := net.ParseCIDR(ipc.Address); err != nil {
			return fmt.Errorf("ips[%d].address %q is not an address with a prefix length (\"10.0.0.5/24\"): %v", i, ipc.Address, err)
		}
	}
	c.prev = p
	return nil
}
