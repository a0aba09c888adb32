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

// reloader is a watched run's hot reload: the watcher, the version waiting for the step boundary,
// the one a swap replaced and the versions found broken. The run owns it (nil unless Watch was
// called) and swaps the versions in; the reloader loads and checks them, with the run's config
// getter, policies and events log, given at Watch.
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

	// What a new version is loaded and checked with: the run's.
	ctx        context.Context       // the run's: the watcher stops with it
	events     *eventLog             // where reloads and broken versions are said
	cfg        func() *config.Config // the running config
	pols       *policyTable          // the run's policies
	zero       bool                  // the run is zero-config: a new policy name is a new model
	scriptOpts script.Options        // how the run loads its script
	sandboxed  bool                  // rollouts run in sandbox children: a version is only parsed here
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
	r.reload = &reloader{scriptPath: r.script.Path, cfgPath: cfgPath, override: r.opts.ConfigOverride, watcher: w,
		ctx: r.ctx, events: r.events, cfg: r.Config, pols: &r.pols, zero: r.zero,
		scriptOpts: r.scriptOptions(r.sandbox != nil), sandboxed: r.sandbox != nil}
	if cfgPath != "" {
		r.reload.cfgHash, _ = hashFiles([]string{cfgPath})
	}
	r.reload.watch(r.script.Files)
	go r.reload.listen(r.checkReload)
	r.events.printf("watching %s and %d loaded files for changes", r.script.Path, len(r.script.Files)-1)
	return nil
}

// listen calls check once a burst of file events has ended, until the run's context ends; it
// closes the watcher then.
func (rl *reloader) listen(check func()) {
	w := rl.watcher
	defer w.Close()
	var burst <-chan time.Time
	for {
		select {
		case <-rl.ctx.Done():
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
			rl.events.printf("watch: %v", err)
		case <-burst:
			burst = nil
			check()
		}
	}
}

// watch watches the parent folders of files (those of the running version) and of the config.
func (rl *reloader) watch(files []string) {
	dirs := map[string]bool{}
	for _, f := range append(append([]string(nil), files...), rl.cfgPath) {
		if f != "" {
			dirs[filepath.Dir(f)] = true
		}
	}
	for d := range dirs {
		if err := rl.watcher.Add(d); err != nil {
			rl.events.printf("watch %s: %v", d, err)
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
	rl.checkScript(r.script)
	rl.checkConfig()
}

// checkScript loads the script again if its files changed since running, the version the run
// runs (or since the pending one): a good new version becomes pending, a broken one is reported
// once. The caller holds mu.
func (rl *reloader) checkScript(running *script.Script) {
	current := running
	if rl.pending != nil {
		current = rl.pending
	}
	h, err := hashFiles(current.Files)
	if err == nil && h == current.Hash {
		return
	}
	s, err := rl.load()
	switch {
	case err == nil && s.Hash == rl.failed:
		// The version rolled back after its first step: wait for another edit.
	case err != nil:
		// A broken version: report it once, keep running the last good one.
		if h != rl.rejected {
			rl.rejected = h
			rl.events.printf("reload: %s is broken; the run keeps version %s:\n%s", rl.scriptPath, running.Hash[:12], indent(err.Error()))
		}
	case s.Hash != current.Hash:
		rl.pending = s
		rl.events.printf("reload: %s version %s is valid; it takes over at the next step", rl.scriptPath, s.Hash[:12])
	}
}

// load loads the script's file again. In the run's own process it also gets the checks of
// `slimen check --config`: a version that names a policy the run does not have would fail every
// rollout.
func (rl *reloader) load() (*script.Script, error) {
	s, err := script.Load(rl.scriptPath, rl.scriptOpts)
	if err != nil || rl.sandboxed {
		return s, err
	}
	var cfg *config.Config
	if !rl.zero {
		cfg = rl.cfg()
	}
	problems, _ := script.LintScript(s, cfg)
	if rl.zero {
		// With no config a new name is a new model: refuse the typo that would leave
		// the trained one idle, as the config refuses an unknown name.
		problems = append(problems, script.RenamedPolicies(script.PolicyUses(s), rl.pols.names())...)
	}
	if len(problems) > 0 {
		return s, errors.New(strings.Join(problems, "\n"))
	}
	return s, nil
}

// checkConfig loads the config again if its file changed: one the running engines can take
// becomes pending, and why another cannot is reported. The caller holds mu.
func (rl *reloader) checkConfig() {
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
		rl.events.printf("reload: %s is invalid; the run keeps its config:\n%s", rl.cfgPath, indent(err.Error()))
		return
	}
	if rl.zero && len(c.Policies) == 0 {
		// A config that lists no policies leaves them to the script: keep those it created.
		c.Policies = append([]config.PolicyConfig(nil), rl.cfg().Policies...)
	}
	if why := needsNewEngine(rl.cfg(), c); why != "" {
		rl.events.printf("reload: %s changes %s, which needs a new engine; restart the run to apply it (the run keeps its config)", rl.cfgPath, why)
		return
	}
	if err := rl.checkEngines(c); err != nil {
		rl.events.printf("reload: %s: %v (the run keeps its config)", rl.cfgPath, err)
		return
	}
	rl.pendingCfg = c
	rl.events.printf("reload: %s is valid; its new settings take over at the next step", rl.cfgPath)
}

// checkEngines refuses config c if a policy's engine cannot train under it (checkTIS).
func (rl *reloader) checkEngines(c *config.Config) error {
	for _, pc := range c.Policies {
		p := rl.pols.get(pc.Name)
		if p == nil {
			continue
		}
		if err := checkTIS(rl.ctx, rl.cfg(), pc, p.eng); err != nil {
			return err
		}
	}
	return nil
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
	s, c := rl.take()
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
		rl.watch(r.script.Files) // the new version may load new files
		if err := saveScriptVersion(r.opts.Out, r.script, step); err != nil {
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

// take returns the pending script and config (nil for none) and clears them.
func (rl *reloader) take() (*script.Script, *config.Config) {
	rl.mu.Lock()
	defer rl.mu.Unlock()
	s, c := rl.pending, rl.pendingCfg
	rl.pending, rl.pendingCfg = nil, nil
	return s, c
}

// saveScriptVersion keeps s, a version the run accepted at step, in the run directory out ("" for
// none). script.star is the running main script, and scripts/step_N-HASH/ holds the version that
// started at step N — the main script and every file it loaded, at their paths relative to the
// main script's folder. HASH (the first 12 hex digits of Script.Hash) covers all of them.
func saveScriptVersion(out string, s *script.Script, step int) error {
	if out == "" {
		return nil
	}
	dir := filepath.Join(out, "scripts", fmt.Sprintf("step_%d-%s", step, s.Hash[:12]))
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
	return os.WriteFile(filepath.Join(out, "script.star"), s.Source, 0o644)
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
	rl.watch(r.script.Files)
	r.events.printf("reload: version %s failed its first step (step %d), so the run goes back to version %s and runs the "+
		"step again; edit the script to try another version:\n%s",
		bad.Hash[:12], step, prev.Hash[:12], indent(why.Error()))
	return true
}
