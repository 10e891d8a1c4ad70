package nfct_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/containernetworking/cni/libcni"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/vishvananda/netns"
)

const refPlugins = "/usr/lib/cni"

func randHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

func addNetns(t *testing.T, name string) string {
	t.Helper()
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add %s: %v: %s", name, err, out)
	}
	t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	return "/var/run/netns/" + name
}

// inNetns runs fn on a thread moved into the namespace at path. Sockets fn
// opens stay there; processes fn starts (the CNI plugins) start there.
func inNetns(path string, fn func() error) error {
	target, err := netns.GetFromPath(path)
	if err != nil {
		return fmt.Errorf("open netns %s: %w", path, err)
	}
	defer target.Close()
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			errc <- err
			return
		}
		defer orig.Close()
		if err := netns.Set(target); err != nil {
			errc <- fmt.Errorf("enter netns %s: %w", path, err)
			return
		}
		ferr := fn()
		if netns.Set(orig) == nil {
			runtime.UnlockOSThread()
		} // else the thread dies with the goroutine, still locked
		errc <- ferr
	}()
	return <-errc
}

// network is one CNI network of the test node: Debian's reference bridge +
// host-local, run through libcni from inside the node's namespace, as a
// runtime on that node would run them.
type network struct {
	cni  *libcni.CNIConfig
	list *libcni.NetworkConfigList
	node string // netns path of the node
}

// newNetwork makes the conflist; with ctscrub set (the plugin binary and
// scrubd's socket) the ctscrub plugin is chained after bridge.
func newNetwork(t *testing.T, node, name, bridge string, subnet netip.Prefix, first, last netip.Addr, ctscrub *ctscrubPlugin) *network {
	t.Helper()
	for _, p := range []string{"bridge", "host-local"} {
		if _, err := os.Stat(filepath.Join(refPlugins, p)); err != nil {
			t.Skipf("reference CNI plugin %s missing (install containernetworking-plugins): %v", p, err)
		}
	}
	dir := t.TempDir()
	plugins := []map[string]any{{
		"type":      "bridge",
		"bridge":    bridge,
		"isGateway": true,
		"ipMasq":    false,
		"ipam": map[string]any{
			"type":    "host-local",
			"dataDir": filepath.Join(dir, "ipam"),
			"ranges":  [][]map[string]string{{{"subnet": subnet.String(), "rangeStart": first.String(), "rangeEnd": last.String()}}},
			"routes":  []map[string]string{{"dst": "0.0.0.0/0"}},
		},
	}}
	binDirs := []string{refPlugins}
	if ctscrub != nil {
		plugins = append(plugins, map[string]any{"type": "ctscrub", "socket": ctscrub.socket, "timeout": "20s"})
		binDirs = append(binDirs, filepath.Dir(ctscrub.bin))
	}
	conf := map[string]any{
		"cniVersion": "1.0.0", // Debian's plugins speak up to 1.0.0
		"name":       name,
		"plugins":    plugins,
	}
	data, _ := json.Marshal(conf)
	list, err := libcni.ConfListFromBytes(data)
	if err != nil {
		t.Fatalf("conflist %s: %v", name, err)
	}
	return &network{
		cni:  libcni.NewCNIConfigWithCacheDir(binDirs, filepath.Join(dir, "cache"), nil),
		list: list,
		node: node,
	}
}

// ctscrubPlugin is the ctscrub CNI plugin binary and the scrubd it talks to.
type ctscrubPlugin struct {
	bin    string
	socket string
}

type pod struct {
	name  string
	netns string
	ip    netip.Addr
	rt    *libcni.RuntimeConf
}

func (nw *network) add(t *testing.T, name string) *pod {
	t.Helper()
	path := addNetns(t, name)
	p := &pod{name: name, netns: path, rt: &libcni.RuntimeConf{ContainerID: name, NetNS: path, IfName: "eth0"}}
	var res *current.Result
	err := inNetns(nw.node, func() error {
		r, err := nw.cni.AddNetworkList(context.Background(), nw.list, p.rt)
		if err != nil {
			return err
		}
		res, err = current.NewResultFromResult(r)
		return err
	})
	if err != nil {
		t.Fatalf("CNI ADD of pod %s: %v", name, err)
	}
	for _, ipc := range res.IPs {
		if a, ok := netip.AddrFromSlice(ipc.Address.IP); ok && a.Unmap().Is4() {
			p.ip = a.Unmap()
		}
	}
	if !p.ip.IsValid() {
		t.Fatalf("CNI ADD of pod %s gave no IPv4 address: %v", name, res)
	}
	return p
}

// del runs the chain's DEL and removes the pod's namespace: the pod is gone,
// its IP released.
func (nw *network) del(t *testing.T, p *pod) {
	t.Helper()
	if err := inNetns(nw.node, func() error {
		return nw.cni.DelNetworkList(context.Background(), nw.list, p.rt)
	}); err != nil {
		t.Fatalf("CNI DEL of pod %s: %v", p.name, err)
	}
	if out, err := exec.Command("ip", "netns", "del", filepath.Base(p.netns)).CombinedOutput(); err != nil {
		t.Fatalf("delete netns of pod %s: %v: %s", p.name, err, out)
	}
}

func run(t *testing.T, node string, args ...string) {
	t.Helper()
	cmd := append([]string{"netns", "exec", filepath.Base(node)}, args...)
	if out, err := exec.Command("ip", cmd...).CombinedOutput(); err != nil {
		t.Fatalf("ip %v: %v: %s", cmd, err, out)
	}
}
