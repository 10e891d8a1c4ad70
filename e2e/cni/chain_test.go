// Package cni tests the ctscrub plugin in the real CNI chain: libcni runs a
// conflist of the reference bridge + host-local plugins and ctscrub, for every
// CNI version ctscrub claims, in real network namespaces, with a real scrubd
// and the Cilium datapath stand-in turning real pod traffic into CT entries in
// Cilium's layout.
package cni

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/ctscrub/ctscrub/e2e/internal/node"
	"github.com/ctscrub/ctscrub/internal/testsupport/standin"
	"github.com/ctscrub/ctscrub/scrubd/api"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
)

func TestMain(m *testing.M) {
	code := m.Run()
	node.CleanupBuilds()
	if pluginsDir != "" {
		os.RemoveAll(pluginsDir)
	}
	os.Exit(code)
}

// Debian's reference plugins (1.1.1) speak CNI up to 1.0.0.
const debianCNI = "/usr/lib/cni"

var (
	pluginsOnce sync.Once
	pluginsDir  string
	pluginsErr  error
)

// referencePlugins returns the directory of bridge and host-local for ver:
// Debian's for up to 1.0.0, and for 1.1.0 ones built from
// github.com/containernetworking/plugins v1.10.0 (through the module proxy).
func referencePlugins(t *testing.T, ver string) string {
	t.Helper()
	if ver != "1.1.0" {
		for _, p := range []string{"bridge", "host-local"} {
			if _, err := os.Stat(filepath.Join(debianCNI, p)); err != nil {
				t.Skipf("reference CNI plugin %s missing in %s (apt install containernetworking-plugins)", p, debianCNI)
			}
		}
		return debianCNI
	}
	pluginsOnce.Do(func() {
		pluginsDir, pluginsErr = os.MkdirTemp("", "ctscrub-e2e-plugins-")
		if pluginsErr != nil {
			return
		}
		cmd := exec.Command("go", "install",
			"github.com/containernetworking/plugins/plugins/main/bridge@v1.10.0",
			"github.com/containernetworking/plugins/plugins/ipam/host-local@v1.10.0")
		cmd.Env = append(os.Environ(), "GOBIN="+pluginsDir, "GOFLAGS=", "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			pluginsErr = fmt.Errorf("%v\n%s", err, out)
		}
	})
	if pluginsErr != nil {
		t.Skipf("CNI 1.1.0 needs bridge and host-local from containernetworking/plugins v1.10.0; building them failed (no module proxy?): %v", pluginsErr)
	}
	return pluginsDir
}

// TestChain runs, at each CNI version: two pods with real traffic between
// them, a pod deleted while its peer keeps sending to its IP (stale entries),
// a new pod that gets the same IP and must start with none of the old pod's
// entries, CHECK (0.4.0+), STATUS and GC (1.1.0), repeated DEL and a DEL whose
// netns is gone.
func TestChain(t *testing.T) {
	node.RequireRoot(t)
	for _, ver := range []string{"0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"} {
		t.Run(ver, func(t *testing.T) { testChain(t, ver) })
	}
}

// chain is one node: a node namespace holding the bridge, the CT maps and
// the stand-in, scrubd, and the conflist run through libcni.
type chain struct {
	t      *testing.T
	ver    string
	nodeNS string
	cni    *libcni.CNIConfig
	list   *libcni.NetworkConfigList
	dp     *standin.Datapath
	maps   *ctmap.Maps
	scrubd *node.Scrubd
	sfx    string
	subnet netip.Prefix
}

type pod struct {
	name     string
	netns    string
	id       string
	ip       netip.Addr
	mac      net.HardwareAddr
	hostVeth string
	rt       *libcni.RuntimeConf
}

func testChain(t *testing.T, ver string) {
	ref := referencePlugins(t, ver)
	c := newChain(t, ver, ref, true)
	ctx := context.Background()

	a, b := c.add("a"), c.add("b")
	serveEcho(t, b.netns)
	serveEcho(t, a.netns)
	for _, p := range [][2]*pod{{a, b}, {b, a}} {
		if err := tcp(p[0].netns, p[1].ip); err != nil {
			t.Fatal(err)
		}
		if err := udp(p[0].netns, p[1].ip); err != nil {
			t.Fatal(err)
		}
	}
	before := c.entries(a.ip)
	if before == 0 {
		t.Fatalf("no CT entries of %s after real traffic: the stand-in did not see it", a.ip)
	}
	c.check(a)
	// scrubd's recorder, attached in a's netns at ADD, saw the same flows:
	// the index holds at least every entry of a's IP and can prove it.
	c.scrubd.WaitIndexed(t, a.ip, before)

	// DEL a: its entries go (reason del), found through the index.
	byIndex := map[string]string{"reason": "del", "method": "index"}
	indexDels := c.scrubd.Metric(t, "ctscrub_scrub_duration_seconds_count", byIndex)
	lateBefore := c.scrubd.Metric(t, "ctscrub_del_late_total", nil)
	start := time.Now()
	c.del(a)
	delTook := time.Since(start)
	if got := c.scrubd.Metric(t, "ctscrub_scrub_duration_seconds_count", byIndex); got != indexDels+1 {
		t.Fatalf("DEL's scrub did not go through the index: index del scrubs %v -> %v", indexDels, got)
	}
	if n := c.entries(a.ip); n != 0 {
		t.Fatalf("%d CT entries of %s left after DEL", n, a.ip)
	}
	if rec, err := c.scrubd.Client.IndexPod(ctx, api.Attachment{ContainerID: a.id, IfName: "eth0"}); err == nil && rec.Stopped.IsZero() {
		t.Fatalf("%s still indexed after DEL: %+v", a.id, rec)
	}

	// scrubd scrubs a's IP once more when its interface is gone (the DEL
	// window, docs/daemon.md); b's stale traffic below must come after that
	// late scrub, or it may scrub b's entries before the ADD can.
	c.scrubd.WaitLateDel(t, lateBefore+1)

	// b keeps sending to a's IP (its neighbour entry still points at a's
	// MAC, as a client's does for a while): real traffic that leaves stale
	// CT entries of the old IP behind.
	if err := node.Do(b.netns, func() error {
		return exec.Command("ip", "neigh", "replace", a.ip.String(), "lladdr", a.mac.String(), "nud", "permanent", "dev", "eth0").Run()
	}); err != nil {
		t.Fatal(err)
	}
	if err := sendUDP(b.netns, a.ip); err != nil {
		t.Fatal(err)
	}
	stale := c.entries(a.ip)
	if stale == 0 {
		t.Fatalf("b's traffic to the deleted pod's IP %s created no CT entry", a.ip)
	}
	node.Do(b.netns, func() error { return exec.Command("ip", "neigh", "del", a.ip.String(), "dev", "eth0").Run() })
	// b's recorder indexes the stale flow (through its ring buffer).
	c.scrubd.WaitIndexed(t, a.ip, stale)
	t.Logf("%s: %d entries of pod a (%s) before its DEL, 0 after; %d stale ones from b's traffic to the gone IP", ver, before, a.ip, stale)

	// A new pod gets a's IP (host-local's range holds two addresses): ADD
	// scrubs the stale entries before the pod gets any traffic.
	addByIndex := map[string]string{"reason": "add", "method": "index"}
	indexAdds := c.scrubd.Metric(t, "ctscrub_scrub_duration_seconds_count", addByIndex)
	start = time.Now()
	n := c.add("c")
	addTook := time.Since(start)
	// b's recorder saw its flows to the old IP: the ADD scrub needs no sweep.
	if got := c.scrubd.Metric(t, "ctscrub_scrub_duration_seconds_count", addByIndex); got != indexAdds+1 {
		t.Errorf("ADD's scrub of the reused IP did not go through the index: index add scrubs %v -> %v", indexAdds, got)
	}
	if n.ip != a.ip {
		t.Fatalf("new pod got %s, want the reused IP %s (host-local range of two)", n.ip, a.ip)
	}
	if left := c.entries(n.ip); left != 0 {
		t.Fatalf("new pod %s starts with %d CT entries of the old pod (there were %d stale)", n.ip, left, stale)
	}
	t.Logf("%s: chain DEL of a %s, chain ADD of c (same IP, stale entries scrubbed) %s", ver, delTook.Round(time.Millisecond), addTook.Round(time.Millisecond))
	serveEcho(t, n.netns)
	if err := tcp(b.netns, n.ip); err != nil {
		t.Fatal(err)
	}
	if c.entries(n.ip) == 0 {
		t.Fatal("no CT entries for the new pod's own traffic")
	}
	c.check(n)
	if ver >= "0.4.0" {
		// CHECK of an attachment scrubd does not index: a clear failure.
		conf := []byte(fmt.Sprintf(`{"cniVersion":%q,"name":"x","type":"ctscrub","socket":%q,"prevResult":{"cniVersion":%q,"ips":[{"address":"%s/24"}]}}`,
			ver, c.scrubd.Socket, ver, n.ip))
		err := invoke.ExecPluginWithoutResult(ctx, node.Build(t, "./plugin", "ctscrub"), conf,
			&invoke.Args{Command: "CHECK", ContainerID: "never-added", NetNS: n.netns, IfName: "eth0", Path: "/nonexistent"}, nil)
		var e *types.Error
		if !errors.As(err, &e) || e.Code != types.ErrInternal || !strings.Contains(e.Msg, "does not index eth0 of container never-added") {
			t.Fatalf("CHECK of an unknown attachment: %v", err)
		}
	}

	if ver == "1.1.0" {
		if err := c.cni.GetStatusNetworkList(ctx, c.list); err != nil {
			t.Fatalf("STATUS with scrubd up: %v", err)
		}
		// GC with only b valid: libcni DELs the other cached attachment (n)
		// through the chain, then ctscrub's GC has scrubd drop what is not b.
		err := c.cni.GCNetworkList(ctx, c.list, &libcni.GCArgs{ValidAttachments: []types.GCAttachment{{ContainerID: b.id, IfName: "eth0"}}})
		if err != nil {
			t.Fatalf("GC: %v", err)
		}
		if c.entries(n.ip) != 0 {
			t.Fatalf("CT entries of %s left after GC removed its pod", n.ip)
		}
		list, err := c.scrubd.Client.IndexList(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(list.Pods) != 1 || list.Pods[0].ContainerID != b.id {
			t.Fatalf("indexed after GC: %+v, want only %s", list.Pods, b.id)
		}
	} else {
		c.del(n)
	}

	// DEL whose netns is gone, then the same DEL again.
	if err := exec.Command("ip", "netns", "del", filepath.Base(b.netns)).Run(); err != nil {
		t.Fatal(err)
	}
	c.del(b)
	c.del(b)
	if left := c.entries(b.ip); left != 0 {
		t.Fatalf("%d CT entries of %s left after DEL with its netns gone", left, b.ip)
	}
	if st, err := c.scrubd.Client.Status(ctx); err != nil || st.IndexedPods != 0 {
		t.Fatalf("after every DEL: %+v, %v; want nothing indexed", st, err)
	}
}

// newChain builds the node; with nodeNetns scrubd is told the node's
// namespace (where the bridge plugin leaves the host-side veths), so its
// recorder puts its host-side links there.
func newChain(t *testing.T, ver, refDir string, nodeNetns bool) *chain {
	sfx := node.Suffix()
	c := &chain{t: t, ver: ver, sfx: sfx}
	// The bridge, its veths and the gateway address live in a node
	// namespace of their own: nothing of the host's network changes.
	c.nodeNS = node.NewNetns(t, "ctsn-"+sfx)
	if err := node.Do(c.nodeNS, func() error { return exec.Command("ip", "link", "set", "lo", "up").Run() }); err != nil {
		t.Fatal(err)
	}

	dir := standin.TempDir(t)
	if err := standin.CreateMaps(dir, 65536); err != nil {
		t.Fatal(err)
	}
	dp, err := standin.Load(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dp.Close() })
	c.dp = dp
	if c.maps, err = dp.Maps(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.maps.Close() })

	subnet := netip.MustParsePrefix(fmt.Sprintf("10.%d.%d.0/24", 130+rand.IntN(30), rand.IntN(250)))
	c.subnet = subnet
	opts := node.Options{CTRoot: dir, PodCIDRs: []string{subnet.String()}}
	if nodeNetns {
		opts.Args = []string{"--node-netns", c.nodeNS}
	}
	c.scrubd = node.StartScrubd(t, opts)

	base := subnet.Addr().As4()
	ip := func(last byte) string { b := base; b[3] = last; return netip.AddrFrom4(b).String() }
	conf := fmt.Sprintf(`{
  "cniVersion": %[1]q,
  "name": "ctscrub-e2e-%[2]s",
  "plugins": [
    {"type": "bridge", "bridge": "br%[2]s", "isGateway": true, "ipMasq": false,
     "ipam": {"type": "host-local", "dataDir": %[3]q,
              "ranges": [[{"subnet": %[4]q, "rangeStart": %[5]q, "rangeEnd": %[6]q}]]}},
    {"type": "ctscrub", "socket": %[7]q, "timeout": "20s"}
  ]
}`, ver, sfx, filepath.Join(t.TempDir(), "ipam"), subnet.String(), ip(10), ip(11), c.scrubd.Socket)
	if c.list, err = libcni.ConfListFromBytes([]byte(conf)); err != nil {
		t.Fatal(err)
	}
	ctscrub := node.Build(t, "./plugin", "ctscrub")
	c.cni = libcni.NewCNIConfigWithCacheDir([]string{refDir, filepath.Dir(ctscrub)}, t.TempDir(), nil)
	return c
}

// add creates a pod's netns and runs ADD through the chain, then attaches
// the Cilium stand-in to its host-side veth as cilium-cni would.
func (c *chain) add(name string) *pod {
	t := c.t
	p := &pod{name: name, netns: node.NewNetns(t, "ctsp-"+c.sfx+"-"+name), id: fmt.Sprintf("e2e-%s-%s", c.sfx, name)}
	p.rt = &libcni.RuntimeConf{ContainerID: p.id, NetNS: p.netns, IfName: "eth0"}
	var res types.Result
	err := node.Do(c.nodeNS, func() error {
		var err error
		res, err = c.cni.AddNetworkList(context.Background(), c.list, p.rt)
		return err
	})
	if err != nil {
		t.Fatalf("ADD %s at %s: %v", name, c.ver, err)
	}
	t.Cleanup(func() {
		node.Do(c.nodeNS, func() error { return c.cni.DelNetworkList(context.Background(), c.list, p.rt) })
	})
	r, err := current.NewResultFromResult(res)
	if err != nil {
		t.Fatal(err)
	}
	for _, in := range r.Interfaces {
		switch {
		case in.Sandbox != "":
			if p.mac, err = net.ParseMAC(in.Mac); err != nil {
				t.Fatalf("pod MAC %q: %v", in.Mac, err)
			}
		case in.Name != "br"+c.sfx:
			p.hostVeth = in.Name
		}
	}
	if len(r.IPs) != 1 || p.hostVeth == "" || p.mac == nil {
		t.Fatalf("ADD %s: result %s has no single IP, host veth or pod MAC", name, r)
	}
	p.ip, _ = netip.AddrFromSlice(r.IPs[0].Address.IP.To4())
	if err := node.Do(c.nodeNS, func() error { return c.dp.AttachHostSide(p.hostVeth) }); err != nil {
		t.Fatal(err)
	}
	rec, err := c.scrubd.Client.IndexPod(context.Background(), api.Attachment{ContainerID: p.id, IfName: "eth0"})
	if err != nil || !rec.Stopped.IsZero() || len(rec.IPs) != 1 || rec.IPs[0] != p.ip || rec.Netns != p.netns {
		t.Fatalf("after ADD %s: scrubd's record %+v, %v; want eth0 of %s in %s indexed with %s", name, rec, err, p.id, p.netns, p.ip)
	}
	return p
}

func (c *chain) del(p *pod) {
	c.t.Helper()
	err := node.Do(c.nodeNS, func() error { return c.cni.DelNetworkList(context.Background(), c.list, p.rt) })
	if err != nil {
		c.t.Fatalf("DEL %s at %s: %v", p.name, c.ver, err)
	}
}

// check runs CHECK through the chain (0.4.0 and later).
func (c *chain) check(p *pod) {
	c.t.Helper()
	if c.ver < "0.4.0" {
		return
	}
	err := node.Do(c.nodeNS, func() error { return c.cni.CheckNetworkList(context.Background(), c.list, p.rt) })
	if err != nil {
		c.t.Fatalf("CHECK %s at %s: %v", p.name, c.ver, err)
	}
}

// entries counts the CT entries that hold ip.
func (c *chain) entries(ip netip.Addr) int { return node.CountEntries(c.t, c.maps, ip) }

const echoPort = 7777

// serveEcho answers TCP and UDP on echoPort inside the pod's namespace.
func serveEcho(t *testing.T, netnsPath string) {
	t.Helper()
	var ln net.Listener
	var pc net.PacketConn
	err := node.Do(netnsPath, func() error {
		var err error
		if ln, err = net.Listen("tcp4", fmt.Sprintf(":%d", echoPort)); err != nil {
			return err
		}
		pc, err = net.ListenPacket("udp4", fmt.Sprintf(":%d", echoPort))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close(); pc.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			buf := make([]byte, 64)
			conn.SetDeadline(time.Now().Add(3 * time.Second))
			if n, err := conn.Read(buf); err == nil {
				conn.Write(buf[:n])
			}
			conn.Close()
		}
	}()
	go func() {
		buf := make([]byte, 64)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			pc.WriteTo(buf[:n], from)
		}
	}()
}

// dial opens a socket inside netnsPath.
func dial(netnsPath, network string, dst netip.Addr) (net.Conn, error) {
	var conn net.Conn
	err := node.Do(netnsPath, func() error {
		var err error
		conn, err = net.DialTimeout(network, netip.AddrPortFrom(dst, echoPort).String(), 3*time.Second)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("%s from %s to %s: %w", network, netnsPath, dst, err)
	}
	conn.SetDeadline(time.Now().Add(3 * time.Second))
	return conn, nil
}

func echo(netnsPath, network string, dst netip.Addr) error {
	conn, err := dial(netnsPath, network, dst)
	if err != nil {
		return err
	}
	defer conn.Close()
	if _, err := conn.Write([]byte("ctscrub")); err != nil {
		return fmt.Errorf("%s to %s: %w", network, dst, err)
	}
	buf := make([]byte, 64)
	if _, err := conn.Read(buf); err != nil {
		return fmt.Errorf("%s to %s: no echo: %w", network, dst, err)
	}
	return nil
}

func tcp(netnsPath string, dst netip.Addr) error { return echo(netnsPath, "tcp4", dst) }
func udp(netnsPath string, dst netip.Addr) error { return echo(netnsPath, "udp4", dst) }

// sendUDP sends one datagram and waits for nothing (the peer may be gone).
func sendUDP(netnsPath string, dst netip.Addr) error {
	conn, err := dial(netnsPath, "udp4", dst)
	if err != nil {
		return err
	}
	defer conn.Close()
	_, err = conn.Write([]byte("anyone?"))
	return err
}
