// Package bpf holds ctscrub's BPF programs and their generated Go bindings.
//
// The generated *_bpfel.go and *_bpfel.o files are committed so that building
// ctscrub needs no clang; `make generate` rebuilds them with the pinned clang
// (see the Makefile) and CI checks that they are current.
package bpf

// The recorder: cls_bpf programs on a pod's container-side interface that record
// every new flow's CT keys (the index's kernel side).
//go:generate go tool bpf2go -target bpfel -go-package bpf Recorder recorder.c -- -I./include

// The sweep: SEC("syscall") program that walks one CT map in the kernel and
// deletes the entries of a set of IPs.
//go:generate go tool bpf2go -target bpfel -go-package bpf Sweep sweep.c -- -I./include

// The bootstrap pass's walk: SEC("syscall") program that walks one CT map in
// the kernel and copies out the keys holding a pod-CIDR address.
//go:generate go tool bpf2go -target bpfel -go-package bpf Bootstrap bootstrap.c -- -I./include

// The expiry pass: counts live and expired CT entries and deletes expired ones.
//go:generate go tool bpf2go -target bpfel -go-package bpf Expiry expiry.c -- -I./include

// The test-only stand-in for Cilium's datapath lives with its Go side in
// internal/testsupport/standin (not shipped in this package).
