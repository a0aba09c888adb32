package tiny

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/slimen/slimen/engines"
)

// adapterState is one LoRA adapter of an engine with its AdamW state.
type adapterState struct {
	name string
	w    *loraWeights[float32]
	opt  *adamState
}

// AddAdapter gives the engine a new LoRA adapter: A drawn from seed, B zero, so that it computes
// what the base computes until it trains. Adding a name twice is an error.
func (e *Engine) AddAdapter(name string, c LoRAConfig, seed uint64) error {
	if err := c.validate(); err != nil {
		return fmt.Errorf("tiny: adapter %q: %w", name, err)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return ErrClosed
	}
	if name == "" {
		return errors.New("tiny: an adapter needs a name")
	}
	if _, dup := e.adapters[name]; dup {
		return fmt.Errorf("tiny: adapter %q: %w", name, engines.ErrAdapterExists)
	}
	w := newLoRA[float32](e.m.w.cfg, c)
	w.initRandom(seed)
	if e.adapters == nil {
		e.adapters = map[string]*adapterState{}
	}
	e.adapters[name] = &adapterState{name: name, w: w, opt: newAdamStateOf(w.tensors())}
	return nil
}

// RemoveAdapter drops an adapter; its AdapterEngine must no longer be used. A name the engine
// does not have is ignored.
func (e *Engine) RemoveAdapter(name string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	delete(e.adapters, name)
}

var _ engines.AdapterHolder = (*Engine)(nil)

// NewAdapter is AddAdapter for engines.AdapterHolder (an engine server's AddAdapter).
func (e *Engine) NewAdapter(name string, l engines.LoRA, seed uint64) (int64, error) {
	if err := e.AddAdapter(name, LoRAConfig{Rank: l.Rank, Alpha: l.Alpha, Dropout: l.Dropout, Targets: l.Targets}, seed); err != nil {
		return 0, err
	}
	e.mu.RLock()
	defer e.mu.RUnlock()
	a, ok := e.adapters[name]
	if !ok {
		return 0, fmt.Errorf("tiny: adapter %q was removed as it was added", name)
	}
	return a.params(), nil
}

// DropAdapter is RemoveAdapter for engines.AdapterHolder.
func (e *Engine) DropAdapter(name string) { e.RemoveAdapter(name) }

// AdapterNames are the engine's adapters, sorted.
func (e *Engine) AdapterNames() []string {
	e.mu.RLock()
	defer e.mu.RUnlock()
	return slices.Sorted(maps.Keys(e.adapters))
}

// AdapterEngine is Adapter for engines.AdapterHolder.
func (e *Engine) AdapterEngine(name string) (engines.Engine, error) {
	v, err := e.Adapter(name)
	if err != nil {
		return nil, err
	}
	return v, nil
}

// LoadAdapter replaces adapter name with the PEFT folder dir (AdapterEngine.Load), making the
// adapter when the engine does not have it; a failed load of a new one leaves none behind.
func (e *Engine) LoadAdapter(ctx context.Context, name, dir string) error {
	if name == "" {
		return errors.New("tiny: an adapter needs a name")
	}
	if v, err := e.Adapter(name); err == nil {
		return v.Load(ctx, dir)
	}
	a := &adapterState{name: name}
	if err := (&AdapterEngine{e: e, a: a, versionStore: &versionStore{}}).Load(ctx, dir); err != nil {
		return err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return ErrClosed
	}
	if old, ok := e.adapters[name]; ok { // made meanwhile: this load replaces it as well
		old.w, old.opt = a.w, a.opt
		return nil
	}
	if e.adapters == nil {
		e.adapters = map[string]*adapterState{}
	}
	e.adapters[name] = a
	return nil
}

// params is the adapter's parameter count.
func (a *adapterState) params() int64 {
	n := 0
	for _, t := range a.w.tensors() {
		n += len(t.data)
	}
	return int64(n)
}

// adapterList resolves the adapter names of n requests; the caller holds the lock.
func (e *Engine) adapterList(names []string, n int) ([]*loraWeights[float32], error) {
	ads := make([]*loraWeights[float32], n)
	if names == nil {
		return ads, nil
	}
	if len(names) != n {
		return nil, fmt.Errorf("tiny: %d adapter names for %d requests", len(names), n)
	}
	for i, name := range names {
		if name == "" {
			continue
		}
		a, ok := e.adapters[name]
		if !ok {
			return nil, fmt.Errorf("tiny: request %d: no adapter %q (have %v)", i, name, slices.Sorted(maps.Keys(e.adapters)))
		}
		ads[i] = a.w
	}
	return ads, nil
}

// Adapter returns the engine as seen by one adapter: an engines.Engine that generates, scores and
// trains with it over the shared base and saves and loads only the adapter.
func (e *Engine) Adapter(name string) (*AdapterEngine, error) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	a, ok := e.adapters[name]
	if !ok {
		return nil, fmt.Errorf("tiny: no adapter %q", name)
	}
	return &AdapterEngine{e: e, a: a, versionStore: &versionStore{}}, nil
}

// AdapterEngine is one LoRA adapter on an engine's base model (Engine.Adapter). Its KL reference
// is the base without the adapter. Close does not close the base engine.
type AdapterEngine struct {
	e *Engine
	a *adapterState
	// versionStore holds the rollout copies of the adapter and serves their engines.Versions
	// methods (versions.go).
	*versionStore
}

var (
	_ engines.Engine   = (*AdapterEngine)(nil)
	_ engines.Renderer = (*AdapterEngine)(nil)
)

// Info is the base's, with the adapter's parameter count.
func (v *AdapterEngine) Info(ctx context.Context) (engines.Info, error) {
	in, err := v.e.Info(ctx)
	if err != nil {
		return in, err
	}
	in.Model = v.e.spec + " + LoRA " + v.a.name
	in.Capabilities = []string{"generate", "score", "train", "reference", "tis", "constrain"}
	in.Params = v.a.params()
	return in, nil
}

// Generate samples with the adapter.
func (v *AdapterEngine) Generate(ctx context.Context, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	names := make([]string, len(reqs))
	for i := range names {
		names[i] = v.a.name
	}
	return v.e.GenerateAdapters(ctx, reqs, names)
}

// Score scores with the adapter, or with the base for Reference requests.
func (v *AdapterEngine) Score(ctx context.Context, reqs []engines.ScoreRequest) ([]engines.Scores, error) {
	return v.e.score(ctx, reqs, v.a)
}

// Train takes one AdamW step of the adapter; the base does not change.
func (v *AdapterEngine) Train(ctx context.Context, b engines.Batch) (engines.TrainStats, error) {
	return v.e.train(ctx, b, v.a)
}

// Tokenize is the base's.
func (v *AdapterEngine) Tokenize(ctx context.Context, texts []string) ([][]int32, error) {
	return v.e.Tokenize(ctx, texts)
}

// Render is the base's: an adapter shares its tokenizer and chat template.
func (v *AdapterEngine) Render(ctx context.Context, reqs []engines.RenderRequest) ([][]int32, error) {
	return v.e.Render(ctx, reqs)
}

// Base is the engine the adapter is on.
func (v *AdapterEngine) Base() *Engine { return v.e }

// Name is the adapter's name.
func (v *AdapterEngine) Name() string { return v.a.name }

// Close releases nothing: the base engine is closed by its owner.
func (v *AdapterEngine) Close() error { return nil }

// PEFT's file names, and ours for the adapter's optimizer state.
const (
	fileAdapterConfig    = "adapter_config.json"
	fileAdapterWeights   = "adapter_model.safetensors"
	fileAdapterOptimizer = "adapter_optimizer.safetensors"
	fileAdapterOptState  = "adapter_optimizer.json"
)

// peftConfig is the part of PEFT's adapter_config.json that describes a LoRA adapter.
type peftConfig struct {
	PeftType            string   `json:"peft_type"`
	TaskType            string   `json:"task_type"`
	BaseModelNameOrPath string   `json:"base_model_name_or_path"`
	R                   int      `json:"r"`
	LoraAlpha           float64  `json:"lora_alpha"`
	LoraDropout         float64  `json:"lora_dropout"`
	TargetModules       []string `json:"target_modules"`
	Bias                string   `json:"bias"`
	FanInFanOut         bool     `json:"fan_in_fan_out"`
	InferenceMode       bool     `json:"inference_mode"`
	UseRSLoRA           bool     `json:"use_rslora"`
	UseDoRA             bool     `json:"use_dora"`
	InitLoraWeights     bool     `json:"init_lora_weights"`
}

// Save writes the adapter as a PEFT folder: adapter_config.json (its base_model_name_or_path the
// base this engine opened) and adapter_model.safetensors with PEFT's tensor names, plus, once it
// has trained, its AdamW state (adapter_optimizer.safetensors, adapter_optimizer.json).
func (v *AdapterEngine) Save(ctx context.Context, dir string) error {
	v.e.mu.RLock()
	defer v.e.mu.RUnlock()
	if v.e.closed {
		return ErrClosed
	}
	c := v.a.w.cfg
	pc := peftConfig{PeftType: "LORA", TaskType: "CAUSAL_LM", BaseModelNameOrPath: v.e.spec, R: c.Rank, LoraAlpha: c.Alpha,
		LoraDropout: c.Dropout, TargetModules: slices.Clone(c.Targets), Bias: "none", InferenceMode: true, InitLoraWeights: true}
	cj, err := json.MarshalIndent(pc, "", "  ")
	if err != nil {
		return err
	}
	files := map[string][]byte{
		fileAdapterConfig:  append(cj, '\n'),
		fileAdapterWeights: encodeSafetensors(loraTensors32(v.a.w), map[string]string{"format": "pt"}),
	}
	if v.a.opt.step > 0 {
		var ots []tensor
		for i, t := range v.a.w.tensors() {
			ots = append(ots, tensor{name: "exp_avg." + t.name, shape: t.shape, data: v.a.opt.m[i]},
				tensor{name: "exp_avg_sq." + t.name, shape: t.shape, data: v.a.opt.v[i]})
		}
		files[fileAdapterOptimizer] = encodeSafetensors(ots, nil)
		meta, _ := json.Marshal(optimizerMeta{Optimizer: "adamw", Step: v.a.opt.step})
		files[fileAdapterOptState] = append(meta, '\n')
	}
	if err := writeFiles(dir, files, []string{fileAdapterOptimizer, fileAdapterOptState}); err != nil {
		return fmt.Errorf("tiny: save adapter %q to %s: %w", v.a.name, dir, err)
	}
	return nil
}

// Load replaces the adapter (and its optimizer state, reset when the folder has none) with the
// PEFT folder in dir, which must be a LoRA of this base's shape; its rank, alpha and targets
// become the adapter's.
func (v *AdapterEngine) Load(ctx context.Context, dir string) error {
	fail := func(err error) error { return fmt.Errorf("tiny: load adapter %q from %s: %w", v.a.name, dir, err) }
	cj, err := os.ReadFile(filepath.Join(dir, fileAdapterConfig))
	if err != nil {
		return fail(err)
	}
	var pc peftConfig
	if err := json.Unmarshal(cj, &pc); err != nil {
		return fail(fmt.Errorf("%s: %w", fileAdapterConfig, err))
	}
	if pc.PeftType != "LORA" || pc.UseRSLoRA || pc.UseDoRA || (pc.Bias != "" && pc.Bias != "none") || pc.FanInFanOut {
		return fail(fmt.Errorf("%s: peft_type %q, use_rslora %v, use_dora %v, bias %q, fan_in_fan_out %v: "+
			"only a plain LoRA without bias loads", fileAdapterConfig, pc.PeftType, pc.UseRSLoRA, pc.UseDoRA, pc.Bias, pc.FanInFanOut))
	}
	c := LoRAConfig{Rank: pc.R, Alpha: pc.LoraAlpha, Targets: pc.TargetModules}
	if err := c.validate(); err != nil {
		return fail(err)
	}
	c.Dropout = pc.LoraDropout
	wb, err := os.ReadFile(filepath.Join(dir, fileAdapterWeights))
	if err != nil {
		return fail(err)
	}
	ts, err := decodeSafetensors(wb)
	if err != nil {
		return fail(fmt.Errorf("%s: %w", fileAdapterWeights, err))
	}
	v.e.mu.Lock()
	defer v.e.mu.Unlock()
	if v.e.closed {
		return ErrClosed
	}
	w := newLoRA[float32](v.e.m.w.cfg, c)
	if err := fillNamed(w.tensors(), ts, "", func(string) bool { return false }); err != nil {
		return fail(fmt.Errorf("%s: %w", fileAdapterWeights, err))
	}
	opt := newAdamStateOf(w.tensors())
	if ob, err := os.ReadFile(filepath.Join(dir, fileAdapterOptimizer)); err == nil {
		ots, err := decodeSafetensors(ob)
		if err != nil {
			return fail(fmt.Errorf("%s: %w", fileAdapterOptimizer, err))
		}
		var meta optimizerMeta
		mb, err := os.ReadFile(filepath.Join(dir, fileAdapterOptState))
		if err == nil {
			err = json.Unmarshal(mb, &meta)
		}
		if err != nil {
			return fail(fmt.Errorf("%s: %w", fileAdapterOptState, err))
		}
		m, vv := newLoRA[float32](v.e.m.w.cfg, c), newLoRA[float32](v.e.m.w.cfg, c)
		if err := fillNamed(m.tensors(), ots, "exp_avg.", func(n string) bool { return strings.HasPrefix(n, "exp_avg_sq.") }); err != nil {
			return fail(fmt.Errorf("%s: %w", fileAdapterOptimizer, err))
		}
		if err := fillNamed(vv.tensors(), ots, "exp_avg_sq.", func(n string) bool { return !strings.HasPrefix(n, "exp_avg_sq.") }); err != nil {
			return fail(fmt.Errorf("%s: %w", fileAdapterOptimizer, err))
		}
		opt.step = meta.Step
		for i, t := range m.tensors() {
			opt.m[i] = t.data
		}
		for i, t := range vv.tensors() {
			opt.v[i] = t.data
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return fail(err)
	}
	v.a.w, v.a.opt = w, opt
	return nil
}

// AdapterName is the adapter's name (engines.AdapterView).
func (v *AdapterEngine) AdapterName() string { return v.a.name }

// AdapterBase is the engine the adapter is on (engines.AdapterView).
func (v *AdapterEngine) AdapterBase() engines.AdapterGenerator { return v.e }
