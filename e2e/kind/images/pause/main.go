// Command pause is the pod sandbox ("pause") image's process for the kind
// nodes built by e2e/kind/images: it holds the pod's namespaces, reaps
// children when it is PID 1 of a shared PID namespace, and exits on SIGINT
// or SIGTERM, like Kubernetes' own pause (build/pause/linux/pause.c).
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range sigs {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
