package jail

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"
)

// A jail's cgroup bounds its whole tree: memory (its /tmp included), processes and CPU. Under
// cgroup v2 it is one group with the memory, pids and cpu controllers; under v1 (hybrid hosts,
// older containers) one group in each controller's hierarchy. Either way it is a child of the
// group this process is in, so a jail can never hold more than its parent allows.

// hierarchy is where a controller's groups live and the group this process is in.
type hierarchy struct {
	controller string // "" for cgroup v2's unified hierarchy
	dir        string // this process's group in it
}

// layout is where a jail's group is made and which bounds it can hold. Memory is required; a
// host that does not give sub-groups the pids or cpu controller (a container whose group has
// only memory delegated) gets the fallbacks of Start instead: a per-process limit on the
// program's own user, and the idle scheduling class.
type layout struct {
	hs        []hierarchy
	pids, cpu bool
}

// absentControllers are controllers findCgroups treats as missing (tests of the fallbacks).
var absentControllers []string

// findCgroups finds the groups jails are made under, or says what the host lacks.
func findCgroups() (layout, error) {
	l, err := findLayout()
	l.pids = l.pids && !slices.Contains(absentControllers, "pids")
	l.cpu = l.cpu && !slices.Contains(absentControllers, "cpu")
	return l, err
}

func findLayout() (layout, error) {
	own, err := ownGroups()
	if err != nil {
		return layout{}, fmt.Errorf("jail: cannot read this process's cgroups: %v", err)
	}
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err == nil {
		dir := groupDir("/sys/fs/cgroup", own[""])
		if filepath.Base(dir) == leafGroup {
			dir = filepath.Dir(dir) // this process was moved to the leaf: jails go beside it
		}
		ctl := filepath.Join(dir, "cgroup.subtree_control")
		avail, _ := os.ReadFile(filepath.Join(dir, "cgroup.controllers"))
		enable := func() {
			enabled, _ := os.ReadFile(ctl)
			for _, c := range []string{"memory", "pids", "cpu"} {
				if hasWord(string(avail), c) && !hasWord(string(enabled), c) {
					os.WriteFile(ctl, []byte("+"+c), 0)
				}
			}
		}
		enable()
		if enabled, _ := os.ReadFile(ctl); hasWord(string(avail), "memory") && !hasWord(string(enabled), "memory") {
			// cgroup v2 gives sub-groups controllers only of a group without processes of its
			// own (a container's group holds the container's): move them to a leaf beside the
			// jails, as Docker-in-Docker does with its "init" group. They stay under the same
			// group, within the same limits.
			toLeaf(dir)
			enable()
		}
		enabled, _ := os.ReadFile(ctl)
		if !hasWord(string(enabled), "memory") {
			return layout{}, fmt.Errorf("jail: the memory controller is not available to sub-groups of this process's "+
				"cgroup v2 group %s (its cgroup.controllers: %q, cgroup.subtree_control: %q); "+
				"the jail bounds a program's memory with it: run slimen in a group whose sub-groups "+
				"get memory (a container or systemd scope with delegation)",
				dir, strings.TrimSpace(string(avail)), strings.TrimSpace(string(enabled)))
		}
		return layout{hs: []hierarchy{{dir: dir}}, pids: hasWord(string(enabled), "pids"), cpu: hasWord(string(enabled), "cpu")}, nil
	}
	var l layout
	for _, c := range []string{"memory", "pids", "cpu"} {
		mount := filepath.Join("/sys/fs/cgroup", c)
		if _, err := os.Stat(filepath.Join(mount, "cgroup.procs")); err != nil {
			if c == "memory" {
				return layout{}, fmt.Errorf("jail: neither cgroup v2 (/sys/fs/cgroup/cgroup.controllers) "+
					"nor the cgroup v1 memory controller (%s) is mounted; the jail bounds a program's memory with it", mount)
			}
			continue
		}
		l.hs = append(l.hs, hierarchy{controller: c, dir: groupDir(mount, own[c])})
		l.pids = l.pids || c == "pids"
		l.cpu = l.cpu || c == "cpu"
	}
	return l, nil
}

// leafGroup is the sub-group a cgroup v2 group's own processes move to (toLeaf).
const leafGroup = "slimen-leaf"

// toLeaf moves every process of group dir into its leafGroup.
func toLeaf(dir string) {
	leaf := filepath.Join(dir, leafGroup)
	if err := os.Mkdir(leaf, 0o755); err != nil && !os.IsExist(err) {
		return
	}
	for range 3 { // processes started meanwhile
		b, _ := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
		pids := strings.Fields(string(b))
		if len(pids) == 0 {
			return
		}
		for _, p := range pids {
			os.WriteFile(filepath.Join(leaf, "cgroup.procs"), []byte(p), 0)
		}
	}
}

// groupDir is the folder of group path under a hierarchy's mount: in a container the mount may
// show only the container's own group as its root, so a path that does not exist there is the
// mount itself.
func groupDir(mount, path string) string {
	d := filepath.Join(mount, path)
	if _, err := os.Stat(d); err != nil {
		return mount
	}
	return d
}

// ownGroups reads /proc/self/cgroup: controller → group path ("" for v2's unified hierarchy).
func ownGroups() (map[string]string, error) {
	f, err := os.Open("/proc/self/cgroup")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		for _, c := range strings.Split(parts[1], ",") {
			out[c] = parts[2]
		}
	}
	return out, sc.Err()
}

func hasWord(s, w string) bool {
	for _, f := range strings.Fields(s) {
		if f == w {
			return true
		}
	}
	return false
}

// cgroup is one jail's group (one folder a hierarchy).
type cgroup struct {
	dirs                  []string
	v2                    bool
	boundsPids, boundsCPU bool // whether it bounds processes and CPU (else Start's fallbacks do)
}

var cgroupSeq atomic.Int64

// newCgroup makes a jail's group with the spec's bounds.
func newCgroup(s Spec) (*cgroup, error) {
	l, err := findCgroups()
	if err != nil {
		return nil, err
	}
	name := fmt.Sprintf("slimen-jail-%d-%d", os.Getpid(), cgroupSeq.Add(1))
	cg := &cgroup{boundsPids: l.pids, boundsCPU: l.cpu}
	for _, h := range l.hs {
		sweep(h.dir)
		dir := filepath.Join(h.dir, name)
		if err := os.Mkdir(dir, 0o755); err != nil {
			cg.remove()
			return nil, fmt.Errorf("jail: cannot make the jail's cgroup: %v", err)
		}
		cg.dirs = append(cg.dirs, dir)
		cg.v2 = h.controller == ""
		if err := limits(h.controller, dir, s); err != nil {
			cg.remove()
			return nil, err
		}
	}
	return cg, nil
}

// limits writes the spec's bounds into a group of one hierarchy.
func limits(controller, dir string, s Spec) error {
	type kv struct{ file, value string }
	var w []kv
	period := 100000
	quota := int(s.CPUs * float64(period))
	switch controller {
	case "": // v2: each controller's files exist when the parent gives it
		if s.MemoryBytes > 0 {
			w = append(w, kv{"memory.max", strconv.FormatInt(s.MemoryBytes, 10)}, kv{"memory.swap.max", "0"})
		}
		if _, err := os.Stat(filepath.Join(dir, "pids.max")); err == nil && s.Pids > 0 {
			w = append(w, kv{"pids.max", strconv.Itoa(s.Pids)})
		}
		if _, err := os.Stat(filepath.Join(dir, "cpu.max")); err == nil && quota > 0 {
			w = append(w, kv{"cpu.max", fmt.Sprintf("%d %d", quota, period)})
		}
	case "memory":
		if s.MemoryBytes > 0 {
			w = append(w, kv{"memory.limit_in_bytes", strconv.FormatInt(s.MemoryBytes, 10)})
			if _, err := os.Stat(filepath.Join(dir, "memory.memsw.limit_in_bytes")); err == nil {
				w = append(w, kv{"memory.memsw.limit_in_bytes", strconv.FormatInt(s.MemoryBytes, 10)})
			}
		}
	case "pids":
		if s.Pids > 0 {
			w = append(w, kv{"pids.max", strconv.Itoa(s.Pids)})
		}
	case "cpu":
		if quota > 0 {
			w = append(w, kv{"cpu.cfs_period_us", strconv.Itoa(period)}, kv{"cpu.cfs_quota_us", strconv.Itoa(quota)})
		}
	}
	for _, x := range w {
		if err := os.WriteFile(filepath.Join(dir, x.file), []byte(x.value), 0); err != nil {
			if x.file == "memory.swap.max" && errors.Is(err, os.ErrNotExist) {
				continue // no swap accounting: nothing to bound
			}
			return fmt.Errorf("jail: cannot bound the jail's cgroup (%s): %v", x.file, err)
		}
	}
	return nil
}

// add moves a process into the group.
func (cg *cgroup) add(pid int) error {
	for _, d := range cg.dirs {
		if err := os.WriteFile(filepath.Join(d, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
			return fmt.Errorf("jail: cannot put the jail's init in its cgroup %s: %v", d, err)
		}
	}
	return nil
}

// pids lists the processes in the group.
func (cg *cgroup) pids() []int {
	if len(cg.dirs) == 0 {
		return nil
	}
	b, _ := os.ReadFile(filepath.Join(cg.dirs[0], "cgroup.procs"))
	var out []int
	for _, f := range strings.Fields(string(b)) {
		if n, err := strconv.Atoi(f); err == nil {
			out = append(out, n)
		}
	}
	return out
}

// kill ends every process in the group: the namespace's end kills them too, but a process can
// be in the group and outside the namespace only if something moved it there; this is the
// backstop, and waits (a little) until the group is empty.
func (cg *cgroup) kill() {
	if cg.v2 && len(cg.dirs) > 0 {
		os.WriteFile(filepath.Join(cg.dirs[0], "cgroup.kill"), []byte("1"), 0)
	}
	for i := 0; i < 200; i++ {
		ps := cg.pids()
		if len(ps) == 0 {
			return
		}
		for _, p := range ps {
			syscall.Kill(p, syscall.SIGKILL)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// remove deletes the group's folders (once its processes are gone).
func (cg *cgroup) remove() {
	for _, d := range cg.dirs {
		for i := 0; i < 100; i++ {
			if err := os.Remove(d); err == nil || errors.Is(err, os.ErrNotExist) {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
}

// sweep removes the empty groups of jails whose maker died before removing them (a sandbox
// child that was killed): their names carry the maker's pid.
func sweep(parent string) {
	SweepOrphans(parent, "slimen-jail-", func(d string) {
		if b, _ := os.ReadFile(filepath.Join(d, "cgroup.procs")); len(strings.TrimSpace(string(b))) == 0 {
			os.Remove(d)
		}
	})
}

// SweepOrphans calls remove with each entry of dir named prefix + "<pid>-…" whose maker is gone
// (Orphaned): what a killed process left behind.
func SweepOrphans(dir, prefix string, remove func(path string)) {
	paths, _ := filepath.Glob(filepath.Join(dir, prefix+"*"))
	for _, p := range paths {
		if Orphaned(filepath.Base(p), prefix) {
			remove(p)
		}
	}
}

// Orphaned says whether a name made as prefix + "<pid>-…" belongs to a process that is gone.
func Orphaned(name, prefix string) bool {
	rest, ok := strings.CutPrefix(name, prefix)
	if !ok {
		return false
	}
	pid, err := strconv.Atoi(strings.SplitN(rest, "-", 2)[0])
	if err != nil || pid == os.Getpid() {
		return false
	}
	return syscall.Kill(pid, 0) == syscall.ESRCH
}
