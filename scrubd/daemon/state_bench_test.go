package daemon

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ctscrub/ctscrub/scrubd/api"
)

// BenchmarkStateWrite times what an index start (CNI ADD) and an index stop
// (DEL) write for restarts, with `pods` attachments already on the node (a
// journal line, fsynced; the state file rewritten when the journal has
// grown past twice the attachments), on the disk under the test's temp dir
// and on a tmpfs (what /run is on a node). Run:
//
//	go test ./scrubd/daemon -run '^$' -bench StateWrite -benchtime 200x
func BenchmarkStateWrite(b *testing.B) {
	dirs := map[string]string{"disk": b.TempDir()}
	if os.Geteuid() == 0 {
		t := b.TempDir()
		if err := unix.Mount("tmpfs", t, "tmpfs", 0, "size=64m"); err == nil {
			b.Cleanup(func() { unix.Unmount(t, unix.MNT_DETACH) })
			dirs["tmpfs"] = t
		}
	}
	for _, fs := range []string{"disk", "tmpfs"} {
		dir, ok := dirs[fs]
		if !ok {
			continue
		}
		for _, n := range []int{10, 110, 1000} {
			b.Run(fmt.Sprintf("%s/pods=%d", fs, n), func(b *testing.B) {
				path := filepath.Join(dir, fmt.Sprintf("attachments-%d.json", n))
				p := newPods(path, 5*time.Minute)
				for i := range n {
					p.active[api.Attachment{ContainerID: fmt.Sprintf("%064x", i), IfName: "eth0"}] = api.IndexedPod{
						Attachment: api.Attachment{ContainerID: fmt.Sprintf("%064x", i), IfName: "eth0"},
						Netns:      fmt.Sprintf("/var/run/netns/cni-%08x-0000-0000-0000-000000000000", i),
						IPs:        []netip.Addr{netip.AddrFrom4([4]byte{10, 244, byte(i >> 8), byte(i)}), netip.MustParseAddr("fd00::1")},
						Ifindex:    3, Network: "cilium", Since: time.Now(),
					}
				}
				pod := api.IndexedPod{Attachment: api.Attachment{ContainerID: "new", IfName: "eth0"}, Netns: "/var/run/netns/x",
					IPs: []netip.Addr{netip.MustParseAddr("10.244.255.1")}, Network: "cilium", Since: time.Now()}
				cpu := func() time.Duration {
					var ru unix.Rusage
					unix.Getrusage(unix.RUSAGE_SELF, &ru)
					return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
				}
				b.ResetTimer()
				c0 := cpu()
				for range b.N {
					if _, err := p.start(pod); err != nil {
						b.Fatal(err)
					}
					if _, _, err := p.stop(pod.Attachment); err != nil {
						b.Fatal(err)
					}
				}
				b.StopTimer()
				b.ReportMetric(float64((cpu()-c0).Microseconds())/float64(2*b.N), "cpu_us/write")
				b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(2*b.N), "us/write")
				var size int64
				if st, err := os.Stat(path); err == nil {
					size = st.Size()
				}
				b.ReportMetric(float64(size), "file_bytes")
			})
		}
	}
}
