package main

import (
	"fmt"
	"net/netip"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// The synthetic objects: Services without a selector (no controller of the
// cluster touches them or their slices) and EndpointSlices written by the
// benchmark alone, shaped as the EndpointSlice controller writes them for
// a Deployment's pods (a target reference, node name and zone per
// endpoint), so a watch event carries what it carries in a real cluster.
// Addresses are backed by no pod.

const (
	managedBy = "remotewatch.bench.ctscrub.io"
	// The synthetic nodes the endpoints name (a 5,000-node cluster's).
	syntheticNodes = 5000
	// Unscheduled pods: no scheduler of this name runs, so nothing but the
	// benchmark ever writes them.
	noScheduler = "ctscrub-bench-unscheduled"
)

var (
	// Backend addresses: 10.128.0.0/9, outside kind's pod (10.244.0.0/16)
	// and Service (10.96.0.0/16) ranges.
	backendBase = netip.MustParseAddr("10.128.0.0")
	// Synthetic pods' addresses: 10.64.0.0/10.
	podBase = netip.MustParseAddr("10.64.0.0")
)

// nthAddr is base + n.
func nthAddr(base netip.Addr, n uint32) netip.Addr {
	b := base.As4()
	v := uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])
	v += n
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}

func serviceName(svc int) string { return fmt.Sprintf("svc-%05d", svc) }

// service is synthetic Service svc: ClusterIP, one port, no selector.
func service(ns string, svc int) *corev1.Service {
	return &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: serviceName(svc), Namespace: ns, Labels: map[string]string{"app": serviceName(svc)}},
		Spec: corev1.ServiceSpec{
			Type:  corev1.ServiceTypeClusterIP,
			Ports: []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080), Protocol: corev1.ProtocolTCP}},
		},
	}
}

// uid is a UUID-shaped UID for the n-th synthetic object of a kind.
func uid(kind byte, n uint32) types.UID {
	return types.UID(fmt.Sprintf("%08x-%04x-4%03x-8%03x-%012x", n, uint16(kind), n%0x1000, (n>>12)%0x1000, uint64(n)*2654435761))
}

// endpoint is the endpoint of backend n (its address is backendBase + n):
// ready and serving, its pod on one of the synthetic nodes.
func endpoint(ns string, svc int, n uint32) discoveryv1.Endpoint {
	t, f := true, false
	node := fmt.Sprintf("node-%04d", n%syntheticNodes)
	zone := fmt.Sprintf("zone-%c", 'a'+byte(n%3))
	return discoveryv1.Endpoint{
		Addresses:  []string{nthAddr(backendBase, n).String()},
		Conditions: discoveryv1.EndpointConditions{Ready: &t, Serving: &t, Terminating: &f},
		NodeName:   &node,
		Zone:       &zone,
		TargetRef: &corev1.ObjectReference{
			Kind: "Pod", Namespace: ns, Name: fmt.Sprintf("%s-7d9f8c6b5d-%05x", serviceName(svc), n%0xfffff), UID: uid('p', n),
		},
	}
}

// terminating marks e as its pod's deletion leaves it in the slice: not
// ready, not serving, terminating (the grace period run out of serving).
func terminating(e discoveryv1.Endpoint) discoveryv1.Endpoint {
	f, t := false, true
	e.Conditions = discoveryv1.EndpointConditions{Ready: &f, Serving: &f, Terminating: &t}
	return e
}

// slice is Service svc's one EndpointSlice with backends first .. first+n-1.
func slice(ns string, svc int, first uint32, n int) *discoveryv1.EndpointSlice {
	name, port, proto := "http", int32(8080), corev1.ProtocolTCP
	s := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{
			Name:      serviceName(svc) + "-x7k2p",
			Namespace: ns,
			Labels: map[string]string{
				discoveryv1.LabelServiceName: serviceName(svc),
				discoveryv1.LabelManagedBy:   managedBy,
				"app":                        serviceName(svc),
			},
		},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: &name, Port: &port, Protocol: &proto}},
		Endpoints:   make([]discoveryv1.Endpoint, n),
	}
	for i := range n {
		s.Endpoints[i] = endpoint(ns, svc, first+uint32(i))
	}
	return s
}

func podName(n uint32) string { return fmt.Sprintf("app-%03d-7d9f8c6b5d-%06d", n%1000, n) }

// pod is synthetic pod n as a Deployment's pod reaches the API (labels, one
// container with ports, env, resources and probes; the admission plugins
// add the service account volume and tolerations), never scheduled.
func pod(ns string, n uint32) *corev1.Pod {
	app := fmt.Sprintf("app-%03d", n%1000)
	grace := int64(30)
	env := []corev1.EnvVar{
		{Name: "LOG_LEVEL", Value: "info"}, {Name: "PORT", Value: "8080"},
		{Name: "POD_NAME", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.name"}}},
		{Name: "POD_IP", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "status.podIP"}}},
	}
	probe := &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/healthz", Port: intstr.FromString("http")}},
		PeriodSeconds: 10, TimeoutSeconds: 1, SuccessThreshold: 1, FailureThreshold: 3}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: podName(n), Namespace: ns,
			Labels:      map[string]string{"app": app, "pod-template-hash": "7d9f8c6b5d", "version": "v1"},
			Annotations: map[string]string{"kubectl.kubernetes.io/restartedAt": "2026-12-01T10:00:00Z"},
		},
		Spec: corev1.PodSpec{
			SchedulerName:                 noScheduler,
			TerminationGracePeriodSeconds: &grace,
			Containers: []corev1.Container{{
				Name: "app", Image: "registry.example.com/team/" + app + ":1.24.3",
				Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8080, Protocol: corev1.ProtocolTCP}},
				Env:   env,
				Resources: corev1.ResourceRequirements{
					Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m"), corev1.ResourceMemory: resource.MustParse("128Mi")},
					Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("256Mi")},
				},
				ReadinessProbe: probe, LivenessProbe: probe,
			}},
		},
	}
}

// running is p's status once its kubelet reported it running and ready on
// one of the synthetic nodes, with address podBase + n.
func running(p *corev1.Pod, n uint32) {
	ip := nthAddr(podBase, n).String()
	host := nthAddr(netip.MustParseAddr("172.20.0.0"), n%syntheticNodes).String()
	t := metav1.NewTime(metav1.Now().Rfc3339Copy().Time)
	started := true
	cond := func(c corev1.PodConditionType) corev1.PodCondition {
		return corev1.PodCondition{Type: c, Status: corev1.ConditionTrue, LastTransitionTime: t}
	}
	p.Status = corev1.PodStatus{
		Phase:      corev1.PodRunning,
		Conditions: []corev1.PodCondition{cond("PodReadyToStartContainers"), cond(corev1.PodInitialized), cond(corev1.PodReady), cond(corev1.ContainersReady), cond(corev1.PodScheduled)},
		HostIP:     host, HostIPs: []corev1.HostIP{{IP: host}},
		PodIP: ip, PodIPs: []corev1.PodIP{{IP: ip}},
		StartTime: &t,
		QOSClass:  corev1.PodQOSBurstable,
		ContainerStatuses: []corev1.ContainerStatus{{
			Name: "app", Ready: true, Started: &started, RestartCount: 0,
			Image:       p.Spec.Containers[0].Image,
			ImageID:     p.Spec.Containers[0].Image + "@sha256:3f1cd1b14f58cfca3f1cd1b14f58cfca3f1cd1b14f58cfca3f1cd1b14f58cfca",
			ContainerID: fmt.Sprintf("containerd://%064x", uint64(n)*2654435761),
			State:       corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: t}},
		}},
	}
}
