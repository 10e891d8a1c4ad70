// Command demo is `make demo` (scripts/demo.sh runs it after set-up and
// build): see internal/demo and docs/demo.md.
package main

import "github.com/ctscrub/ctscrub/internal/demo"

func main() { demo.Main() }
