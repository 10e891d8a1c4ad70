package netnsnode

import (
	"fmt"
	"io"
	"sync"
)

// Cleanup is a stack of undo steps. Every resource the demo creates pushes
// the step that removes it right after it exists, so an interrupted run undoes
// exactly what it did, in reverse order.
type Cleanup struct {
	mu    sync.Mutex
	steps []step
	done  bool
}

type step struct {
	what string
	fn   func() error
}

// Push records how to undo one thing. After Run has started, fn runs at once:
// the process is on its way out and nothing may be left behind.
func (c *Cleanup) Push(what string, fn func() error) {
	c.mu.Lock()
	if c.done {
		c.mu.Unlock()
		_ = fn()
		return
	}
	c.steps = append(c.steps, step{what, fn})
	c.mu.Unlock()
}

// Run undoes every step, newest first, and reports failures on w. It runs
// once; later calls return at once.
func (c *Cleanup) Run(w io.Writer) (failed int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.done {
		return 0
	}
	c.done = true
	for i := len(c.steps) - 1; i >= 0; i-- {
		s := c.steps[i]
		if err := s.fn(); err != nil {
			failed++
			fmt.Fprintf(w, "  cleanup: %s: %v\n", s.what, err)
		}
	}
	c.steps = nil
	return failed
}
