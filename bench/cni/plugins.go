package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/ctscrub/ctscrub/internal/netnsnode"
)

// pluginCalls runs the CNI plugins as a runtime does: the real binary from
// the chain's bin dir, with the CNI environment and stdin, forked from the
// node's netns. A timed call's page faults (ctscrub and the baseline) and,
// with the trace on, ctscrub's steps are kept.
type pluginCalls struct {
	binDir  string
	node    string // the node's netns path
	noTrace bool   // TRACE=0
	timed   bool   // the calls of a warm-up pair are not broken down either

	faults                        map[string][]int64 // minor faults per "plugin COMMAND"
	addSteps, delSteps, execSteps stepSamples
}

// run runs one plugin call and returns its stdout and how long it took from
// fork to exit.
func (c *pluginCalls) run(plugin, command, containerID, netns string, conf []byte) ([]byte, time.Duration, error) {
	cmd := exec.Command(filepath.Join(c.binDir, plugin))
	cmd.Env = []string{"CNI_COMMAND=" + command, "CNI_CONTAINERID=" + containerID, "CNI_NETNS=" + netns,
		"CNI_IFNAME=eth0", "CNI_PATH=" + c.binDir, "PATH=/usr/sbin:/usr/bin:/sbin:/bin"}
	traced := plugin == "ctscrub" && (command == "ADD" || command == "DEL" || command == "VERSION") && !c.noTrace
	if traced {
		cmd.Env = append(cmd.Env, pluginTraceEnv+"=1")
	}
	cmd.Stdin = bytes.NewReader(conf)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	var start, end time.Time
	err := netnsnode.InNetns(c.node, func() error {
		start = time.Now()
		err := cmd.Run()
		end = time.Now()
		return err
	})
	el := end.Sub(start)
	if err != nil {
		return nil, el, fmt.Errorf("%s %s: %v: %s %s", plugin, command, err, bytes.TrimSpace(stdout.Bytes()), bytes.TrimSpace(stderr.Bytes()))
	}
	if ru, ok := cmd.ProcessState.SysUsage().(*syscall.Rusage); ok && strings.HasPrefix(plugin, "ctscrub") && c.timed {
		c.faults[plugin+" "+command] = append(c.faults[plugin+" "+command], ru.Minflt)
	}
	if traced && c.timed {
		steps := map[string]*stepSamples{"ADD": &c.addSteps, "DEL": &c.delSteps, "VERSION": &c.execSteps}[command]
		if err := steps.addCall(stderr.Bytes(), start, end); err != nil {
			return nil, el, fmt.Errorf("%s %s: %w", plugin, command, err)
		}
	}
	return stdout.Bytes(), el, nil
}

// pluginConf is plugin i of the chain's conflist as a runtime hands it to
// that plugin: with the network's name and cniVersion.
func pluginConf(ch *netnsnode.Chain, i int) ([]byte, error) {
	if i >= len(ch.List.Plugins) {
		return nil, fmt.Errorf("conflist %s has no plugin %d", ch.ConfPath, i)
	}
	var m map[string]any
	if err := json.Unmarshal(ch.List.Plugins[i].Bytes, &m); err != nil {
		return nil, err
	}
	m["name"] = ch.List.Name
	m["cniVersion"] = ch.List.CNIVersion
	return json.Marshal(m)
}

// injectPrev adds prevResult to a plugin's configuration.
func injectPrev(conf, prev []byte) ([]byte, error) {
	var m map[string]any
	if err := json.Unmarshal(conf, &m); err != nil {
		return nil, err
	}
	m["prevResult"] = json.RawMessage(prev)
	return json.Marshal(m)
}
