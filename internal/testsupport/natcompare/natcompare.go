// Package natcompare fills Cilium-layout CT and SNAT maps with one set of
// entries, runs ctscrub's scrubs and expiry pass over them, and dumps what
// is left, so that a test can hold the result against Cilium's own scrub of
// the same entries (e2e/ciliumgc, one module per Cilium version, runs
// Cilium's ctmap GC on a second copy). Nothing of Cilium is in here: the
// judge is Cilium's code, run by those tests.
package natcompare

import (
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/scrubd/cilium"
	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/expiry"
	"github.com/ctscrub/ctscrub/scrubd/index"
	"github.com/ctscrub/ctscrub/scrubd/scrub"
)

// Addresses of the case. Pod4/Pod6 are scrubbed; Other4/Other6 are another
// pod's, whose entries and mappings must stay.
var (
	Pod4   = netip.MustParseAddr("10.244.1.5")
	Other4 = netip.MustParseAddr("10.244.1.6")
	Peer4  = netip.MustParseAddr("192.0.2.10")
	Node4  = netip.MustParseAddr("172.18.0.2") // the SNAT address
	Pod6   = netip.MustParseAddr("fd00:10:244::5")
	Other6 = netip.MustParseAddr("fd00:10:244::6")
	Peer6  = netip.MustParseAddr("2001:db8::10")
	Node6  = netip.MustParseAddr("fc00:c111::2")

	PodCIDRs = []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16"), netip.MustParsePrefix("fd00:10:244::/64")}
)

// ScrubIPs are the IPs the comparison scrubs.
var ScrubIPs = []netip.Addr{Pod4, Pod6}

// dsrInternal is ct_entry's dsr_internal flag bit (Cilium's
// ctmap.DSRInternal).
const dsrInternal = 1 << 7

// Entry is one map entry: key and value bytes.
type Entry struct{ Key, Value []byte }

// Maps are the CT and SNAT maps of one copy, by pin name.
type Maps map[string][]Entry

// ctEntry is a CT value with a lifetime and flag bits (and the packet count
// standing for the rest, so that two entries are told apart).
func ctEntry(lifetime uint32, flags uint16, tag uint64) []byte {
	v := make([]byte, ctmap.EntrySize)
	binary.LittleEndian.PutUint64(v[16:], tag) // packets
	binary.LittleEndian.PutUint32(v[32:], lifetime)
	binary.LittleEndian.PutUint16(v[36:], flags)
	return v
}

// natEntry is struct ipv4_nat_entry / ipv6_nat_entry: created, then the
// address and port translated to.
func natEntry(v6 bool, addr netip.Addr, port uint16, created uint64) []byte {
	size, off := ctmap.NATEntrySize4, 32
	if v6 {
		size = ctmap.NATEntrySize6
	}
	v := make([]byte, size)
	binary.LittleEndian.PutUint64(v[0:], created)
	a := addr.AsSlice()
	copy(v[off:], a)
	binary.BigEndian.PutUint16(v[off+len(a):], port)
	return v
}

// key builds a CT/SNAT key of either family (ports in host order).
func key(daddr, saddr netip.Addr, dport, sport uint16, proto, flags uint8) []byte {
	if daddr.Is4() {
		k := ctmap.NewKey4(daddr, saddr, dport, sport, proto, flags)
		return k[:]
	}
	k := ctmap.NewKey6(daddr, saddr, dport, sport, proto, flags)
	return k[:]
}

// Case returns the entries of the comparison: for each family, CT entries
// of the scrubbed pod (OUT ones with and without SNAT mappings, DSR-internal,
// IN, related, service) and of another pod, and SNAT entries that must go
// with them or stay. lifetime(i) gives entry i's lifetime (all live for a
// scrub; some expired for the expiry pass).
func Case(lifetime func(i int) uint32) Maps {
	out := Maps{}
	i := 0
	put := func(name string, k, v []byte) { out[name] = append(out[name], Entry{k, v}) }
	ct := func(v6 bool, proto uint8, k []byte, flags uint16) {
		i++
		put(ctName(v6, proto), k, ctEntry(lifetime(i), flags, uint64(i)))
	}
	nat := func(v6 bool, k []byte, to netip.Addr, port uint16) {
		i++
		put(ctmap.NATName(v6), k, natEntry(v6, to, port, uint64(i)))
	}
	for _, fam := range []struct {
		v6                     bool
		pod, other, peer, node netip.Addr
		icmp                   uint8
	}{{false, Pod4, Other4, Peer4, Node4, ctmap.ProtoICMP}, {true, Pod6, Other6, Peer6, Node6, ctmap.ProtoICMPv6}} {
		v6, p, o, r, n := fam.v6, fam.pod, fam.other, fam.peer, fam.node
		for _, who := range []netip.Addr{p, o} {
			for j, proto := range []uint8{ctmap.ProtoTCP, ctmap.ProtoUDP} {
				sport := uint16(40000 + j)
				// OUT, the pod initiated, SNATed to the node: the forward
				// mapping (the CT key, addresses swapped) and the reverse.
				out := key(who, r, 80, sport, proto, ctmap.FlagOut)
				ct(v6, proto, out, 0)
				ct(v6, fam.icmp, key(who, r, 0, 0, fam.icmp, ctmap.FlagRelated), 0)
				nat(v6, key(r, who, 80, sport, proto, ctmap.FlagOut), n, 50000+sport%100)
				nat(v6, key(n, r, 50000+sport%100, 80, proto, ctmap.FlagIn), who, sport)
				// OUT with a forward mapping whose reverse is gone.
				ct(v6, proto, key(who, r, 81, sport, proto, ctmap.FlagOut), 0)
				nat(v6, key(r, who, 81, sport, proto, ctmap.FlagOut), n, 51000+sport%100)
				// OUT without a forward mapping, beside a key that looks
				// like a reverse mapping: Cilium deletes neither.
				ct(v6, proto, key(who, r, 82, sport, proto, ctmap.FlagOut), 0)
				nat(v6, key(n, r, 52000+sport%100, 82, proto, ctmap.FlagIn), who, sport)
				// A DSR-internal OUT entry: its one mapping is the CT key
				// with the ports swapped; a forward-looking key stays.
				ct(v6, proto, key(who, r, 83, sport, proto, ctmap.FlagOut), dsrInternal)
				nat(v6, key(who, r, sport, 83, proto, ctmap.FlagOut), r, 83)
				nat(v6, key(r, who, 83, sport, proto, ctmap.FlagOut), n, 53000+sport%100)
				// IN (a peer initiated towards the pod): no mappings of its
				// own, even where a key looks like one.
				ct(v6, proto, key(r, who, 8080, sport, proto, ctmap.FlagIn), 0)
				nat(v6, key(who, r, 8080, sport, proto, ctmap.FlagIn), n, 54000+sport%100)
				// OUT with the pod as the responder (saddr): Cilium's
				// filter matches either address.
				ct(v6, proto, key(r, who, 9090, sport, proto, ctmap.FlagOut), 0)
				nat(v6, key(who, r, 9090, sport, proto, ctmap.FlagOut), n, 55000+sport%100)
				nat(v6, key(n, who, 55000+sport%100, 9090, proto, ctmap.FlagIn), r, sport)
				// SERVICE: no mappings.
				ct(v6, proto, key(r, who, sport, 443, proto, ctmap.FlagService), 0)
			}
		}
		// Mappings no CT entry owns.
		nat(v6, key(r, n, 1, 2, ctmap.ProtoTCP, ctmap.FlagOut), n, 3)
	}
	return out
}

func ctName(v6 bool, proto uint8) string {
	switch {
	case proto == ctmap.ProtoTCP && v6:
		return ctmap.TCP6.Name()
	case proto == ctmap.ProtoTCP:
		return ctmap.TCP4.Name()
	case v6:
		return ctmap.Any6.Name()
	}
	return ctmap.Any4.Name()
}

// MapNames are the six maps of a copy.
var MapNames = []string{ctmap.TCP4.Name(), ctmap.Any4.Name(), ctmap.TCP6.Name(), ctmap.Any6.Name(), ctmap.NATName4, ctmap.NATName6}

// Fill writes entries into the maps pinned under dir.
func Fill(dir string, entries Maps) error {
	for name, es := range entries {
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, name), nil)
		if err != nil {
			return fmt.Errorf("fill: %w", err)
		}
		for _, e := range es {
			if err := m.Put(e.Key, e.Value); err != nil {
				m.Close()
				return fmt.Errorf("fill %s: %w", name, err)
			}
		}
		m.Close()
	}
	return nil
}

// Clone pins under dst an empty map for each map pinned under src, with the
// same type, sizes and flags: a second copy of Cilium's maps (made by
// Cilium's own specs) for ctscrub to work on.
func Clone(src, dst string) error {
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return err
	}
	for _, name := range MapNames {
		m, err := ebpf.LoadPinnedMap(filepath.Join(src, name), nil)
		if err != nil {
			var have []string
			if es, derr := os.ReadDir(src); derr == nil {
				for _, e := range es {
					have = append(have, e.Name())
				}
			}
			return fmt.Errorf("clone %s: %w (pinned there: %v)", name, err, have)
		}
		spec := &ebpf.MapSpec{Name: name, Type: m.Type(), KeySize: m.KeySize(), ValueSize: m.ValueSize(), MaxEntries: m.MaxEntries(), Flags: m.Flags()}
		m.Close()
		c, err := ebpf.NewMap(spec)
		if err != nil {
			return fmt.Errorf("clone %s: %w", name, err)
		}
		err = c.Pin(filepath.Join(dst, name))
		c.Close()
		if err != nil {
			return fmt.Errorf("clone %s: %w", name, err)
		}
	}
	return nil
}

// Clear deletes every entry of the maps pinned under dir.
func Clear(dir string) error {
	for _, name := range MapNames {
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, name), nil)
		if err != nil {
			return fmt.Errorf("clear: %w", err)
		}
		k := make([]byte, m.KeySize())
		for {
			if err := m.NextKey(nil, &k); err != nil {
				break
			}
			if err := m.Delete(k); err != nil {
				m.Close()
				return fmt.Errorf("clear %s: %w", name, err)
			}
		}
		m.Close()
	}
	return nil
}

// Snapshot is every entry of a copy, as "map key" -> value, in hex.
type Snapshot map[string]string

// Dump reads every entry of the maps pinned under dir.
func Dump(dir string) (Snapshot, error) {
	s := Snapshot{}
	for _, name := range MapNames {
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, name), nil)
		if err != nil {
			return nil, fmt.Errorf("dump: %w", err)
		}
		k, v := make([]byte, m.KeySize()), make([]byte, m.ValueSize())
		it := m.Iterate()
		for it.Next(&k, &v) {
			s[name+" "+hex.EncodeToString(k)] = hex.EncodeToString(v)
		}
		err = it.Err()
		m.Close()
		if err != nil {
			return nil, fmt.Errorf("dump %s: %w", name, err)
		}
	}
	return s, nil
}

// Count counts the snapshot's entries of the maps whose name has prefix.
func (s Snapshot) Count(prefix string) int {
	n := 0
	for k := range s {
		if strings.HasPrefix(k, prefix) {
			n++
		}
	}
	return n
}

// Diff lists the entries only one snapshot holds, or that differ ("" when
// none).
func Diff(cilium, ctscrub Snapshot) string {
	var out []string
	for k, v := range cilium {
		if w, ok := ctscrub[k]; !ok {
			out = append(out, "left by Cilium only: "+k)
		} else if w != v {
			out = append(out, "value differs: "+k)
		}
	}
	for k := range ctscrub {
		if _, ok := cilium[k]; !ok {
			out = append(out, "left by ctscrub only: "+k)
		}
	}
	slices.Sort(out)
	return strings.Join(out, "\n")
}

// Method is how ctscrub's scrub reaches the entries.
type Method string

const (
	Index Method = "index" // the IPs' index is complete: the delete program
	Sweep Method = "sweep" // the index is not trusted: the in-kernel sweep
)

// Scrub runs ctscrub's Cilium backend on the maps pinned under dir (opened
// as scrubd opens them, SNAT maps included) for ips, with every CT key of
// entries in the IPs' index (Index) or none tracked (Sweep).
func Scrub(ctx context.Context, dir string, entries Maps, ips []netip.Addr, method Method) (scrub.Result, error) {
	maps, err := ctmap.Open(dir)
	if err != nil {
		return scrub.Result{}, err
	}
	defer maps.Close()
	for _, v6 := range []bool{false, true} {
		if maps.NAT(v6) == nil {
			return scrub.Result{}, fmt.Errorf("SNAT map %s not opened (%v)", ctmap.NATName(v6), maps.NATError(v6))
		}
	}
	ix := index.New(index.Config{PodCIDRs: PodCIDRs})
	ix.SetHooks(&index.Hooks{}) // fed here, synchronously
	if method == Index {
		for _, ip := range ips {
			ix.Track(ip)
		}
		for _, k := range []ctmap.Kind{ctmap.TCP4, ctmap.Any4} {
			for _, e := range entries[k.Name()] {
				ix.Add4(ctmap.CTKey4(e.Key))
			}
		}
		for _, k := range []ctmap.Kind{ctmap.TCP6, ctmap.Any6} {
			for _, e := range entries[k.Name()] {
				ix.Add6(ctmap.CTKey6(e.Key))
			}
		}
	}
	b, err := cilium.New(maps, ix, cilium.Options{})
	if err != nil {
		return scrub.Result{}, err
	}
	defer b.Close()
	if method == Index {
		if err := b.DeleteError(); err != nil {
			return scrub.Result{}, fmt.Errorf("the delete program did not load: %w", err)
		}
	}
	res, err := b.Scrub(ctx, scrub.Request{IPs: ips, Reason: scrub.ReasonDel})
	if err != nil {
		return res, err
	}
	for _, ip := range ips {
		if got := res.PerIP[ip.String()]; got != scrub.Method(method) {
			return res, fmt.Errorf("%s scrubbed by %q, want %q (swept why: %v)", ip, got, method, res.SweptWhy)
		}
	}
	return res, nil
}

// Expire runs ctscrub's expiry pass (sweep mode, ktime clock) once over the
// maps pinned under dir.
func Expire(ctx context.Context, dir string) (expiry.Report, error) {
	maps, err := ctmap.Open(dir)
	if err != nil {
		return expiry.Report{}, err
	}
	defer maps.Close()
	r, err := expiry.New(maps, expiry.Config{Mode: expiry.ModeSweep, Clock: expiry.ClockKtime}, expiry.Options{})
	if err != nil {
		return expiry.Report{}, err
	}
	defer r.Close()
	return r.Pass(ctx)
}

// NowKtime is Cilium's CT clock now (ktime seconds, bpf_mono_now).
func NowKtime() uint32 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		panic(err)
	}
	return uint32(ts.Sec)
}

// Main runs a test binary's tests (from TestMain) in a mount namespace of
// their own with a fresh bpffs at /sys/fs/bpf: Cilium's map code pins where
// a node's Cilium pins (tc/globals under the first bpffs mount), and the
// tests must not touch the host's. It re-runs the binary unshared; as
// non-root it runs the tests as they are (they skip).
func Main(m interface{ Run() int }) int {
	const child = "CTSCRUB_NATCOMPARE_CHILD"
	if os.Geteuid() != 0 {
		return m.Run()
	}
	if os.Getenv(child) == "" {
		cmd := exec.Command(os.Args[0], os.Args[1:]...)
		cmd.Env = append(os.Environ(), child+"=1")
		cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
		cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
		if err := cmd.Run(); err != nil {
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				return ee.ExitCode()
			}
			fmt.Fprintln(os.Stderr, "natcompare: run the tests in a mount namespace:", err)
			return 1
		}
		return 0
	}
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		fmt.Fprintln(os.Stderr, "natcompare: make mounts private:", err)
		return 1
	}
	if err := unix.Mount("bpffs", "/sys/fs/bpf", "bpf", 0, ""); err != nil {
		fmt.Fprintln(os.Stderr, "natcompare: mount a bpffs at /sys/fs/bpf:", err)
		return 1
	}
	return m.Run()
}
