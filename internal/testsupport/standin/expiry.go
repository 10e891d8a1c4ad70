package standin

import "github.com/cilium/ebpf"

// LoadExpiryRefresh returns bpf/expiry.c built with its refresh hook, for
// tests of the expiry pass's delete race (scrubd/expiry): with the variable
// test_refresh_marker set, the pass rewrites the lifetime of every entry
// whose bytes equal it right before it would delete it, as Cilium's datapath
// may from another CPU.
func LoadExpiryRefresh() (*ebpf.CollectionSpec, error) { return loadExpiryRefresh() }
