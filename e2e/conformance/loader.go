package conformance

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/btf"
)

// Collection is one loaded Cilium object: its programs, with their tail
// calls in the object's calls map, and its maps, those Cilium pins by name
// shared through a private bpffs directory with the other objects of the
// same node (as Cilium shares them under /sys/fs/bpf/tc/globals).
type Collection struct {
	*ebpf.Collection
	// CT are Cilium's four global CT maps (TCP4, Any4, TCP6, Any6 as in
	// ctmap.Kinds), found by name.
	CT [4]*ebpf.Map
	// PolicyProg is the endpoint's ingress policy program (bpf_lxc.c's
	// handle_policy up to 1.17, cil_lxc_policy from 1.18): local delivery
	// tail-calls it through cilium_call_policy, keyed by endpoint ID.
	PolicyProg *ebpf.Program
}

// The calls map's name and the legacy iproute2 map ID of the calls and
// policy prog arrays (bpf/lib/ids.h: CILIUM_MAP_POLICY 1, CILIUM_MAP_CALLS 2).
const (
	legacyPolicyMapID = 1
	legacyCallsMapID  = 2
	policyCallMap     = "cilium_call_policy"
)

// Config values (DECLARE_CONFIG, 1.18+) the harness sets.
type configs map[string]any // uint64, or [16]byte for an address

// loadObject loads an object file the way Cilium's loader does what
// matters here: tail-call programs into the calls map (section "2/N" up to
// 1.16, the BTF decl tag "tail:cilium_calls/N" from 1.17), maps pinned by
// name shared under pinDir, prog arrays other than the policy call map
// private to the object, runtime config set.
func loadObject(path, pinDir string, minor int, cfg configs) (*Collection, error) {
	spec, err := ebpf.LoadCollectionSpec(path)
	if err != nil {
		return nil, fmt.Errorf("load %s: %w", path, err)
	}
	if minor <= 16 {
		if err := inlineConfig(spec); err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
	}
	if false {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	byID := map[uint32]*ebpf.MapSpec{}
	for name, m := range spec.Maps {
		pin := m.Pinning
		var legacyID uint32
		if m.Extra != nil && m.Extra.Len() >= 8 {
			// struct bpf_elf_map's tail: id, pinning, inner_id, inner_idx.
			var tail struct{ ID, Pinning uint32 }
			if err := binary.Read(m.Extra, spec.ByteOrder, &tail); err != nil {
				return nil, fmt.Errorf("map %s: legacy definition: %w", name, err)
			}
			if tail.ID != 0 {
				byID[tail.ID] = m
			}
			legacyID = tail.ID
			pin = ebpf.PinType(tail.Pinning)
			m.Extra = bytes.NewReader(nil)
		}
		switch {
		case m.Type == ebpf.ProgramArray && name != policyCallMap && legacyID != legacyPolicyMapID:
			m.Pinning = ebpf.PinNone
		case pin != ebpf.PinNone:
			// LIBBPF_PIN_BY_NAME, and Cilium's own "pin and replace"
			// flag: shared by name with the node's other objects.
			m.Pinning = ebpf.PinByName
		default:
			m.Pinning = ebpf.PinNone
		}
	}
	var policyName string
	for name, p := range spec.Programs {
		var id, slot uint32
		legacyTail := false
		if _, err := fmt.Sscanf(p.SectionName, "%d/%v", &id, &slot); err == nil {
			// Up to 1.16 tail calls sit in "map-ID/slot" sections, which
			// ebpf-go cannot type; they are tc programs like the entries.
			p.Type = ebpf.SchedCLS
			legacyTail = true
		}
		if p.Type != ebpf.SchedCLS && p.Type != ebpf.SchedACT {
			delete(spec.Programs, name)
			continue
		}
		if legacyTail {
			switch id {
			case legacyCallsMapID:
				m := byID[id]
				if m == nil {
					return nil, fmt.Errorf("%s: program %s in section %s but no calls map", path, name, p.SectionName)
				}
				m.Contents = append(m.Contents, ebpf.MapKV{Key: slot, Value: name})
			case legacyPolicyMapID:
				policyName = name
			}
			continue
		}
		if strings.HasSuffix(p.SectionName, "/tail") {
			slot, err := tailSlot(p)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", path, err)
			}
			calls := spec.Maps["cilium_calls"]
			if calls == nil {
				return nil, fmt.Errorf("%s: tail call %s but no cilium_calls map", path, name)
			}
			calls.Contents = append(calls.Contents, ebpf.MapKV{Key: slot, Value: name})
		}
		switch {
		case name == "cil_lxc_policy":
			policyName = name
		case name == "handle_policy" && policyName == "":
			// 1.17: the policy program keeps 1.16's name in a "tc" section.
			policyName = name
		}
	}
	for k, v := range cfg {
		vs, ok := spec.Variables["__config_"+k]
		if !ok {
			continue // not in this version
		}
		var err error
		switch v := v.(type) {
		case [16]byte:
			err = vs.Set(v)
		case uint64:
			switch vs.Size() {
			case 1:
				err = vs.Set(uint8(v))
			case 2:
				err = vs.Set(uint16(v))
			case 4:
				err = vs.Set(uint32(v))
			case 8:
				err = vs.Set(v)
			default:
				err = fmt.Errorf("size %d", vs.Size())
			}
		default:
			err = fmt.Errorf("value of type %T", v)
		}
		if err != nil {
			return nil, fmt.Errorf("%s: set config %s: %w", path, k, err)
		}
	}
	coll, err := ebpf.NewCollectionWithOptions(spec, ebpf.CollectionOptions{
		Maps:     ebpf.MapOptions{PinPath: pinDir},
		Programs: ebpf.ProgramOptions{LogSizeStart: 1 << 20},
	})
	if err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			return nil, fmt.Errorf("load %s: %-50v", path, ve)
		}
		return nil, fmt.Errorf("load %s: %w", path, err)
	}
	c := &Collection{Collection: coll}
	for name, m := range coll.Maps {
		for i, pat := range ctMapNames {
			if name == pat[0] || strings.HasPrefix(name, pat[1]) {
				c.CT[i] = m
			}
		}
	}
	if policyName != "" {
		c.PolicyProg = coll.Programs[policyName]
	}
	return c, nil
}

// ctMapNames: the global CT maps' names (1.17+ and production) and the
// prefix of their names in 1.16's test configuration (bpf/node_config.h).
var ctMapNames = [4][2]string{
	{"cilium_ct4_global", "test_cilium_ct_tcp4_"},
	{"cilium_ct_any4_global", "test_cilium_ct_any4_"},
	{"cilium_ct6_global", "test_cilium_ct_tcp6_"},
	{"cilium_ct_any6_global", "test_cilium_ct_any6_"},
}

func tailSlot(p *ebpf.ProgramSpec) (uint32, error) {
	fn := btf.FuncMetadata(&p.Instructions[0])
	if fn == nil {
		return 0, fmt.Errorf("tail call %s: no BTF", p.Name)
	}
	for _, tag := range fn.Tags {
		var slot uint32
		if _, err := fmt.Sscanf(tag, "tail:cilium_calls/%v", &slot); err == nil {
			return slot, nil
		}
	}
	return 0, fmt.Errorf("tail call %s: no tail:cilium_calls/N tag", p.Name)
}

// inlineConfig does for 1.16's objects what its loader does: the
// compile-time configuration sits in a ".rodata.config" section (DEFINE_U32
// and friends) and every load from it is replaced by an immediate load of
// the value, so the verifier sees constants (the code stores some of them
// with 32-bit stack writes, which it rejects for map-value pointers).
func inlineConfig(spec *ebpf.CollectionSpec) error {
	const sec = ".rodata.config"
	ms := spec.Maps[sec]
	if ms == nil {
		return nil
	}
	if len(ms.Contents) != 1 {
		return fmt.Errorf("%s: %d values, want 1", sec, len(ms.Contents))
	}
	data, ok := ms.Contents[0].Value.([]byte)
	if !ok {
		return fmt.Errorf("%s: contents are %T", sec, ms.Contents[0].Value)
	}
	ds, ok := ms.Value.(*btf.Datasec)
	if !ok {
		return fmt.Errorf("%s: no BTF datasec", sec)
	}
	sizes := map[uint32]uint32{}
	for _, v := range ds.Vars {
		sizes[v.Offset] = v.Size
	}
	for _, prog := range spec.Programs {
		for i, ins := range prog.Instructions {
			if !ins.IsLoadFromMap() || ins.Src != asm.PseudoMapValue || ins.Reference() != sec {
				continue
			}
			off := uint32(uint64(ins.Constant) >> 32)
			size, ok := sizes[off]
			if !ok || int(off+size) > len(data) {
				return fmt.Errorf("%s: no value at offset %d", sec, off)
			}
			var v uint64
			switch size {
			case 1:
				v = uint64(data[off])
			case 2:
				v = uint64(spec.ByteOrder.Uint16(data[off:]))
			case 4:
				v = uint64(spec.ByteOrder.Uint32(data[off:]))
			case 8:
				v = spec.ByteOrder.Uint64(data[off:])
			default:
				return fmt.Errorf("%s: value of %d bytes at offset %d", sec, size, off)
			}
			r := asm.LoadImm(ins.Dst, int64(v), asm.DWord)
			r.Metadata = ins.Metadata
			prog.Instructions[i] = r
		}
	}
	delete(spec.Maps, sec)
	for n, v := range spec.Variables {
		if v.SectionName == sec {
			delete(spec.Variables, n)
		}
	}
	return nil
}
