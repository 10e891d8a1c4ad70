package netnsid

import (
	"fmt"
	"os"
	"testing"
)

// Two paths of one namespace have one ID; a namespace file and a plain
// file do not.
func TestOf(t *testing.T) {
	self, err := Self()
	if err != nil {
		t.Fatal(err)
	}
	byPid, err := Of(fmt.Sprintf("/proc/%d/ns/net", os.Getpid()))
	if err != nil {
		t.Fatal(err)
	}
	if self != byPid {
		t.Errorf("/proc/self and /proc/PID name one namespace: %+v != %+v", self, byPid)
	}
	other, err := Of("/proc/self/ns/mnt")
	if err != nil {
		t.Fatal(err)
	}
	if other == self {
		t.Errorf("the mount namespace has the network namespace's ID %+v", self)
	}
	if _, err := Of("/nonexistent/ns"); err == nil {
		t.Error("a missing path has an ID")
	}
}
