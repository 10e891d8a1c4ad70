package demo

import (
	"bytes"
	"fmt"
	"os/exec"
	"strings"
)

// The demo routes between its bridge and the outside host's veth. A host
// whose FORWARD chain drops by default (Docker sets that) would drop it, so
// the demo accepts its own interfaces' traffic with rules tagged
// fwComment, and removes exactly those rules at the end.
const fwComment = "ctscrub-demo"

var fwTools = []string{"iptables", "ip6tables"}

func fwRules() [][]string {
	var out [][]string
	for _, l := range []string{bridgeName, outsideVeth} {
		out = append(out,
			[]string{"-i", l, "-m", "comment", "--comment", fwComment, "-j", "ACCEPT"},
			[]string{"-o", l, "-m", "comment", "--comment", fwComment, "-j", "ACCEPT"})
	}
	return out
}

func iptables(tool string, args ...string) error {
	out, err := exec.Command(tool, append([]string{"-w", "5"}, args...)...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %v: %s", tool, strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

// acceptForward inserts the demo's FORWARD rules and pushes their removal.
func acceptForward(c *Cleanup) error {
	for _, tool := range fwTools {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("%s not found: install Debian's iptables package (scripts/setup.sh)", tool)
		}
		for _, r := range fwRules() {
			if err := iptables(tool, append([]string{"-I", "FORWARD"}, r...)...); err != nil {
				return err
			}
			c.Push(tool+" FORWARD rule of the demo", func() error {
				return iptables(tool, append([]string{"-D", "FORWARD"}, r...)...)
			})
		}
	}
	return nil
}

// removeForwardRules deletes every FORWARD rule tagged fwComment (leftovers
// of a killed run) and reports how many it removed.
func removeForwardRules() (int, error) {
	n := 0
	for _, tool := range fwTools {
		if _, err := exec.LookPath(tool); err != nil {
			continue
		}
		out, err := exec.Command(tool, "-w", "5", "-S", "FORWARD").Output()
		if err != nil {
			return n, fmt.Errorf("%s -S FORWARD: %w", tool, err)
		}
		for _, line := range strings.Split(string(out), "\n") {
			if !strings.HasPrefix(line, "-A FORWARD ") || !strings.Contains(line, "--comment "+fwComment+" ") {
				continue
			}
			// iptables -S prints rules as arguments; the comment has no
			// spaces, so splitting on blanks gives them back.
			args := strings.Fields(strings.TrimPrefix(line, "-A FORWARD "))
			if err := iptables(tool, append([]string{"-D", "FORWARD"}, args...)...); err != nil {
				return n, err
			}
			n++
		}
	}
	return n, nil
}

// forwardRulesLeft counts FORWARD rules tagged fwComment.
func forwardRulesLeft() int {
	n := 0
	for _, tool := range fwTools {
		out, _ := exec.Command(tool, "-w", "5", "-S", "FORWARD").Output()
		n += strings.Count(string(out), "--comment "+fwComment+" ")
	}
	return n
}
