package recorder

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/cilium/ebpf/ringbuf"
)

// barrier lets a scrub wait until the reader has applied every record the
// kernel produced before the scrub asked. Without it a scrub could trust an
// IP's index while that IP's newest records still sat in the ring buffer
// (the reader lags under load or after a burst), delete only the keys
// applied so far and report the IP complete.
//
// How: a waiter takes a sequence number and flushes the reader
// (ringbuf.Reader.Flush), which makes ReadInto return every record in the
// ring and then ErrFlushed. The reader notes the newest sequence number
// before each ReadInto; when that call returns ErrFlushed it found the ring
// empty after those waiters arrived, and every record it returned before
// was applied, so it releases them.
type barrier struct {
	rd      *ringbuf.Reader
	mu      sync.Mutex
	next    uint64
	waiters []barrierWaiter
}

type barrierWaiter struct {
	seq uint64
	ch  chan struct{}
}

// wait returns once every record produced before the call is applied, or
// with ctx's error.
func (b *barrier) wait(ctx context.Context) error {
	b.mu.Lock()
	b.next++
	w := barrierWaiter{b.next, make(chan struct{})}
	b.waiters = append(b.waiters, w)
	b.mu.Unlock()
	if err := b.rd.Flush(); err != nil {
		return fmt.Errorf("recorder: wake the ring-buffer reader: %w", err)
	}
	select {
	case <-w.ch:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("recorder: ring-buffer reader did not catch up: %w", ctx.Err())
	}
}

// noted is the newest waiter's sequence number; the reader takes it before
// each ReadInto.
func (b *barrier) noted() uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.next
}

// flushed releases the waiters up to seq. Flushes of later waiters may have
// been merged into the one just seen (the wake-up is a counter): if any are
// left, wake the reader once more.
func (b *barrier) flushed(seq uint64) {
	b.mu.Lock()
	left := b.waiters[:0]
	for _, w := range b.waiters {
		if w.seq <= seq {
			close(w.ch)
		} else {
			left = append(left, w)
		}
	}
	b.waiters = left
	again := len(left) > 0
	b.mu.Unlock()
	if again {
		b.rd.Flush()
	}
}

// isFlushed reports whether err is the reader's answer to a flush.
func isFlushed(err error) bool { return errors.Is(err, ringbuf.ErrFlushed) }
