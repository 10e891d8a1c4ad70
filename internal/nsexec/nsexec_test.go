package nsexec

import (
	"fmt"
	"os"
	"testing"

	"github.com/vishvananda/netns"
)

func TestCreateAndDo(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to create network namespaces")
	}
	name := fmt.Sprintf("ctscrub-nsexec-%d", os.Getpid())
	path, err := Create(name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { netns.DeleteNamed(name) })

	here, err := netns.Get()
	if err != nil {
		t.Fatal(err)
	}
	defer here.Close()
	var inside netns.NsHandle
	if err := Do(path, func() error {
		var err error
		inside, err = netns.Get()
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer inside.Close()
	if inside.Equal(here) {
		t.Fatal("Do ran fn in the caller's namespace, not the new one")
	}
	after, err := netns.Get()
	if err != nil {
		t.Fatal(err)
	}
	defer after.Close()
	if !after.Equal(here) {
		t.Fatal("Create or Do left the calling thread in another namespace")
	}
	if err := Do("/var/run/netns/ctscrub-no-such-ns", func() error { return nil }); err == nil {
		t.Fatal("Do on a missing namespace succeeded")
	}
}
