package config

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strings"

	"gopkg.in/yaml.v3"
)

// Load reads a run config: slimen's schema or slime-n's policy YAML unchanged. It fills every
// default and validates the result; the error lists every problem of the file, each with its
// YAML line (an ErrorList).
func Load(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read config: %w", err)
	}
	return Parse(data, path)
}

// Parse is Load on bytes already read; file names them in messages and locates a relative
// model_args_path.
func Parse(data []byte, file string) (*Config, error) {
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, syntaxError(file, err)
	}
	d := newDecoder(file)
	c := &Config{File: file}
	if len(doc.Content) == 0 || isNull(resolve(doc.Content[0])) {
		return nil, &Error{File: file, Msg: "the file is empty; see docs/config.md for what a config holds"}
	}
	d.decode(doc.Content[0], reflect.ValueOf(c).Elem(), pathName{})
	if err := d.errs.err(); err != nil {
		return nil, err // defaults and checks on a half-read file would only add noise
	}
	r := resolver{d: d, c: c}
	r.resolve()
	r.validate()
	if err := d.errs.err(); err != nil {
		return nil, err
	}
	return c, nil
}

// syntaxError places yaml.v3's "yaml: line 3: did not find expected key" at its line. For
// parser errors yaml.v3 names the line where the enclosing block starts, which can be a line or
// two above the mistake, so the message says where to look.
func syntaxError(file string, err error) error {
	msg := strings.TrimPrefix(err.Error(), "yaml: ")
	var line int
	if n, _ := fmt.Sscanf(msg, "line %d:", &line); n == 1 {
		_, msg, _ = strings.Cut(msg, ": ")
		return &Error{File: file, Line: line, Msg: "not valid YAML: " + msg + " (at this line or a few below it; check the indentation)"}
	}
	return &Error{File: file, Msg: "not valid YAML: " + msg}
}

// resolver fills defaults and checks a decoded config.
type resolver struct {
	d *decoder
	c *Config
}

func (r *resolver) given(path string) bool { _, ok := r.d.given[path]; return ok }

// line is the YAML line of a key, or of the nearest enclosing entry that has one.
func (r *resolver) line(path string, fallback int) int {
	if l, ok := r.d.given[path]; ok {
		return l
	}
	return fallback
}

func (r *resolver) warnf(line int, path, format string, args ...any) {
	e := &Error{File: r.c.File, Line: line, Path: r.shown(path), Msg: fmt.Sprintf(format, args...)}
	r.c.Warnings = append(r.c.Warnings, e.Error())
}

// fill copies def's value into each scalar field of dst whose key was not given under prefix.
func (r *resolver) fill(dst, def any, prefix string) {
	dv, sv := reflect.ValueOf(dst).Elem(), reflect.ValueOf(def)
	s := r.d.spec(dv.Type())
	for key, i := range s.fields {
		switch dv.Field(i).Kind() {
		case reflect.Struct, reflect.Slice, reflect.Map:
			continue // filled by their own rules
		}
		if !r.given(prefix + "." + key) {
			dv.Field(i).Set(sv.Field(i))
		}
	}
}

func (r *resolver) resolve() {
	c := r.c
	r.fill(&c.Rollout, defaultRollout(), "rollout")
	r.fill(&c.Data, defaultData(), "data")
	r.fill(&c.Run, defaultRun(), "run")
	r.fill(&c.Sandbox, DefaultSandbox(), "sandbox")
	r.fill(&c.Eval, EvalConfig{NSamples: 1}, "eval")
	for i := range c.Policies {
		r.resolvePolicy(i)
	}
	r.resolveEval()
}

// TISFunctions maps the Python paths of slime's off-policy corrections, as slime-n's
// custom_tis_function_path names them, to tis_mode.
var TISFunctions = map[string]string{
	"slime.backends.megatron_utils.loss.vanilla_tis_function": "tis",
	"slime.backends.megatron_utils.loss.icepop_function":      "icepop",
}

// resolveTIS reads slime-n's custom_tis_function_path as tis_mode and warns about TIS settings
// that use_tis: false leaves unused.
func (r *resolver) resolveTIS(p *PolicyConfig, pp string) {
	t, tp := &p.Train, pp+".train"
	if path := t.CustomTISFunctionPath; path != "" {
		at := r.line(tp+".custom_tis_function_path", p.Line)
		mode, ok := TISFunctions[path]
		switch {
		case !ok:
			r.check(false, tp+".custom_tis_function_path", at,
				"%q is not one of slime's corrections slimen has (slimen runs no Python functions of its own): use tis_mode: tis (%s) or tis_mode: icepop (%s)",
				path, "slime.backends.megatron_utils.loss.vanilla_tis_function", "slime.backends.megatron_utils.loss.icepop_function")
		case r.given(tp+".tis_mode") && t.TISMode != mode:
			r.check(false, tp+".custom_tis_function_path", at,
				"names slime's %s function, but tis_mode is %q; set one of the two", mode, t.TISMode)
		default:
			t.TISMode = mode
		}
	}
	if !t.UseTIS {
		// Only values other than the defaults: the config.yaml a run writes lists every key.
		def := SlimeTrainDefaults()
		unused := map[string]bool{"tis_mode": t.TISMode != def.TISMode, "tis_clip": t.TISClip != def.TISClip,
			"tis_clip_low": t.TISClipLow != def.TISClipLow, "custom_tis_function_path": t.CustomTISFunctionPath != ""}
		for _, k := range []string{"tis_mode", "tis_clip", "tis_clip_low", "custom_tis_function_path"} {
			if path := tp + "." + k; r.given(path) && unused[k] {
				r.warnf(r.line(path, p.Line), path, "has no effect because use_tis is false (as in slime); set use_tis: true to correct for off-policy samples")
			}
		}
	}
}

func (r *resolver) resolvePolicy(i int) {
	p := &r.c.Policies[i]
	pp := fmt.Sprintf("policies[%d]", i)
	base := DefaultPolicy(p.Name)
	r.fill(p, base, pp)

	r.readModelArgs(i)
	def := SlimeTrainDefaults()
	if isBuiltin(p.HFCheckpoint) {
		def = TinyTrainDefaults()
	}
	r.fill(&p.Train, def, pp+".train")
	if !r.given(pp + ".train.eps_clip_high") {
		p.Train.EpsClipHigh = p.Train.EpsClip
	}
	if p.Train.CalculatePerTokenLoss && !r.given(pp+".train.loss_aggregation") {
		p.Train.LossAggregation = "token_mean"
	}
	r.resolveTIS(p, pp)
	if p.Train.KLCoef > 0 && !slices.Contains([]string{"reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"}, p.Train.AdvantageEstimator) {
		r.warnf(r.line(pp+".train.kl_coef", p.Line), pp+".train.kl_coef",
			"%g has no effect with advantage_estimator %s (as in slime): the reward-side KL is applied by reinforce_plus_plus, reinforce_plus_plus_baseline and ppo",
			p.Train.KLCoef, p.Train.AdvantageEstimator)
	}

	// A Hugging Face folder runs on the torch worker unless the config says otherwise (what a
	// slime-n config, which names no engine kind, expects); builtin:* models run on tiny, the
	// only engine that has them.
	r.fill(&p.Engine, base.Engine, pp+".engine")
	if !r.given(pp+".engine.kind") && !isBuiltin(p.HFCheckpoint) {
		p.Engine.Kind = "torch"
	}
	if p.Engine.Kind != "torch" {
		for _, k := range []string{"python", "device", "gpus", "args", "start_timeout", "max_restarts", "hang_timeout", "deterministic"} {
			if path := pp + ".engine." + k; r.given(path) {
				r.warnf(r.line(path, p.Line), path, "has no effect on a %s engine: it is a setting of the worker that kind: torch starts", p.Engine.Kind)
			}
		}
	}
	if !r.given(pp + ".engine.model_path") {
		p.Engine.ModelPath = p.HFCheckpoint
	}
	if !r.given(pp + ".num_gpus_per_node") {
		p.NumGPUsPerNode = 0
		if p.Engine.Kind == "torch" && p.Engine.Device != "cpu" {
			p.NumGPUsPerNode = defaultTorchGPUsPerNode
		}
	}

	if p.Train.KLLossCoef > 0 && !p.Train.UseKLLoss {
		r.warnf(r.line(pp+".train.kl_loss_coef", p.Line), pp+".train.kl_loss_coef",
			"%g has no effect because use_kl_loss is false (as in slime); set use_kl_loss: true to apply it",
			p.Train.KLLossCoef)
	}
	if p.LoRA != nil {
		r.fill(p.LoRA, DefaultLoRA(), pp+".lora")
		if !r.given(pp + ".lora.targets") {
			p.LoRA.Targets = DefaultLoRA().Targets
		}
	}
	r.warnTypos(pp+".train", p.Train.Extra, reflect.TypeFor[TrainConfig]())
	r.warnTypos(pp+".engine", p.Engine.Extra, reflect.TypeFor[EngineConfig]())
}

// otherNames are the names other trainers (Hugging Face's TrainingArguments, PyTorch's
// optimizers) give settings slimen reads under slime-n's (Megatron's) names.
var otherNames = map[string]string{
	"learning_rate": "lr",
	"max_grad_norm": "clip_grad",
	"batch_size":    "global_batch_size",
	"lr_scheduler":  "lr_decay_style",
}

// warnTypos flags pass-through keys one or two letters away from a key slimen reads: they go to
// the engine as written, which is right for Megatron's own flags and wrong for a typo.
func (r *resolver) warnTypos(prefix string, extra map[string]any, t reflect.Type) {
	s := r.d.spec(t)
	for _, k := range sortedKeys(extra) {
		best := nearest(k, append([]string(nil), s.order...))
		if other, ok := otherNames[k]; ok && has(s, other) {
			best = other // another framework's name of a key slimen reads, letters apart from it
		}
		if best != "" && best != k {
			r.warnf(r.line(prefix+"."+k, 0), prefix+"."+k, "passed through to the engine as it is not a key slimen reads; did you mean %s?", best)
		}
	}
}

func (r *resolver) resolveEval() {
	c := r.c
	def := c.Eval.Defaults
	ignored := func(path string, line int) {
		k := path[strings.LastIndexByte(path, '.')+1:]
		r.warnf(line, path, "slimen reads no %s (the script's eval_rollout decides how a task is run and scored); ignored", k)
	}
	for _, k := range sortedKeys(def.Extra) {
		ignored("eval.defaults."+k, r.line("eval.defaults."+k, 0))
	}
	for i := range c.Eval.Datasets {
		ds := &c.Eval.Datasets[i]
		dp := fmt.Sprintf("eval.datasets[%d]", i)
		fromDefaults := func(key string, set func()) {
			if !r.given(dp+"."+key) && r.given("eval.defaults."+key) {
				set()
				r.d.given[dp+"."+key] = r.d.given["eval.defaults."+key]
			}
		}
		fromDefaults("n_samples_per_eval_prompt", func() { ds.NSamples = def.NSamples })
		fromDefaults("temperature", func() { ds.Temperature = def.Temperature })
		fromDefaults("top_p", func() { ds.TopP = def.TopP })
		fromDefaults("max_response_len", func() { ds.MaxResponseLen = def.MaxResponseLen })
		fromDefaults("input_key", func() { ds.InputKey = def.InputKey })
		fromDefaults("label_key", func() { ds.LabelKey = def.LabelKey })
		fromDefaults("rm_type", func() { ds.RMType = def.RMType })
		for _, k := range sortedKeys(ds.Extra) {
			ignored(dp+"."+k, r.line(dp+"."+k, ds.Line))
		}
		for k, v := range def.Extra {
			if _, ok := ds.Extra[k]; !ok {
				if ds.Extra == nil {
					ds.Extra = map[string]any{}
				}
				ds.Extra[k] = v
			}
		}
		limit := 0
		if strings.HasPrefix(ds.Path, "synthetic:") {
			limit = defaultSyntheticEvalLimit
		}
		name := strings.TrimSuffix(filepath.Base(ds.Path), filepath.Ext(ds.Path))
		if strings.HasPrefix(ds.Path, "synthetic:") {
			name = strings.TrimPrefix(ds.Path, "synthetic:")
		}
		r.fill(ds, EvalDataset{
			Name: name, Path: ds.Path, InputKey: c.Data.InputKey, LabelKey: c.Data.LabelKey, Limit: limit,
			NSamples: c.Eval.NSamples, Temperature: c.Rollout.Temperature, TopP: c.Rollout.TopP,
			MaxResponseLen: c.Rollout.MaxResponseLen,
		}, dp)
	}
	c.Eval.Defaults = EvalDefaults{}
	if !r.given("run.eval_interval") && len(c.Eval.Datasets) > 0 {
		c.Run.EvalInterval = defaultEvalInterval
	}
}

func sortedKeys(m map[string]any) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// Policy returns the policy named name.
func (c *Config) Policy(name string) (*PolicyConfig, bool) {
	for i := range c.Policies {
		if c.Policies[i].Name == name {
			return &c.Policies[i], true
		}
	}
	return nil, false
}

// GPUs sizes the cluster as slime-n does: actor GPUs = Σ megatron_num_nodes·num_gpus_per_node,
// rollout GPUs = Σ sglang_num_nodes·num_gpus_per_node, total = the larger of the two with
// run.colocate, else their sum. Tiny and remote engines default to num_gpus_per_node 0, so they
// count for nothing unless the config says otherwise.
func (c *Config) GPUs() (actor, rollout, total int) {
	for _, p := range c.Policies {
		actor += p.MegatronNumNodes * p.NumGPUsPerNode
		rollout += p.SGLangNumNodes * p.NumGPUsPerNode
	}
	if c.Run.Colocate {
		return actor, rollout, max(actor, rollout)
	}
	return actor, rollout, actor + rollout
}

// IsCritic reports whether the policy is a PPO critic: role critic, or slime-n's critic shape
// (trainable, no engine replicas: sglang_num_nodes 0, advantage_estimator ppo).
func (p *PolicyConfig) IsCritic() bool {
	return p.Role == "critic" || (p.Trainable && p.SGLangNumNodes == 0 && p.Train.AdvantageEstimator == "ppo")
}

// KLReference is the model the policy's KL loss measures against: ref_load, else hf_checkpoint
// (as in slime-n), never the load: folder the policy resumes from.
func (p *PolicyConfig) KLReference() string {
	if p.RefLoad != "" {
		return p.RefLoad
	}
	return p.HFCheckpoint
}

// PassThrough lists the keys of the policy that slimen does not interpret, as "train.KEY",
// "engine.KEY" or "KEY" (slime-n's policy-level data keys), sorted, for the host to print once
// at start-up. Train and engine keys reach the engine, which may use them.
func (p *PolicyConfig) PassThrough() []string {
	var out []string
	for _, k := range sortedKeys(p.Extra) {
		out = append(out, k)
	}
	for _, k := range sortedKeys(p.Train.Extra) {
		out = append(out, "train."+k)
	}
	for _, k := range sortedKeys(p.Engine.Extra) {
		out = append(out, "engine."+k)
	}
	return out
}

// Marshal renders the resolved config as YAML in slimen's names, every default spelled out. Load
// reads it back to an equal config; the host writes it to <out>/config.yaml.
func (c *Config) Marshal() ([]byte, error) {
	var b bytes.Buffer
	if c.File != "" {
		fmt.Fprintf(&b, "# resolved by slimen from %s\n", c.File)
	} else {
		b.WriteString("# resolved by slimen: zero-config defaults\n")
	}
	enc := yaml.NewEncoder(&b)
	enc.SetIndent(2)
	if err := enc.Encode(c); err != nil {
		return nil, fmt.Errorf("marshal config: %w", err)
	}
	if err := enc.Close(); err != nil {
		return nil, fmt.Errorf("marshal config: %w", err)
	}
	return b.Bytes(), nil
}

// Overrides are the command line's replacements for config values; nil leaves a value alone.
type Overrides struct {
	Steps *int    // --steps
	Seed  *uint64 // --seed
	Out   *string // --out
	Data  *string // --data: a JSONL file or synthetic:arith[?…]
}

// Override applies command-line values after Load or Default and checks them.
func (c *Config) Override(o Overrides) error {
	var errs []error
	if o.Steps != nil {
		if *o.Steps < 1 {
			errs = append(errs, fmt.Errorf("--steps %d: a run needs at least 1 step", *o.Steps))
		} else {
			c.Run.Steps = *o.Steps
		}
	}
	if o.Seed != nil {
		c.Run.Seed = *o.Seed
	}
	if o.Out != nil {
		if *o.Out == "" {
			errs = append(errs, errors.New("--out: give a folder for the run's outputs"))
		} else {
			c.Run.Out = *o.Out
		}
	}
	if o.Data != nil {
		if msg := checkDataPath(*o.Data); msg != "" {
			errs = append(errs, fmt.Errorf("--data %q: %s", *o.Data, msg))
		} else {
			c.Data.Path = *o.Data
		}
	}
	return errors.Join(errs...)
}
