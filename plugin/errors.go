package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/client"
)

// daemonError turns a failure of a call to scrubd into the CNI error the
// runtime gets. The code tells the runtime what to do: 50 (unavailable: scrubd
// is not running), 11 (try again later: scrubd refused for load or did not
// finish within the plugin's timeout), 7 (the config and scrubd's disagree),
// 999 (anything else).
func daemonError(conf *Config, what string, err error) *types.Error {
	sock := conf.Socket
	timeout := time.Duration(conf.Timeout)
	if client.IsUnavailable(err) {
		return types.NewError(types.ErrPluginNotAvailable,
			fmt.Sprintf("ctscrub: %s: scrubd is unavailable: %v", what, err),
			fmt.Sprintf("start scrubd on this node (the ctscrub DaemonSet, socket %s), or check the plugin's \"socket\" setting; failurePolicy %q keeps pods waiting until it runs", sock, conf.FailurePolicy))
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return types.NewError(types.ErrTryAgainLater,
			fmt.Sprintf("ctscrub: %s: scrubd did not answer within the plugin's timeout %s: %v", what, timeout, err),
			"scrubd is slow or overloaded; the runtime retries. If it persists, look at scrubd's ctscrub_scrub_duration_seconds and queue metrics, or raise \"timeout\" (keep it below the runtime's deadline)")
	}
	if e, ok := client.APIError(err); ok {
		switch e.Code {
		case api.CodeTryAgain:
			return types.NewError(types.ErrTryAgainLater,
				fmt.Sprintf("ctscrub: %s: scrubd refused for load: %s", what, e.Message),
				"the runtime retries; if it persists, raise scrubd's queue limit in conf/scrubd.yaml or lower the pod churn on this node")
		case api.CodeCancelled:
			return types.NewError(types.ErrTryAgainLater,
				fmt.Sprintf("ctscrub: %s: scrubd stopped the work at the plugin's deadline (timeout %s): %s", what, timeout, e.Message),
				"the runtime retries; a later scrub finishes the job. If it persists, raise \"timeout\" (keep it below the runtime's deadline)")
		case api.CodeBadRequest, api.CodeNotPodIP:
			return types.NewError(types.ErrInvalidNetworkConfig,
				fmt.Sprintf("ctscrub: %s: scrubd rejected the request: %s", what, e.Message),
				"make scrubd's pod CIDRs (conf/scrubd.yaml) cover the IPs the IP-assigning plugin hands out, and check the plugin and scrubd versions match")
		}
		return types.NewError(types.ErrInternal,
			fmt.Sprintf("ctscrub: %s: scrubd failed (%s): %s", what, e.Code, e.Message),
			"see scrubd's log on this node (kubectl -n kube-system logs ds/ctscrub) for the cause")
	}
	return types.NewError(types.ErrInternal,
		fmt.Sprintf("ctscrub: %s: talking to scrubd at %s: %v", what, sock, err),
		"see scrubd's log on this node (kubectl -n kube-system logs ds/ctscrub)")
}

// failure applies the failure policy to an error from scrubd: with "fail" it
// returns the CNI error; with "ignore" it logs the error to stderr (the
// runtime's log) and returns nil so the chain goes on.
func failure(conf *Config, cmd string, id string, what string, err error) error {
	e := daemonError(conf, what, err)
	if conf.FailurePolicy == PolicyIgnore {
		fmt.Fprintf(stderr, "ctscrub: %s %s: ignored because failurePolicy is %q (the IP may keep stale CT entries): %s (%s)\n",
			cmd, id, PolicyIgnore, e.Msg, e.Details)
		return nil
	}
	return e
}
