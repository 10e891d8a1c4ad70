package recorder

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ctscrub/ctscrub/internal/testsupport/netpods"
	"github.com/ctscrub/ctscrub/internal/testsupport/standin"
)

// BenchmarkAttach times what the CNI path costs in scrubd per pod: Attach
// (filters, address list, generation bump) and Detach of a veth in a
// network namespace, with 200,000 flows in the IPv4 flow cache (Attach's
// cost must not depend on them). Run:
//
//	go test ./scrubd/recorder -run '^$' -bench Attach -benchtime 200x
func BenchmarkAttach(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root: BPF and network namespaces")
	}
	node := netpods.NewNode(b)
	rec, err := Load(Options{PinDir: filepath.Join(standin.TempDir(b), "ctscrub"), CTRoot: standin.TempDir(b)})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { rec.Close() })
	fill := make([]seenKeyValue4, 200_000)
	for i := range fill {
		fill[i] = seenKeyValue4{local: [4]byte{10, 244, byte(i >> 16), byte(i >> 8)}, remote: [4]byte{192, 0, 2, byte(i)}}
	}
	keys, vals := seenBatch4(fill)
	if _, err := rec.objs.RecFlows4.BatchUpdate(keys, vals, nil); err != nil {
		b.Fatal(err)
	}
	pods := make([]*netpods.Pod, 8)
	for i := range pods {
		pods[i] = node.AddPod()
	}
	var attach, detach time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		p := pods[i%len(pods)]
		start := time.Now()
		if _, err := rec.Attach(p.Path, "eth0"); err != nil {
			b.Fatal(err)
		}
		mid := time.Now()
		if err := rec.Detach(p.Path, "eth0"); err != nil {
			b.Fatal(err)
		}
		attach += mid.Sub(start)
		detach += time.Since(mid)
	}
	b.ReportMetric(float64(attach.Microseconds())/float64(b.N), "attach_us/op")
	b.ReportMetric(float64(detach.Microseconds())/float64(b.N), "detach_us/op")
}
