// Package nsexec runs code inside another network namespace: the one way the
// recorder, the test support and the e2e harness enter a pod's or a node's
// namespace.
package nsexec

import (
	"errors"
	"fmt"
	"path/filepath"
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

// Create makes a named network namespace (bound under /var/run/netns, as
// `ip netns add` does) without leaving the calling goroutine in it, and
// returns its path.
func Create(name string) (string, error) {
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		return "", fmt.Errorf("get current netns: %w", err)
	}
	defer orig.Close()
	ns, err := netns.NewNamed(name) // moves this thread into the new namespace
	if serr := netns.Set(orig); serr != nil {
		// The thread is in the wrong namespace: it stays locked, so Go
		// discards it with the goroutine.
		return "", errors.Join(err, fmt.Errorf("return from new netns %s: %w", name, serr))
	}
	runtime.UnlockOSThread()
	if err != nil {
		return "", fmt.Errorf("create netns %s: %w", name, err)
	}
	ns.Close()
	return filepath.Join("/var/run/netns", name), nil
}
