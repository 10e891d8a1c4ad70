package cilium

import "sync/atomic"

// Test support for the sweeper: its runner stops at Sweeper.hooks, which only
// these tests set.

// hooks runs its funcs at the runner's points (nil: go on).
type hooks struct{ onTaken, onWalking func() }

func (h hooks) taken() {
	if h.onTaken != nil {
		h.onTaken()
	}
}

func (h hooks) walking() {
	if h.onWalking != nil {
		h.onWalking()
	}
}

// setHooks sets (nil: removes) sw's hooks; set it while no pass runs.
func setHooks(sw *Sweeper, h passHooks) {
	sw.mu.Lock()
	defer sw.mu.Unlock()
	sw.hooks = h
}

// gates hold the runner before each of its next passes until released.
type gates struct {
	n  atomic.Int32
	ch []chan struct{}
}

func holdPasses(sw *Sweeper, n int) *gates {
	g := &gates{}
	for range n {
		g.ch = append(g.ch, make(chan struct{}))
	}
	setHooks(sw, hooks{onTaken: func() {
		if i := int(g.n.Add(1)) - 1; i < len(g.ch) {
			<-g.ch[i]
		}
	}})
	return g
}

func (g *gates) release(i int) { close(g.ch[i]) }
