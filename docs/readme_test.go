package docs

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"unicode/utf8"
)

// The README's shape, kept by the build rather than by review: it has grown
// back into a lab notebook twice (issue 39). Measurements, caveats and run
// histories belong in the doc that owns them, linked once from the README.
const (
	readmeMaxLines = 150
	readmeMaxProse = 100 // characters per line of prose; tables and code may be wider
)

func TestReadmeShape(t *testing.T) {
	md, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range readmeShapeProblems(string(md)) {
		t.Error("README.md: " + p)
	}
}

// The checker finds what it must, so TestReadmeShape passing means something.
func TestReadmeShapeProblemsFound(t *testing.T) {
	long := strings.Repeat("x", readmeMaxProse+1)
	wide := strings.Repeat("é", readmeMaxProse) // 100 characters, 200 bytes
	lines := func(n int) string { return strings.Repeat("line\n", n) }
	for _, tc := range []struct {
		name, md string
		problems int
	}{
		{"short", "# t\n\ntext\n", 0},
		{"150 lines", lines(readmeMaxLines), 0},
		{"150 lines, no final newline", strings.TrimSuffix(lines(readmeMaxLines), "\n"), 0},
		{"151 lines", lines(readmeMaxLines + 1), 1},
		{"150 lines and a blank one", lines(readmeMaxLines) + "\n", 1},
		{"prose of 100 characters", strings.Repeat("x", readmeMaxProse) + "\n", 0},
		{"prose of 100 characters in 200 bytes", wide + "\n", 0},
		{"prose of 101 characters", long + "\n", 1},
		{"a long heading", "## " + long + "\n", 1},
		{"a long list item", "- " + long + "\n", 1},
		{"two long lines", long + "\n" + long + "\n", 2},
		{"a long table row", "| a | b |\n|---|---|\n| " + long + " | x |\n", 0},
		{"an indented table row", "  | " + long + " |\n", 0},
		{"a long line in a fenced block", "```\n" + long + "\n```\n", 0},
		{"a long line in a tilde fence", "~~~\n" + long + "\n~~~\n", 0},
		{"after a fenced block", "```\nx\n```\n" + long + "\n", 1},
		{"a long line in an indented block", "text\n\n    make x   # " + long + "\n", 0},
		{"an indented block's second line", "\n    a\n    " + long + "\n", 0},
		{"a list item's continuation", "- item\n    " + long + "\n", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := readmeShapeProblems(tc.md); len(got) != tc.problems {
				t.Errorf("%d problems %q, want %d", len(got), got, tc.problems)
			}
		})
	}
}

// readmeShapeProblems says what in md breaks the README's shape: more than
// readmeMaxLines lines, or a line of prose (not a table row, not in a code
// block) of more than readmeMaxProse characters.
func readmeShapeProblems(md string) []string {
	var bad []string
	all := strings.Split(strings.TrimSuffix(md, "\n"), "\n")
	if len(all) > readmeMaxLines {
		bad = append(bad, fmt.Sprintf("%d lines, more than %d: move measurements, caveats and run histories to the doc that owns them and link it", len(all), readmeMaxLines))
	}
	for n, line := range outsideCode(all) {
		if strings.HasPrefix(strings.TrimSpace(line), "|") {
			continue
		}
		if c := utf8.RuneCountInString(line); c > readmeMaxProse {
			bad = append(bad, fmt.Sprintf("line %d: %d characters of prose, more than %d: wrap it, or say less and link the doc", n+1, c, readmeMaxProse))
		}
	}
	return bad
}
