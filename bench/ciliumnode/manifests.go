package main

import (
	"fmt"
	"regexp"
	"strings"

	"go.yaml.in/yaml/v3"
)

// scrubdConf is conf/scrubd.yaml with the cluster's pod range in place of the
// example one and the expiry pass in mode (off or sweep).
func scrubdConf(raw, podCIDR, mode string) (string, error) {
	out := regexp.MustCompile(`(?m)^([ \t]*)- 10\.0\.0\.0/8\b.*$`).ReplaceAllString(raw, "${1}- "+podCIDR)
	out = regexp.MustCompile(`(?m)^([ \t]+)mode:[ \t]*[a-z]+\b(.*)$`).ReplaceAllString(out, "${1}mode: "+mode+"${2}")
	var conf struct {
		PodCIDRs []string `yaml:"pod_cidrs"`
		Expiry   struct {
			Mode string `yaml:"mode"`
		} `yaml:"expiry"`
	}
	if err := yaml.Unmarshal([]byte(out), &conf); err != nil {
		return "", fmt.Errorf("conf/scrubd.yaml templated: %w", err)
	}
	if len(conf.PodCIDRs) != 1 || conf.PodCIDRs[0] != podCIDR || conf.Expiry.Mode != mode {
		return "", fmt.Errorf("conf/scrubd.yaml templated has pod_cidrs %v and expiry.mode %q, want [%s] and %q: update bench/ciliumnode to the file", conf.PodCIDRs, conf.Expiry.Mode, podCIDR, mode)
	}
	return out, nil
}

// daemonSet is conf/daemonset.yaml with every container on image, never
// pulled (it is loaded into the kind nodes).
func daemonSet(raw, image string) (string, error) {
	rx := regexp.MustCompile(`(?m)^([ \t]*)image: ghcr\.io/ctscrub/ctscrub:dev[ \t]*$`)
	n := len(rx.FindAllString(raw, -1))
	out := rx.ReplaceAllString(raw, "${1}image: "+image+"\n${1}imagePullPolicy: IfNotPresent")
	if n == 0 || strings.Contains(out, "ghcr.io/ctscrub") {
		return "", fmt.Errorf("conf/daemonset.yaml: %d image lines replaced, some left: update bench/ciliumnode to the file", n)
	}
	return out, nil
}

// benchPods is PODS bare pods pinned to node (no scheduler in the way: the
// kubelet gets them all at once), running image's default command.
func benchPods(ns, prefix, node, image string, n int) string {
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, `---
apiVersion: v1
kind: Pod
metadata:
  name: %[2]s-%[5]d
  namespace: %[1]s
  labels: {ctscrub-bench: %[2]s}
spec:
  nodeName: %[3]s
  terminationGracePeriodSeconds: 1
  automountServiceAccountToken: false
  enableServiceLinks: false
  containers:
    - name: c
      image: %[4]s
      imagePullPolicy: Never
`, ns, prefix, node, image, i)
	}
	return b.String()
}

// trafficPods are the node's real flows for the whole run: a server and a
// client that keeps opening connections to it and resolving a name (UDP to
// the cluster DNS).
func trafficPods(ns, node, serverImage, clientImage string) string {
	server := `command: ["/agnhost", "netexec", "--http-port=8080"]`
	if !strings.Contains(serverImage, "agnhost") {
		server = `command: ["sh", "-c", "mkdir -p /www && echo ok >/www/index.html && exec httpd -f -p 8080 -h /www"]`
	}
	return fmt.Sprintf(`---
apiVersion: v1
kind: Pod
metadata: {name: traffic-server, namespace: %[1]s, labels: {app: traffic-server}}
spec:
  nodeName: %[2]s
  terminationGracePeriodSeconds: 1
  containers:
    - name: server
      image: %[3]s
      imagePullPolicy: Never
      %[5]s
---
apiVersion: v1
kind: Service
metadata: {name: traffic-server, namespace: %[1]s}
spec:
  selector: {app: traffic-server}
  ports: [{port: 8080, targetPort: 8080}]
---
apiVersion: v1
kind: Pod
metadata: {name: traffic-client, namespace: %[1]s}
spec:
  nodeName: %[2]s
  terminationGracePeriodSeconds: 1
  containers:
    - name: client
      image: %[4]s
      imagePullPolicy: Never
      command: ["sh", "-c", "while :; do for i in 1 2 3 4 5; do timeout 5 wget -q -O /dev/null http://traffic-server:8080/ || true; done; timeout 5 nslookup traffic-server >/dev/null 2>&1 || true; sleep 1; done"]
`, ns, node, serverImage, clientImage, server)
}
