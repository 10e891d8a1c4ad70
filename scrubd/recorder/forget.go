package recorder

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"

	"github.com/cilium/ebpf"

	"github.com/ctscrub/ctscrub/scrubd/ctmap"
	"github.com/ctscrub/ctscrub/scrubd/index"
)

// ReasonForgetFailed marks an IP whose cached flows the recorder could not
// forget: entries re-created for them might never be recorded, so its next
// scrub sweeps.
const ReasonForgetFailed = "recorder could not forget the IP's cached flows"

// ErrForget is wrapped by the errors of ForgetIPs (and of Attach when its
// filters are on but the addresses' cached flows could not be forgotten):
// the caller must mark the addresses incomplete.
var ErrForget = errors.New("could not forget cached flows")

// genSlots is GEN_SLOTS in bpf/recorder.c.
const genSlots = 1 << 12

// genSlot is gen_slot4/gen_slot6 in bpf/recorder.c: the rec_gen slot of an
// address. The program reads the address words as they lie in memory, so
// they are read here in native byte order.
func genSlot(ip netip.Addr) uint32 {
	if ip.Is4() {
		b := ip.As4()
		return (binary.NativeEndian.Uint32(b[:]) * 0x9e3779b1) >> 20
	}
	b := ip.As16()
	x := binary.NativeEndian.Uint32(b[0:4]) ^ binary.NativeEndian.Uint32(b[4:8]) ^
		binary.NativeEndian.Uint32(b[8:12]) ^ binary.NativeEndian.Uint32(b[12:16])
	return (x * 0x9e3779b1) >> 20
}

// ForgetIPs makes the recorder forget every cached flow whose local or
// remote address is one of ips: it bumps each address's generation slot
// (rec_gen), and every cached flow carrying the old generation stops
// matching, so its next packet is recorded again. O(1) per address (a
// lookup and an update of one array slot), whatever the caches hold.
// Addresses sharing a slot with one of ips have their flows recorded again
// too; that costs records, never completeness.
//
// Attach calls it for a new pod's addresses; Run's index hooks for an IP
// declared complete (Track) and for an IP whose keys a scrub takes (Take);
// Prune for an IP whose stale keys it drops. On an error the flows may
// still be cached: the caller must mark the IPs incomplete.
func (r *Recorder) ForgetIPs(ips ...netip.Addr) error {
	slots := make(map[uint32]bool, len(ips))
	for _, ip := range ips {
		if ip = ip.Unmap(); ip.IsValid() {
			slots[genSlot(ip)] = true
		}
	}
	r.genMu.Lock()
	defer r.genMu.Unlock()
	var errs []error
	for slot := range slots {
		var g uint32
		if err := r.objs.RecGen.Lookup(slot, &g); err != nil {
			errs = append(errs, err)
			continue
		}
		if err := r.objs.RecGen.Update(slot, g+1, 0); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("recorder: %w of %v: %w", ErrForget, ips, err)
	}
	return nil
}

// ForgetAll makes the recorder forget every cached flow, of every address:
// each of the GEN_SLOTS generation slots is bumped (one batch read and one
// batch write of the array). A bootstrap pass calls it after the recorder
// is attached to every pod and before it walks the CT maps
// (scrubd/bootstrap), so that an entry Cilium makes from then on (for a
// flow a previous scrubd recorded and whose entry went meanwhile) is
// recorded again when the walk has already passed its bucket. On an error
// the caller must not vouch for any address.
func (r *Recorder) ForgetAll() error {
	r.genMu.Lock()
	defer r.genMu.Unlock()
	slots := int(r.objs.RecGen.MaxEntries()) // GEN_SLOTS
	keys, gens := make([]uint32, slots), make([]uint32, slots)
	var cur ebpf.MapBatchCursor
	n, err := r.objs.RecGen.BatchLookup(&cur, keys, gens, nil)
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("recorder: %w (all): read the generations: %w", ErrForget, err)
	}
	if n != slots {
		return fmt.Errorf("recorder: %w (all): read %d generations, want %d", ErrForget, n, slots)
	}
	for i := range gens {
		gens[i]++
	}
	if _, err := r.objs.RecGen.BatchUpdate(keys, gens, nil); err != nil {
		return fmt.Errorf("recorder: %w (all): write the generations: %w", ErrForget, err)
	}
	return nil
}

// Hooks keeps the flow caches in step with the index (see index.Hooks): an
// IP whose keys a scrub takes has its flows forgotten before the scrub
// deletes the entries, and so does an IP declared complete (a sweep is about
// to remove all its entries, or a fresh pod), so every entry created from
// then on is recorded, including flows to service VIPs that mark it
// incomplete again. When forgetting fails the IP is marked incomplete: a
// flow still cached would not be recorded when its entry comes back. A
// scrub's Take resolves first (Resolve, the final resolution) and has
// flows whose backend was removed confirmed (Confirm, confirmRepicks).
// Without Sync, which Run adds: code that drains the recorder itself
// (e2e/conformance) installs these to scrub as scrubd does.
func (r *Recorder) Hooks(ix *index.Index) *index.Hooks {
	h := r.hooks(ix)
	h.Resolve = func(ip netip.Addr) { r.Resolve(ix, ip, true) }
	return h
}

func (r *Recorder) hooks(ix *index.Index) *index.Hooks {
	fail := func(ips []netip.Addr, err error) {
		r.opts.Log.Error("recorder: forget cached flows failed; the IPs are marked incomplete", "ips", ips, "err", err)
		for _, ip := range ips {
			ix.MarkIncomplete(ip, ReasonForgetFailed)
		}
	}
	return &index.Hooks{
		Taken: func(ip netip.Addr, _ []ctmap.CTKey4, _ []ctmap.CTKey6) {
			if err := r.ForgetIPs(ip); err != nil {
				fail([]netip.Addr{ip}, err)
			}
		},
		Tracked: func(ips []netip.Addr) {
			if err := r.ForgetIPs(ips...); err != nil {
				fail(ips, err)
			}
		},
		Confirm: r.confirmRepicks,
	}
}
