package main

// scrubd's figures as the soak reads them: its process's memory, fds and
// goroutines from /proc, its metrics, and latency percentiles.

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
)

// memory reads scrubd's VmRSS, RssAnon, RssFile and RssShmem in bytes.
func (s *soak) memory() map[string]int64 {
	m := map[string]int64{}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", s.daemon().Pid()))
	if err != nil {
		return m
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && strings.HasSuffix(f[0], ":") {
			if kb, err := strconv.ParseInt(f[1], 10, 64); err == nil {
				m[strings.TrimSuffix(f[0], ":")] = kb * 1024
			}
		}
	}
	return m
}

// procFigures reads scrubd's resident memory, open fds and goroutines.
func (s *soak) procFigures() (rss int64, fds, goroutines int) {
	rss = s.memory()["VmRSS"]
	if ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", s.daemon().Pid())); err == nil {
		fds = len(ents)
	}
	goroutines = int(s.metric("go_goroutines"))
	return rss, fds, goroutines
}

// metric reads one unlabelled (or summed) series from scrubd's /metrics.
func (s *soak) metric(name string) float64 {
	resp, err := http.Get("http://" + s.daemon().Metrics + "/metrics")
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	sum := 0.0
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, name+" ") || strings.HasPrefix(l, name+"{") {
			f := strings.Fields(l)
			v, _ := strconv.ParseFloat(f[len(f)-1], 64)
			sum += v
		}
	}
	return sum
}

func pct(d []time.Duration, p int) float64 {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	i := min(len(s)-1, (len(s)*p+99)/100-1)
	return s[max(0, i)].Seconds()
}
