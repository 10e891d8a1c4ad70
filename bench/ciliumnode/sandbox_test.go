package main

import (
	"errors"
	"testing"
)

// A sandbox gone between `crictl pods` and `crictl rmp` is what the removal
// wanted; anything else still fails the run.
func TestSandboxNotFound(t *testing.T) {
	for _, c := range []struct {
		out  string
		gone bool
	}{
		{`docker exec w crictl rmp -f abc: exit status 1: removing the pod sandbox "abc": rpc error: code = NotFound desc = an error occurred when try to find sandbox "abc": not found`, true},
		{`docker exec w crictl rmp -f abc: exit status 1: getting sandbox status of pod "abc": rpc error: code = NotFound desc = an error occurred when try to find sandbox: not found`, true},
		{`docker exec w crictl rmp -f abc: exit status 1: pod sandbox "abc" does not exist`, true},
		{`docker exec w crictl rmp -f abc: exit status 126: OCI runtime exec failed: exec: "crictl": executable file not found in $PATH`, false},
		{`docker exec w crictl rmp -f abc: exit status 1: Error response from daemon: No such container: w`, false},
		{`docker exec w crictl rmp -f abc: exit status 1: rpc error: code = DeadlineExceeded desc = context deadline exceeded`, false},
		{`docker exec w crictl rmp -f abc: exit status 1: failed to stop sandbox "abc": rpc error: code = Unknown desc = failed to destroy network for sandbox`, false},
	} {
		if got := sandboxNotFound(errors.New(c.out)); got != c.gone {
			t.Errorf("%q: gone %v, want %v", c.out, got, c.gone)
		}
	}
}
