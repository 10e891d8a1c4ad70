package nfct

import (
	"fmt"
	"sync"

	"golang.org/x/sys/unix"
)

// Table is direct access to one network namespace's conntrack table: batched
// creation (tests and benchmarks fill a table with real kernel entries
// through it), a streaming dump and the entry count.
type Table struct {
	mu sync.Mutex
	s  *socket
}

// OpenTable opens the conntrack table of the network namespace at nsPath
// ("" = the caller's).
func OpenTable(nsPath string) (*Table, error) {
	s, err := openSocket(nsPath)
	if err != nil {
		return nil, fmt.Errorf("open conntrack table of %s: %w", nsName(nsPath), err)
	}
	s.setRcvBuf(8 << 20)
	tv := unix.Timeval{Sec: 30}
	_ = unix.SetsockoptTimeval(s.fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	return &Table{s: s}, nil
}

// Close closes the table's socket.
func (t *Table) Close() error { return t.s.close() }

// Create inserts entries (orig and reply tuples as given, so NAT'd entries
// can be made), deleteBatch at a time, each with the timeout in seconds. It
// returns how many the kernel created; the first refusal other than EEXIST
// is returned as error.
func (t *Table) Create(es []Entry, timeout uint32) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	created := 0
	for len(es) > 0 {
		b := es[:min(len(es), deleteBatch)]
		es = es[len(b):]
		var m msgBuf
		m.b = make([]byte, 0, len(b)*200)
		first := t.s.seq.Add(uint32(len(b))) - uint32(len(b)) + 1
		for i := range b {
			fam := uint8(unix.AF_INET)
			if b[i].Orig.Src.Is6() {
				fam = unix.AF_INET6
			}
			m.begin(msgType(msgCTNew), unix.NLM_F_REQUEST|unix.NLM_F_ACK|unix.NLM_F_CREATE|unix.NLM_F_EXCL, first+uint32(i), fam, 0)
			m.tuple(ctaTupleOrig, &b[i].Orig)
			m.tuple(ctaTupleReply, &b[i].Reply)
			m.be32(7 /* CTA_TIMEOUT */, timeout)
			if b[i].Zone != 0 {
				m.be16(ctaZone, b[i].Zone)
			}
			m.end()
		}
		var firstErr error
		err := t.s.exchange(&m, first, len(b), func(i int, errno unix.Errno) {
			switch errno {
			case 0:
				created++
			case unix.EEXIST:
			default:
				if firstErr == nil {
					firstErr = fmt.Errorf("create conntrack entry %v: %w", b[i].Orig, errno)
				}
			}
		})
		if err != nil {
			return created, err
		}
		if firstErr != nil {
			return created, firstErr
		}
	}
	return created, nil
}

// Dump calls fn for every entry of the table (both families).
func (t *Table) Dump(fn func(Entry)) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.s.dump(0, nil, fn)
}
