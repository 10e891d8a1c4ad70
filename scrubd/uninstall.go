package main

// Uninstall without a second step: when the DaemonSet scrubd runs in is
// deleted (helm uninstall, kubectl delete), scrubd's SIGTERM is the last
// chance to take ctscrub off the node. Left chained with failurePolicy fail,
// every pod ADD and DEL on the node would fail until someone ran
// `ctscrub uninstall` there by hand. Any other SIGTERM (rolling update,
// drain, eviction, a node shutdown) keeps the chain: a replacement comes,
// and pods must not start unseen meanwhile.
//
// How scrubd tells the two apart: it watches its own DaemonSet through the
// API server from the start (plain HTTPS with the pod's service account
// token; the chart's Role allows get/list/watch on that one DaemonSet), and
// at SIGTERM asks once more. A watch, not only a GET at SIGTERM: Helm
// deletes the Role, RoleBinding and ServiceAccount right after the
// DaemonSet, before the garbage collector deletes the pods, so at SIGTERM
// the API usually answers 401 or 403; the watch saw the DaemonSet go before
// that. When neither can tell (API unreachable, no permission), the chain is
// kept and the log says why and what to run.

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"
)

// The in-cluster service account files (kubelet mounts them in every pod
// that automounts its token).
const serviceAccountDir = "/var/run/secrets/kubernetes.io/serviceaccount"

// daemonSetWatch knows whether scrubd's own DaemonSet is being removed.
type daemonSetWatch struct {
	base      string // https://host:port of the API server
	namespace string
	name      string
	tokenFile string // read at each request: the kubelet rotates it
	client    *http.Client
	log       *slog.Logger

	removed atomic.Bool   // the watch saw the DaemonSet deleted or deleting
	synced  atomic.Bool   // the watch reached the API at least once
	backoff time.Duration // between watch attempts
}

// newInClusterDaemonSetWatch watches namespace/name with the pod's service
// account, found the way client-go's in-cluster config finds it.
func newInClusterDaemonSetWatch(ref string, log *slog.Logger) (*daemonSetWatch, error) {
	ns, name, ok := strings.Cut(ref, "/")
	if !ok || ns == "" || name == "" {
		return nil, fmt.Errorf("--daemonset %q: want namespace/name (the chart passes $(POD_NAMESPACE)/<its DaemonSet>)", ref)
	}
	host, port := os.Getenv("KUBERNETES_SERVICE_HOST"), os.Getenv("KUBERNETES_SERVICE_PORT")
	if host == "" || port == "" {
		return nil, errors.New("--daemonset: KUBERNETES_SERVICE_HOST/PORT are not set: not running in a pod? (leave --daemonset empty outside Kubernetes)")
	}
	ca, err := os.ReadFile(filepath.Join(serviceAccountDir, "ca.crt"))
	if err != nil {
		return nil, fmt.Errorf("--daemonset: %v (the pod needs its service account token: automountServiceAccountToken)", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		return nil, fmt.Errorf("--daemonset: no certificate in %s", filepath.Join(serviceAccountDir, "ca.crt"))
	}
	return newDaemonSetWatch("https://"+net.JoinHostPort(host, port), ns, name,
		filepath.Join(serviceAccountDir, "token"), &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}, log), nil
}

func newDaemonSetWatch(base, namespace, name, tokenFile string, tlsConf *tls.Config, log *slog.Logger) *daemonSetWatch {
	tr := &http.Transport{TLSClientConfig: tlsConf, TLSHandshakeTimeout: 5 * time.Second, ResponseHeaderTimeout: 10 * time.Second}
	return &daemonSetWatch{
		base: base, namespace: namespace, name: name, tokenFile: tokenFile,
		client: &http.Client{Transport: tr}, log: log, backoff: 5 * time.Second,
	}
}

// dsObject is the part of a DaemonSet (or a watch event's object, or a
// Status) this needs.
type dsObject struct {
	Kind     string `json:"kind"`
	Metadata struct {
		Name              string  `json:"name"`
		ResourceVersion   string  `json:"resourceVersion"`
		DeletionTimestamp *string `json:"deletionTimestamp"`
	} `json:"metadata"`
	Code int `json:"code"` // a Status's (an ERROR event's object)
}

func (w *daemonSetWatch) path() string {
	return fmt.Sprintf("/apis/apps/v1/namespaces/%s/daemonsets", url.PathEscape(w.namespace))
}

func (w *daemonSetWatch) request(ctx context.Context, u string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, err
	}
	token, err := os.ReadFile(w.tokenFile)
	if err != nil {
		return nil, fmt.Errorf("service account token: %w", err)
	}
	req.Header.Set("Authorization", "Bearer "+strings.TrimSpace(string(token)))
	req.Header.Set("Accept", "application/json")
	return w.client.Do(req)
}

// run keeps a watch on the DaemonSet until ctx ends, and sets removed when
// it sees the DaemonSet deleted or given a deletionTimestamp. A watch the
// API server ends (its timeout) is resumed at once from the last
// resourceVersion, so a deletion in between is still delivered; after an
// error it waits backoff.
func (w *daemonSetWatch) run(ctx context.Context) {
	rv := ""
	for ctx.Err() == nil && !w.removed.Load() {
		q := url.Values{"watch": {"1"}, "fieldSelector": {"metadata.name=" + w.name}}
		if rv != "" {
			q.Set("resourceVersion", rv)
		}
		var err error
		began := time.Now()
		rv, err = w.watchOnce(ctx, w.base+w.path()+"?"+q.Encode(), rv)
		if ctx.Err() != nil || w.removed.Load() {
			return
		}
		// A stream that lasted ended by the server's timeout; one that
		// ends at once must not become a busy loop.
		if (err == nil || errors.Is(err, io.EOF)) && time.Since(began) > time.Second {
			continue
		}
		w.log.Debug("daemonset watch ended", "daemonset", w.namespace+"/"+w.name, "err", err)
		select {
		case <-ctx.Done():
		case <-time.After(w.backoff):
		}
	}
}

// watchOnce reads one watch stream; it returns the resourceVersion to
// resume from ("" after 410 Gone: start over) and why the stream ended.
func (w *daemonSetWatch) watchOnce(ctx context.Context, u, rv string) (string, error) {
	resp, err := w.request(ctx, u)
	if err != nil {
		return rv, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		err := fmt.Errorf("watch %s: HTTP %d: %s", u, resp.StatusCode, strings.TrimSpace(string(b)))
		if !w.synced.Load() {
			// Once, so a missing Role is in the log long before a SIGTERM.
			w.log.Warn("cannot watch scrubd's DaemonSet: an uninstall will leave ctscrub chained on this node (check the chart's Role and RoleBinding)", "err", err)
			w.synced.Store(true)
		}
		if resp.StatusCode == http.StatusGone {
			rv = ""
		}
		return rv, err
	}
	w.synced.Store(true)
	dec := json.NewDecoder(bufio.NewReader(resp.Body))
	for {
		var ev struct {
			Type   string   `json:"type"`
			Object dsObject `json:"object"`
		}
		if err := dec.Decode(&ev); err != nil {
			return rv, err
		}
		if ev.Type == "ERROR" {
			if ev.Object.Code == http.StatusGone {
				rv = "" // too old to resume from: start over
			}
			return rv, fmt.Errorf("watch %s: ERROR event, code %d", u, ev.Object.Code)
		}
		if ev.Object.Kind != "DaemonSet" || ev.Object.Metadata.Name != w.name {
			continue
		}
		if ev.Object.Metadata.ResourceVersion != "" {
			rv = ev.Object.Metadata.ResourceVersion
		}
		if ev.Type == "DELETED" || ev.Object.Metadata.DeletionTimestamp != nil {
			w.log.Info("scrubd's DaemonSet is being deleted: at SIGTERM ctscrub is taken off this node", "daemonset", w.namespace+"/"+w.name, "event", ev.Type)
			w.removed.Store(true)
			return rv, nil
		}
	}
}

// decide tells, at SIGTERM, whether this stop is an uninstall: the watch saw
// the DaemonSet go, or a GET now finds it gone (404) or being deleted. It
// returns why, for the log; an error when it cannot tell (the chain stays).
func (w *daemonSetWatch) decide(ctx context.Context) (bool, string, error) {
	if w.removed.Load() {
		return true, "the watch saw the DaemonSet deleted", nil
	}
	u := w.base + w.path() + "/" + url.PathEscape(w.name)
	resp, err := w.request(ctx, u)
	if err != nil {
		return false, "", fmt.Errorf("GET %s: %w", u, err)
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusNotFound:
		return true, "the DaemonSet is gone (404)", nil
	case http.StatusOK:
		var ds dsObject
		if err := json.NewDecoder(resp.Body).Decode(&ds); err != nil {
			return false, "", fmt.Errorf("GET %s: %w", u, err)
		}
		if ds.Metadata.DeletionTimestamp != nil {
			return true, "the DaemonSet is being deleted (deletionTimestamp " + *ds.Metadata.DeletionTimestamp + ")", nil
		}
		return false, "the DaemonSet is still there (rolling update, drain or eviction)", nil
	default:
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return false, "", fmt.Errorf("GET %s: HTTP %d: %s", u, resp.StatusCode, strings.TrimSpace(string(b)))
	}
}

// ctscrubBinary is the plugin binary shipped beside scrubd in the image: its
// `uninstall` is the one way ctscrub is taken off a node.
func ctscrubBinary() (string, error) {
	self, err := os.Executable()
	if err != nil {
		return "", err
	}
	return filepath.Join(filepath.Dir(self), "ctscrub"), nil
}

// uninstallStep runs `ctscrub uninstall` with args and logs its output.
func uninstallStep(ctx context.Context, log *slog.Logger, step string, args ...string) error {
	bin, err := ctscrubBinary()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, bin, append([]string{"uninstall"}, args...)...).CombinedOutput()
	for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if l != "" {
			log.Info("uninstall: "+step, "out", l)
		}
	}
	if err != nil {
		return fmt.Errorf("%s uninstall %s: %w", bin, strings.Join(args, " "), err)
	}
	return nil
}
