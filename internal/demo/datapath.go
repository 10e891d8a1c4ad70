package demo

// datapath turns the pods' real packets into CT entries in the demo's maps,
// as Cilium's datapath would on the pods' host-side veths.
type datapath interface {
	Attach(hostVeth string) error
	Close() error
}

// noDatapath stands in until internal/testsupport/standin is there: traffic
// flows but creates no CT entries.
type noDatapath struct{}

func (noDatapath) Attach(string) error { return nil }
func (noDatapath) Close() error        { return nil }

func newDatapath(m *ctMaps) (datapath, error) { return noDatapath{}, nil }
