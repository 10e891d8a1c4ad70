package kind

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"testing"

	"go.yaml.in/yaml/v3"
)

// helmBinary is helm on PATH or where e2e/kind/install.sh puts it.
func helmBinary(t *testing.T) string {
	t.Helper()
	if p, err := exec.LookPath("helm"); err == nil {
		return p
	}
	p := "/opt/ctscrub-kind/bin/helm"
	if _, err := os.Stat(p); err == nil {
		return p
	}
	t.Skip("helm is not installed (e2e/kind/install.sh builds it from helm.sh/helm/v3; `make e2e-kind` runs this test)")
	return ""
}

// renderChart runs `helm template` on conf/chart and returns its objects by
// kind/name.
func renderChart(t *testing.T, args ...string) map[string]map[string]any {
	t.Helper()
	root := moduleRoot(t)
	cmd := exec.Command(helmBinary(t), append([]string{"template", "ctscrub", filepath.Join(root, "conf", "chart"), "--namespace", "kube-system"}, args...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("helm template: %v\n%s", err, stderr.String())
	}
	objs := map[string]map[string]any{}
	dec := yaml.NewDecoder(bytes.NewReader(out))
	for {
		var o map[string]any
		if err := dec.Decode(&o); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("helm template output: %v\n%s", err, out)
		}
		if o == nil {
			continue
		}
		md, _ := o["metadata"].(map[string]any)
		objs[fmt.Sprintf("%v/%v", o["kind"], md["name"])] = o
	}
	return objs
}

func yamlFile(t *testing.T, rel string) map[string]any {
	t.Helper()
	var o map[string]any
	if err := yaml.Unmarshal(readFile(t, moduleRoot(t), rel), &o); err != nil {
		t.Fatalf("%s: %v", rel, err)
	}
	return o
}

// TestChartMatchesConf: conf/chart with its default values renders exactly
// what conf/ holds, object by object (compared as data, so comments and key
// order do not matter): the DaemonSet (conf/daemonset.yaml), the ConfigMap
// ctscrub-config of conf/scrubd.yaml, and Cilium's CNI ConfigMap
// (conf/cilium-cni-configmap.yaml), and nothing else. scrubd needs no
// Kubernetes API access, so neither holds RBAC objects.
func TestChartMatchesConf(t *testing.T) {
	objs := renderChart(t)
	want := map[string]map[string]any{
		"DaemonSet/ctscrub":            yamlFile(t, "conf/daemonset.yaml"),
		"ConfigMap/cilium-cni-ctscrub": yamlFile(t, "conf/cilium-cni-configmap.yaml"),
		"ConfigMap/ctscrub-config": {
			"apiVersion": "v1", "kind": "ConfigMap",
			"metadata": map[string]any{"name": "ctscrub-config", "namespace": "kube-system"},
			"data":     map[string]any{"scrubd.yaml": string(readFile(t, moduleRoot(t), "conf/scrubd.yaml"))},
		},
	}
	for key := range objs {
		if _, ok := want[key]; !ok {
			t.Errorf("the chart renders %s, which conf/ does not hold", key)
		}
	}
	for key, w := range want {
		got, ok := objs[key]
		if !ok {
			t.Errorf("the chart does not render %s", key)
			continue
		}
		// The files inside ConfigMaps compare as data too.
		for file, decode := range map[string]func(string) (any, error){
			"scrubd.yaml": func(s string) (any, error) { var v any; return v, yaml.Unmarshal([]byte(s), &v) },
			"cni-config":  func(s string) (any, error) { var v any; return v, json.Unmarshal([]byte(s), &v) },
		} {
			for _, o := range []map[string]any{got, w} {
				if d, ok := o["data"].(map[string]any); ok {
					if s, ok := d[file].(string); ok {
						v, err := decode(s)
						if err != nil {
							t.Fatalf("%s: %s: %v", key, file, err)
						}
						d[file] = v
					}
				}
			}
		}
		if !reflect.DeepEqual(got, w) {
			g, _ := yaml.Marshal(got)
			ww, _ := yaml.Marshal(w)
			t.Errorf("%s: the chart renders\n%s\nconf/ holds\n%s", key, g, ww)
		}
	}
}

// TestChartValues: the values the kind e2e sets reach every container and
// scrubd's config.
func TestChartValues(t *testing.T) {
	objs := renderChart(t, "--set", "image.repository=example/ctscrub", "--set", "image.tag=t1",
		"--set", "image.pullPolicy=IfNotPresent", "--set", "config.pod_cidrs={10.244.0.0/16}")
	ds := objs["DaemonSet/ctscrub"]
	spec := ds["spec"].(map[string]any)["template"].(map[string]any)["spec"].(map[string]any)
	n := 0
	for _, list := range []string{"initContainers", "containers"} {
		for _, c := range spec[list].([]any) {
			c := c.(map[string]any)
			n++
			if c["image"] != "example/ctscrub:t1" || c["imagePullPolicy"] != "IfNotPresent" {
				t.Errorf("container %v: image %v, pull policy %v; want example/ctscrub:t1, IfNotPresent", c["name"], c["image"], c["imagePullPolicy"])
			}
		}
	}
	if n != 3 {
		t.Errorf("%d containers, want 3 (install-cni, scrubd, cni-conf)", n)
	}
	var conf struct {
		PodCIDRs []string `yaml:"pod_cidrs"`
	}
	cm := objs["ConfigMap/ctscrub-config"]["data"].(map[string]any)["scrubd.yaml"].(string)
	if err := yaml.Unmarshal([]byte(cm), &conf); err != nil || !reflect.DeepEqual(conf.PodCIDRs, []string{"10.244.0.0/16"}) {
		t.Errorf("scrubd.yaml pod_cidrs %v (%v), want [10.244.0.0/16]:\n%s", conf.PodCIDRs, err, cm)
	}
}
