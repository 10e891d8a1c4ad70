package index

import (
	"encoding/binary"
	"testing"
)

// BenchmarkKeySetAdd4: inserting fresh IPv4 records into one set of 16,384
// (a pod's share of a 16 M-entry node), the set grown from empty as a
// bootstrap pass or the recorder grows it.
func BenchmarkKeySetAdd4(b *testing.B) {
	const n = 16384
	recs := make([][RecSize4]byte, n)
	for i := range recs {
		binary.BigEndian.PutUint32(recs[i][0:4], uint32(i)*2654435761)
		binary.BigEndian.PutUint16(recs[i][4:6], 443)
		binary.BigEndian.PutUint16(recs[i][6:8], uint16(i))
		recs[i][8], recs[i][10] = 6, recSideDAddr
	}
	b.ResetTimer()
	for range b.N {
		var s keySet
		for i := range recs {
			s.add(recs[i][:])
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n), "ns/key")
}
