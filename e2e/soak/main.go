// Command soak is `make soak`: churn and faults on the demo's node; see
// internal/demo/soak.go and docs/soak.md.
package main

import "github.com/ctscrub/ctscrub/internal/demo"

func main() { demo.SoakMain() }
