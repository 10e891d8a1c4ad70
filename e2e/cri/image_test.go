package cri

import (
	"testing"

	"github.com/ctscrub/ctscrub/internal/testsupport/crirt"
)

// writePauseImage writes the locally built pause image's OCI archive
// (crirt.WritePauseImage: no registry is reachable here).
func writePauseImage(t *testing.T, pauseBin, archive string) {
	t.Helper()
	if err := crirt.WritePauseImage(pauseBin, archive); err != nil {
		t.Fatalf("pause image: %v", err)
	}
}
