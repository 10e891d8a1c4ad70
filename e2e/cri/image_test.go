package cri

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"runtime"
	"testing"
	"time"
)

// pauseImage is the sandbox image's name; containerd's CRI finds it locally
// after `ctr images import` and never tries to pull it.
const pauseImage = "localhost/ctscrub/pause:e2e"

type descriptor struct {
	MediaType   string            `json:"mediaType"`
	Digest      string            `json:"digest"`
	Size        int               `json:"size"`
	Platform    map[string]string `json:"platform,omitempty"`
	Annotations map[string]string `json:"annotations,omitempty"`
}

// writePauseImage writes an OCI image archive (an OCI image layout in a tar)
// holding one uncompressed layer with the pause binary at /pause.
func writePauseImage(t *testing.T, pauseBin, archive string) {
	t.Helper()
	bin, err := os.ReadFile(pauseBin)
	if err != nil {
		t.Fatal(err)
	}
	var layer bytes.Buffer
	lw := tar.NewWriter(&layer)
	now := time.Unix(0, 0)
	if err := lw.WriteHeader(&tar.Header{Name: "pause", Mode: 0o755, Size: int64(len(bin)), ModTime: now, Typeflag: tar.TypeReg}); err != nil {
		t.Fatal(err)
	}
	lw.Write(bin)
	lw.Close()

	blobs := map[string][]byte{}
	add := func(mediaType string, b []byte) descriptor {
		sum := sha256.Sum256(b)
		d := "sha256:" + hex.EncodeToString(sum[:])
		blobs[hex.EncodeToString(sum[:])] = b
		return descriptor{MediaType: mediaType, Digest: d, Size: len(b)}
	}
	mustJSON := func(v any) []byte {
		b, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	layerDesc := add("application/vnd.oci.image.layer.v1.tar", layer.Bytes())
	config := add("application/vnd.oci.image.config.v1+json", mustJSON(map[string]any{
		"architecture": runtime.GOARCH,
		"os":           "linux",
		"config":       map[string]any{"Entrypoint": []string{"/pause"}},
		// An uncompressed layer's diff ID is its digest.
		"rootfs": map[string]any{"type": "layers", "diff_ids": []string{layerDesc.Digest}},
	}))
	manifest := add("application/vnd.oci.image.manifest.v1+json", mustJSON(map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.manifest.v1+json",
		"config":        config,
		"layers":        []descriptor{layerDesc},
	}))
	manifest.Platform = map[string]string{"architecture": runtime.GOARCH, "os": "linux"}
	manifest.Annotations = map[string]string{
		"io.containerd.image.name":          pauseImage,
		"org.opencontainers.image.ref.name": "e2e",
	}
	index := mustJSON(map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.index.v1+json",
		"manifests":     []descriptor{manifest},
	})

	f, err := os.Create(archive)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	tw := tar.NewWriter(f)
	file := func(name string, b []byte) {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(b)), ModTime: now, Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		tw.Write(b)
	}
	file("oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`))
	file("index.json", index)
	for hexsum, b := range blobs {
		file("blobs/sha256/"+hexsum, b)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
}
