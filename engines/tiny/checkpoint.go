package tiny

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// The files of a model folder. The first four are what transformers reads; the optimizer files
// are the tiny engine's own and are optional on load.
const (
	fileConfig          = "config.json"
	fileWeights         = "model.safetensors"
	fileTokenizer       = "tokenizer.json"
	fileTokenizerConfig = "tokenizer_config.json"
	fileOptimizer       = "optimizer.safetensors"
	fileOptimizerState  = "optimizer.json"
)

// checkpoint is the content of a model folder.
type checkpoint struct {
	w   *weights[float32]
	tok *Tokenizer
	eos []int32
	opt *adamState // nil when the folder has no optimizer state
}

// optimizerMeta is optimizer.json.
type optimizerMeta struct {
	Optimizer string `json:"optimizer"`
	Step      int64  `json:"step"`
}

// readCheckpoint reads a model folder from fsys; label names the folder in errors.
func readCheckpoint(fsys fs.FS, label string) (*checkpoint, error) {
	wrap := func(file string, err error) error {
		var fe *fileError
		if errors.As(err, &fe) {
			file, err = fe.file, fe.err
		}
		return fmt.Errorf("%s: %w", filepath.Join(label, file), err)
	}
	read := func(name string) ([]byte, error) {
		b, err := fs.ReadFile(fsys, name)
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil, wrap(name, errors.New("missing: a tiny model folder holds config.json, model.safetensors, tokenizer.json and tokenizer_config.json"))
			}
			return nil, wrap(name, err)
		}
		return b, nil
	}
	cfgJSON, err := read(fileConfig)
	if err != nil {
		return nil, err
	}
	cfg, eos, err := parseHFConfig(cfgJSON)
	if err != nil {
		return nil, wrap(fileConfig, err)
	}
	tokJSON, err := read(fileTokenizer)
	if err != nil {
		return nil, err
	}
	tokCfgJSON, err := read(fileTokenizerConfig)
	if err != nil {
		return nil, err
	}
	tok, err := parseTokenizer(tokJSON, tokCfgJSON)
	if err != nil {
		return nil, wrap("", err)
	}
	if tok.VocabSize() > cfg.VocabSize {
		return nil, wrap(fileTokenizer, fmt.Errorf("%d tokens do not fit the model's vocab_size %d (config.json)", tok.VocabSize(), cfg.VocabSize))
	}
	if len(eos) == 0 {
		eos = []int32{tok.eos}
	}
	for _, id := range eos {
		if id < 0 || int(id) >= cfg.VocabSize {
			return nil, wrap(fileConfig, fmt.Errorf("eos_token_id %d is outside the vocabulary", id))
		}
	}
	wb, err := read(fileWeights)
	if err != nil {
		return nil, err
	}
	ts, err := decodeSafetensors(wb)
	if err != nil {
		return nil, wrap(fileWeights, err)
	}
	w := newWeights[float32](cfg)
	if _, ok := ts["score.weight"]; ok {
		w.addValueHead() // a PPO critic's checkpoint
	}
	if err := fillTensors(w, ts, "", func(name string) bool {
		// transformers drops the tied head on save but some writers keep it; older checkpoints
		// carry the rotary buffer. Neither is a parameter here.
		return (cfg.TieEmbeddings && name == "lm_head.weight") || strings.HasSuffix(name, "rotary_emb.inv_freq")
	}); err != nil {
		return nil, wrap(fileWeights, err)
	}
	ck := &checkpoint{w: w, tok: tok, eos: eos}

	ob, err := fs.ReadFile(fsys, fileOptimizer)
	if errors.Is(err, fs.ErrNotExist) {
		return ck, nil
	} else if err != nil {
		return nil, wrap(fileOptimizer, err)
	}
	metaJSON, err := fs.ReadFile(fsys, fileOptimizerState)
	if err != nil {
		return nil, wrap(fileOptimizerState, fmt.Errorf("%w (optimizer.safetensors is there; optimizer.json holds its step count)", err))
	}
	var meta optimizerMeta
	if err := json.Unmarshal(metaJSON, &meta); err != nil {
		return nil, wrap(fileOptimizerState, fmt.Errorf("not valid JSON: %w", err))
	}
	if meta.Optimizer != "adamw" || meta.Step < 0 {
		return nil, wrap(fileOptimizerState, fmt.Errorf("want optimizer \"adamw\" with a non-negative step, got %q step %d", meta.Optimizer, meta.Step))
	}
	ots, err := decodeSafetensors(ob)
	if err != nil {
		return nil, wrap(fileOptimizer, err)
	}
	opt := newAdamState(w)
	opt.step = meta.Step
	mw, vw := w.zeros(), w.zeros()
	if err := fillTensors(mw, ots, "exp_avg.", func(name string) bool { return strings.HasPrefix(name, "exp_avg_sq.") }); err != nil {
		return nil, wrap(fileOptimizer, err)
	}
	if err := fillTensors(vw, ots, "exp_avg_sq.", func(name string) bool { return strings.HasPrefix(name, "exp_avg.") }); err != nil {
		return nil, wrap(fileOptimizer, err)
	}
	for i, t := range mw.tensors() {
		copy(opt.m[i], t.data)
	}
	for i, t := range vw.tensors() {
		copy(opt.v[i], t.data)
	}
	ck.opt = opt
	return ck, nil
}

// fillTensors copies the tensors named prefix+parameter name into w, checking that each is
// present with the right shape and that nothing unexpected is left (other than what ignore
// accepts).
func fillTensors(w *weights[float32], ts map[string]tensor, prefix string, ignore func(string) bool) error {
	return fillNamed(w.tensors(), ts, prefix, ignore)
}

// fillNamed is fillTensors for the parameters ps.
func fillNamed(ps []namedTensor[float32], ts map[string]tensor, prefix string, ignore func(string) bool) error {
	used := map[string]bool{}
	for _, p := range ps {
		name := prefix + p.name
		t, ok := ts[name]
		if !ok {
			return fmt.Errorf("tensor %s is missing", name)
		}
		if !slices.Equal(t.shape, p.shape) {
			return fmt.Errorf("tensor %s has shape %v, want %v (from config.json)", name, t.shape, p.shape)
		}
		copy(p.data, t.data)
		used[name] = true
	}
	var extra []string
	for name := range ts {
		if !used[name] && !ignore(name) {
			extra = append(extra, name)
		}
	}
	if len(extra) > 0 {
		slices.Sort(extra)
		return fmt.Errorf("unexpected tensor %s (not a parameter of the architecture in config.json)", extra[0])
	}
	return nil
}

// writeCheckpoint writes a model folder into dir; each file is written to a temporary name and
// renamed, so a crash never leaves a half-written file behind.
func writeCheckpoint(dir string, ck *checkpoint) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	cfg := ck.w.cfg
	cfgJSON, err := json.MarshalIndent(cfg.toHF(ck.eos, ck.tok.pad), "", "  ")
	if err != nil {
		return err
	}
	tokJSON, tokCfgJSON, err := ck.tok.files(cfg.MaxSeqLen)
	if err != nil {
		return err
	}
	var ts []tensor
	for _, t := range ck.w.tensors() {
		ts = append(ts, tensor{name: t.name, shape: t.shape, data: t.data})
	}
	files := map[string][]byte{
		fileConfig:          append(cfgJSON, '\n'),
		fileTokenizer:       append(tokJSON, '\n'),
		fileTokenizerConfig: append(tokCfgJSON, '\n'),
		fileWeights:         encodeSafetensors(ts, map[string]string{"format": "pt"}),
	}
	if ck.opt != nil && ck.opt.step > 0 {
		var ots []tensor
		for i, t := range ck.w.tensors() {
			ots = append(ots, tensor{name: "exp_avg." + t.name, shape: t.shape, data: ck.opt.m[i]},
				tensor{name: "exp_avg_sq." + t.name, shape: t.shape, data: ck.opt.v[i]})
		}
		files[fileOptimizer] = encodeSafetensors(ots, nil)
		meta, _ := json.Marshal(optimizerMeta{Optimizer: "adamw", Step: ck.opt.step})
		files[fileOptimizerState] = append(meta, '\n')
	}
	return writeFiles(dir, files, []string{fileOptimizer, fileOptimizerState})
}

// writeFiles writes files into dir, each to a temporary name then renamed, and removes the files
// of stale that it does not write (a fresh optimizer: stale state from an earlier save into the
// same folder must not be picked up by the next load).
func writeFiles(dir string, files map[string][]byte, stale []string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	for _, f := range stale {
		if _, ok := files[f]; ok {
			continue
		}
		if err := os.Remove(filepath.Join(dir, f)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
	}
	for _, name := range slices.Sorted(maps.Keys(files)) {
		path := filepath.Join(dir, name)
		tmp := path + ".tmp"
		if err := os.WriteFile(tmp, files[name], 0o644); err != nil {
			return err
		}
		if err := os.Rename(tmp, path); err != nil {
			return err
		}
	}
	return nil
}
