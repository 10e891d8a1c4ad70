package main

import (
	"encoding/json"
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/containernetworking/cni/libcni"
	"go.yaml.in/yaml/v3"
)

// The files an operator installs (conf/) must stay consistent with the
// plugin: the example chain parses, the ConfigMap holds the same chain, and
// the DaemonSet mounts what the plugin and scrubd need.

func TestConfConflist(t *testing.T) {
	data, err := os.ReadFile("../conf/05-cilium.conflist")
	if err != nil {
		t.Fatal(err)
	}
	list, err := libcni.ConfListFromBytes(data)
	if err != nil {
		t.Fatal(err)
	}
	var types []string
	for _, p := range list.Plugins {
		types = append(types, p.Network.Type)
	}
	if !reflect.DeepEqual(types, []string{"cilium-cni", "ctscrub"}) {
		t.Fatalf("chain %v, want cilium-cni then ctscrub", types)
	}
	// What the runtime hands the plugin: the entry plus name and cniVersion.
	entry, err := libcni.InjectConf(list.Plugins[1], map[string]any{"name": list.Name, "cniVersion": list.CNIVersion})
	if err != nil {
		t.Fatal(err)
	}
	conf, err := parseConfig(entry.Bytes)
	if err != nil {
		t.Fatalf("the example's ctscrub entry: %v", err)
	}
	if conf.FailurePolicy != DefaultFailurePolicy {
		t.Fatalf("example failurePolicy %q, default %q", conf.FailurePolicy, DefaultFailurePolicy)
	}

	var cm struct {
		Data map[string]string `yaml:"data"`
	}
	raw, err := os.ReadFile("../conf/cilium-cni-configmap.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(raw, &cm); err != nil {
		t.Fatal(err)
	}
	var a, b any
	json.Unmarshal(data, &a)
	if err := json.Unmarshal([]byte(cm.Data["cni-config"]), &b); err != nil {
		t.Fatalf("ConfigMap cni-config: %v", err)
	}
	if !reflect.DeepEqual(a, b) {
		t.Fatal("conf/cilium-cni-configmap.yaml and conf/05-cilium.conflist differ")
	}
}

func TestConfDaemonSet(t *testing.T) {
	raw, err := os.ReadFile("../conf/daemonset.yaml")
	if err != nil {
		t.Fatal(err)
	}
	type container struct {
		Name         string   `yaml:"name"`
		Command      []string `yaml:"command"`
		VolumeMounts []struct {
			Name      string `yaml:"name"`
			MountPath string `yaml:"mountPath"`
		} `yaml:"volumeMounts"`
	}
	var ds struct {
		Kind string `yaml:"kind"`
		Spec struct {
			Template struct {
				Spec struct {
					HostNetwork    bool        `yaml:"hostNetwork"`
					InitContainers []container `yaml:"initContainers"`
					Containers     []container `yaml:"containers"`
					Volumes        []struct {
						Name     string `yaml:"name"`
						HostPath struct {
							Path string `yaml:"path"`
						} `yaml:"hostPath"`
					} `yaml:"volumes"`
				} `yaml:"spec"`
			} `yaml:"template"`
		} `yaml:"spec"`
	}
	if err := yaml.Unmarshal(raw, &ds); err != nil {
		t.Fatal(err)
	}
	spec := ds.Spec.Template.Spec
	if ds.Kind != "DaemonSet" || !spec.HostNetwork {
		t.Fatalf("kind %q hostNetwork %v: scrubd must run on the host network, outside the chain it serves", ds.Kind, spec.HostNetwork)
	}
	hostPaths := map[string]string{}
	for _, v := range spec.Volumes {
		hostPaths[v.Name] = v.HostPath.Path
	}
	mounted := func(c container) []string {
		var out []string
		for _, m := range c.VolumeMounts {
			out = append(out, hostPaths[m.Name]+"->"+m.MountPath)
		}
		return out
	}
	var scrubd, install *container
	for i, c := range spec.Containers {
		if c.Name == "scrubd" {
			scrubd = &spec.Containers[i]
		}
	}
	for i, c := range spec.InitContainers {
		if slices.Contains(c.Command, "install") {
			install = &spec.InitContainers[i]
		}
	}
	if scrubd == nil || install == nil {
		t.Fatal("want a scrubd container and an init container running ctscrub install")
	}
	// The plugin runs on the host and finds the socket at the default path;
	// scrubd opens the pods' netns by the path the runtime passes.
	for _, want := range []string{"/sys/fs/bpf->/sys/fs/bpf", "/run/ctscrub->/run/ctscrub", "/var/run/netns->/var/run/netns"} {
		if !slices.Contains(mounted(*scrubd), want) {
			t.Errorf("scrubd mounts %v, missing %s", mounted(*scrubd), want)
		}
	}
	for _, want := range []string{"/opt/cni/bin->/host/opt/cni/bin", "/etc/cni/net.d->/host/etc/cni/net.d"} {
		if !slices.Contains(mounted(*install), want) {
			t.Errorf("install-cni mounts %v, missing %s", mounted(*install), want)
		}
	}
	// The install command's flags must be ones ctscrub install knows.
	root := t.TempDir()
	os.MkdirAll(root+"/opt/cni/bin", 0o755)
	os.MkdirAll(root+"/etc/cni/net.d", 0o755)
	args := install.Command[2:]
	for i, a := range args {
		args[i] = strings.Replace(a, "/host", root, 1)
		if strings.HasPrefix(a, "--wait=") {
			// The init container waits up to 10 min for Cilium's conflist;
			// here a moment is enough (the test took 10 min with it).
			args[i] = "--wait=10ms"
		}
	}
	err = runSubcommand("install", args, &strings.Builder{})
	if err == nil || !strings.Contains(err.Error(), "no *.conflist") {
		t.Fatalf("install with the DaemonSet's flags on empty dirs: %v, want the missing-conflist error", err)
	}
}
