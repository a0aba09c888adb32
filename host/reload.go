package host

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"time"

	"github.com/fsnotify/fsnotify"

	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/script"
)

// Hot reload (`slimen exec --watch`, docs/host.md). The host watches the script, every file it
// loaded and the config. A changed script is loaded (parsed, resolved, top level executed) as
// soon as it is saved, so a broken edit is reported at once; a good version is swapped in at the
// next step boundary. Engines, buffers, optimizer state, `state` and the step counter stay. The
// last good version keeps running while the new one is broken.
//
// Correctness does not hang on file events: at every step boundary the host also compares the
// watched files' contents with the running version, so a change saved just before a step starts
// is never missed; events only make errors show up early.

type reloader struct {
	mu         sync.Mutex
	scriptPath string
	cfgPath    string
	rejected   string // hash of the last version found broken (reported once)
	// previous is the version a swap replaced, kept while the new one runs its first step (at
	// swappedAt): if too many of that step's rollouts fail, the run goes back to it.
	previous   *script.Script
	swappedAt  int
	failed     string         // Hash of a version rolled back after its first step: not swapped in again
	pending    *script.Script // a good new version waiting for the step boundary
	pendingCfg *config.Config // a good new config waiting for the step boundary
	cfgHash    string
	override   func(*config.Config) error // the command line's overrides, applied to every reloaded config
	watcher    *fsnotify.Watcher
}

// Watch starts watching the script, the files it loaded and the config (cfgPath, "" for none)
// until the run is closed. Changes take effect at step boundaries.
func (r *Run) Watch(cfgPath string) error {
	if r.opts.FS != nil {
		return errors.New("watch: the script was read from Options.FS; only files on disk can be watched")
	}
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("watch: %w", err)
	}
	r.reload = &reloader{scriptPath: r.script.Path, cfgPath: cfgPath, override: r.opts.ConfigOverride, watcher: w}
	if cfgPath != "" {
		r.reload.cfgHash, _ = hashFiles([]string{cfgPath})
	}
	r.watchDirs()
	go func() {
		defer w.Close()
		var burst <-chan time.Time
		for {
			select {
			case <-r.ctx.Done():
				return
			case _, ok := <-w.Events:
				if !ok {
					return
				}
				// Editors save by writing a temporary file and renaming it: wait for the burst to end.
				burst = time.After(150 * time.Millisecond)
			case err, ok := <-w.Errors:
				if !ok {
					return
				}
				r.events.printf("watch: %v", err)
			case <-burst:
				burst = nil
				r.checkReload()
			}
		}
	}()
	r.events.printf("watching %s and %d loaded files for changes", r.script.Path, len(r.script.Files)-1)
	return nil
}

// watchDirs watches the parent folders of every file of the running version and the config.
func (r *Run) watchDirs() {
	dirs := map[string]bool{}
	for _, f := range append(append([]string(nil), r.script.Files...), r.reload.cfgPath) {
		if f != "" {
			dirs[filepath.Dir(f)] = true
		}
	}
	for d := range dirs {
		if err := r.reload.watcher.Add(d); err != nil {
			r.events.printf("watch %s: %v", d, err)
		}
	}
}

func hashFiles(files []string) (string, error) {
	return script.HashFiles(files, os.ReadFile)
}

// checkReload loads the script or config again if their files changed since the running (or
// pending) version, keeping a good version pending and reporting a broken one.
func (r *Run) checkReload() {
	rl := r.reload
	rl.mu.Lock()
	defer rl.mu.Unlock()
	current := r.script
	if rl.pending != nil {
		current = rl.pending
	}
	if h, err := hashFiles(current.Files); err != nil || h != current.Hash {
		s, err := script.Load(rl.scriptPath, r.scriptOptions(r.sandbox != nil))
		if err == nil && r.sandbox == nil {
			// The checks of `slimen check --config`: a version that names a policy the run
			// does not have would fail every rollout.
			var cfg *config.Config
			if !r.zero {
				cfg = r.Config()
			}
			problems, _ := script.LintScript(s, cfg)
			if r.zero {
				// With no config a new name is a new model: refuse the typo that would leave
				// the trained one idle, as the config refuses an unknown name.
				problems = append(problems, script.RenamedPolicies(script.PolicyUses(s), r.pols.names())...)
			}
			if len(problems) > 0 {
				err = errors.New(strings.Join(problems, "\n"))
			}
		}
		switch {
		case err == nil && s.Hash == rl.failed:
			// The version rolled back after its first step: wait for another edit.
		case err != nil:
			// A broken version: report it once, keep running the last good one.
			if h != rl.rejected {
				rl.rejected = h
				r.events.printf("reload: %s is broken; the run keeps version %s:\n%s", rl.scriptPath, r.script.Hash[:12], indent(err.Error()))
			}
		case s.Hash != current.Hash:
			rl.pending = s
			r.events.printf("reload: %s version %s is valid; it takes over at the next step", rl.scriptPath, s.Hash[:12])
		}
	}
	if rl.cfgPath == "" {
		return
	}
	h, err := hashFiles([]string{rl.cfgPath})
	if err != nil || h == rl.cfgHash {
		return
	}
	rl.cfgHash = h
	c, err := config.Load(rl.cfgPath)
	if err == nil && rl.override != nil {
		// The reloaded file gets the command line's overrides, as the first one did.
		err = rl.override(c)
	}
	if err != nil {
		r.events.printf("reload: %s is invalid; the run keeps its config:\n%s", rl.cfgPath, indent(err.Error()))
		return
	}
	if r.zero && len(c.Policies) == 0 {
		// A config that lists no policies leaves them to the script: keep those it created.
		c.Policies = append([]config.PolicyConfig(nil), r.Config().Policies...)
	}
	if why := needsNewEngine(r.Config(), c); why != "" {
		r.events.printf("reload: %s changes %s, which needs a new engine; restart the run to apply it (the run keeps its config)", rl.cfgPath, why)
		return
	}
	for _, pc := range c.Policies {
		p := r.pols.get(pc.Name)
		if p == nil {
			continue
		}
		if err := r.checkTIS(r.ctx, pc.Name, pc, p.eng); err != nil {
			r.events.printf("reload: %s: %v (the run keeps its config)", rl.cfgPath, err)
			return
		}
	}
	rl.pendingCfg = c
	r.events.printf("reload: %s is valid; its new settings take over at the next step", rl.cfgPath)
}

// needsNewEngine names a change that a running engine cannot take ("" if none): policies added,
// removed or renamed, another checkpoint, engine settings, trainability or buffer mode.
func needsNewEngine(old, new *config.Config) string {
	if len(old.Policies) != len(new.Policies) {
		return "the list of policies"
	}
	for i, p := range old.Policies {
		q := new.Policies[i]
		switch {
		case p.Name != q.Name:
			return fmt.Sprintf("policy %q (now %q)", p.Name, q.Name)
		case p.HFCheckpoint != q.HFCheckpoint:
			return fmt.Sprintf("policies[%s].hf_checkpoint", p.Name)
		case !reflect.DeepEqual(p.Engine, q.Engine):
			return fmt.Sprintf("policies[%s].engine", p.Name)
		case p.Trainable != q.Trainable:
			return fmt.Sprintf("policies[%s].trainable", p.Name)
		case p.BufferMode != q.BufferMode:
			return fmt.Sprintf("policies[%s].buffer_mode", p.Name)
		}
	}
	if old.Data != new.Data {
		return "data"
	}
	if old.Rollout.MaxStaleness != new.Rollout.MaxStaleness {
		return "rollout.max_staleness"
	}
	return ""
}

// applyReload swaps in a pending script or config at a step boundary.
func (r *Run) applyReload(ctx context.Context, step int) error {
	if r.reload == nil {
		return nil
	}
	r.checkReload()
	rl := r.reload
	rl.mu.Lock()
	s, c := rl.pending, rl.pendingCfg
	rl.pending, rl.pendingCfg = nil, nil
	rl.mu.Unlock()
	if s != nil || c != nil {
		// Rollouts launched under the old version (rollout.max_staleness > 0) run again under
		// the new one: a reload takes effect from this step, as in the synchronous loop.
		r.async.discard("reload")
	}
	if s != nil {
		rl.mu.Lock() // checkReload reads the running version from the watcher's goroutine
		rl.previous, rl.swappedAt = r.script, step
		r.script = s
		rl.mu.Unlock()
		if r.sandbox != nil {
			r.sandbox.close() // children of the old version; new ones load the new one
		}
		r.watchDirs() // the new version may load new files
		if err := r.saveScriptVersion(step); err != nil {
			return err
		}
		r.events.printf("reload: script version %s runs from step %d", s.Hash[:12], step)
	}
	if c != nil {
		r.cfgMu.Lock()
		old := r.cfg
		c.Run.Out, c.File = old.Run.Out, old.File
		r.cfg = c
		r.cfgMu.Unlock()
		r.pols.reconfigure(c.Policies)
		if err := r.writeConfig(); err != nil {
			return err
		}
		r.events.printf("reload: config takes effect from step %d", step)
	}
	return nil
}

// saveScriptVersion keeps each accepted version in the run directory. script.star is the running
// main script, and scripts/step_N-HASH/ holds the version that started at step N — the main script
// and every file it loaded, at their paths relative to the main script's folder. HASH (the first
// 12 hex digits of Script.Hash) covers all of them.
func (r *Run) saveScriptVersion(step int) error {
	if r.opts.Out == "" {
		return nil
	}
	s := r.script
	dir := filepath.Join(r.opts.Out, "scripts", fmt.Sprintf("step_%d-%s", step, s.Hash[:12]))
	root, err := filepath.Abs(filepath.Dir(s.Path))
	if err != nil {
		return err
	}
	for _, f := range s.Files {
		src, ok := s.Sources[f]
		if !ok {
			return fmt.Errorf("script version %s: no source for %s", s.Hash[:12], f)
		}
		abs, err := filepath.Abs(f)
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, abs)
		if err != nil || !filepath.IsLocal(rel) {
			return fmt.Errorf("script version %s: %s is outside the script's folder %s", s.Hash[:12], f, root)
		}
		dst := filepath.Join(dir, rel)
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(dst, src, 0o644); err != nil {
			return err
		}
	}
	return os.WriteFile(filepath.Join(r.opts.Out, "script.star"), s.Source, 0o644)
}

// rollBack puts back the version a swap replaced when the new one's first step (step) failed
// too many rollouts; false if there is none to go back to.
func (r *Run) rollBack(step int, why error) bool {
	rl := r.reload
	if rl == nil {
		return false
	}
	rl.mu.Lock()
	prev := rl.previous
	if prev == nil || rl.swappedAt != step {
		rl.mu.Unlock()
		return false
	}
	bad := r.script
	r.script, rl.previous, rl.failed = prev, nil, bad.Hash
	rl.mu.Unlock()
	if r.sandbox != nil {
		r.sandbox.close() // children of the failed version
	}
	r.watchDirs()
	r.events.printf("reload: version %s failed its first step (step %d), so the run goes back to version %s and runs the "+
		"step again; edit the script to try another version:\n%s",
		bad.Hash[:12], step, prev.Hash[:12], indent(why.Error()))
	return true
}
