package host

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/slimen/slimen/engines"
)

// replicas give an engine that keeps no weights versions itself (a torch worker: one copy of
// the weights, trained in place) the engines.Versions of the asynchronous loop (async.go): each
// kept version lives in a rollout replica, another engine of the policy opened with its config
// (another worker process on the same device), which takes the trainer's weights through a
// folder: the trainer saves them (Engine.Save) and the replica loads them (Engine.Load). A
// replica is reused once its version is dropped, so a policy has at most K replicas.
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
	pushDur time.Duration          // their time, save and load
	pushGB  float64                // their size
}

var _ engines.Versions = (*replicas)(nil)

// prepare opens n replicas at once (each a worker process to start: their start-up overlaps).
func (r *replicas) prepare(ctx context.Context, n int) error {
	opened := make([]engines.Engine, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			opened[i], errs[i] = r.open(ctx)
		}()
	}
	wg.Wait()
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, e := range opened {
		if errs[i] == nil {
			r.all = append(r.all, e)
			r.free = append(r.free, e)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("opening rollout replicas: %w", err)
	}
	r.logf("policy %q: %d rollout replicas opened (rollout.max_staleness: each holds one weights version)", r.policy, n)
	return nil
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
		r.mu.Unlock()
		r.logf("policy %q: rollout replica %d opened (rollout.max_staleness: it holds one weights version)", r.policy, len(r.all))
	}
	dir := filepath.Join(r.dir, strconv.Itoa(v))
	os.RemoveAll(dir)
	defer os.RemoveAll(dir)
	t := time.Now()
	err := r.trainer.Save(ctx, dir)
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
	if old := r.kept[v]; old != nil {
		r.free = append(r.free, old)
	}
	if r.kept == nil {
		r.kept = map[int]engines.Engine{}
	}
	r.kept[v] = rep
	gb := float64(treeSize(dir)) / 1e9
	r.pushes++
	r.pushDur += d
	r.pushGB += gb
	r.logf("policy %q: weights version %d pushed to its rollout replica in %.3fs (%.3f GB of model loaded, %.3f GB saved with the optimizer state: %.3f s/GB saved and loaded)", r.policy, v, d.Seconds(), gb, float64(saved)/1e9, d.Seconds()/max(gb, 1e-9))
	return nil
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
