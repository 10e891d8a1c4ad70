package main

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/ctscrub/ctscrub/internal/netnsnode"
)

// session is one run's state after set-up: the chain, the daemon, the maps.
type session struct {
	cfg     Config
	p       *printer
	ch      *netnsnode.Chain
	d       *netnsnode.Daemon
	maps    *netnsnode.CTMaps
	dp      netnsnode.Datapath
	node    string // the node's netns path
	cleanup *netnsnode.Cleanup

	outside *netnsnode.Server
	servers map[string]*netnsnode.Server // per pod
	rows    []row
	walkNK  netnsnode.WalkResult
	walkB   netnsnode.WalkResult
	reuse   []reuseCheck
	audited auditResult
}

// pod is one of the demo's pods: the demo deletes some itself, the cleanup
// stack the others.
type pod struct {
	*netnsnode.Pod
	gone     bool   // deleted by the demo
	onDelete func() // tells the cleanup stack its DEL already ran
}

func (s *session) run(ctx context.Context, nPods int) error {
	p := s.p
	out, err := netnsnode.StartServer(netnsnode.NetnsPath(netnsnode.OutsideNS))
	if err != nil {
		return err
	}
	s.outside = out
	s.cleanup.Push("stop the outside host's servers", func() error { out.Close(); return nil })
	s.servers = map[string]*netnsnode.Server{}

	p.section(fmt.Sprintf("3. %d pods through the CNI chain (libcni, conflist %s)", nPods, s.ch.ConfPath))
	p.f("   the node is netns %s (bridge %s, the pods' host-side veths, routing): the machine's own\n", netnsnode.NodeNS, netnsnode.BridgeName)
	p.f("   links, sysctls and firewall stay untouched; scrubd runs in the machine's namespace.\n")
	p.f("   chain: bridge + host-local (Debian's reference plugins), then ctscrub; host-local hands out\n")
	p.f("   only %d addresses per family,", nPods)
	p.f(" so a new pod gets the IP of the pod deleted before it.\n")
	var pods []*pod
	for i := 0; i < nPods; i++ {
		pd, err := s.addPod(ctx, fmt.Sprintf("pod-%c", 'a'+i), "ADD")
		if err != nil {
			return err
		}
		pods = append(pods, pd)
	}

	p.section("4. Real traffic: pod to pod, pod to outside, outside to pod (TCP, UDP, ping; v4 and v6)")
	p.f("   the outside host is netns %s at %s and %s\n", netnsnode.OutsideNS, netnsnode.OutsideAddr[0].Addr(), netnsnode.OutsideAddr[1].Addr())
	if err := netnsnode.WaitDAD(ctx, netnsnode.BridgeName); err != nil {
		return err
	}
	for _, pd := range pods {
		if err := s.traffic(ctx, pd, pods); err != nil {
			return err
		}
	}
	if err := s.showEntries(ctx, pods); err != nil {
		return err
	}

	victim := pods[1]
	p.section("5. One full walk of the same maps, as Cilium scrubs one IP")
	p.f("   looking for %s's entries (%s), deleting nothing:\n", victim.Name, ipList(victim.IPs()))
	if s.walkNK, err = netnsnode.NextKeyWalk(ctx, s.maps, victim.IPs()); err != nil {
		return err
	}
	p.f("   NextKey+Lookup walk (Cilium 1.16):   read %s entries in %s, %s of them %s's\n",
		netnsnode.Num(s.walkNK.Entries), netnsnode.Dur(s.walkNK.Duration), netnsnode.Num(s.walkNK.Matches), victim.Name)
	if s.walkB, err = netnsnode.BatchWalkAll(s.maps, victim.IPs()); err != nil {
		return err
	}
	p.f("   batch-lookup walk (Cilium 1.18+):     read %s entries in %s, %s of them %s's\n",
		netnsnode.Num(s.walkB.Entries), netnsnode.Dur(s.walkB.Duration), netnsnode.Num(s.walkB.Matches), victim.Name)
	p.f("   Cilium does one such walk for every pod start and every pod delete.\n")
	if ctx.Err() != nil {
		return ctx.Err()
	}

	p.section("6. Delete pods and create new ones: host-local hands out the same IPs again")
	victims := []*pod{pods[1], pods[2]}
	if s.cfg.Short {
		victims = victims[:1]
	}
	next := nPods
	for _, v := range victims {
		if err := s.reuseIP(ctx, v, fmt.Sprintf("pod-%c", 'a'+next), pods); err != nil {
			return err
		}
		next++
	}

	if s.audited, err = s.audit(ctx); err != nil {
		return err
	}
	s.summary()
	s.metrics(ctx)
	s.printJSON()
	for _, r := range s.reuse {
		if r.LeftAtDel != 0 || r.Inherited != 0 {
			return fmt.Errorf("%s: %d CT entries of %s were left after its DEL and %s inherited %d: the scrub was not complete",
				r.IP, r.LeftAtDel, r.OldPod, r.NewPod, r.Inherited)
		}
	}
	if s.audited.Missing != 0 {
		return fmt.Errorf("the audit found %d CT keys of complete IPs missing from the index", s.audited.Missing)
	}
	s.hold(ctx, pods)
	return nil
}

// hold keeps the node up until Ctrl-C when DEMO_HOLD is set, and says what
// to try meanwhile; otherwise it only names the knob.
func (s *session) hold(ctx context.Context, pods []*pod) {
	p := s.p
	if !s.cfg.Hold {
		p.f("\n(DEMO_HOLD=1 make demo keeps the node, scrubd and its metrics up until Ctrl-C, to look around.)\n")
		return
	}
	var live *pod
	for _, pd := range pods {
		if !pd.gone {
			live = pd
		}
	}
	p.section("Holding the node up (DEMO_HOLD=1): Ctrl-C removes everything")
	sock := "--socket " + s.d.Socket
	p.f("   bin/scrubd status %s\n", sock)
	p.f("   bin/scrubd index %s\n", sock)
	if live != nil {
		p.f("   bin/scrubd index --ip %s %s\n", live.V4, sock)
		p.f("   bin/scrubd scrub --ip %s --dry-run %s\n", live.V4, sock)
		p.f("   ip netns exec %s ip addr          # %s, created through the CNI chain\n", netnsnode.NamePrefix+"-"+live.Name, live.Name)
	}
	p.f("   bin/scrubd ct stats %s\n", sock)
	p.f("   curl -s http://%s/metrics | grep ^ctscrub_\n", s.d.Metrics)
	p.f("   ls %s            # the CT maps, pinned\n", s.maps.Dir())
	<-ctx.Done()
}

// addPod creates a pod through the chain and prints the scrubs it caused.
func (s *session) addPod(ctx context.Context, name, step string) (*pod, error) {
	np, err := s.ch.Add(ctx, s.cleanup, name)
	if err != nil {
		return nil, err
	}
	pd := &pod{Pod: np}
	deleted := false
	s.cleanup.Push("CNI DEL of "+name, func() error {
		if deleted {
			return nil
		}
		dctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, err := s.ch.Del(dctx, pd.Pod)
		return err
	})
	pd.onDelete = func() { deleted = true }
	// The host-side veth is in the node's namespace.
	if err := netnsnode.InNetns(s.node, func() error { return s.dp.Attach(pd.HostVeth) }); err != nil {
		return nil, err
	}
	srv, err := netnsnode.StartServer(pd.Netns)
	if err != nil {
		return nil, err
	}
	s.servers[name] = srv
	s.cleanup.Push("stop "+name+"'s servers", func() error { srv.Close(); return nil })
	s.p.f("   %-6s ADD  %-13s %-20s host veth %-15s CNI ADD took %s\n", pd.Name, pd.V4, pd.V6, pd.HostVeth, netnsnode.Dur(pd.AddTook))
	s.scrubLines(step, pd, "add", pd.AddTook)
	return pd, nil
}

// scrubLines prints the scrubs scrubd logged for a CNI call that just ended.
func (s *session) scrubLines(step string, pd *pod, reason string, cni time.Duration) {
	if !s.ch.HasPlugin {
		return
	}
	var got []netnsnode.ScrubLine
	// The plugin returned after scrubd answered; the log line may trail the
	// answer by a moment.
	for i := 0; i < 20 && len(got) == 0; i++ {
		got = s.d.NewScrubs()
		if len(got) == 0 {
			time.Sleep(25 * time.Millisecond)
		}
	}
	if len(got) == 0 {
		s.p.f("          scrub: none logged by scrubd for this %s (see %s)\n", reason, s.d.LogPath)
		return
	}
	for _, l := range got {
		r := row{Step: step, Pod: pd.Name, IPs: strings.Join(l.IPs, " "), Reason: l.Reason, Method: l.Method,
			Deleted: l.Deleted, Latency: l.Duration, Result: l.Result, CNITotal: cni}
		s.rows = append(s.rows, r)
		s.p.f("          scrub %-3s method=%-5s deleted=%-7s latency=%-9s result=%s\n",
			r.Reason, r.Method, netnsnode.Num(r.Deleted), netnsnode.Dur(r.Latency), r.Result)
	}
}

// traffic sends one pod's traffic to the other pods and the outside host, and
// the outside host's to the pod, in both families.
func (s *session) traffic(ctx context.Context, pd *pod, pods []*pod) error {
	toPod := netnsnode.TrafficCounts{TCP: 3, UDP: 5, Ping: 1}
	toOut := netnsnode.TrafficCounts{TCP: 20, UDP: 150, Ping: 3}
	fromOut := netnsnode.TrafficCounts{TCP: 5, UDP: 5, Ping: 1}
	if s.cfg.Short {
		toOut = netnsnode.TrafficCounts{TCP: 5, UDP: 20, Ping: 2}
	}
	total := 0
	send := func(from string, dst netip.Addr, n netnsnode.TrafficCounts) error {
		if !dst.IsValid() {
			return nil
		}
		got, err := netnsnode.SendTraffic(ctx, from, dst, n)
		total += got
		return err
	}
	peers := 0
	for _, o := range pods {
		if o == pd || o.gone {
			continue
		}
		peers++
		for _, dst := range o.IPs() {
			if err := send(pd.Netns, dst, toPod); err != nil {
				return err
			}
		}
	}
	for _, a := range netnsnode.OutsideAddr {
		if err := send(pd.Netns, a.Addr(), toOut); err != nil {
			return err
		}
	}
	for _, dst := range pd.IPs() {
		if err := send(netnsnode.NetnsPath(netnsnode.OutsideNS), dst, fromOut); err != nil {
			return err
		}
	}
	s.p.f("   %-6s %4d flows answered (to %d pods, to and from the outside host)\n", pd.Name, total, peers)
	return nil
}

// showEntries prints, per pod, its entries in the CT maps and in scrubd's index.
func (s *session) showEntries(ctx context.Context, pods []*pod) error {
	s.p.f("   %-6s %-30s %12s %12s  %s\n", "pod", "IPs", "CT entries", "index keys", "index complete?")
	for _, pd := range pods {
		if pd.gone {
			continue
		}
		n, err := netnsnode.EntriesOf(s.maps, pd.IPs()...)
		if err != nil {
			return err
		}
		keys, complete := 0, []string{}
		for _, ip := range pd.IPs() {
			st, err := s.d.Client.IndexIP(ctx, ip)
			if err != nil {
				complete = append(complete, "? ("+err.Error()+")")
				continue
			}
			keys += st.Keys
			c := "yes"
			if !st.Complete {
				c = "no: " + st.Incomplete
			}
			complete = append(complete, c)
		}
		s.p.f("   %-6s %-30s %12s %12s  %s\n", pd.Name, ipList(pd.IPs()), netnsnode.Num(n), netnsnode.Num(keys), strings.Join(slices.Compact(complete), ", "))
	}
	return nil
}

// reuseIP deletes old, creates a pod that gets old's IPs again, and checks
// that the new pod inherits none of old's CT entries.
func (s *session) reuseIP(ctx context.Context, old *pod, name string, pods []*pod) error {
	p := s.p
	had, err := netnsnode.EntriesOf(s.maps, old.IPs()...)
	if err != nil {
		return err
	}
	p.f("   %-6s DEL  %-13s %-20s (%s CT entries)\n", old.Name, old.V4, old.V6, netnsnode.Num(had))
	took, err := s.ch.Del(ctx, old.Pod)
	if err != nil {
		return err
	}
	old.gone = true
	old.onDelete()
	if srv := s.servers[old.Name]; srv != nil {
		srv.Close()
	}
	s.scrubLines("DEL", old, "del", took)
	left, err := netnsnode.EntriesOf(s.maps, old.IPs()...)
	if err != nil {
		return err
	}
	p.f("          CT entries of %s left after DEL: %d\n", ipList(old.IPs()), left)

	nw, err := s.addPod(ctx, name, "ADD")
	if err != nil {
		return err
	}
	inherited, err := netnsnode.EntriesOf(s.maps, nw.IPs()...)
	if err != nil {
		return err
	}
	same := nw.V4 == old.V4 && nw.V6 == old.V6
	verdict := "the same IPs"
	if !same {
		verdict = "DIFFERENT IPs (host-local did not reuse)"
	}
	mark := "ok"
	if inherited != 0 {
		mark = "NOT CLEAN: these would steer the new pod's traffic by the old pod's state"
	}
	p.f("          %s got %s %s had; CT entries it inherits from %s: %d (%s)\n", nw.Name, verdict, old.Name, old.Name, inherited, mark)
	for _, ip := range nw.IPs() {
		s.reuse = append(s.reuse, reuseCheck{IP: ip.String(), OldPod: old.Name, NewPod: nw.Name, OldHad: had, LeftAtDel: left, Inherited: inherited})
	}
	if !same {
		return fmt.Errorf("host-local gave %s %s, not %s's %s: the demo's IP reuse did not happen", nw.Name, ipList(nw.IPs()), old.Name, ipList(old.IPs()))
	}
	return s.traffic(ctx, nw, pods)
}

func ipList(ips []netip.Addr) string {
	var s []string
	for _, ip := range ips {
		s = append(s, ip.String())
	}
	return strings.Join(s, " ")
}
