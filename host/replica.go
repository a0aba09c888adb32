package host

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/slimen/slimen/engines"
)

// replicas give an engine that keeps no weights versions itself (a torch worker: one copy of
// the weights, trained in place) the engines.Versions of the asynchronous loop. Each
// kept version lives in a rollout replica, another engine of the policy opened with its config
// (another worker process on the same device), which takes the trainer's weights through a
// folder: the trainer saves them (Engine.Save) and the replica loads them (Engine.Load). A
// replica is reused once its version is dropped, so a policy has at most K replicas.
//
// When the trainer and the replicas can push weights between them (engines.WeightsPusher: a torch
// worker lists "push" in its capabilities), prepare has them join a process group of their own
// (the trainer rank 0, the replicas 1…n) and KeepVersion sends the trainer's weights to the free
// replica by a broadcast through it (NCCL between two GPUs) instead of through the folder; a group
// that cannot be made, or a push that fails, falls back to the folder (events.log says why).
type replicas struct {
	policy  string
	trainer engines.Engine
	open    func(ctx context.Context) (engines.Engine, error)
	dir     string               // where the weights travel: under the run's directory
	logf    func(string, ...any) // events.log
	mu      sync.Mutex
	free    []engines.Engine       // opened, holding no version still needed
	kept    map[int]engines.Engine // version → its replica
	all     []engines.Engine       // every replica, for Close
	pushes  int                    // weights pushed so far
	pushDur time.Duration          // their time, save and load, or the broadcast
	pushGB  float64                // their size
	group   *pushGroup             // nil: pushes go through the folder
}

// pushGroup is the process group of a trainer and its replicas (engines.WeightsPusher).
type pushGroup struct {
	g        engines.PushGroup
	rank     map[engines.Engine]int // replica → its rank (1…)
	restarts int                    // the trainer's restarts when it joined (a new process has left the group)
}

// pushTimeout is how long a member of a push group waits for the others, at the join and at each
// push; PushHostEnv names the address the members meet at.
const pushTimeout = 120 * time.Second

// PushHostEnv names the environment variable that holds the address of the trainer's machine
// at which its rollout replicas meet it to take its weights (a push group); unset, it is
// 127.0.0.1: the workers run on the host's machine.
const PushHostEnv = "SLIMEN_PUSH_HOST"

var _ engines.Versions = (*replicas)(nil)

// prepare opens n replicas at once (each a worker process to start: their start-up overlaps).
func (r *replicas) prepare(ctx context.Context, n int) error {
	opened := make([]engines.Engine, n)
	errs := atOnce(n, func(i int) (err error) {
		opened[i], err = r.open(ctx)
		return err
	})
	r.mu.Lock()
	for i, e := range opened {
		if errs[i] == nil {
			r.all = append(r.all, e)
			r.free = append(r.free, e)
		}
	}
	r.mu.Unlock()
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("opening rollout replicas: %w", err)
	}
	r.logf("policy %q: %d rollout replicas opened (rollout.max_staleness: each holds one weights version)", r.policy, n)
	r.join(ctx, opened)
	return nil
}

// join makes the push group of the trainer and reps, or says in events.log why the weights go
// through the folder.
func (r *replicas) join(ctx context.Context, reps []engines.Engine) {
	folder := func(why string, args ...any) {
		r.logf("policy %q: weights are pushed to its rollout replicas through a folder (the trainer saves, a replica loads): %s", r.policy, fmt.Sprintf(why, args...))
	}
	members := append([]engines.Engine{r.trainer}, reps...)
	pushers := make([]engines.WeightsPusher, len(members))
	for i, e := range members {
		p, ok := e.(engines.WeightsPusher)
		if !ok {
			folder("its engine cannot join a push group (a LoRA policy, whose adapter is what would move, or an engine without engines.WeightsPusher)")
			return
		}
		can, err := p.CanPush(ctx)
		if err != nil {
			folder("asking its engine whether it joins push groups: %v", err)
			return
		}
		if !can {
			folder("its engine does not join push groups (no \"push\" in its capabilities: a worker group of several ranks, " +
				"a worker started with --no-push, or an older release)")
			return
		}
		pushers[i] = p
	}
	host := os.Getenv(PushHostEnv)
	if host == "" {
		host = "127.0.0.1"
	}
	port, err := freePort(host)
	if err != nil {
		folder("no port for the push group on %s (%s): %v", host, PushHostEnv, err)
		return
	}
	g := engines.PushGroup{Name: fmt.Sprintf("%s-%d", r.policy, time.Now().UnixNano()),
		InitMethod: "tcp://" + net.JoinHostPort(host, strconv.Itoa(port)), World: len(members), TimeoutS: pushTimeout.Seconds()}
	jctx, cancel := context.WithTimeout(ctx, pushTimeout+30*time.Second)
	defer cancel()
	links := make([][]string, len(members))
	t := time.Now()
	errs := atOnce(len(pushers), func(i int) (err error) {
		if links[i], err = pushers[i].JoinPushGroup(jctx, g, i); err != nil {
			cancel() // the others wait for a member that will not come
		}
		return err
	})
	for i, err := range errs {
		if err != nil {
			who := "the trainer"
			if i > 0 {
				who = fmt.Sprintf("rollout replica %d", i)
			}
			folder("the push group at %s could not be made: %s: %v", g.InitMethod, who, err)
			return
		}
	}
	pg := &pushGroup{g: g, rank: map[engines.Engine]int{}, restarts: restartsOf(r.trainer)}
	for i, e := range reps {
		pg.rank[e] = i + 1
	}
	r.mu.Lock()
	r.group = pg
	r.mu.Unlock()
	r.logf("policy %q: its trainer and %d rollout replicas joined push group %s at %s in %.3fs (links from the trainer: "+
		"%s); weights are pushed by broadcast", r.policy, len(reps), g.Name, g.InitMethod, time.Since(t).Seconds(), describeLinks(links[0]))
}

// describeLinks names the trainer's link to each replica: "rank 1 nccl, rank 2 cuda-ipc".
func describeLinks(links []string) string {
	var out []string
	for i, l := range links {
		if i > 0 {
			if l == "" {
				l = "?"
			}
			out = append(out, fmt.Sprintf("rank %d %s", i, l))
		}
	}
	return strings.Join(out, ", ")
}

// restartsOf is how many times an engine's worker has restarted (0 for one that does not say).
func restartsOf(e engines.Engine) int {
	if rs, ok := e.(interface{ Restarts() int }); ok {
		return rs.Restarts()
	}
	return 0
}

// freePort is a TCP port free on host now.
func freePort(host string) (int, error) {
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// broadcast pushes the trainer's weights to rep through the push group: the trainer's send and
// the replica's receive at once. It returns the trainer's part (its bytes and link, the seconds
// of the slower worker), and false when rep is in no group.
func (r *replicas) broadcast(ctx context.Context, rep engines.Engine, v int) (engines.PushStats, bool, error) {
	var none engines.PushStats
	r.mu.Lock()
	pg := r.group
	r.mu.Unlock()
	if pg == nil {
		return none, false, nil
	}
	peer, ok := pg.rank[rep]
	if !ok {
		return none, false, nil // a replica opened after the group was made
	}
	if n := restartsOf(r.trainer); n != pg.restarts {
		return none, true, fmt.Errorf("the trainer's worker restarted (a new process is in no push group)")
	}
	var sent, got engines.PushStats
	var errSend, errRecv error
	var wg sync.WaitGroup
	pctx, cancel := context.WithCancel(ctx)
	defer cancel()
	wg.Add(2)
	go func() {
		defer wg.Done()
		if sent, errSend = r.trainer.(engines.WeightsPusher).PushWeights(pctx, pg.g.Name, peer, v); errSend != nil {
			cancel()
		}
	}()
	go func() {
		defer wg.Done()
		if got, errRecv = rep.(engines.WeightsPusher).PushWeights(pctx, pg.g.Name, peer, v); errRecv != nil {
			cancel()
		}
	}()
	wg.Wait()
	if errSend != nil || errRecv != nil {
		return none, true, fmt.Errorf("the trainer: %v; the replica: %v", errSend, errRecv)
	}
	if sent.Bytes != got.Bytes {
		return none, true, fmt.Errorf("the trainer sent %d bytes, the replica took %d", sent.Bytes, got.Bytes)
	}
	sent.Seconds = max(sent.Seconds, got.Seconds)
	return sent, true, nil
}

// KeepVersion pushes the trainer's current weights into a free replica (opened when none is).
func (r *replicas) KeepVersion(ctx context.Context, v int) error {
	r.mu.Lock()
	var rep engines.Engine
	if n := len(r.free); n > 0 {
		rep, r.free = r.free[n-1], r.free[:n-1]
	}
	r.mu.Unlock()
	if rep == nil {
		var err error
		if rep, err = r.open(ctx); err != nil {
			return fmt.Errorf("opening a rollout replica: %w", err)
		}
		r.mu.Lock()
		r.all = append(r.all, rep)
		n, grouped := len(r.all), r.group != nil
		r.mu.Unlock()
		r.logf("policy %q: rollout replica %d opened (rollout.max_staleness: it holds one weights version)", r.policy, n)
		if grouped {
			r.logf("policy %q: rollout replica %d is not in the push group made before it opened: its weights go through a folder", r.policy, n)
		}
	}
	t := time.Now()
	st, grouped, err := r.broadcast(ctx, rep, v)
	if grouped {
		d := time.Since(t)
		r.mu.Lock()
		if err == nil {
			gb := float64(st.Bytes) / 1e9
			r.keep(v, rep, d, gb)
			r.mu.Unlock()
			r.logf("policy %q: weights version %d pushed to its rollout replica by broadcast in %.6fs (%.6g GB: %.6f s/GB; %s, %.6fs in the workers)",
				r.policy, v, d.Seconds(), gb, d.Seconds()/max(gb, 1e-12), st.Link, st.Seconds)
			return nil
		}
		// A group that failed once is not trusted again (a member may still wait in it).
		r.group = nil
		r.mu.Unlock()
		r.logf("policy %q: pushing weights version %d by broadcast failed, so it and the later versions go through a folder: %v", r.policy, v, err)
	}
	dir := filepath.Join(r.dir, strconv.Itoa(v))
	os.RemoveAll(dir)
	defer os.RemoveAll(dir)
	t = time.Now()
	err = r.trainer.Save(ctx, dir)
	saved := treeSize(dir)
	if err == nil {
		// A replica never trains: the trainer's optimizer state stays out of it.
		dropOptimizerFiles(dir)
		err = rep.Load(ctx, dir)
	}
	d := time.Since(t)
	r.mu.Lock()
	defer r.mu.Unlock()
	if err != nil {
		r.free = append(r.free, rep)
		return fmt.Errorf("pushing weights version %d to a rollout replica through %s: %w", v, dir, err)
	}
	gb := float64(treeSize(dir)) / 1e9
	r.keep(v, rep, d, gb)
	r.logf("policy %q: weights version %d pushed to its rollout replica in %.3fs (%.3f GB of model loaded, "+
		"%.3f GB saved with the optimizer state: %.3f s/GB saved and loaded)", r.policy, v, d.Seconds(), gb, float64(saved)/1e9, d.Seconds()/max(gb, 1e-9))
	return nil
}

// keep records rep as the holder of version v, pushed in d (gb of weights); called with r.mu held.
func (r *replicas) keep(v int, rep engines.Engine, d time.Duration, gb float64) {
	if old := r.kept[v]; old != nil && old != rep {
		r.free = append(r.free, old)
	}
	if r.kept == nil {
		r.kept = map[int]engines.Engine{}
	}
	r.kept[v] = rep
	r.pushes++
	r.pushDur += d
	r.pushGB += gb
}

func (r *replicas) replica(v int) (engines.Engine, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	rep := r.kept[v]
	if rep == nil {
		return nil, fmt.Errorf("no rollout replica holds weights version %d", v)
	}
	return rep, nil
}

// GenerateVersion samples from the replica holding version v.
func (r *replicas) GenerateVersion(ctx context.Context, v int, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	rep, err := r.replica(v)
	if err != nil {
		return nil, err
	}
	return rep.Generate(ctx, reqs)
}

// ScoreVersion scores with the replica holding version v.
func (r *replicas) ScoreVersion(ctx context.Context, v int, reqs []engines.ScoreRequest) ([]engines.Scores, error) {
	rep, err := r.replica(v)
	if err != nil {
		return nil, err
	}
	return rep.Score(ctx, reqs)
}

// SaveVersion has the replica holding version v save it.
func (r *replicas) SaveVersion(ctx context.Context, v int, dir string) error {
	rep, err := r.replica(v)
	if err != nil {
		return err
	}
	return rep.Save(ctx, dir)
}

// DropVersions frees the replicas of the versions below v for later versions.
func (r *replicas) DropVersions(ctx context.Context, below int) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	for v, rep := range r.kept {
		if v < below {
			r.free = append(r.free, rep)
			delete(r.kept, v)
		}
	}
	return nil
}

// pushRate is the mean time of a push per GB so far (0 before the first).
func (r *replicas) pushRate() float64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.pushGB == 0 {
		return 0
	}
	return r.pushDur.Seconds() / r.pushGB
}

// Close closes the replicas.
func (r *replicas) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	var errs []error
	for _, rep := range r.all {
		errs = append(errs, rep.Close())
	}
	r.all, r.free, r.kept = nil, nil, nil
	return errors.Join(errs...)
}

// treeSize is the total size of the files under dir.
func treeSize(dir string) int64 {
	var n int64
	filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			if info, err := d.Info(); err == nil {
				n += info.Size()
			}
		}
		return nil
	})
	return n
}

// dropOptimizerFiles removes the optimizer state a model folder may hold (optimizer.pt of a
// torch worker, optimizer.* and adapter_optimizer.* of the tiny engine).
func dropOptimizerFiles(dir string) {
	for _, pat := range []string{"optimizer*", "adapter_optimizer*"} {
		files, _ := filepath.Glob(filepath.Join(dir, pat))
		for _, f := range files {
			os.RemoveAll(f)
		}
	}
}
