// Package nsexec runs code inside another network namespace: the one way the
// recorder, the test support and the e2e harness enter a pod's or a node's
// namespace.
package nsexec

import (
	"errors"
	"fmt"
	"runtime"

	"github.com/vishvananda/netns"
)

// Do runs fn on a locked OS thread inside the network namespace at path, then
// moves the thread back. Sockets fn opens, and programs it starts, live in
// that namespace. If the thread cannot move back it stays locked, so Go
// discards it when the goroutine ends instead of reusing it in the wrong
// namespace.
func Do(path string, fn func() error) error {
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("get current netns: %w", err)
	}
	defer orig.Close()
	target, err := netns.GetFromPath(path)
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("open netns %s: %w", path, err)
	}
	defer target.Close()
	if err := netns.Set(target); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("enter netns %s: %w", path, err)
	}
	ferr := fn()
	if err := netns.Set(orig); err != nil {
		return errors.Join(ferr, fmt.Errorf("return from netns %s: %w", path, err))
	}
	runtime.UnlockOSThread()
	return ferr
}
