package recorder

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/ringbuf"
	"golang.org/x/sys/unix"
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
	pos     *ringPositions // nil: no fast path
	applied atomic.Uint64  // consumer position after the last applied record
	fast    atomic.Uint64  // waits that returned without a flush (tests)
	mu      sync.Mutex
	next    uint64
	waiters []barrierWaiter
}

type barrierWaiter struct {
	seq uint64
	ch  chan struct{}
}

// A scrub mostly finds the reader idle with the ring empty, and a flush
// then costs two goroutine wake-ups (about 0.1-0.2 ms, docs/bench.md). So
// wait first compares the ring's producer position, read from a read-only
// mapping of its position pages, with the consumer position the reader
// noted after its last applied record. Equal: everything produced so far is
// consumed and applied, and wait returns at once. A record reserved and not
// yet submitted, or one discarded, keeps them apart, and wait flushes.
type ringPositions struct {
	mu    sync.RWMutex // pages: read under RLock, unmapped under Lock
	pages []byte       // the consumer page, then the producer page; nil once closed
	page  int
}

// mapPositions maps the ring buffer's two position pages read-only; nil
// when the kernel refuses (every wait then flushes).
func mapPositions(ring *ebpf.Map) *ringPositions {
	page := os.Getpagesize()
	b, err := unix.Mmap(ring.FD(), 0, 2*page, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil
	}
	return &ringPositions{pages: b, page: page}
}

// load reads the position at offset off; ok is false once closed.
func (p *ringPositions) load(off int) (pos uint64, ok bool) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.pages == nil {
		return 0, false
	}
	return atomic.LoadUint64((*uint64)(unsafe.Pointer(&p.pages[off]))), true
}

// close unmaps the pages; a wait still running after it flushes.
func (p *ringPositions) close() {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	unix.Munmap(p.pages)
	p.pages = nil
}

// appliedUpTo notes that every record before the consumer position now is
// applied. Only the reader calls it, after applying a record or after a
// flush answer, between two ReadInto calls, when the consumer position
// cannot move.
func (b *barrier) appliedUpTo() {
	if b.pos == nil {
		return
	}
	if cons, ok := b.pos.load(0); ok {
		b.applied.Store(cons)
	}
}

// caughtUp reports whether every record produced until now is applied.
func (b *barrier) caughtUp() bool {
	if b.pos == nil {
		return false
	}
	prod, ok := b.pos.load(b.pos.page)
	return ok && prod == b.applied.Load()
}

// wait returns once every record produced before the call is applied, or
// with ctx's error.
func (b *barrier) wait(ctx context.Context) error {
	if b.caughtUp() {
		b.fast.Add(1)
		return nil
	}
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
