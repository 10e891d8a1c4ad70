package netnsnode

import (
	"github.com/ctscrub/ctscrub/internal/testsupport/standin"
)

// Datapath turns the pods' real packets into CT entries in the demo's maps,
// as Cilium's datapath would on the pods' host-side veths. It is the stand-in
// from internal/testsupport (TEST SUPPORT: there is no Cilium here).
type Datapath interface {
	Attach(hostVeth string) error
	Close() error
}

type standinDatapath struct{ dp *standin.Datapath }

func (s standinDatapath) Attach(hostVeth string) error { return s.dp.AttachHostSide(hostVeth) }
func (s standinDatapath) Close() error                 { return s.dp.Close() }

// NewDatapath loads the stand-in over the demo's CT maps. The stand-in also
// reads Cilium's service maps, which the demo creates empty beside the CT
// maps (the demo has no service VIPs); scrubd's recorder finds them there too.
// The CT maps are the demo's own (sized per map for the fill), not
// standin.CreateMaps' (one size for all).
// lt sets the stand-in's lifetimes (nil: Cilium's defaults, no close
// timeout).
func NewDatapath(m *CTMaps, lt *standin.Lifetimes) (Datapath, error) {
	if err := standin.CreateServiceMaps(m.dir); err != nil {
		return nil, err
	}
	return LoadDatapath(m, lt)
}

// LoadDatapath loads the stand-in over the CT and service maps pinned in
// m.dir now (after newDatapath made the service maps).
func LoadDatapath(m *CTMaps, lt *standin.Lifetimes) (Datapath, error) {
	dp, err := standin.Load(m.dir, lt)
	if err != nil {
		return nil, err
	}
	return standinDatapath{dp}, nil
}
