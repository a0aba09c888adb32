package host

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/script"
)

// Checkpoints. <out>/checkpoints/step_N/ holds what a run needs to go on as if it had
// never stopped:
//
//	<policy>/          each trainable policy's engine state (Engine.Save: HF folder + optimizer)
//	state.json         the `state` store
//	run.json           the step, the script's path and hash, the seed, the directory the run started in
//	config.yaml        the resolved config (with zero-config policies created on the way)
//	script.star        the running script version
//	MANIFEST.json      sha256 and size of every file above, and where the state of policies on
//	                   remote engines lives; written last
//
// Buffers need no saving: the loop is synchronous and on-policy, so they are empty between steps.
// RNG state needs none either: every seed is a function of the run seed, the step and the task.
// A checkpoint is written into a temporary folder (.step_N.tmp-*) and renamed into place when
// complete, so a crash during the write leaves at most a stray temporary folder, never a step_N
// that resume accepts; stray folders are removed at the next resume or checkpoint.
//
// Where engine state lives. tiny and torch engines write on this machine's disk: they save into
// the temporary folder and the host checks that files arrived, so their state is checksummed and
// renamed with the rest. A remote engine writes on its server's disk, which the host may not
// see: it saves straight into the final path <out>/checkpoints/step_N/<policy> (absolute), which
// no rename moves on the server. If that folder then shows up here (a shared file system, a
// server on this machine), the host moves it into the temporary folder and it is checksummed like
// the rest; otherwise the manifest names the policy and the folder under "external", and resume
// asks the engine to load it (checking it first when this host can see it).

const (
	manifestFile = "MANIFEST.json"
	runFile      = "run.json"
	stateFile    = "state.json"
	// saveMarker is written into a policy's save: folder with the step it holds (Megatron's name
	// for the file that says which iteration a save folder has).
	saveMarker = "latest_checkpointed_iteration.txt"
)

// tempName matches the host's own temporary folders in a checkpoints folder: a checkpoint being
// written (.step_N.tmp-*) and one set aside while its replacement is renamed in (.step_N.old-*).
// os.MkdirTemp puts decimal digits where the pattern has its star.
var tempName = regexp.MustCompile(`^\.step_[0-9]+\.(tmp|old)-[0-9]+$`)

type runInfo struct {
	Step int `json:"step"`
	// NextTask is the data position: the index of the first task of the next step. Checkpoints
	// written before it was recorded lack it; they were written at a fixed batch size.
	NextTask   *int   `json:"next_task,omitempty"`
	Script     string `json:"script"`
	ScriptHash string `json:"script_hash"`
	Seed       uint64 `json:"seed"`
	// Dir is the absolute working directory the run started in: the script's path and the
	// config's relative paths (data.path, …) are taken from it when the run resumes elsewhere.
	// Checkpoints written before it was recorded lack it.
	Dir string `json:"dir,omitempty"`
	// MaxStaleness is the run's rollout.max_staleness: the checkpoint holds the weights versions
	// (rollout_versions/) its next steps generate from under it.
	MaxStaleness int `json:"max_staleness,omitempty"`
}

type manifest struct {
	Files map[string]fileSum `json:"files"`
	// External are the policies whose engine saved its state where this host could not see it
	// (a remote engine's own disk); their files are not under Files.
	External map[string]externalState `json:"external,omitempty"`
}

type fileSum struct {
	SHA256 string `json:"sha256"`
	Size   int64  `json:"size"`
}

// externalState is a policy's engine state saved outside the checkpoint folder.
type externalState struct {
	Dir     string `json:"dir"`     // the folder the engine saved into, a path on its server
	Address string `json:"address"` // the engine server
}

// checkpoints is the run's checkpoints folder, <out>/checkpoints, and the policies' save: folders;
// the run owns it. It puts a checkpoint in place whole or not at all, keeps the newest
// run.keep_checkpoints, removes what interrupted writes left there, and remembers what the run
// wrote. Given the policies, it has their engines save into a checkpoint and load from one, and
// writes their save: folders. What else goes into a checkpoint is the run's (writeCheckpoint).
type checkpoints struct {
	out    string    // the run folder; "" for a run without one, which has no checkpoints
	events *eventLog // where the folder's changes are said

	have    bool // a complete checkpoint of step `step` is in place: this run wrote it or resumed from it
	step    int
	cleaned bool            // stray temporary folders were looked for
	told    map[string]bool // remote policies whose off-host state was explained in the events
	since   time.Time       // when the last checkpoint was written (or the run started)
}

// due reports whether run.save_minutes have passed since the last checkpoint.
func (c *checkpoints) due(minutes float64) bool {
	return minutes > 0 && !c.since.IsZero() && time.Since(c.since) >= time.Duration(minutes*float64(time.Minute))
}

func stepName(step int) string { return fmt.Sprintf("step_%d", step) }

// root is the absolute path of the checkpoints folder (the run has a directory).
func (c *checkpoints) root() (string, error) {
	return filepath.Abs(filepath.Join(c.out, "checkpoints"))
}

// Checkpoint writes <out>/checkpoints/step_N for the steps done so far, writes the save: folder
// of every trainable policy that has one, and keeps the newest run.keep_checkpoints checkpoints.
// A step whose checkpoint this run already wrote (or resumed from) is not written again: the
// complete checkpoint in place is never replaced.
func (r *Run) Checkpoint(ctx context.Context) (string, error) {
	step := r.step
	final, wrote, err := r.ckpt.put(step, r.Config().Run.KeepCheckpoints, func(final, tmp string) error {
		return r.writeCheckpoint(ctx, step, final, tmp)
	})
	if err != nil || !wrote {
		return final, err
	}
	return final, r.ckpt.writeSaveFolders(ctx, r.pols.list(), step)
}

// put puts the checkpoint of step in place: fill writes everything of it into tmp, the folder
// that is renamed to final once complete; then the newest keep checkpoints are kept (keep <= 0:
// all). wrote is false when the complete checkpoint of step that the run wrote (or resumed from)
// is in place already: it is never replaced.
func (c *checkpoints) put(step, keep int, fill func(final, tmp string) error) (final string, wrote bool, err error) {
	if c.out == "" {
		return "", false, errors.New("checkpoint: the run has no directory")
	}
	root, err := c.root()
	if err != nil {
		return "", false, err
	}
	final = filepath.Join(root, stepName(step))
	if c.have && c.step == step {
		if VerifyCheckpoint(final) == nil {
			c.events.filef("checkpoint: step %d is already saved in %s", step, final)
			return final, false, nil
		}
	}
	if err := os.MkdirAll(root, 0o755); err != nil {
		return "", false, fmt.Errorf("checkpoint: %w", err)
	}
	if !c.cleaned {
		c.removeStrays(root)
		c.cleaned = true
	}
	// A step_N already there is not one of this run's (an interrupted write, or a run this one
	// did not resume): it is set aside, and removed once the new one is in place.
	var aside string
	if _, err := os.Lstat(final); err == nil {
		if aside, err = setAside(root, fmt.Sprintf(".step_%d.old-", step), final); err != nil {
			return "", false, fmt.Errorf("checkpoint: %s is in the way and could not be moved: %w", final, err)
		}
		c.events.printf("checkpoint: replacing %s, written by an earlier run or an interrupted save", final)
	}
	tmp, err := os.MkdirTemp(root, fmt.Sprintf(".step_%d.tmp-", step))
	if err != nil {
		return "", false, fmt.Errorf("checkpoint: %w", err)
	}
	defer os.RemoveAll(tmp) // after a successful rename there is nothing left to remove
	if err := fill(final, tmp); err != nil {
		return "", false, err
	}
	if err := os.Rename(tmp, final); err != nil {
		return "", false, fmt.Errorf("checkpoint: %w", err)
	}
	syncDir(root)
	c.have, c.step, c.since = true, step, time.Now()
	if aside != "" {
		os.RemoveAll(aside)
	}
	c.events.printf("checkpoint: step %d saved in %s", step, final)
	c.prune(root, step, keep)
	return final, true, nil
}

// writeCheckpoint writes everything of a checkpoint into tmp, the folder that becomes final once
// complete: the policies' engine states, the run's files and the manifest that checksums them.
func (r *Run) writeCheckpoint(ctx context.Context, step int, final, tmp string) error {
	external, err := r.ckpt.savePolicies(ctx, r.pols.list(), step, final, tmp)
	if err != nil {
		return err
	}
	if err := r.vers.save(ctx, r.pols.list(), step, tmp, r.async.inFlight); err != nil {
		return err
	}
	st, err := script.EncodeState(r.state)
	if err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	info, _ := json.MarshalIndent(runInfo{Step: step, NextTask: &r.next, Script: r.script.Path, ScriptHash: r.script.Hash, Seed: r.Config().Run.Seed,
		Dir: r.wd, MaxStaleness: r.vers.staleness()}, "", "  ")
	y, err := r.Config().Marshal()
	if err != nil {
		return err
	}
	for name, b := range map[string][]byte{stateFile: st, runFile: info, "config.yaml": y, "script.star": r.script.Source} {
		if err := os.WriteFile(filepath.Join(tmp, name), b, 0o644); err != nil {
			return fmt.Errorf("checkpoint: %w", err)
		}
	}
	m, err := sumTree(tmp, nil)
	if err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	if len(external) > 0 {
		m.External = external
	}
	mb, _ := json.MarshalIndent(m, "", "  ")
	if err := writeSynced(filepath.Join(tmp, manifestFile), mb); err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	return nil
}

// savePolicies has the engine of every trainable policy of pols save its state into tmp/<policy>
// (an engine whose state lives on its server saves there, and is recorded as external).
func (c *checkpoints) savePolicies(ctx context.Context, pols []*policy, step int, final, tmp string) (map[string]externalState, error) {
	external := map[string]externalState{}
	for _, p := range pols {
		if !p.cfg.Trainable {
			continue // a frozen policy is what its config says it is: nothing to save
		}
		if offHost(p.cfg) {
			ext, err := c.saveRemote(ctx, p, final, tmp)
			if err != nil {
				return nil, err
			}
			if ext != nil {
				external[p.name] = *ext
			}
		} else {
			dir := filepath.Join(tmp, p.name)
			if err := p.save(ctx, dir); err != nil {
				return nil, fmt.Errorf("checkpoint: policy %q: its engine could not save: %w", p.name, err)
			}
			if !hasFiles(dir) {
				return nil, fmt.Errorf("checkpoint: policy %q: its %s engine reported the save done, but %s holds no files; "+
					"the engine does not write on this machine's disk — "+
					"give it engine: {kind: remote} so that its state is recorded as living on its server",
					p.name, p.cfg.Engine.Kind, dir)
			}
		}
		// Fault injection for the crash-safety test: die by SIGKILL halfway through a write.
		if os.Getenv("SLIMEN_TEST_SIGKILL_IN_CHECKPOINT") == strconv.Itoa(step) {
			syscall.Kill(os.Getpid(), syscall.SIGKILL)
		}
	}
	return external, nil
}

// saveRemote saves a remote engine's state into the final path final/<policy> on its server. If
// the folder shows up on this machine, it is moved into tmp and checksummed with the rest;
// otherwise it is recorded as external.
func (c *checkpoints) saveRemote(ctx context.Context, p *policy, final, tmp string) (*externalState, error) {
	dir := filepath.Join(final, p.name)
	if err := p.save(ctx, dir); err != nil {
		return nil, fmt.Errorf("checkpoint: policy %q: its engine at %s could not save into %s: %w", p.name, p.cfg.Engine.Address, dir, err)
	}
	if hasFiles(dir) { // a file system this host shares with the server
		if err := os.Rename(dir, filepath.Join(tmp, p.name)); err != nil {
			return nil, fmt.Errorf("checkpoint: policy %q: the engine saved into %s, but it could not be moved into the checkpoint being written: %w", p.name, dir, err)
		}
		if err := os.Remove(final); err != nil {
			return nil, fmt.Errorf("checkpoint: %s should be empty once policy %q's state is moved out: %w", final, p.name, err)
		}
		return nil, nil
	}
	c.tellOffHost(p.name, p.cfg.Engine.Address, dir)
	return &externalState{Dir: dir, Address: p.cfg.Engine.Address}, nil
}

// tellOffHost says, once per policy, that policy name's engine at address keeps its checkpoints
// on its own disk (dir, this step's folder there).
func (c *checkpoints) tellOffHost(name, address, dir string) {
	if c.told == nil {
		c.told = map[string]bool{}
	}
	if !c.told[name] {
		c.told[name] = true
		c.events.printf("checkpoint: policy %q: its engine at %s saves on its own disk, which this host cannot see: "+
			"its state stays on the server in %s (step_N for each checkpoint); "+
			"the manifest names that folder and resume asks the engine to load it. Pruning "+
			"(run.keep_checkpoints) does not reach the server's copies",
			name, address, dir)
	}
}

// setAside renames a folder in the way to a fresh temporary name in dir (pattern as for
// os.MkdirTemp), for the caller to remove once its replacement is in place.
func setAside(dir, pattern, path string) (string, error) {
	aside, err := os.MkdirTemp(dir, pattern)
	if err != nil {
		return "", err
	}
	if err := os.Remove(aside); err != nil {
		return "", err
	}
	return aside, os.Rename(path, aside)
}

// removeStrays removes the temporary folders a crashed or killed run left in root: only names of
// the host's own pattern (.step_N.tmp-DIGITS, .step_N.old-DIGITS), only folders.
func (c *checkpoints) removeStrays(root string) {
	entries, _ := os.ReadDir(root)
	for _, e := range entries {
		if e.IsDir() && tempName.MatchString(e.Name()) {
			if err := os.RemoveAll(filepath.Join(root, e.Name())); err == nil {
				c.events.printf("checkpoint: removed %s, left by an interrupted checkpoint write", filepath.Join(root, e.Name()))
			}
		}
	}
}

// hasFiles says whether dir holds at least one regular file (at any depth).
func hasFiles(dir string) bool {
	found := errors.New("found")
	err := filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() {
			return found
		}
		return nil
	})
	return err == found
}

func writeSynced(path string, b []byte) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func syncDir(dir string) {
	if d, err := os.Open(dir); err == nil {
		d.Sync()
		d.Close()
	}
}

// sumTree hashes every file under dir (paths relative to dir, slash-separated), leaving out the
// top-level folders named in skip.
func sumTree(dir string, skip map[string]externalState) (manifest, error) {
	m := manifest{Files: map[string]fileSum{}}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		if _, ok := skip[filepath.ToSlash(rel)]; ok && d.IsDir() {
			return fs.SkipDir
		}
		if d.IsDir() || rel == manifestFile {
			return nil
		}
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		defer f.Close()
		h := sha256.New()
		n, err := io.Copy(h, f)
		if err != nil {
			return err
		}
		m.Files[filepath.ToSlash(rel)] = fileSum{SHA256: hex.EncodeToString(h.Sum(nil)), Size: n}
		return nil
	})
	return m, err
}

// VerifyCheckpoint checks a checkpoint folder against its manifest and names what is wrong.
func VerifyCheckpoint(dir string) error {
	_, err := readManifest(dir)
	return err
}

// readManifest verifies a checkpoint folder and returns its manifest.
func readManifest(dir string) (manifest, error) {
	var want manifest
	b, err := os.ReadFile(filepath.Join(dir, manifestFile))
	if err != nil {
		return want, fmt.Errorf("checkpoint %s is incomplete: it has no %s (its write never finished)", dir, manifestFile)
	}
	if err := json.Unmarshal(b, &want); err != nil {
		return want, fmt.Errorf("checkpoint %s: %s is corrupt: %v", dir, manifestFile, err)
	}
	got, err := sumTree(dir, want.External)
	if err != nil {
		return want, fmt.Errorf("checkpoint %s: %w", dir, err)
	}
	names := make([]string, 0, len(want.Files))
	for n := range want.Files {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		w := want.Files[n]
		g, ok := got.Files[n]
		switch {
		case !ok:
			return want, fmt.Errorf("checkpoint %s: file %s is missing", dir, n)
		case g.Size != w.Size:
			return want, fmt.Errorf("checkpoint %s: file %s has %d bytes, the manifest says %d (truncated or overwritten)", dir, n, g.Size, w.Size)
		case g.SHA256 != w.SHA256:
			return want, fmt.Errorf("checkpoint %s: file %s does not match its checksum (corrupted)", dir, n)
		}
	}
	for n := range got.Files {
		if _, ok := want.Files[n]; !ok {
			return want, fmt.Errorf("checkpoint %s: file %s is not in the manifest (written after the checkpoint was complete)", dir, n)
		}
	}
	return want, nil
}

// holds says whether the manifest lists files under the folder name/.
func (m manifest) holds(name string) bool {
	for f := range m.Files {
		if strings.HasPrefix(f, name+"/") {
			return true
		}
	}
	return false
}

// checkpointSteps lists the step_N folders of a run's checkpoints, newest first.
func checkpointSteps(root string) []int {
	entries, _ := os.ReadDir(root)
	var steps []int
	for _, e := range entries {
		if n, ok := strings.CutPrefix(e.Name(), "step_"); ok && e.IsDir() {
			if k, err := strconv.Atoi(n); err == nil && k >= 0 && stepName(k) == e.Name() {
				steps = append(steps, k)
			}
		}
	}
	sort.Sort(sort.Reverse(sort.IntSlice(steps)))
	return steps
}

// prune keeps the newest keep (run.keep_checkpoints) checkpoints up to step, the current one.
// Folders of later steps (left by a run this one did not resume) are not this run's to prune.
func (c *checkpoints) prune(root string, step, keep int) {
	if keep <= 0 {
		return
	}
	kept := 0
	for _, s := range checkpointSteps(root) {
		if s > step {
			continue
		}
		if kept++; kept > keep {
			os.RemoveAll(filepath.Join(root, stepName(s)))
		}
	}
}

// readRunInfo reads a checkpoint's run.json.
func readRunInfo(dir string) (runInfo, error) {
	var info runInfo
	b, err := os.ReadFile(filepath.Join(dir, runFile))
	if err != nil {
		return info, fmt.Errorf("checkpoint %s: %w", dir, err)
	}
	if err := json.Unmarshal(b, &info); err != nil {
		return info, fmt.Errorf("checkpoint %s: %s: %w", dir, runFile, err)
	}
	return info, nil
}

// checkSaveFolders looks at the save: folders of pols at start-up. A frozen policy's is never
// written (said once), and a folder on this machine that holds something other than a model
// folder is refused before the run starts rather than at its first checkpoint.
func (c *checkpoints) checkSaveFolders(pols []*policy) error {
	for _, p := range pols {
		if p.cfg.Save == "" {
			continue
		}
		switch {
		case !p.cfg.Trainable:
			c.events.printf("config: policy %q is frozen (trainable: false): its save: folder %s is not written; only trainable policies are saved", p.name, p.cfg.Save)
		case offHost(p.cfg):
			c.events.printf("config: policy %q: save: %s is a folder on the engine server at %s, which writes it at every checkpoint", p.name, p.cfg.Save,
				p.cfg.Engine.Address)
		default:
			if err := saveFolderUsable(p); err != nil {
				return err
			}
		}
	}
	return nil
}

// saveFolderUsable refuses a save: folder that holds something other than a model folder: it is
// replaced at every checkpoint.
func saveFolderUsable(p *policy) error {
	dst := p.cfg.Save
	fi, err := os.Stat(dst)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("policy %q: save: %w", p.name, err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("policy %q: save: %s is a file; give a folder (slimen writes the policy's model folder there at every checkpoint)", p.name, dst)
	}
	entries, err := os.ReadDir(dst)
	if err != nil {
		return fmt.Errorf("policy %q: save: %w", p.name, err)
	}
	if len(entries) == 0 {
		return nil
	}
	for _, f := range []string{saveMarker, "config.json"} {
		if _, err := os.Stat(filepath.Join(dst, f)); err == nil {
			return nil
		}
	}
	return fmt.Errorf("policy %q: save: %s holds files but is not a model folder (no config.json); "+
		"slimen replaces the whole save: folder at every checkpoint, so point save: at a folder of its own", p.name, dst)
}

// writeSaveFolders writes the save: folder of every trainable policy of pols that has one, with
// the state of step.
func (c *checkpoints) writeSaveFolders(ctx context.Context, pols []*policy, step int) error {
	for _, p := range pols {
		if p.cfg.Trainable && p.cfg.Save != "" {
			if err := c.writeSaveFolder(ctx, p, step); err != nil {
				return err
			}
		}
	}
	return nil
}

// writeSaveFolder writes a policy's save: folder (slime-n's per-policy save path): the engine's
// state (a Hugging Face model folder plus the engine's optimizer files, what Engine.Save writes)
// and latest_checkpointed_iteration.txt with the step. On this machine the folder is written
// beside the old one and swapped in; a remote engine writes it on its server, in place.
func (c *checkpoints) writeSaveFolder(ctx context.Context, p *policy, step int) error {
	fail := func(err error) error {
		return fmt.Errorf("checkpoint: step %d is saved, but policy %q's save: folder %s was not written: %w", step, p.name, p.cfg.Save, err)
	}
	if offHost(p.cfg) {
		if err := p.save(ctx, p.cfg.Save); err != nil {
			return fail(err)
		}
		c.events.filef("checkpoint: policy %q: step %d saved by its engine into %s on its server", p.name, step, p.cfg.Save)
		return nil
	}
	if err := saveFolderUsable(p); err != nil {
		return fail(err)
	}
	dst, err := filepath.Abs(p.cfg.Save)
	if err != nil {
		return fail(err)
	}
	parent, base := filepath.Dir(dst), filepath.Base(dst)
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return fail(err)
	}
	tmp, err := os.MkdirTemp(parent, "."+base+".tmp-")
	if err != nil {
		return fail(err)
	}
	defer os.RemoveAll(tmp)
	if err := p.save(ctx, tmp); err != nil {
		return fail(err)
	}
	if !hasFiles(tmp) {
		return fail(fmt.Errorf("the engine reported the save done but wrote no files into %s", tmp))
	}
	if err := os.WriteFile(filepath.Join(tmp, saveMarker), []byte(strconv.Itoa(step)+"\n"), 0o644); err != nil {
		return fail(err)
	}
	var old string
	if _, err := os.Lstat(dst); err == nil {
		if old, err = setAside(parent, "."+base+".old-", dst); err != nil {
			return fail(err)
		}
	}
	if err := os.Rename(tmp, dst); err != nil {
		return fail(err)
	}
	if old != "" {
		os.RemoveAll(old)
	}
	c.events.filef("checkpoint: policy %q: step %d written to its save: folder %s", p.name, step, dst)
	return nil
}

// checkpointPlan says when a run checkpoints and how many it keeps, for its start-up line.
func checkpointPlan(c config.RunConfig) string {
	var when []string
	if c.SaveInterval > 0 {
		when = append(when, fmt.Sprintf("every %d steps (run.save_interval)", c.SaveInterval))
	}
	if c.SaveMinutes > 0 {
		when = append(when, fmt.Sprintf("after the first step past %g minutes since the last (run.save_minutes)", c.SaveMinutes))
	}
	when = append(when, "at the end or on a signal")
	keep := "all kept"
	if c.KeepCheckpoints > 0 {
		keep = fmt.Sprintf("the newest %d kept (run.keep_checkpoints)", c.KeepCheckpoints)
	}
	return strings.Join(when, ", ") + "; " + keep
}

// policyDir is the folder a policy's engine loads its state from in the run's checkpoint of a
// step: a folder inside the checkpoint, or one on the engine's server that the manifest names.
func (c *checkpoints) policyDir(step int, policy string) (string, error) {
	if c.out == "" {
		return "", fmt.Errorf("the run has no directory")
	}
	root, err := c.root()
	if err != nil {
		return "", err
	}
	dir := filepath.Join(root, stepName(step))
	m, err := readManifest(dir)
	if err != nil {
		return "", err
	}
	if ext, ok := m.External[policy]; ok {
		return ext.Dir, nil
	}
	if !m.holds(policy) {
		return "", fmt.Errorf("checkpoint %s holds no state for it", dir)
	}
	return filepath.Join(dir, policy), nil
}

// LastCheckpoint is the folder of the newest complete checkpoint this run wrote or resumed from;
// "" when there is none.
func (r *Run) LastCheckpoint() string { return r.ckpt.last() }

// last is the folder of the newest complete checkpoint the run wrote or resumed from; "" when
// there is none.
func (c *checkpoints) last() string {
	if !c.have || c.out == "" {
		return ""
	}
	return filepath.Join(c.out, "checkpoints", stepName(c.step))
}
