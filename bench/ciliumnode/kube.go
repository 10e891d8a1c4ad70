package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"time"
)

// run runs a command with a timeout and returns its stdout; the error names
// the command and carries stderr.
func run(ctx context.Context, timeout time.Duration, stdin string, name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if stdin != "" {
		cmd.Stdin = strings.NewReader(stdin)
	}
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(lastLines(errb.String(), 5)))
	}
	return out.String(), nil
}

func lastLines(s string, n int) string {
	l := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(l) > n {
		l = l[len(l)-n:]
	}
	return strings.Join(l, "\n")
}

// kube is the benchmark's cluster: kubectl with the cluster's kubeconfig
// (KUBECONFIG from the environment), and the worker node's container.
type kube struct {
	ctx     context.Context
	worker  string // node name = Docker container name
	nodePID int    // the worker container's init process: its mount and net namespaces
	// the worker's Docker container ID: the cgroup path of every process
	// in it (the agent's, scrubd's) holds it
	containerID string
}

func (k *kube) kubectl(timeout time.Duration, args ...string) (string, error) {
	return run(k.ctx, timeout, "", "kubectl", args...)
}

func (k *kube) apply(yaml string) error {
	_, err := run(k.ctx, 2*time.Minute, yaml, "kubectl", "apply", "-f", "-")
	return err
}

// nodeFile is a path inside the worker node's mount namespace, reached
// from the host through /proc/PID/root (bpffs pins included).
func (k *kube) nodeFile(p string) string {
	return fmt.Sprintf("/proc/%d/root%s", k.nodePID, p)
}

// nodeHTTP fetches a URL from inside the worker's network namespace
// (loopback listeners of hostNetwork pods: Cilium's and scrubd's /metrics).
// The Go HTTP client cannot enter a namespace on its own goroutine safely,
// so nsenter runs the host's curl there.
func (k *kube) nodeHTTP(url string) (string, error) {
	return run(k.ctx, 30*time.Second, "", "nsenter", "-t", fmt.Sprint(k.nodePID), "-n", "curl", "-sf", "--max-time", "20", url)
}

// scrubdMetrics is scrubd's /metrics on the worker: it listens on the
// node's IP (conf/scrubd.yaml, metrics_addr ${HOST_IP}:9967).
func (k *kube) scrubdMetrics() (string, error) {
	ip, err := k.kubectl(time.Minute, "get", "node", k.worker, "-o", `jsonpath={.status.addresses[?(@.type=="InternalIP")].address}`)
	if err != nil {
		return "", err
	}
	return k.nodeHTTP("http://" + net.JoinHostPort(strings.TrimSpace(ip), "9967") + "/metrics")
}

// readFrom returns a node file's content from byte offset off on, and its
// size.
func (k *kube) readFrom(p string, off int64) (string, int64, error) {
	f, err := os.Open(k.nodeFile(p))
	if err != nil {
		if os.IsNotExist(err) {
			return "", 0, nil
		}
		return "", 0, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return "", 0, err
	}
	if st.Size() < off { // rotated
		off = 0
	}
	if _, err := f.Seek(off, io.SeekStart); err != nil {
		return "", 0, err
	}
	b, err := io.ReadAll(f)
	return string(b), st.Size(), err
}
