package standin

// TEST SUPPORT ONLY: the stand-in for Cilium's datapath (cilium_standin.c),
// compiled with the same pinned clang as bpf/ (`make generate`) and checked
// by `make check-generate`. It shares bpf/include/ctscrub_flow.h, the
// recorder's parser, so both derive the same key from the same packet; the
// conformance suite (e2e/conformance) checks both against Cilium's real
// programs.
//go:generate go tool bpf2go -target bpfel -go-package standin ciliumStandin cilium_standin.c -- -I../../../bpf/include

// bpf/expiry.c built with its refresh hook (CTSCRUB_TEST_REFRESH), which
// stands in for Cilium's datapath refreshing an entry inside the expiry
// pass's delete window; the shipped bpf/expiry_bpfel.o has no such hook.
//go:generate go tool bpf2go -target bpfel -go-package standin expiryRefresh ../../../bpf/expiry.c -- -I../../../bpf/include -DCTSCRUB_TEST_REFRESH
