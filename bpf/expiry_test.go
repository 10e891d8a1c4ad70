package bpf

import (
	"strings"
	"testing"

	"github.com/cilium/ebpf/btf"
)

// The shipped expiry pass has no test hook: the refresh hook rewrites the
// lifetime of Cilium's live entries, and any holder of the program's fd
// could switch it on. Tests get it from internal/testsupport/standin's build.
func TestExpiryShipsNoTestHook(t *testing.T) {
	spec, err := LoadExpiry()
	if err != nil {
		t.Fatal(err)
	}
	for name := range spec.Variables {
		if strings.Contains(name, "test") {
			t.Errorf("shipped expiry object has the variable %s", name)
		}
	}
	var args *btf.Struct
	if err := spec.Types.TypeByName("expiry_args", &args); err != nil {
		t.Fatal(err)
	}
	for _, m := range args.Members {
		if strings.Contains(m.Name, "test") {
			t.Errorf("shipped expiry program's arguments have the field %s", m.Name)
		}
	}
}
