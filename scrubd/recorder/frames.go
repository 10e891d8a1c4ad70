package recorder

import (
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/ringbuf"

	"github.com/ctscrub/ctscrub/scrubd/index"
)

// RunFrame runs the loaded recorder program on one Ethernet frame with
// BPF_PROG_TEST_RUN, as if the frame crossed a pod's interface: egress =
// the pod sends it, ingress = the pod receives it. It is how the
// conformance suite (e2e/conformance) feeds the recorder the same packets
// it feeds Cilium's datapath programs; records land in the ring buffer as
// they would from an attached program (read them with Drain, or Run). An
// egress frame's source is first recorded as owned by the device the test
// run uses, as Attach records a pod's addresses: the pod sends from its own
// address (forged sources are tested on real interfaces).
func (r *Recorder) RunFrame(egress bool, frame []byte) error {
	prog, eg := r.programs()
	if egress {
		prog = eg
		if err := ownTestRunSource(r.objs.RecOwner, frame); err != nil {
			return fmt.Errorf("recorder: test run: %w", err)
		}
	}
	if _, err := prog.Run(&ebpf.RunOptions{Data: frame}); err != nil {
		return fmt.Errorf("recorder: test run: %w", err)
	}
	return nil
}

// RunHostFrame runs the host-side program (recorder_host) on one Ethernet
// frame the pod sends, with BPF_PROG_TEST_RUN, as if it crossed the pod's
// host-side veth's ingress: how the conformance suite feeds a frame sent
// with PACKET_QDISC_BYPASS, which the container-side programs never see.
// The frame's source is first recorded as the pod's own, as in RunFrame.
func (r *Recorder) RunHostFrame(frame []byte) error {
	if err := ownTestRunSource(r.objs.RecOwner, frame); err != nil {
		return fmt.Errorf("recorder: test run: %w", err)
	}
	if _, err := r.HostProgram().Run(&ebpf.RunOptions{Data: frame}); err != nil {
		return fmt.Errorf("recorder: test run: %w", err)
	}
	return nil
}

// Drain applies every record waiting in the ring buffer to ix and returns
// how many it applied. Not to be used while Run reads the ring.
func (r *Recorder) Drain(ix *index.Index) (int, error) {
	rd, err := ringbuf.NewReader(r.objs.RecEvents)
	if err != nil {
		return 0, fmt.Errorf("recorder: ring buffer reader: %w", err)
	}
	defer rd.Close()
	rd.SetDeadline(time.Now())
	n := 0
	var rec ringbuf.Record
	for {
		if err := rd.ReadInto(&rec); err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				return n, nil
			}
			return n, fmt.Errorf("recorder: read ring buffer: %w", err)
		}
		rc, err := ParseRecord(rec.RawSample)
		if err != nil {
			return n, err
		}
		Apply(ix, &rc)
		n++
	}
}
