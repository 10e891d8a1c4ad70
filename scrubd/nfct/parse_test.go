package nfct

import (
	"testing"

	"golang.org/x/sys/unix"
)

// The event reader parses tens of thousands of messages a second: the
// message builder and parser must agree, and parsing must not allocate.
func TestParseRoundTrip(t *testing.T) {
	for _, e := range []Entry{
		dnat("10.244.7.7", "10.96.0.10", "10.244.1.5", 40000, 53),
		tcp("fd00::1", "fd00::2", 1, 2),
		icmpEcho("10.244.1.5", "9.9.9.9", 77),
		icmpEcho("fd00::5", "fd00::9", 78),
	} {
		e.Zone, e.ID = 7, 0xdeadbeef
		var m msgBuf
		m.begin(msgType(msgCTNew), unix.NLM_F_REQUEST, 1, unix.AF_INET, 0)
		m.tuple(ctaTupleOrig, &e.Orig)
		m.tuple(ctaTupleReply, &e.Reply)
		m.be32(ctaID, e.ID)
		m.be16(ctaZone, e.Zone)
		m.end()
		body := m.b[nlmsgHdrLen+nfgenLen:]
		got, ok := parseEntry(body)
		if !ok || got != e {
			t.Errorf("round trip of %+v gave %+v (ok %v)", e, got, ok)
		}
		if a := testing.AllocsPerRun(100, func() { parseEntry(body) }); a != 0 {
			t.Errorf("parseEntry allocates %.0f times per message", a)
		}
	}
}
