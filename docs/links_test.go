// Package docs holds the checks that keep the project's markdown honest: every
// relative link resolves, and `make help` lists every target.
package docs

import (
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"unicode"
)

// Every relative link in the repository's markdown (README.md, docs/, the
// plugin's README, the chart's, ...) names a file or directory that exists
// and, with a #fragment, a heading in that file.
func TestLinksResolve(t *testing.T) {
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	files := markdownFiles(t, root)
	if len(files) < 3 {
		t.Fatalf("found %d markdown files under %s; is the test running from docs/?", len(files), root)
	}
	for _, bad := range brokenLinks(root, files) {
		t.Error(bad)
	}
}

// The checker finds what it must, so TestLinksResolve passing means something.
func TestBrokenLinksFound(t *testing.T) {
	for _, tc := range []struct {
		name, md string
		broken   bool
	}{
		{"file", "[x](other.md)", false},
		{"directory", "[x](sub)", false},
		{"directory with slash", "[x](sub/)", false},
		{"missing file", "[x](gone.md)", true},
		{"missing directory", "[x](sub/gone/)", true},
		{"heading", "[x](other.md#a-heading-with-code-and-punctuation)", false},
		{"second heading of a name", "[x](other.md#twice-1)", false},
		{"missing heading", "[x](other.md#no-such-heading)", true},
		{"heading in this file", "[x](#this-file)", false},
		{"missing heading in this file", "[x](#elsewhere)", true},
		{"heading only in a code block", "[x](other.md#not-a-heading)", true},
		{"up and back", "[x](../d/other.md)", false},
		{"title after the target", `[x](other.md "title")`, false},
		{"reference definition", "[x]: gone.md", true},
		{"image", "![x](gone.png)", true},
		{"external", "[x](https://example.com/gone.md)", false},
		{"inside a code span", "`[x](gone.md)`", false},
		{"inside a fenced block", "```\n[x](gone.md)\n```", false},
		{"inside an indented block", "\n    make x   # [x](gone.md)\n", false},
		{"a list item's continuation", "- item\n    [x](gone.md)", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := filepath.Join(t.TempDir(), "d")
			write(t, filepath.Join(root, "sub", "keep"), "")
			write(t, filepath.Join(root, "other.md"), "# Other\n\n## A heading, with `code` and (punctuation)!\n\n## Twice\n\n## Twice\n\n```\n# not a heading\n```\n")
			write(t, filepath.Join(root, "doc.md"), "# This file\n\n"+tc.md+"\n")
			bad := brokenLinks(root, []string{"doc.md"})
			if got := len(bad) > 0; got != tc.broken {
				t.Errorf("%q: broken %v (%q), want %v", tc.md, got, bad, tc.broken)
			}
		})
	}
}

func write(t *testing.T, path, s string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
}

// markdownFiles lists the repository's own markdown, relative to root:
// not build output, hidden directories or scratch space.
func markdownFiles(t *testing.T, root string) []string {
	t.Helper()
	var files []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if d.IsDir() && rel != "." && (strings.HasPrefix(d.Name(), ".") || rel == "bin" || d.Name() == "testdata" || d.Name() == "node_modules") {
			return filepath.SkipDir
		}
		if !d.IsDir() && strings.HasSuffix(p, ".md") {
			files = append(files, rel)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(files)
	return files
}

var (
	fence     = regexp.MustCompile("^\\s*(```|~~~)")
	codeSpan  = regexp.MustCompile("`+[^`]*`+")
	inline    = regexp.MustCompile(`!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)`)
	reference = regexp.MustCompile(`^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)`)
	heading   = regexp.MustCompile(`^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$`)
	scheme    = regexp.MustCompile(`^[a-zA-Z][a-zA-Z0-9+.-]*:`)
)

// brokenLinks checks the relative links of files (relative to root) and
// says, for each that does not resolve, where it is and what is missing.
func brokenLinks(root string, files []string) []string {
	var bad []string
	anchors := map[string]map[string]bool{}
	for _, f := range files {
		data, err := os.ReadFile(filepath.Join(root, f))
		if err != nil {
			bad = append(bad, fmt.Sprintf("%s: %v", f, err))
			continue
		}
		for _, target := range links(string(data)) {
			if scheme.MatchString(target.dest) || strings.HasPrefix(target.dest, "//") {
				continue // https:, mailto:, ...: not this test's business
			}
			path, frag, _ := strings.Cut(target.dest, "#")
			abs := filepath.Join(root, f) // a bare #fragment: this file
			if path != "" {
				abs = filepath.Join(root, filepath.Dir(f), filepath.FromSlash(path))
			}
			where := fmt.Sprintf("%s:%d: link %q", f, target.line, target.dest)
			st, err := os.Stat(abs)
			if err != nil {
				bad = append(bad, fmt.Sprintf("%s: %s does not exist (fix the path or the file's name)", where, path))
				continue
			}
			if frag == "" {
				continue
			}
			if st.IsDir() || !strings.HasSuffix(abs, ".md") {
				bad = append(bad, fmt.Sprintf("%s: #%s on something not a markdown file", where, frag))
				continue
			}
			if anchors[abs] == nil {
				b, err := os.ReadFile(abs)
				if err != nil {
					bad = append(bad, fmt.Sprintf("%s: %v", where, err))
					continue
				}
				anchors[abs] = headingAnchors(string(b))
			}
			if !anchors[abs][frag] {
				bad = append(bad, fmt.Sprintf("%s: no heading with anchor #%s in %s (headings are slugged as GitHub does)", where, frag, filepath.Base(abs)))
			}
		}
	}
	return bad
}

type link struct {
	dest string
	line int
}

// outsideCode returns md's lines with those in code blocks (fenced, or
// indented) and the fences themselves blanked, so that line numbers stay.
func outsideCode(lines []string) []string {
	out := make([]string, len(lines))
	inFence, inIndented, prevBlank := false, false, true
	for n, line := range lines {
		blank := strings.TrimSpace(line) == ""
		// An indented code block: 4 spaces or a tab after a blank line (or
		// more of the block); a list item's continuation is not one.
		indented := strings.HasPrefix(line, "    ") || strings.HasPrefix(line, "\t")
		inIndented = !blank && indented && (prevBlank || inIndented) || blank && inIndented
		prevBlank = blank
		if fence.MatchString(line) {
			inFence = !inFence
			continue
		}
		if !inFence && !inIndented {
			out[n] = line
		}
	}
	return out
}

// links finds inline links, images and reference definitions outside code.
func links(md string) []link {
	var out []link
	for n, line := range outsideCode(strings.Split(md, "\n")) {
		line = codeSpan.ReplaceAllString(line, "")
		for _, m := range inline.FindAllStringSubmatch(line, -1) {
			out = append(out, link{m[1], n + 1})
		}
		if m := reference.FindStringSubmatch(line); m != nil {
			out = append(out, link{m[1], n + 1})
		}
	}
	return out
}

// headingAnchors lists the anchors GitHub gives a file's headings: the text
// lower-cased, punctuation dropped, spaces turned into hyphens, and "-1",
// "-2", ... after a repeated one.
func headingAnchors(md string) map[string]bool {
	anchors := map[string]bool{}
	seen := map[string]int{}
	inFence := false
	for _, line := range strings.Split(md, "\n") {
		if fence.MatchString(line) {
			inFence = !inFence
			continue
		}
		m := heading.FindStringSubmatch(line)
		if inFence || m == nil {
			continue
		}
		s := slug(m[1])
		if n := seen[s]; n > 0 {
			anchors[fmt.Sprintf("%s-%d", s, n)] = true
		} else {
			anchors[s] = true
		}
		seen[s]++
	}
	return anchors
}

var linkText = regexp.MustCompile(`!?\[([^\]]*)\]\([^)]*\)`)

func slug(h string) string {
	h = linkText.ReplaceAllString(h, "$1")
	var b strings.Builder
	for _, r := range strings.ToLower(h) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r) || unicode.IsMark(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

// `make help` shows every target the Makefile declares, so each needs a
// "## what it does" comment, and help's pattern must accept its name (it once
// skipped names with digits, and e2e-kind with them).
func TestMakeHelpListsEveryTarget(t *testing.T) {
	if _, err := exec.LookPath("make"); err != nil {
		t.Skip("make is not installed")
	}
	mk, err := os.ReadFile("../Makefile")
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("make", "-s", "-C", "..", "help").CombinedOutput()
	if err != nil {
		t.Fatalf("make help: %v\n%s", err, out)
	}
	listed := map[string]bool{}
	for _, l := range strings.Split(string(out), "\n") {
		if f := strings.Fields(l); len(f) > 0 {
			listed[f[0]] = true
		}
	}
	var phony []string
	for _, l := range strings.Split(string(mk), "\n") {
		if rest, ok := strings.CutPrefix(l, ".PHONY:"); ok {
			phony = append(phony, strings.Fields(rest)...)
		}
	}
	if len(phony) < 5 {
		t.Fatalf("found %d .PHONY targets in the Makefile", len(phony))
	}
	for _, target := range phony {
		if !listed[target] {
			t.Errorf("make help does not list %q: give its rule a \"## what it does\" comment (target: deps ## ...)", target)
		}
	}
}
