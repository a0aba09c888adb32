package host

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/script"
)

// Resume. A stopped run goes on from one of its checkpoints as if it had never stopped: Resume
// finds the checkpoint (the newest valid one of a run folder, or the folder given), settles the
// script and the config to load (the checkpoint's own, its relative paths taken from the
// directory the run started in), loads the run with them and restores it: the policies' engine
// states and the weights versions the next steps generate from, the `state` store, the step
// counter and the data position. What the stopped run wrote after the checkpoint (metrics and
// rollouts lines, later checkpoints, stray temporary folders) is dropped, since the resumed run
// redoes those steps.

// Resume loads a stopped run again and restores it. from is its run directory (its newest valid
// checkpoint is taken; newer ones that fail verification are reported in the run's log and
// removed as the run goes on) or one of its checkpoints/step_N folders. scriptPath "" is the script
// the checkpoint recorded, found from any working directory (resumeScript). opts.Config nil is the
// checkpoint's own config, its relative paths taken from the directory the run started in (which
// run.json records), then opts.ConfigOverride applied to it; opts.Out "" is the run directory the
// checkpoint belongs to. The run then goes on at the step after the checkpoint's. A checkpoint
// that cannot be found or read, and a config or script that does not load, are ScriptErrors.
func Resume(ctx context.Context, from, scriptPath string, opts Options) (*Run, error) {
	plan, err := planResume(from, scriptPath, &opts)
	if err != nil {
		return nil, err
	}
	r, err := Load(ctx, plan.script, opts)
	if err != nil {
		var se *ScriptError
		if !errors.As(err, &se) {
			err = script.Errorf("%w", err)
		}
		return nil, err
	}
	plan.tell(r.events, opts.Relocate)
	if err := r.restore(ctx, plan.ckpt); err != nil {
		r.events.filef("stop: the resume from %s failed: %v", plan.ckpt, err)
		r.Close()
		return nil, err
	}
	r.opts.resuming = false // the engines hold the checkpoint's state now
	return r, nil
}

// resumePlan is what Resume settles before it loads the run: the checkpoint and the script, and
// what it says once the run's events.log is open.
type resumePlan struct {
	ckpt       string   // the checkpoint folder
	script     string   // the script to run
	scriptNote string   // which copy of the script runs; "" for the file the checkpoint recorded
	skipped    []error  // newer checkpoints that failed verification, newest first
	moved      []string // what Options.Relocate changed in the checkpoint's config
}

// planResume finds the checkpoint from names and the script to run (scriptPath, or the one the
// checkpoint recorded), and fills in opts for loading the run from it: the run directory, the
// directory the run started in and, unless given, the checkpoint's config.
func planResume(from, scriptPath string, opts *Options) (resumePlan, error) {
	ckpt, skipped, err := FindCheckpoint(from)
	if err != nil {
		return resumePlan{}, script.Errorf("%w", err)
	}
	info, err := readRunInfo(ckpt)
	if err != nil {
		return resumePlan{}, script.Errorf("%w", err)
	}
	plan := resumePlan{ckpt: ckpt, script: scriptPath, skipped: skipped}
	if scriptPath == "" {
		plan.script, plan.scriptNote = resumeScript(ckpt, info, opts.FS != nil)
	}
	if opts.Out == "" {
		opts.Out = runDirOf(ckpt)
	}
	opts.workDir, opts.resuming = info.Dir, true
	if opts.Config == nil {
		if plan.moved, err = resumeConfig(opts, ckpt, info.Dir); err != nil {
			return resumePlan{}, err
		}
	}
	return plan, nil
}

// resumeConfig sets opts.Config to the config of the checkpoint ckpt, moved to opts.Relocate's
// engines, its relative paths taken from dir (the directory the run started in), then
// opts.ConfigOverride applied; it returns what opts.Relocate changed.
func resumeConfig(opts *Options, ckpt, dir string) (moved []string, err error) {
	ckptConfig := filepath.Join(ckpt, "config.yaml")
	if opts.Config, err = config.Load(ckptConfig); err != nil {
		return nil, script.Errorf("%w", err)
	}
	if opts.Relocate != nil {
		if moved, err = relocate(opts.Config, opts.Relocate); err != nil {
			return nil, script.Errorf("resume: %w", err)
		}
	}
	if opts.FS == nil {
		// Before the command line's changes, which are relative to here; and so for every
		// version of the checkpoint's config a reload reads (--watch on a resumed run).
		rebasePaths(opts.Config, dir)
		override := opts.ConfigOverride
		opts.ConfigOverride = func(c *config.Config) error {
			if c.File == ckptConfig {
				rebasePaths(c, dir)
			}
			if override != nil {
				return override(c)
			}
			return nil
		}
	}
	if opts.ConfigOverride != nil {
		if err := opts.ConfigOverride(opts.Config); err != nil {
			return nil, script.Errorf("%w", err)
		}
	}
	opts.Config.Run.Out = opts.Out
	return moved, nil
}

// tell says in events what the resume chose on the way: the copy of the script it runs, what
// relocation (Options.Relocate) changed, and the newer checkpoints it skipped.
func (p resumePlan) tell(events *eventLog, relocation *config.Config) {
	if p.scriptNote != "" {
		events.printf("resume: %s", p.scriptNote)
	}
	if relocation != nil && len(p.moved) == 0 {
		events.printf("resume: --config %s: the engines live where the checkpoint's config says; nothing changed", relocation.File)
	}
	for _, c := range p.moved {
		events.printf("resume: --config %s: %s", relocation.File, c)
	}
	for _, bad := range p.skipped {
		events.printf("warning: %v", bad)
	}
	if len(p.skipped) > 0 {
		events.printf("warning: resuming from %s, the newest valid checkpoint; the newer ones above are removed when the run goes on", p.ckpt)
	}
}

// FindCheckpoint resolves --resume. path is a checkpoint folder (checkpoints/step_N), which must
// verify: if it does not, the error says what is wrong and names the previous valid checkpoint.
// Or path is a run directory (or its checkpoints folder), whose newest valid checkpoint is taken:
// skipped describes each newer checkpoint that failed verification, newest first, for the caller
// to warn about.
func FindCheckpoint(path string) (dir string, skipped []error, err error) {
	if _, err := os.Stat(path); errors.Is(err, fs.ErrNotExist) {
		msg := fmt.Sprintf("resume %s: it does not exist (give a run folder or one of its checkpoints/step_N)", path)
		if parent := filepath.Dir(filepath.Clean(path)); filepath.Base(parent) == "checkpoints" {
			var names []string
			for _, s := range checkpointSteps(parent) {
				names = append(names, stepName(s))
			}
			if len(names) > 0 {
				msg += fmt.Sprintf("; %s holds %s", parent, strings.Join(names, ", "))
			}
		}
		return "", nil, errors.New(msg)
	}
	if _, err := os.Stat(filepath.Join(path, runFile)); err == nil || strings.HasPrefix(filepath.Base(filepath.Clean(path)), "step_") {
		if err := VerifyCheckpoint(path); err != nil {
			return "", nil, withPrevious(err, filepath.Dir(filepath.Clean(path)), path)
		}
		return path, nil, nil
	}
	root := filepath.Join(path, "checkpoints")
	if filepath.Base(filepath.Clean(path)) == "checkpoints" {
		root = path
	}
	steps := checkpointSteps(root)
	if len(steps) == 0 {
		return "", nil, fmt.Errorf("resume %s: there are no checkpoints in %s (a run writes one when it ends or stops on a "+
			"signal, and every run.save_interval steps)", path, root)
	}
	for _, s := range steps {
		d := filepath.Join(root, stepName(s))
		if err := VerifyCheckpoint(d); err != nil {
			skipped = append(skipped, err)
			continue
		}
		return d, skipped, nil
	}
	return "", skipped, fmt.Errorf("resume %s: none of its %d checkpoints is valid:\n%w", path, len(steps), errors.Join(skipped...))
}

// withPrevious adds the newest valid checkpoint older than bad to err.
func withPrevious(err error, root, bad string) error {
	badStep, _ := strconv.Atoi(strings.TrimPrefix(filepath.Base(filepath.Clean(bad)), "step_"))
	for _, s := range checkpointSteps(root) {
		dir := filepath.Join(root, stepName(s))
		if s < badStep && VerifyCheckpoint(dir) == nil {
			return fmt.Errorf("%w\nresume from the previous checkpoint instead: --resume %s", err, dir)
		}
	}
	return fmt.Errorf("%w\nno earlier valid checkpoint was found", err)
}

// resumeScript picks the script a resumed run executes when none is given. That is the file the
// checkpoint recorded, its path taken from the directory the run started in, so that a run resumes
// from any working directory; if that file is gone (or the checkpoint predates run.json's dir and
// the path does not resolve from here), the copy the run directory keeps of the version the
// checkpoint ran (scripts/step_N-HASH/, with every file it loaded), else the checkpoint's
// script.star. note says which copy was taken, "" for the file itself. inFS: the script is a path
// in Options.FS, taken as recorded.
func resumeScript(ckpt string, info runInfo, inFS bool) (path, note string) {
	path = info.Script
	if inFS {
		return path, ""
	}
	if !filepath.IsAbs(path) && info.Dir != "" {
		path = filepath.Join(info.Dir, path)
	}
	if st, err := os.Stat(path); err == nil && st.Mode().IsRegular() {
		return path, ""
	}
	saved := filepath.Join(ckpt, "script.star")
	if len(info.ScriptHash) >= 12 {
		matches, _ := filepath.Glob(filepath.Join(runDirOf(ckpt), "scripts", "step_*-"+info.ScriptHash[:12], filepath.Base(info.Script)))
		if len(matches) > 0 {
			saved = matches[0] // every such folder holds the same files: the hash covers them
		}
	}
	return saved, fmt.Sprintf("the script %s cannot be read from here; running the copy the run kept of the version the checkpoint ran, %s", path, saved)
}

// rebasePaths makes the config's relative local paths relative to dir, the working directory the
// run started in, so that a resumed run reads the same files from anywhere. Those paths are the
// data, eval datasets, the models, load and save folders and TLS files of engines on this machine.
// Names with a scheme (builtin:, synthetic:) stay; so do a remote engine's folders, which are paths
// on its server. dir "" changes nothing.
func rebasePaths(c *config.Config, dir string) {
	if dir == "" {
		return
	}
	fix := func(p *string) {
		if *p != "" && !filepath.IsAbs(*p) && !strings.Contains(*p, ":") {
			*p = filepath.Join(dir, *p)
		}
	}
	fix(&c.Data.Path)
	for i := range c.Eval.Datasets {
		fix(&c.Eval.Datasets[i].Path)
	}
	for i := range c.Policies {
		p := &c.Policies[i]
		if t := p.Engine.TLS; t != nil {
			fix(&t.CA)
			fix(&t.Cert)
			fix(&t.Key)
		}
		if offHost(*p) {
			continue
		}
		for _, f := range []*string{&p.HFCheckpoint, &p.Load, &p.Save, &p.RefLoad, &p.Engine.ModelPath, &p.Train.ModelArgsPath} {
			fix(f)
		}
	}
}

// runDirOf is the run directory a checkpoint folder belongs to.
func runDirOf(checkpoint string) string { return filepath.Dir(filepath.Dir(checkpoint)) }

// restore puts back a run loaded with the checkpoint's config (Resume does both): engines, state
// and the step counter. Its engine state wins over a policy's load: folder (the engine opened on load:, then
// loads the checkpoint). Then what the stopped run wrote after the checkpoint is dropped: metrics
// lines of later steps, later checkpoints in the run directory (they belong to steps this run
// will redo), and stray temporary folders of interrupted writes.
func (r *Run) restore(ctx context.Context, dir string) error {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return err
	}
	m, info, err := openCheckpoint(dir, r.vers.staleness())
	if err != nil {
		return err
	}
	if err := r.ckpt.loadPolicies(ctx, dir, m, r.pols.list(), &r.vers, r.step); err != nil {
		return err
	}
	st, err := readState(dir)
	if err != nil {
		return err
	}
	r.state.Restore(st.Snapshot())
	r.step, r.next = info.Step, info.nextTask(r.Config().Rollout.BatchSize)
	if info.ScriptHash != r.script.Hash {
		r.events.printf("resume: the script differs from the checkpoint's version %s; the run goes on with version %s", short(info.ScriptHash), short(r.script.Hash))
	}
	if err := r.forgetAfter(dir, info.Step); err != nil {
		return err
	}
	r.ckpt.resumed(dir, info.Step)
	r.events.printf("resume: from %s at step %d", dir, info.Step)
	return nil
}

// openCheckpoint verifies the checkpoint folder dir (absolute) and reads its manifest and
// run.json, for a run whose rollout.max_staleness is staleness: the checkpoint must hold the
// weights versions the steps after it generate from.
func openCheckpoint(dir string, staleness int) (manifest, runInfo, error) {
	m, err := readManifest(dir)
	if err != nil {
		return m, runInfo{}, err
	}
	info, err := readRunInfo(dir)
	if err != nil {
		return m, info, err
	}
	if staleness > info.MaxStaleness && info.Step > 0 {
		return m, info, fmt.Errorf("resume: checkpoint %s was written with rollout.max_staleness %d and the run now has %d: "+
			"the checkpoint holds the weights versions its next steps generate from under %d only; "+
			"resume with rollout.max_staleness at most %d", dir, info.MaxStaleness, staleness, info.MaxStaleness, info.MaxStaleness)
	}
	return m, info, nil
}

// nextTask is the data position after the checkpoint: the index of the first task of the next
// step, at batchSize tasks a step for checkpoints that predate its record.
func (info runInfo) nextTask(batchSize int) int {
	if info.NextTask != nil {
		return *info.NextTask
	}
	return info.Step * batchSize
}

// loadPolicies has the engine of every trainable policy of pols load its state from the
// checkpoint dir with manifest m, over the weights versions vers puts back first (done: the steps
// the run has completed).
func (c *checkpoints) loadPolicies(ctx context.Context, dir string, m manifest, pols []*policy, vers *versionKeeper, done int) error {
	for _, p := range pols {
		if !p.cfg.Trainable {
			continue
		}
		if err := vers.restore(ctx, pols, done, dir, p); err != nil {
			return err
		}
		if ext, ok := m.External[p.name]; ok {
			if err := c.loadExternal(ctx, dir, p, ext); err != nil {
				return err
			}
			continue
		}
		if !m.holds(p.name) {
			return fmt.Errorf("resume: checkpoint %s holds no state for policy %q (it was frozen or not yet used when the "+
				"checkpoint was written); resume with the config the checkpoint was written with (its config.yaml)", dir, p.name)
		}
		if err := p.eng.Load(ctx, filepath.Join(dir, p.name)); err != nil {
			return fmt.Errorf("resume: policy %q: its engine could not load %s: %w", p.name, filepath.Join(dir, p.name), err)
		}
	}
	return nil
}

// readState reads the `state` store of the checkpoint dir.
func readState(dir string) (*script.State, error) {
	sb, err := os.ReadFile(filepath.Join(dir, stateFile))
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", dir, err)
	}
	st := script.NewState()
	if err := script.DecodeState(sb, st); err != nil {
		return nil, fmt.Errorf("checkpoint %s: %s: %w", dir, stateFile, err)
	}
	return st, nil
}

// forgetAfter drops what the stopped run wrote of the steps after step, those of the checkpoint
// dir it resumes from: their metrics and rollouts lines. Steps up to it that metrics.jsonl lacks
// are said once.
func (r *Run) forgetAfter(dir string, step int) error {
	if err := r.metrics.truncateAfter(step); err != nil {
		return err
	}
	if err := r.rec.truncateAfter(step); err != nil {
		return err
	}
	if missing, err := r.metrics.missingSteps(step); err != nil {
		return err
	} else if len(missing) > 0 {
		r.events.printf("warning: metrics: %s has no lines for step %s of the %d steps checkpoint %s holds (lost, "+
			"or cut by hand); the run goes on from step %d, and those steps stay missing from its metrics",
			r.metrics.f.Name(), stepRanges(missing), step, dir, step+1)
	}
	return nil
}

// loadExternal loads a policy's state that its remote engine saved on its own disk.
func (c *checkpoints) loadExternal(ctx context.Context, dir string, p *policy, ext externalState) error {
	if _, err := os.Stat(ext.Dir); err == nil {
		// This host sees the folder: check it before the engine is asked to load it.
		if !hasFiles(ext.Dir) {
			return fmt.Errorf("resume: checkpoint %s: policy %q's state should be in %s (saved by its engine at %s), "+
				"but that folder is empty; resume from an earlier checkpoint", dir, p.name, ext.Dir, ext.Address)
		}
	} else {
		c.events.printf("resume: policy %q: its state is in %s on the engine server %s, which this host cannot see; the engine loads it", p.name, ext.Dir,
			ext.Address)
	}
	if err := p.eng.Load(ctx, ext.Dir); err != nil {
		return fmt.Errorf("resume: policy %q: its engine at %s could not load %s, the folder on the server's disk where %s "+
			"says its state was saved: %w\nrestore that folder on the server (or point the policy at "+
			"the server that saved it), or resume from an earlier checkpoint",
			p.name, p.cfg.Engine.Address, ext.Dir, filepath.Join(dir, manifestFile), err)
	}
	return nil
}

// resumed notes that the run resumed at step from dir, a checkpoint folder (the folder's own or
// another run's), and clears the folder: the checkpoints of later steps and stray temporary
// folders of interrupted writes.
func (c *checkpoints) resumed(dir string, step int) {
	if c.out == "" {
		return
	}
	root, err := c.root()
	if err != nil {
		return
	}
	c.removeLater(root, step)
	c.removeStrays(root)
	c.cleaned = true
	c.have, c.step = filepath.Join(root, stepName(step)) == dir, step
}

// removeLater removes the checkpoints of steps after step: the run goes on from step and will
// write its own.
func (c *checkpoints) removeLater(root string, step int) {
	for _, s := range checkpointSteps(root) {
		if s <= step {
			continue
		}
		d := filepath.Join(root, stepName(s))
		if err := os.RemoveAll(d); err != nil {
			c.events.printf("resume: could not remove %s, a checkpoint of a later step than the one resumed from: %v; remove it by hand", d, err)
			continue
		}
		c.events.printf("resume: removed %s, a checkpoint of a later step than the one resumed from (its metrics lines were dropped too; the run writes its own)", d)
	}
}

func short(h string) string { return h[:min(12, len(h))] }
