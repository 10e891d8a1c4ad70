module github.com/ctscrub/ctscrub/e2e/conformance

go 1.26.8

require (
	github.com/cilium/ebpf v0.22.0
	github.com/ctscrub/ctscrub v0.0.0-00010101000000-000000000000
)

require (
	github.com/vishvananda/netlink v1.3.1 // indirect
	github.com/vishvananda/netns v0.0.5 // indirect
	golang.org/x/sys v0.50.0 // indirect
)

replace github.com/ctscrub/ctscrub => ../..
