package host

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"math/big"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"

	"go.starlark.net/starlark"
)

// Checkpoints (issue 9). <out>/checkpoints/step_N/ holds what a run needs to go on as if it had
// never stopped:
//
//	<policy>/          each trainable policy's engine state (Engine.Save: HF folder + optimizer)
//	state.json         the `state` store
//	run.json           the step, the script's path and hash, the seed
//	config.yaml        the resolved config (with zero-config policies created on the way)
//	script.star        the running script version
//	MANIFEST.json      sha256 and size of every file above; written last
//
// Buffers need no saving: the loop is synchronous and on-policy, so they are empty between steps.
// RNG state needs none either: every seed is a function of the run seed, the step and the task.
// A checkpoint is written into a temporary folder and renamed into place when complete, so a crash
// during the write leaves at most a stray temporary folder, never a step_N that resume accepts.

const (
	manifestFile = "MANIFEST.json"
	runFile      = "run.json"
	stateFile    = "state.json"
)

type runInfo struct {
	Step       int    `json:"step"`
	Script     string `json:"script"`
	ScriptHash string `json:"script_hash"`
	Seed       uint64 `json:"seed"`
}

type manifest struct {
	Files map[string]fileSum `json:"files"`
}

type fileSum struct {
	SHA256 string `json:"sha256"`
	Size   int64  `json:"size"`
}

// Checkpoint writes <out>/checkpoints/step_N for the steps done so far and keeps the newest
// run.keep_checkpoints of them.
func (r *Run) Checkpoint(ctx context.Context) (string, error) {
	if r.opts.Out == "" {
		return "", errors.New("checkpoint: the run has no directory")
	}
	root := filepath.Join(r.opts.Out, "checkpoints")
	final := filepath.Join(root, fmt.Sprintf("step_%d", r.step))
	if err := os.MkdirAll(root, 0o755); err != nil {
		return "", err
	}
	tmp, err := os.MkdirTemp(root, fmt.Sprintf(".step_%d.tmp-", r.step))
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp) // after a successful rename there is nothing left to remove
	for _, p := range r.policyList() {
		if !p.cfg.Trainable {
			continue // a frozen policy is what its config says it is: nothing to save
		}
		if err := p.eng.Save(ctx, filepath.Join(tmp, p.name)); err != nil {
			return "", fmt.Errorf("checkpoint: policy %q: %w", p.name, err)
		}
		// Fault injection for the crash-safety test: die by SIGKILL halfway through a write.
		if os.Getenv("SLIMEN_TEST_SIGKILL_IN_CHECKPOINT") == strconv.Itoa(r.step) {
			syscall.Kill(os.Getpid(), syscall.SIGKILL)
		}
	}
	st, err := encodeState(r.state)
	if err != nil {
		return "", err
	}
	info, _ := json.MarshalIndent(runInfo{Step: r.step, Script: r.script.Path, ScriptHash: r.script.Hash, Seed: r.Config().Run.Seed}, "", "  ")
	y, err := r.Config().Marshal()
	if err != nil {
		return "", err
	}
	for name, b := range map[string][]byte{stateFile: st, runFile: info, "config.yaml": y, "script.star": r.script.Source} {
		if err := os.WriteFile(filepath.Join(tmp, name), b, 0o644); err != nil {
			return "", err
		}
	}
	m, err := sumTree(tmp)
	if err != nil {
		return "", err
	}
	mb, _ := json.MarshalIndent(m, "", "  ")
	if err := writeSynced(filepath.Join(tmp, manifestFile), mb); err != nil {
		return "", err
	}
	if err := os.RemoveAll(final); err != nil { // a checkpoint of the same step from an earlier attempt
		return "", err
	}
	if err := os.Rename(tmp, final); err != nil {
		return "", err
	}
	syncDir(root)
	r.events.printf("checkpoint: step %d saved in %s", r.step, final)
	r.pruneCheckpoints(root)
	return final, nil
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

// sumTree hashes every file under dir (paths relative to dir, slash-separated).
func sumTree(dir string) (manifest, error) {
	m := manifest{Files: map[string]fileSum{}}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || d.Name() == manifestFile {
			return err
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
		rel, _ := filepath.Rel(dir, p)
		m.Files[filepath.ToSlash(rel)] = fileSum{SHA256: hex.EncodeToString(h.Sum(nil)), Size: n}
		return nil
	})
	return m, err
}

// VerifyCheckpoint checks a checkpoint folder against its manifest and names what is wrong.
func VerifyCheckpoint(dir string) error {
	b, err := os.ReadFile(filepath.Join(dir, manifestFile))
	if err != nil {
		return fmt.Errorf("checkpoint %s is incomplete: no %s (it was not finished being written)", dir, manifestFile)
	}
	var want manifest
	if err := json.Unmarshal(b, &want); err != nil {
		return fmt.Errorf("checkpoint %s: %s is corrupt: %v", dir, manifestFile, err)
	}
	got, err := sumTree(dir)
	if err != nil {
		return fmt.Errorf("checkpoint %s: %w", dir, err)
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
			return fmt.Errorf("checkpoint %s: file %s is missing", dir, n)
		case g.Size != w.Size:
			return fmt.Errorf("checkpoint %s: file %s has %d bytes, the manifest says %d (truncated or overwritten)", dir, n, g.Size, w.Size)
		case g.SHA256 != w.SHA256:
			return fmt.Errorf("checkpoint %s: file %s does not match its checksum (corrupted)", dir, n)
		}
	}
	for n := range got.Files {
		if _, ok := want.Files[n]; !ok {
			return fmt.Errorf("checkpoint %s: file %s is not in the manifest", dir, n)
		}
	}
	return nil
}

// checkpointSteps lists the step_N folders of a run's checkpoints, newest first.
func checkpointSteps(root string) []int {
	entries, _ := os.ReadDir(root)
	var steps []int
	for _, e := range entries {
		if n, ok := strings.CutPrefix(e.Name(), "step_"); ok && e.IsDir() {
			if k, err := strconv.Atoi(n); err == nil {
				steps = append(steps, k)
			}
		}
	}
	sort.Sort(sort.Reverse(sort.IntSlice(steps)))
	return steps
}

func (r *Run) pruneCheckpoints(root string) {
	keep := r.Config().Run.KeepCheckpoints
	if keep <= 0 {
		return
	}
	for i, s := range checkpointSteps(root) {
		if i >= keep {
			os.RemoveAll(filepath.Join(root, fmt.Sprintf("step_%d", s)))
		}
	}
}

// FindCheckpoint resolves --resume: a checkpoint folder itself, or a run directory whose newest
// valid checkpoint is taken. A checkpoint that fails verification is an error naming what is
// wrong and the previous checkpoint to resume from instead.
func FindCheckpoint(path string) (string, error) {
	if _, err := os.Stat(filepath.Join(path, runFile)); err == nil || strings.HasPrefix(filepath.Base(path), "step_") {
		if err := VerifyCheckpoint(path); err != nil {
			return "", withPrevious(err, filepath.Dir(path), path)
		}
		return path, nil
	}
	root := filepath.Join(path, "checkpoints")
	steps := checkpointSteps(root)
	if len(steps) == 0 {
		return "", fmt.Errorf("resume %s: no checkpoints in %s", path, root)
	}
	newest := filepath.Join(root, fmt.Sprintf("step_%d", steps[0]))
	if err := VerifyCheckpoint(newest); err != nil {
		return "", withPrevious(err, root, newest)
	}
	return newest, nil
}

// withPrevious adds the newest valid checkpoint older than bad to err.
func withPrevious(err error, root, bad string) error {
	badStep, _ := strconv.Atoi(strings.TrimPrefix(filepath.Base(bad), "step_"))
	for _, s := range checkpointSteps(root) {
		dir := filepath.Join(root, fmt.Sprintf("step_%d", s))
		if s < badStep && VerifyCheckpoint(dir) == nil {
			return fmt.Errorf("%w\nresume from the previous checkpoint instead: --resume %s", err, dir)
		}
	}
	return fmt.Errorf("%w\nno earlier valid checkpoint was found", err)
}

// CheckpointInfo reads a checkpoint's step and the path of the script it ran.
func CheckpointInfo(dir string) (step int, script string, err error) {
	b, err := os.ReadFile(filepath.Join(dir, runFile))
	if err != nil {
		return 0, "", err
	}
	var info runInfo
	if err := json.Unmarshal(b, &info); err != nil {
		return 0, "", fmt.Errorf("checkpoint %s: %s: %w", dir, runFile, err)
	}
	return info.Step, info.Script, nil
}

// RunDirOf is the run directory a checkpoint folder belongs to.
func RunDirOf(checkpoint string) string { return filepath.Dir(filepath.Dir(checkpoint)) }

// Resume restores a run loaded with the checkpoint's config: engines, state and the step
// counter; metrics lines of later steps (written before the run stopped) are dropped.
func (r *Run) Resume(ctx context.Context, dir string) error {
	if err := VerifyCheckpoint(dir); err != nil {
		return err
	}
	var info runInfo
	b, err := os.ReadFile(filepath.Join(dir, runFile))
	if err != nil {
		return err
	}
	if err := json.Unmarshal(b, &info); err != nil {
		return fmt.Errorf("checkpoint %s: %s: %w", dir, runFile, err)
	}
	for _, p := range r.policyList() {
		if !p.cfg.Trainable {
			continue
		}
		if err := p.eng.Load(ctx, filepath.Join(dir, p.name)); err != nil {
			return fmt.Errorf("resume: policy %q: %w", p.name, err)
		}
	}
	sb, err := os.ReadFile(filepath.Join(dir, stateFile))
	if err != nil {
		return err
	}
	if err := decodeState(sb, r.state); err != nil {
		return fmt.Errorf("checkpoint %s: %s: %w", dir, stateFile, err)
	}
	r.step = info.Step
	if info.ScriptHash != r.script.Hash {
		r.events.printf("resume: the script differs from the checkpoint's version %s; the run goes on with version %s", short(info.ScriptHash), short(r.script.Hash))
	}
	if err := r.metrics.truncateAfter(info.Step); err != nil {
		return err
	}
	r.events.printf("resume: from %s at step %d", dir, info.Step)
	return nil
}

func short(h string) string { return h[:min(12, len(h))] }

// truncateAfter drops the metrics lines of steps after step.
func (w *metricsWriter) truncateAfter(step int) error {
	if w.f == nil {
		return nil
	}
	path := w.f.Name()
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var keep bytes.Buffer
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 1<<20), 1<<26)
	for sc.Scan() {
		var head struct {
			Step int `json:"step"`
		}
		if json.Unmarshal(sc.Bytes(), &head) == nil && head.Step > step {
			continue
		}
		keep.Write(sc.Bytes())
		keep.WriteByte('\n')
	}
	if err := w.f.Close(); err != nil {
		return err
	}
	if err := os.WriteFile(path, keep.Bytes(), 0o644); err != nil {
		return err
	}
	return w.open(path)
}

// encodeState writes the state store as JSON that keeps Starlark's types: ints stay ints (any
// size), tuples stay tuples, dict keys keep their types.
func encodeState(s *State) ([]byte, error) {
	out := map[string]any{}
	for _, k := range s.Keys() {
		v, _ := s.Get(k)
		e, err := encodeValue(v)
		if err != nil {
			return nil, fmt.Errorf("state %q: %w", k, err)
		}
		out[k] = e
	}
	return json.MarshalIndent(out, "", " ")
}

func encodeValue(v starlark.Value) (any, error) {
	switch v := v.(type) {
	case starlark.NoneType:
		return nil, nil
	case starlark.Bool:
		return bool(v), nil
	case starlark.String:
		return string(v), nil
	case starlark.Int:
		return map[string]any{"int": v.String()}, nil
	case starlark.Float:
		f := float64(v)
		if math.IsNaN(f) || math.IsInf(f, 0) {
			return map[string]any{"float": strconv.FormatFloat(f, 'g', -1, 64)}, nil
		}
		return map[string]any{"float": f}, nil
	case *starlark.List, starlark.Tuple:
		var items []any
		it := starlark.Iterate(v)
		defer it.Done()
		var x starlark.Value
		for it.Next(&x) {
			e, err := encodeValue(x)
			if err != nil {
				return nil, err
			}
			items = append(items, e)
		}
		if items == nil {
			items = []any{}
		}
		if _, ok := v.(starlark.Tuple); ok {
			return map[string]any{"tuple": items}, nil
		}
		return map[string]any{"list": items}, nil
	case *starlark.Dict:
		pairs := [][2]any{}
		for _, kv := range v.Items() {
			k, err := encodeValue(kv[0])
			if err != nil {
				return nil, err
			}
			x, err := encodeValue(kv[1])
			if err != nil {
				return nil, err
			}
			pairs = append(pairs, [2]any{k, x})
		}
		return map[string]any{"dict": pairs}, nil
	}
	return nil, fmt.Errorf("a %s cannot be saved", v.Type())
}

func decodeState(b []byte, s *State) error {
	var in map[string]json.RawMessage
	if err := json.Unmarshal(b, &in); err != nil {
		return err
	}
	for k, raw := range in {
		v, err := decodeJSONValue(raw)
		if err != nil {
			return fmt.Errorf("%q: %w", k, err)
		}
		if err := s.Set(k, v); err != nil {
			return err
		}
	}
	return nil
}

// decodeJSONValue decodes one value written by encodeValue.
func decodeJSONValue(raw []byte) (starlark.Value, error) {
	var x any
	d := json.NewDecoder(bytes.NewReader(raw))
	d.UseNumber()
	if err := d.Decode(&x); err != nil {
		return nil, err
	}
	return decodeValue(x)
}

func decodeValue(x any) (starlark.Value, error) {
	switch x := x.(type) {
	case nil:
		return starlark.None, nil
	case bool:
		return starlark.Bool(x), nil
	case string:
		return starlark.String(x), nil
	case map[string]any:
		for tag, v := range x {
			switch tag {
			case "int":
				s, _ := v.(string)
				i, ok := new(big.Int).SetString(s, 10)
				if !ok {
					return nil, fmt.Errorf("bad int %v", v)
				}
				return starlark.MakeBigInt(i), nil
			case "float":
				switch f := v.(type) {
				case json.Number:
					g, err := f.Float64()
					return starlark.Float(g), err
				case string:
					g, err := strconv.ParseFloat(f, 64)
					return starlark.Float(g), err
				}
			case "list", "tuple":
				items, _ := v.([]any)
				vals := make([]starlark.Value, len(items))
				for i, it := range items {
					e, err := decodeValue(it)
					if err != nil {
						return nil, err
					}
					vals[i] = e
				}
				if tag == "tuple" {
					return starlark.Tuple(vals), nil
				}
				return starlark.NewList(vals), nil
			case "dict":
				pairs, _ := v.([]any)
				d := starlark.NewDict(len(pairs))
				for _, p := range pairs {
					kv, _ := p.([]any)
					if len(kv) != 2 {
						return nil, fmt.Errorf("bad dict entry %v", p)
					}
					k, err := decodeValue(kv[0])
					if err != nil {
						return nil, err
					}
					val, err := decodeValue(kv[1])
					if err != nil {
						return nil, err
					}
					if err := d.SetKey(k, val); err != nil {
						return nil, err
					}
				}
				return d, nil
			}
		}
	}
	return nil, fmt.Errorf("cannot decode %v", x)
}
