// Command pause is the process of the sandbox ("pause") image that e2e/cri
// builds locally, since no registry is reachable: it holds the pod's
// namespaces and blocks until SIGTERM or SIGINT, as Kubernetes' pause does.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	c := make(chan os.Signal, 1)
	signal.Notify(c, syscall.SIGTERM, syscall.SIGINT)
	<-c
}
