package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/client"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// errNoPrevResult is the answer to an ADD or CHECK without prevResult: the
// plugin is installed on its own instead of chained.
func errNoPrevResult(cmd string) *types.Error {
	return configError("%s without prevResult: ctscrub is a chained plugin and must come after the plugin that assigns the pod's IPs "+
		"(cilium-cni, or bridge with host-local) in the conflist's \"plugins\" list, with a cniVersion of 0.3.0 or later", cmd)
}

// podAddrs returns the pod's IPs and its container-side interface from a
// prevResult: the interface with "sandbox" set (preferring the one named
// ifname), and the IPs on sandbox interfaces (or with no interface index).
func podAddrs(res *prevSeen, ifname string) ([]netip.Addr, string) {
	sandbox := map[int]bool{}
	chosen := -1
	for i, in := range res.Interfaces {
		if in == nil || in.Sandbox == "" {
			continue
		}
		sandbox[i] = true
		if chosen < 0 || (in.Name == ifname && res.Interfaces[chosen].Name != ifname) {
			chosen = i
		}
	}
	name := ifname
	if chosen >= 0 && res.Interfaces[chosen].Name != "" {
		// A sandbox interface without a name (found by FuzzPrevResult) is
		// CNI_IFNAME's: the spec names the container's interface so.
		name = res.Interfaces[chosen].Name
	}
	var ips []netip.Addr
	for _, ipc := range res.IPs {
		if ipc == nil {
			continue
		}
		// An IP bound to a host-side interface (a bridge's gateway, say) is
		// not the pod's.
		if ipc.Interface != nil && len(sandbox) > 0 && !sandbox[*ipc.Interface] {
			continue
		}
		// Parsed as the CNI library parses it (net.ParseCIDR, which also takes
		// "/024"); parseConfig refused what it cannot parse.
		ip, _, err := net.ParseCIDR(ipc.Address)
		if err != nil {
			continue
		}
		a, ok := netip.AddrFromSlice(ip)
		if !ok {
			continue
		}
		a = a.Unmap()
		if !slices.Contains(ips, a) {
			ips = append(ips, a)
		}
	}
	return ips, name
}

// prevResultAddrs returns the pod's IPs and interface from conf's prevResult
// (none when absent; parseConfig has checked it).
func prevResultAddrs(conf *Config, ifname string) ([]netip.Addr, string, error) {
	if conf.prev == nil {
		return nil, ifname, nil
	}
	ips, name := podAddrs(conf.prev, ifname)
	return ips, name, nil
}

// convertResult runs a conversion of prevResult by the CNI library, which
// dereferences every element of "interfaces" and "ips" without checking: a
// prevResult with a null element (e.g. "interfaces":[null] at 0.4.0) made it
// panic, and the plugin died without the error JSON the runtime expects
// (found by FuzzPrevResult). A panic there is a malformed prevResult.
func convertResult(conv func() (types.Result, error)) (res types.Result, err error) {
	defer func() {
		if p := recover(); p != nil {
			res, err = nil, fmt.Errorf("malformed (a null or incomplete entry in \"interfaces\", \"ips\", \"routes\" or \"dns\": %v)", p)
		}
	}()
	return conv()
}

func withTimeout(conf *Config) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), time.Duration(conf.Timeout))
}

func attachmentID(args *skel.CmdArgs) string {
	return fmt.Sprintf("container %s ifname %s", args.ContainerID, args.IfName)
}

// cmdAdd scrubs the stale CT entries of the pod's IPs (a previous owner's),
// starts indexing the pod's interface, and only then passes prevResult on:
// the runtime starts the pod's containers after the chain returns, so the pod
// itself sends nothing before its IPs are clean. The IPs are live already,
// though (with Cilium the endpoint exists once cilium-cni has returned): a
// peer's packets can reach them during the scrub and before the recorder is
// attached (docs/plugin.md, "Order of work", says what covers that window).
func cmdAdd(args *skel.CmdArgs) error {
	tr := newTrace("ADD")
	if err := checkNetns(args.Netns); err != nil {
		return err
	}
	conf, err := parseConfig(args.StdinData)
	if err != nil {
		return err
	}
	if !conf.HasPrevResult() {
		return errNoPrevResult("ADD")
	}
	ips, ifname, err := prevResultAddrs(conf, args.IfName)
	if err != nil {
		return err
	}
	if len(ips) == 0 {
		return configError("prevResult has no IPs for the pod's interface %s: ctscrub must come after a plugin that assigns the pod's IPs "+
			"(cilium-cni, or bridge with host-local), not after one that only sets up links", ifname)
	}

	tr.mark("parse")
	ctx, cancel := withTimeout(conf)
	defer cancel()
	cl := tr.client(conf.Socket)
	id := attachmentID(args)
	if err := add(ctx, cl, conf, args, ips, ifname); err != nil {
		if err := failure(conf, "ADD", id, err.what, err.err); err != nil {
			return err
		}
	}
	tr.mark("requests")
	err = printPrevResult(conf)
	tr.mark("print")
	tr.print(cl)
	return err
}

// stepError names the step of a command that failed.
type stepError struct {
	what string
	err  error
}

func add(ctx context.Context, cl *client.Client, conf *Config, args *skel.CmdArgs, ips []netip.Addr, ifname string) *stepError {
	start := api.IndexStartRequest{
		Attachment: api.Attachment{ContainerID: args.ContainerID, IfName: ifname},
		Netns:      args.Netns,
		IPs:        ips,
		Network:    conf.Name,
		Scrub:      conf.ScrubsOnAdd(),
	}
	scrubWhat := fmt.Sprintf("scrub %v before container %s starts", ips, args.ContainerID)
	startWhat := fmt.Sprintf("start indexing %s in %s (container %s)", ifname, args.Netns, args.ContainerID)
	// One round trip: scrubd scrubs, then attaches.
	err := cl.IndexStart(ctx, start)
	if start.Scrub && olderScrubd(err, "scrub") {
		// A scrubd older than this plugin (an upgrade in progress): the
		// scrub and the start as two requests.
		_, err := cl.Scrub(ctx, api.ScrubRequest{
			IPs: ips, Reason: scrub.ReasonAdd,
			ContainerID: args.ContainerID, Netns: args.Netns, IfName: ifname,
		})
		if err != nil {
			return &stepError{scrubWhat, err}
		}
		start.Scrub = false
		err = cl.IndexStart(ctx, start)
		if err != nil {
			return &stepError{startWhat, err}
		}
		return nil
	}
	if err != nil {
		if e, ok := client.APIError(err); ok && e.Results != nil {
			return &stepError{scrubWhat, err} // the scrub failed or was cancelled; nothing attached
		}
		if start.Scrub {
			startWhat = scrubWhat + " and " + startWhat
		}
		return &stepError{startWhat, err}
	}
	return nil
}

// printPrevResult passes prevResult on: byte for byte when it is at the
// config's cniVersion (a runtime hands it over so), else converted by the CNI
// library.
func printPrevResult(conf *Config) error {
	if conf.prev.CNIVersion == conf.CNIVersion {
		_, err := stdout.Write(append(conf.RawPrevResult, '\n'))
		return err
	}
	nc := conf.NetConf
	if err := json.Unmarshal(conf.RawPrevResult, &nc.RawPrevResult); err != nil {
		return configError("prevResult: %v", err)
	}
	if _, err := convertResult(func() (types.Result, error) { return nil, version.ParsePrevResult(&nc) }); err != nil {
		return configError("prevResult cannot be read as a CNI %s result: %v", conf.CNIVersion, err)
	}
	r, err := convertResult(func() (types.Result, error) { return nc.PrevResult.GetAsVersion(conf.CNIVersion) })
	if err != nil {
		return configError("prevResult cannot be converted to cniVersion %s: %v", conf.CNIVersion, err)
	}
	return r.PrintTo(stdout)
}

// cmdDel scrubs the pod's CT entries and stops indexing its interface. The IPs
// come from prevResult, or, when the runtime sends none (containerd's second
// DEL, conflists at 0.3.x), from what scrubd recorded at ADD. A DEL for an
// attachment scrubd does not know, or whose netns is gone, succeeds.
//
// When this DEL fails, the runtime does not run the DELs of the plugins before
// ctscrub (DEL walks the list in reverse), so the IP-assigning plugin keeps the
// IP: no new pod gets an IP whose stale entries are still in the table. The
// runtime retries the DEL.
func cmdDel(args *skel.CmdArgs) error {
	tr := newTrace("DEL")
	conf, err := parseConfig(args.StdinData)
	if err != nil {
		return err
	}
	ips, _, err := prevResultAddrs(conf, args.IfName)
	if err != nil {
		return err
	}
	tr.mark("parse")
	ctx, cancel := withTimeout(conf)
	defer cancel()
	cl := tr.client(conf.Socket)
	defer tr.print(cl)
	id := attachmentID(args)
	if err := del(ctx, cl, conf, args, ips); err != nil {
		if client.IsUnavailable(err.err) && neverAdded(conf) {
			fmt.Fprintf(stderr, "ctscrub: DEL %s: scrubd is unavailable, but without prevResult at cniVersion %s the runtime has no successful ADD on record: the pod never ran, nothing of it to scrub; letting the chain release its IP\n",
				id, conf.CNIVersion)
			return checkNetns(args.Netns)
		}
		if err := failure(conf, "DEL", id, err.what, err.err); err != nil {
			return err
		}
	}
	// After the DEL's work, as skel checked it: the pod's entries are
	// scrubbed whatever the runtime got wrong.
	return checkNetns(args.Netns)
}

// neverAdded reports whether a DEL's config says the runtime has no record of
// a successful ADD: from 0.4.0 on, runtimes pass the cached result of the ADD
// as prevResult, and cache it only when the whole chain succeeded. Such a DEL
// is the cleanup of a failed ADD (or a repeat of a DEL that succeeded), so the
// pod never ran and failing it would only leak the netns and the IP.
func neverAdded(conf *Config) bool {
	if conf.HasPrevResult() {
		return false
	}
	ok, err := version.GreaterThanOrEqualTo(conf.CNIVersion, "0.4.0")
	return err == nil && ok
}

func del(ctx context.Context, cl *client.Client, conf *Config, args *skel.CmdArgs, ips []netip.Addr) *stepError {
	me := api.Attachment{ContainerID: args.ContainerID, IfName: args.IfName}
	// One round trip: scrubd looks the attachment up, scrubs and stops it.
	resp, err := cl.Del(ctx, api.IndexStopRequest{Attachment: me, Netns: args.Netns, Del: &api.CNIDel{IPs: ips, Scrub: conf.ScrubsOnDel()}})
	if !olderScrubd(err, "del") {
		if err != nil {
			return &stepError{fmt.Sprintf("scrub the IPs of container %s and stop indexing %s", args.ContainerID, args.IfName), err}
		}
		for _, s := range resp.Skipped {
			fmt.Fprintf(stderr, "ctscrub: DEL %s: not scrubbing %s: it belongs to container %s ifname %s now\n",
				attachmentID(args), s.IP, s.Owner.ContainerID, s.Owner.IfName)
		}
		return nil
	}
	// A scrubd older than this plugin (mid-upgrade): the DEL as separate
	// requests.
	return delSteps(ctx, cl, conf, args, me, ips)
}

// olderScrubd reports whether err is a scrubd refusing a request field it
// does not know yet (its decoder is strict): one older than the plugin.
func olderScrubd(err error, field string) bool {
	e, ok := client.APIError(err)
	return ok && e.Code == api.CodeBadRequest && strings.Contains(e.Message, `unknown field "`+field+`"`)
}

func delSteps(ctx context.Context, cl *client.Client, conf *Config, args *skel.CmdArgs, me api.Attachment, ips []netip.Addr) *stepError {
	rec, err := cl.IndexPod(ctx, me)
	if e, ok := client.APIError(err); ok && e.Code == api.CodeNotFound {
		rec, err = nil, nil
	}
	if err != nil {
		return &stepError{fmt.Sprintf("look up what scrubd recorded for %s ifname %s", args.ContainerID, args.IfName), err}
	}
	if rec != nil && !rec.Stopped.IsZero() {
		// An earlier DEL (or GC) scrubbed and stopped it: containerd's second
		// DEL on rmp, or a retry.
		return nil
	}
	if len(ips) == 0 && rec != nil {
		ips = rec.IPs
	}
	if rec == nil && len(ips) > 0 {
		// Not indexed, yet prevResult names IPs: a repeated DEL may come after
		// the IP was released and given to a new pod, whose entries are live
		// and must stay.
		kept := ips[:0:0]
		for _, ip := range ips {
			st, err := cl.IndexIP(ctx, ip)
			if err != nil {
				return &stepError{fmt.Sprintf("ask scrubd who holds %s", ip), err}
			}
			if st.Owner != nil && *st.Owner != me {
				fmt.Fprintf(stderr, "ctscrub: DEL %s: not scrubbing %s: it belongs to container %s ifname %s now\n",
					attachmentID(args), ip, st.Owner.ContainerID, st.Owner.IfName)
				continue
			}
			kept = append(kept, ip)
		}
		ips = kept
	}
	if conf.ScrubsOnDel() && len(ips) > 0 {
		_, err := cl.Scrub(ctx, api.ScrubRequest{
			IPs: ips, Reason: scrub.ReasonDel,
			ContainerID: args.ContainerID, Netns: args.Netns, IfName: args.IfName,
		})
		if err != nil {
			return &stepError{fmt.Sprintf("scrub %v of container %s", ips, args.ContainerID), err}
		}
	}
	if rec == nil {
		// A pod scrubd never indexed: tell scrubd, whose released IPs can
		// no longer be trusted (that pod's flows are in no index). Best
		// effort: the DEL's outcome does not depend on it.
		if err := cl.IndexStop(ctx, api.IndexStopRequest{Attachment: me, Netns: args.Netns}); err != nil {
			fmt.Fprintf(stderr, "ctscrub: DEL %s: report an attachment scrubd never indexed: %v\n", attachmentID(args), err)
		}
		return nil
	}
	// After the scrub, so that the index covers every flow up to it.
	err = cl.IndexStop(ctx, api.IndexStopRequest{Attachment: me, Netns: args.Netns})
	if e, ok := client.APIError(err); ok && e.Code == api.CodeNotFound {
		err = nil // a concurrent DEL stopped it first
	}
	if err != nil {
		return &stepError{fmt.Sprintf("stop indexing %s of container %s", args.IfName, args.ContainerID), err}
	}
	return nil
}

// cmdCheck checks that scrubd is reachable and indexes the container's
// interface with the IPs of prevResult.
func cmdCheck(args *skel.CmdArgs) error {
	conf, err := parseConfig(args.StdinData)
	if err != nil {
		return err
	}
	if !conf.HasPrevResult() {
		return errNoPrevResult("CHECK")
	}
	ips, ifname, err := prevResultAddrs(conf, args.IfName)
	if err != nil {
		return err
	}
	ctx, cancel := withTimeout(conf)
	defer cancel()
	id := attachmentID(args)
	me := api.Attachment{ContainerID: args.ContainerID, IfName: ifname}
	rec, err := client.New(conf.Socket).IndexPod(ctx, me)
	if e, ok := client.APIError(err); ok && e.Code == api.CodeNotFound {
		rec, err = nil, nil
	}
	if err != nil {
		return failure(conf, "CHECK", id, "look up the attachment in scrubd", err)
	}
	if rec == nil || !rec.Stopped.IsZero() {
		return checkFailure(conf, id, fmt.Sprintf("scrubd does not index %s of container %s: its flows are not recorded, so scrubbing its IPs needs a sweep of the CT maps", ifname, args.ContainerID),
			"see scrubd's log for why the attachment was lost (restart without its bpffs pins?), and recreate the pod")
	}
	for _, ip := range ips {
		if !slices.Contains(rec.IPs, ip) {
			return checkFailure(conf, id, fmt.Sprintf("scrubd indexes %s of container %s with IPs %v, but prevResult has %s", ifname, args.ContainerID, rec.IPs, ip),
				"recreate the pod so ADD registers its current IPs")
		}
	}
	return nil
}

func checkFailure(conf *Config, id, msg, fix string) error {
	e := types.NewError(types.ErrInternal, "ctscrub: CHECK: "+msg, fix)
	if conf.FailurePolicy == PolicyIgnore {
		fmt.Fprintf(stderr, "ctscrub: CHECK %s: ignored because failurePolicy is %q: %s (%s)\n", id, PolicyIgnore, e.Msg, e.Details)
		return nil
	}
	return e
}

// cmdStatus answers 50 (plugin not available) when scrubd cannot serve ADD:
// not running, or running but not ready. Under failurePolicy "ignore" ADD
// succeeds without scrubd, so STATUS does too.
func cmdStatus(args *skel.CmdArgs) error {
	conf, err := parseConfig(args.StdinData)
	if err != nil {
		return err
	}
	ctx, cancel := withTimeout(conf)
	defer cancel()
	st, err := client.New(conf.Socket).Status(ctx)
	var e *types.Error
	switch {
	case err != nil:
		d := daemonError(conf, "STATUS", err)
		e = types.NewError(types.ErrPluginNotAvailable, d.Msg, d.Details)
	case !st.Ready:
		e = types.NewError(types.ErrPluginNotAvailable,
			fmt.Sprintf("ctscrub: STATUS: scrubd %s at %s is running but not ready (backends %v)", st.Version, conf.Socket, st.Backends),
			"wait for scrubd to finish starting; if it stays not ready, see its log (kubectl -n kube-system logs ds/ctscrub)")
	default:
		return nil
	}
	if conf.FailurePolicy == PolicyIgnore {
		fmt.Fprintf(stderr, "ctscrub: STATUS: ignored because failurePolicy is %q: %s\n", PolicyIgnore, e.Msg)
		return nil
	}
	return e
}

// cmdGC passes the runtime's list of valid attachments to scrubd, which
// drops its state for every other attachment.
func cmdGC(args *skel.CmdArgs) error {
	conf, err := parseConfig(args.StdinData)
	if err != nil {
		return err
	}
	valid := conf.ValidAttachments
	if valid == nil && len(conf.LegacyAttachments) > 0 {
		if err := json.Unmarshal(conf.LegacyAttachments, &valid); err != nil {
			return configError("cni.dev/attachments: %v", err)
		}
	}
	// Without the list scrubd would drop every attachment; a runtime that
	// sends GC always sends it, so its absence is a broken request.
	if valid == nil {
		return configError("GC without cni.dev/valid-attachments: refusing to drop every attachment scrubd indexes")
	}
	if len(valid) == 0 {
		// scrubd refuses a GC that names no attachment (it would drop every
		// pod of the network). A runtime sends an empty list only for a
		// network without a pod on the node: nothing runs whose state could
		// leak for long, and each pod's DEL stopped its attachment anyway.
		fmt.Fprintf(stderr, "ctscrub: GC of network %q: no valid attachment listed; nothing to do (scrubd never drops every pod of a network)\n", conf.Name)
		return nil
	}
	atts := make([]api.Attachment, 0, len(valid))
	for _, a := range valid {
		atts = append(atts, api.Attachment{ContainerID: a.ContainerID, IfName: a.IfName})
	}
	ctx, cancel := withTimeout(conf)
	defer cancel()
	resp, err := client.New(conf.Socket).GC(ctx, conf.Name, atts)
	if err != nil {
		return failure(conf, "GC", fmt.Sprintf("(%d valid attachments)", len(atts)), "drop attachments that are gone", err)
	}
	for _, d := range resp.Dropped {
		fmt.Fprintf(stderr, "ctscrub: GC: scrubd dropped container %s ifname %s\n", d.ContainerID, d.IfName)
	}
	return nil
}
