// Package crirt runs a containerd of its own (root, state, socket, config,
// CNI dirs) with its CRI plugin, for e2e/cri and `make soak`: the config, the
// locally built pause image (no registry is reachable here), and start,
// kill and crictl. TEST SUPPORT: it never meets a containerd the machine may
// run.
package crirt

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"
)

// PauseImage is the sandbox image's name; containerd's CRI finds it locally
// after `ctr images import` and never tries to pull it.
const PauseImage = "localhost/ctscrub/pause:e2e"

// Config is containerd's config.toml for a containerd whose root, state and
// socket are under dir, with one CNI bin dir (containerd 1.6 takes only one)
// and one CNI conf dir.
//
// restrict_oom_score_adj: processes here may not lower oom_score_adj, and
// runc fails without it. The stream server's port 0 keeps two of these
// containerds from fighting over 10010.
func Config(dir, sock, binDir, confDir string) string {
	return fmt.Sprintf(`version = 2
root = %[1]q
state = %[2]q
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]

[grpc]
  address = %[3]q

[ttrpc]
  address = %[4]q

[plugins."io.containerd.internal.v1.opt"]
  path = %[5]q

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %[6]q
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "native"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %[7]q
    conf_dir = %[8]q
    max_conf_num = 1
`, filepath.Join(dir, "root"), filepath.Join(dir, "state"), sock, sock+".ttrpc",
		filepath.Join(dir, "opt"), PauseImage, binDir, confDir)
}

type descriptor struct {
	MediaType   string            `json:"mediaType"`
	Digest      string            `json:"digest"`
	Size        int               `json:"size"`
	Platform    map[string]string `json:"platform,omitempty"`
	Annotations map[string]string `json:"annotations,omitempty"`
}

// WritePauseImage writes an OCI image archive (an OCI image layout in a tar)
// holding one uncompressed layer with the pause binary at /pause.
func WritePauseImage(pauseBin, archive string) error {
	bin, err := os.ReadFile(pauseBin)
	if err != nil {
		return err
	}
	var layer bytes.Buffer
	lw := tar.NewWriter(&layer)
	now := time.Unix(0, 0)
	if err := lw.WriteHeader(&tar.Header{Name: "pause", Mode: 0o755, Size: int64(len(bin)), ModTime: now, Typeflag: tar.TypeReg}); err != nil {
		return err
	}
	lw.Write(bin)
	lw.Close()

	blobs := map[string][]byte{}
	add := func(mediaType string, b []byte) descriptor {
		sum := sha256.Sum256(b)
		d := "sha256:" + hex.EncodeToString(sum[:])
		blobs[hex.EncodeToString(sum[:])] = b
		return descriptor{MediaType: mediaType, Digest: d, Size: len(b)}
	}
	mustJSON := func(v any) []byte {
		b, err := json.Marshal(v)
		if err != nil {
			panic(err) // maps of strings and descriptors always marshal
		}
		return b
	}
	layerDesc := add("application/vnd.oci.image.layer.v1.tar", layer.Bytes())
	config := add("application/vnd.oci.image.config.v1+json", mustJSON(map[string]any{
		"architecture": runtime.GOARCH,
		"os":           "linux",
		"config":       map[string]any{"Entrypoint": []string{"/pause"}},
		// An uncompressed layer's diff ID is its digest.
		"rootfs": map[string]any{"type": "layers", "diff_ids": []string{layerDesc.Digest}},
	}))
	manifest := add("application/vnd.oci.image.manifest.v1+json", mustJSON(map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.manifest.v1+json",
		"config":        config,
		"layers":        []descriptor{layerDesc},
	}))
	manifest.Platform = map[string]string{"architecture": runtime.GOARCH, "os": "linux"}
	manifest.Annotations = map[string]string{
		"io.containerd.image.name":          PauseImage,
		"org.opencontainers.image.ref.name": "e2e",
	}
	index := mustJSON(map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.index.v1+json",
		"manifests":     []descriptor{manifest},
	})

	f, err := os.Create(archive)
	if err != nil {
		return err
	}
	defer f.Close()
	tw := tar.NewWriter(f)
	var errs []error
	file := func(name string, b []byte) {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(b)), ModTime: now, Typeflag: tar.TypeReg}); err != nil {
			errs = append(errs, err)
		}
		_, err := tw.Write(b)
		errs = append(errs, err)
	}
	file("oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`))
	file("index.json", index)
	for hexsum, b := range blobs {
		file("blobs/sha256/"+hexsum, b)
	}
	errs = append(errs, tw.Close())
	return errors.Join(errs...)
}

// Containerd is one containerd process with its dirs under Dir.
type Containerd struct {
	Dir     string
	Sock    string
	BinDir  string // the CNI bin dir
	ConfDir string // the CNI conf dir
	LogPath string
	// Netns, when set, is the network namespace containerd (and so the CNI
	// plugins it runs) lives in: the path of a node netns.
	Netns string

	cmd    *exec.Cmd
	exited chan error
	logf   *os.File
}

// New writes containerd's and crictl's config under dir. binDir and confDir
// must exist (the caller puts the plugins and the conflist there).
func New(dir, binDir, confDir, netns string) (*Containerd, error) {
	c := &Containerd{Dir: dir, Sock: filepath.Join(dir, "containerd.sock"), BinDir: binDir, ConfDir: confDir,
		LogPath: filepath.Join(dir, "containerd.log"), Netns: netns}
	if err := os.MkdirAll(filepath.Join(dir, "pod-logs"), 0o755); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, "config.toml"), []byte(Config(dir, c.Sock, binDir, confDir)), 0o644); err != nil {
		return nil, err
	}
	crictlConf := fmt.Sprintf("runtime-endpoint: unix://%s\nimage-endpoint: unix://%s\ntimeout: 60\n", c.Sock, c.Sock)
	if err := os.WriteFile(filepath.Join(dir, "crictl.yaml"), []byte(crictlConf), 0o644); err != nil {
		return nil, err
	}
	return c, nil
}

// Start runs containerd and waits up to 60 s for its CRI to answer.
func (c *Containerd) Start() error {
	bin, err := exec.LookPath("containerd")
	if err != nil {
		return err
	}
	if c.logf == nil {
		if c.logf, err = os.OpenFile(c.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644); err != nil {
			return err
		}
	}
	args := []string{bin, "--config", filepath.Join(c.Dir, "config.toml")}
	if c.Netns != "" {
		args = append([]string{"nsenter", "--net=" + c.Netns}, args...)
	}
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Stdout, cmd.Stderr = c.logf, c.logf
	if err := cmd.Start(); err != nil {
		return err
	}
	c.cmd = cmd
	c.exited = make(chan error, 1)
	go func() { c.exited <- cmd.Wait() }()
	deadline := time.Now().Add(60 * time.Second)
	for {
		out, err := c.Crictl("info")
		if err == nil {
			return nil
		}
		select {
		case err := <-c.exited:
			c.exited <- err
			return fmt.Errorf("containerd exited: %v (log %s)", err, c.LogPath)
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("containerd's CRI not answering after 60s: %v: %s (log %s)", err, out, c.LogPath)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// Kill SIGKILLs containerd and waits for it to exit. The shims and the
// processes it started (CNI plugins in flight) live on.
func (c *Containerd) Kill() {
	if c.cmd == nil {
		return
	}
	c.cmd.Process.Kill()
	<-c.exited
	c.cmd = nil
}

// Stop stops containerd with SIGINT (SIGKILL after 15 s).
func (c *Containerd) Stop() {
	if c.cmd == nil {
		return
	}
	c.cmd.Process.Signal(os.Interrupt)
	select {
	case <-c.exited:
	case <-time.After(15 * time.Second):
		c.cmd.Process.Kill()
		<-c.exited
	}
	c.cmd = nil
	if c.logf != nil {
		c.logf.Close()
		c.logf = nil
	}
}

// Pid is containerd's process id (0 when not running).
func (c *Containerd) Pid() int {
	if c.cmd == nil {
		return 0
	}
	return c.cmd.Process.Pid
}

// Crictl runs crictl against this containerd and returns its stdout (crictl
// warns on stderr).
func (c *Containerd) Crictl(args ...string) (string, error) {
	return c.CrictlContext(context.Background(), args...)
}

// CrictlContext is Crictl ended by ctx (at most 90 s).
func (c *Containerd) CrictlContext(ctx context.Context, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 90*time.Second)
	defer cancel()
	all := append([]string{"--config", filepath.Join(c.Dir, "crictl.yaml"), "--timeout", "60s"}, args...)
	cmd := exec.CommandContext(ctx, "crictl", all...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return string(out), fmt.Errorf("crictl %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return string(out), nil
}

// ImportImage imports an OCI archive into the CRI's namespace.
func (c *Containerd) ImportImage(archive string) error {
	out, err := exec.Command("ctr", "--address", c.Sock, "-n", "k8s.io", "images", "import", "--snapshotter", "native", archive).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ctr images import: %v: %s", err, out)
	}
	return nil
}
