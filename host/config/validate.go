package config

import (
	"fmt"
	"math"
	"net"
	"net/url"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/advantage"
	"github.com/slimen/slimen/host/tasks"
)

// The values slimen accepts for the enumerated keys.
var (
	roles          = []string{"actor", "critic"}
	bufferModes    = []string{"split", "shared"}
	estimators     = advantage.Names()
	klLossTypes    = []string{"k1", "k2", "k3", "low_var_kl"}
	optimizers     = []string{"adam", "sgd"}
	aggregations   = []string{"sample_mean", "token_mean", "group_token_mean", "token_sum"}
	tisModes       = []string{"tis", "icepop"}
	sglWorkerTypes = []string{"regular", "prefill", "decode", "placeholder", "encoder"}
)

// check records a problem with the value at path (canonical) unless ok. fallback is the line to
// report when the value was a default.
func (r *resolver) check(ok bool, path string, fallback int, format string, args ...any) {
	if ok {
		return
	}
	r.d.errs = append(r.d.errs, &Error{File: r.c.File, Line: r.line(path, fallback), Path: r.shown(path), Msg: fmt.Sprintf(format, args...)})
}

// shown spells a canonical path the way the user wrote it (megatron: rather than train:), also
// for a defaulted key inside a block the user wrote.
func (r *resolver) shown(path string) string {
	if s, ok := r.d.raw[path]; ok {
		return s
	}
	if i := strings.LastIndexByte(path, '.'); i > 0 {
		return r.shown(path[:i]) + path[i:]
	}
	return path
}

func oneOf(v string, allowed []string) bool { return slices.Contains(allowed, v) }

func list(allowed []string) string { return strings.Join(allowed, ", ") }

func (r *resolver) validate() {
	c := r.c
	byName := map[string]int{}
	for i := range c.Policies {
		p := &c.Policies[i]
		pp := fmt.Sprintf("policies[%d]", i)
		r.check(p.Name != "", pp, p.Line, "a policy needs a name: add name: <policy> (the name the script passes to generate)")
		if err := CheckPolicyName(p.Name); p.Name != "" && err != nil {
			r.check(false, pp+".name", p.Line, "%v", err)
		}
		if j, dup := byName[p.Name]; dup && p.Name != "" {
			q := &c.Policies[j]
			r.check(false, pp+".name", p.Line, "policy %q is defined twice (lines %d and %d); give each policy a unique name",
				p.Name, r.line(fmt.Sprintf("policies[%d].name", j), q.Line), r.line(pp+".name", p.Line))
		} else {
			byName[p.Name] = i
		}
		r.validatePolicy(p, pp)
	}
	r.validateShared()
	r.validatePPO()

	ro := c.Rollout
	r.check(ro.BatchSize > 0, "rollout.batch_size", 0, "must be at least 1 (tasks per step), got %d", ro.BatchSize)
	r.validateSampling("rollout", 0, ro.MaxResponseLen, ro.Temperature, ro.TopP)
	r.check(ro.MaxFailedFraction >= 0 && ro.MaxFailedFraction <= 1, "rollout.max_failed_fraction", 0, "must be in [0, 1], got %g", ro.MaxFailedFraction)
	r.check(ro.TimeoutS >= 0, "rollout.timeout_s", 0, "must be ≥ 0 seconds (0: no limit), got %g", ro.TimeoutS)
	r.check(ro.StopGraceS >= 0, "rollout.stop_grace_s", 0, "must be ≥ 0 seconds, got %g", ro.StopGraceS)
	r.check(!ro.Partial || ro.MaxStaleness >= 1, "rollout.partial", 0, "needs rollout.max_staleness ≥ 1: "+
		"a generation is continued under the weights trained while it ran (docs/async.md)")
	r.check(ro.MaxStaleness >= 0, "rollout.max_staleness", 0, "must be ≥ 0 (0: the synchronous loop), got %d", ro.MaxStaleness)
	r.check(ro.MaxBatchTokens >= 0, "rollout.max_batch_tokens", 0, "must be ≥ 0 (0: no limit), got %d", ro.MaxBatchTokens)

	msg := checkDataPath(c.Data.Path)
	r.check(msg == "", "data.path", 0, "%s", msg)
	r.check(c.Data.InputKey != "", "data.input_key", 0, "must name the JSONL key that holds the prompt")

	r.check(c.Eval.NSamples >= 1, "eval.n_samples", 0, "must be at least 1, got %d", c.Eval.NSamples)
	names := map[string]int{}
	for i, ds := range c.Eval.Datasets {
		dp := fmt.Sprintf("eval.datasets[%d]", i)
		msg := checkDataPath(ds.Path)
		r.check(msg == "", dp+".path", ds.Line, "%s", msg)
		if j, dup := names[ds.Name]; dup {
			r.check(false, dp+".name", ds.Line, "eval dataset %q is defined twice (lines %d and %d); names label the eval metrics, give each a unique one",
				ds.Name, c.Eval.Datasets[j].Line, ds.Line)
		}
		names[ds.Name] = i
		r.check(ds.Limit >= 0, dp+".limit", ds.Line, "must be ≥ 0 (0: the whole file), got %d", ds.Limit)
		r.check(ds.Limit > 0 || !strings.HasPrefix(ds.Path, "synthetic:"), dp+".limit", ds.Line, "a synthetic source never ends: give a limit of at least 1")
		r.check(ds.NSamples >= 1, dp+".n_samples_per_eval_prompt", ds.Line, "must be at least 1, got %d", ds.NSamples)
		r.validateSampling(dp, ds.Line, ds.MaxResponseLen, ds.Temperature, ds.TopP)
		r.check(ds.InputKey != "", dp+".input_key", ds.Line, "must name the JSONL key that holds the prompt")
	}

	run := c.Run
	r.check(run.Steps >= 1, "run.steps", 0, "a run needs at least 1 step, got %d", run.Steps)
	r.check(run.SaveInterval >= 0, "run.save_interval", 0, "must be ≥ 0 (0: no periodic checkpoints), got %d", run.SaveInterval)
	r.check(run.SaveMinutes >= 0, "run.save_minutes", 0, "must be ≥ 0 (0: no checkpoints by wall time), got %g", run.SaveMinutes)
	r.check(run.EvalInterval >= 0, "run.eval_interval", 0, "must be ≥ 0 (0: no periodic eval), got %d", run.EvalInterval)
	r.check(run.KeepCheckpoints >= 0, "run.keep_checkpoints", 0, "must be ≥ 0 (0: keep all), got %d", run.KeepCheckpoints)
	r.check(run.OnSignal == "finish" || run.OnSignal == "abandon", "run.on_signal", 0, "must be finish or abandon, got %q", run.OnSignal)
	r.check(run.SaveRollouts >= 0 && run.SaveRollouts <= MaxSaveRollouts, "run.save_rollouts", 0,
		"must be between 0 (keep none) and %d rollouts a step, got %d", MaxSaveRollouts, run.SaveRollouts)
	if w := run.Wandb; w != nil {
		r.check(w.Mode == "" || w.Mode == "online" || w.Mode == "offline" || w.Mode == "disabled", "run.wandb.mode", r.line("run.wandb.mode", 0),
			"must be online, offline or disabled (or left out: the SDK reads WANDB_MODE), got %q", w.Mode)
	}
	r.validateSandbox()
}

// validateSandbox checks the sandbox: section (docs/sandbox.md). A check of a key the user did
// not write reports the line of sandbox:, or none for a config without one.
func (r *resolver) validateSandbox() {
	sb := r.c.Sandbox
	at := r.line("sandbox", 0)
	atLeast := func(key string, v, lo int64) {
		r.check(v >= lo, "sandbox."+key, at, "must be at least %d, got %d", lo, v)
	}
	atLeast("steps", int64(min(sb.Steps, 1<<62)), 1)
	atLeast("generate_calls", int64(sb.GenerateCalls), 1)
	atLeast("tokens", int64(sb.Tokens), 1)
	atLeast("prompt_bytes", int64(sb.PromptBytes), 1)
	r.check(sb.WallSeconds > 0, "sandbox.wall_seconds", at, "must be more than 0 seconds, got %g", sb.WallSeconds)
	atLeast("print_bytes", int64(sb.PrintBytes), 1)
	atLeast("state_bytes", int64(sb.StateBytes), 1)
	r.check(sb.StateTotalBytes >= sb.StateBytes, "sandbox.state_total_bytes", at,
		"is %d, less than state_bytes (%d): the whole store must have room for one entry", sb.StateTotalBytes, sb.StateBytes)
	atLeast("parallel_items", int64(sb.ParallelItems), 1)
	atLeast("threads", int64(sb.Threads), 1)
	// One prompt (or one stored value) travels to the host in one message, and JSON escaping can
	// grow it; the host reads each message whole, so the cap stays far below its memory.
	need := 2 * max(sb.PromptBytes, sb.StateBytes, 32<<10)
	r.check(sb.MessageBytes >= need, "sandbox.message_bytes", at,
		"is %d, less than %d: a prompt of prompt_bytes (%d) or a state entry of state_bytes (%d) must fit in one message, "+
			"escaped, so give at least twice the larger (and at least 64 KiB)",
		sb.MessageBytes, need, sb.PromptBytes, sb.StateBytes)
	r.check(sb.MessageBytes <= maxMessageBytes, "sandbox.message_bytes", at,
		"is %d, more than %d (256 MiB): the host reads each message of a child whole, so this is host memory", sb.MessageBytes, maxMessageBytes)
	atLeast("memory_mb", int64(sb.MemoryMB), 64)
	atLeast("cpu_seconds", int64(sb.CPUSeconds), 0)
	atLeast("processes", int64(sb.Processes), 1)
	atLeast("agent_pids", int64(sb.AgentPids), 4)
	r.check(sb.AgentCPUs >= 0.01, "sandbox.agent_cpus", at, "must be at least 0.01 CPUs, got %g", sb.AgentCPUs)
	for _, name := range sb.AgentEnv {
		r.check(!ReservedAgentEnv(name), "sandbox.agent_env", at,
			"names %q, which a script may not set: loader, shell and interpreter variables (LD_*, BASH_ENV, BASH_FUNC_*, PYTHON*, "+
				"NODE_OPTIONS, …) run code in the program, and PATH, HOME, TMPDIR, "+
				"LANG and the OPENAI_*/SLIMEN_* variables are the jail's", name)
	}
	for _, p := range sb.AgentRead {
		r.check(filepath.IsAbs(p) && filepath.Clean(p) != "/", "sandbox.agent_read", at, "must list absolute paths other than /, got %q", p)
	}
	for _, prog := range sb.Programs {
		for _, w := range strings.Fields(prog) {
			_, err := path.Match(w, "")
			r.check(err == nil, "sandbox.programs", at, "entry %q: the word %q is not a valid pattern (path.Match: %v)", prog, w, err)
		}
	}

	// Grants name policies of this config (a config without policies leaves them to the script,
	// as zero-config does, so there is nothing to check them against).
	if len(r.c.Policies) == 0 {
		return
	}
	for _, name := range sb.Policies {
		_, ok := r.c.Policy(name)
		r.check(ok, "sandbox.policies", at, "names policy %q, which the config does not define (it defines %s)", name, quoted(r.c))
	}
	for _, name := range sb.Train {
		p, ok := r.c.Policy(name)
		if !ok {
			r.check(false, "sandbox.train", at, "names policy %q, which the config does not define (it defines %s)", name, quoted(r.c))
			continue
		}
		r.check(p.Trainable, "sandbox.train", at,
			"grants training of policy %q, which is frozen (trainable: false, policy at line %d); remove it from sandbox.train or make it trainable", name, p.Line)
		r.check(len(sb.Policies) == 0 || slices.Contains(sb.Policies, name), "sandbox.train", at,
			"grants training of policy %q, which sandbox.policies does not grant; add it there too", name)
	}
}

// ReservedAgentEnv says whether a variable is one no script may set for an agent() program,
// even where the operator's sandbox.agent_env lists it. Those are the variables that make a
// loader, a shell or an interpreter run code of the setter's choosing, and those the jail sets
// itself.
func ReservedAgentEnv(name string) bool {
	n := strings.ToUpper(name)
	for _, p := range []string{"LD_", "BASH_FUNC_", "PYTHON", "PERL", "RUBY", "NODE_", "OPENAI_", "SLIMEN_", "MALLOC_", "GLIBC_", "JAVA_", "_JAVA_",
		"JDK_", "GCONV", "NLSPATH", "LOCPATH", "DYLD_", "LUA_", "R_", "GIT_", "SSL_", "GODEBUG", "GOTRACE"} {
		if strings.HasPrefix(n, p) {
			return true
		}
	}
	switch n {
	case "BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "PS4", "PROMPT_COMMAND", "IFS", "CDPATH", "BROWSER", "EDITOR", "VISUAL", "PAGER",
		"HOSTALIASES", "RES_OPTIONS", "LOCALDOMAIN", "TZDIR", "PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "SHELL", "USER", "LOGNAME", "TERMINFO":
		return true
	}
	return name == "" || strings.ContainsAny(name, "=\x00")
}

// maxMessageBytes bounds sandbox.message_bytes.
const maxMessageBytes = 256 << 20

// quoted lists a config's policy names for messages.
func quoted(c *Config) string {
	var names []string
	for _, p := range c.Policies {
		names = append(names, fmt.Sprintf("%q", p.Name))
	}
	return strings.Join(names, ", ")
}

func (r *resolver) validatePolicy(p *PolicyConfig, pp string) {
	at := p.Line
	r.check(oneOf(p.Role, roles), pp+".role", at, "role %q is not one of %s", p.Role, list(roles))
	r.check(p.HFCheckpoint != "", pp+".hf_checkpoint", at, "is empty: give a Hugging Face model folder, or leave the key out for %s", BuiltinCheckpoint)
	r.check(oneOf(p.BufferMode, bufferModes), pp+".buffer_mode", at, "buffer_mode %q is not one of %s", p.BufferMode, list(bufferModes))
	r.check(p.NumGPUsPerNode >= 0, pp+".num_gpus_per_node", at, "must be ≥ 0, got %d", p.NumGPUsPerNode)
	r.check(p.MegatronNumNodes >= 0, pp+".megatron_num_nodes", at, "must be ≥ 0, got %d", p.MegatronNumNodes)
	r.check(p.SGLangNumNodes >= 0, pp+".sglang_num_nodes", at, "must be ≥ 0, got %d", p.SGLangNumNodes)

	t, tp := p.Train, pp+".train"
	r.check(t.LR >= 0, tp+".lr", at, "must be ≥ 0, got %g", t.LR)
	r.check(t.WeightDecay >= 0, tp+".weight_decay", at, "must be ≥ 0, got %g", t.WeightDecay)
	r.check(t.AdamBeta1 >= 0 && t.AdamBeta1 < 1, tp+".adam_beta1", at, "must be in [0, 1), got %g", t.AdamBeta1)
	r.check(t.AdamBeta2 >= 0 && t.AdamBeta2 < 1, tp+".adam_beta2", at, "must be in [0, 1), got %g", t.AdamBeta2)
	r.check(t.ClipGrad >= 0, tp+".clip_grad", at, "must be ≥ 0 (0: no clipping), got %g", t.ClipGrad)
	r.check(oneOf(t.Optimizer, optimizers), tp+".optimizer", at, "optimizer %q is not one of %s", t.Optimizer, list(optimizers))
	r.check(t.MicroBatchSize > 0, tp+".micro_batch_size", at, "must be at least 1, got %d", t.MicroBatchSize)
	r.check(t.GlobalBatchSize >= 0, tp+".global_batch_size", at, "must be ≥ 0 (samples per optimizer step; "+
		"0: all of a step's samples in one), got %d", t.GlobalBatchSize)
	r.check(oneOf(t.AdvantageEstimator, estimators), tp+".advantage_estimator", at, "advantage_estimator %q is not one of %s", t.AdvantageEstimator,
		list(estimators))
	r.check(t.NSamplesPerPrompt > 0, tp+".n_samples_per_prompt", at, "must be at least 1, got %d", t.NSamplesPerPrompt)
	r.check(t.EpsClip >= 0, tp+".eps_clip", at, "must be ≥ 0, got %g", t.EpsClip)
	r.check(t.EpsClipHigh >= 0, tp+".eps_clip_high", at, "must be ≥ 0, got %g", t.EpsClipHigh)
	r.check(t.KLCoef >= 0, tp+".kl_coef", at, "must be ≥ 0, got %g", t.KLCoef)
	r.check(t.KLLossCoef >= 0, tp+".kl_loss_coef", at, "must be ≥ 0, got %g", t.KLLossCoef)
	r.check(oneOf(t.KLLossType, klLossTypes), tp+".kl_loss_type", at, "kl_loss_type %q is not one of %s", t.KLLossType, list(klLossTypes))
	r.check(t.Gamma >= 0 && t.Gamma <= 1, tp+".gamma", at, "must be in [0, 1], got %g", t.Gamma)
	r.check(t.Lambda >= 0 && t.Lambda <= 1, tp+".lambd", at, "must be in [0, 1], got %g", t.Lambda)
	r.check(t.OPDKLCoef >= 0, tp+".opd_kl_coef", at, "must be ≥ 0, got %g", t.OPDKLCoef)
	r.check(oneOf(t.LossAggregation, aggregations), tp+".loss_aggregation", at, "loss_aggregation %q is not one of %s", t.LossAggregation, list(aggregations))
	r.check(!t.CalculatePerTokenLoss || t.LossAggregation == "token_mean", tp+".calculate_per_token_loss", at,
		"true asks for loss_aggregation token_mean, but loss_aggregation is %q; set one of the two", t.LossAggregation)
	r.check(oneOf(t.TISMode, tisModes), tp+".tis_mode", at, "tis_mode %q is not one of %s "+
		"(tis: truncated importance sampling, icepop: IcePop's masking)", t.TISMode, list(tisModes))
	r.check(t.TISClip > 0, tp+".tis_clip", at, "must be > 0 (the upper bound of the importance weight; slime's default is 2), got %g", t.TISClip)
	r.check(t.TISClipLow >= 0 && t.TISClipLow <= t.TISClip, tp+".tis_clip_low", at, "must be in [0, tis_clip %g], got %g", t.TISClip, t.TISClipLow)
	r.check(t.KLCoef == 0 || t.KLLossCoef == 0, tp+".kl_coef", at,
		"%g and kl_loss_coef %g are both set; as in slime, only one of the two may be non-zero", t.KLCoef, t.KLLossCoef)

	if p.LoRA != nil {
		r.validateLoRA(p, pp)
	}

	e, ep := p.Engine, pp+".engine"
	kinds := engineKindNames()
	r.check(oneOf(e.Kind, kinds), ep+".kind", at, "engine kind %q is not one of %s", e.Kind, list(kinds))
	if e.Kind == "remote" {
		_, _, err := net.SplitHostPort(e.Address)
		r.check(e.Address != "", ep+".address", at, "a remote engine needs address: host:port")
		r.check(e.Address == "" || err == nil, ep+".address", at, "%q is not host:port", e.Address)
	}
	r.check(!e.Continue || e.Kind == "remote", ep+".continue", at,
		"applies to remote engines only (a server the run does not start, which may hold what an earlier run taught it); "+
			"a %s engine starts from hf_checkpoint or load:", e.Kind)
	if e.Kind == "torch" {
		r.validateTorch(p, pp)
	}
	if e.Kind == "openai" {
		r.validateOpenAI(p, pp)
	}
	r.check(e.NumGPUsPerEngine >= 0, ep+".num_gpus_per_engine", at, "must be ≥ 0, got %d", e.NumGPUsPerEngine)
	r.check(e.MemFractionStatic >= 0 && e.MemFractionStatic <= 1, ep+".mem_fraction_static", at, "must be in [0, 1], got %g", e.MemFractionStatic)
	r.check(e.Threads >= 0, ep+".threads", at, "must be ≥ 0 (0: all cores), got %d", e.Threads)
	sum := 0
	for j, g := range e.ServerGroups {
		gp := fmt.Sprintf("%s.server_groups[%d]", ep, j)
		r.check(oneOf(g.WorkerType, sglWorkerTypes), gp+".worker_type", at, "worker_type %q is not one of %s", g.WorkerType, list(sglWorkerTypes))
		r.check(g.NumGPUs > 0, gp+".num_gpus", at, "must be at least 1, got %d", g.NumGPUs)
		sum += g.NumGPUs
	}
	// slime-n's placement rule: a trainable policy's engine replicas fill exactly its rollout GPUs.
	if p.Trainable && len(e.ServerGroups) > 0 {
		want := p.SGLangNumNodes * p.NumGPUsPerNode
		r.check(sum == want, ep+".server_groups", at,
			"the server groups have %d GPUs in all but sglang_num_nodes × num_gpus_per_node is %d × %d = %d; make them equal",
			sum, p.SGLangNumNodes, p.NumGPUsPerNode, want)
	}
}

// validateLoRA checks a policy's lora: block. Adapters run on the tiny and torch engines and on
// engine servers (kind remote), which train them without dropout; a critic (a value head) trains
// full weights; an openai engine only samples.
func (r *resolver) validateLoRA(p *PolicyConfig, pp string) {
	l, lp := p.LoRA, pp+".lora"
	at := r.line(lp, p.Line)
	r.check(l.Rank >= 1, lp+".rank", at, "must be at least 1, got %d", l.Rank)
	r.check(l.Alpha > 0, lp+".alpha", at, "must be > 0 (the update is scaled by alpha/rank), got %g", l.Alpha)
	r.check(l.Dropout >= 0 && l.Dropout < 1, lp+".dropout", at, "must be in [0, 1), got %g", l.Dropout)
	r.check(len(l.Targets) > 0, lp+".targets", at, "is empty: name the projections to adapt, some of %s", list(engines.LoRATargets))
	seen := map[string]bool{}
	for _, t := range l.Targets {
		r.check(oneOf(t, engines.LoRATargets), lp+".targets", at, "%q is not a projection of the model; want some of %s", t, list(engines.LoRATargets))
		r.check(!seen[t], lp+".targets", at, "%q is listed twice", t)
		seen[t] = true
	}
	r.check(p.Role != "critic", lp, at, "policy %q is a critic: its value head trains with full weights; remove lora:", p.Name)
	r.check(p.Engine.Kind != "openai", lp, at, "policy %q: LoRA adapters run on the tiny and torch engines and on an engine "+
		"server (kind remote: slimen serve, the torch worker), and its engine kind is openai, "+
		"which only samples; use engine: {kind: tiny}, {kind: torch} or {kind: remote}, or remove lora:", p.Name)
	r.check(!p.Engine.Continue, pp+".engine.continue", r.line(pp+".engine.continue", at), "policy %q: engine.continue "+
		"trains on the full weights a server holds, and a LoRA policy's adapter starts new (or from load:) on every run, "+
		"over the server's frozen base; remove continue or lora:", p.Name)
	r.check(l.Dropout == 0, lp+".dropout", at, "%g: the engines train adapters without dropout (a step's loss must be the "+
		"one its log-probs were scored with); set dropout: 0", l.Dropout)
}

// validateOpenAI checks a policy on an OpenAI-compatible server (engine.kind openai), which only
// generates: such a policy is frozen.
func (r *resolver) validateOpenAI(p *PolicyConfig, pp string) {
	e, ep := p.Engine, pp+".engine"
	u, err := url.Parse(e.BaseURL)
	r.check(e.BaseURL != "", ep+".base_url", p.Line, "policy %q: an openai engine needs base_url: the server's API root, e.g. http://127.0.0.1:8000/v1", p.Name)
	r.check(e.BaseURL == "" || (err == nil && (u.Scheme == "http" || u.Scheme == "https") && u.Host != ""), ep+".base_url", r.line(ep+".base_url", p.Line),
		"%q is not an http:// or https:// URL such as http://127.0.0.1:8000/v1", e.BaseURL)
	r.check(e.Model != "", ep+".model", p.Line, "policy %q: an openai engine needs model: a name the server's /v1/models lists", p.Name)
	r.check(e.MaxRetries >= -1, ep+".max_retries", r.line(ep+".max_retries", p.Line), "must be ≥ -1 (0: 4 retries, -1: none), got %d", e.MaxRetries)
	r.check(e.MaxConcurrency >= 0, ep+".max_concurrency", r.line(ep+".max_concurrency", p.Line), "must be ≥ 0 (0: 32), got %d", e.MaxConcurrency)
	r.check(oneOf(e.TokenIDs, []string{"", "auto", "vllm", "none"}), ep+".token_ids", r.line(ep+".token_ids", p.Line),
		"token_ids %q is not one of auto, vllm, none", e.TokenIDs)
	r.check(oneOf(e.MaxTokensField, []string{"", "auto", "max_tokens", "max_completion_tokens"}), ep+".max_tokens_field",
		r.line(ep+".max_tokens_field", p.Line), "max_tokens_field %q is not one of auto, max_tokens, max_completion_tokens", e.MaxTokensField)
	key := pp + ".trainable"
	if !r.given(key) {
		key = ep + ".kind"
	}
	r.check(!p.Trainable, key, r.line(key, p.Line),
		"policy %q is trainable, but an openai engine only generates (the OpenAI API has no score, train or save): "+
			"set trainable: false for a frozen judge, expert or teacher, "+
			"or serve the model on a torch or tiny engine to train it",
		p.Name)
}

// torchDevice is what engine.device may be: a torch device name, with an index or not.
var torchDevice = regexp.MustCompile(`^[a-z]+(:[0-9]+)?$`)

// validateTorch checks the settings of a worker the host starts (engine.kind torch).
func (r *resolver) validateTorch(p *PolicyConfig, pp string) {
	e, ep := p.Engine, pp+".engine"
	// A torch worker loads a model folder; builtin:* models live in the Go binary.
	ckpt := pp + ".hf_checkpoint"
	if !r.given(ckpt) {
		ckpt = ep + ".kind"
	}
	r.check(!isBuiltin(p.HFCheckpoint), ckpt, p.Line,
		"policy %q: a torch engine loads a Hugging Face model folder, and %s is built into the Go binary for the tiny engine; "+
			"give hf_checkpoint: a model folder (python -m slimen_torch make-model writes a small "+
			"random one) or use engine: {kind: tiny}",
		p.Name, p.HFCheckpoint)
	r.check(e.Address == "", ep+".address", p.Line,
		"policy %q: the host starts a torch worker itself, on a port of its choosing; "+
			"to reach a worker started elsewhere use engine: {kind: remote, address: %s}", p.Name, e.Address)
	r.check(e.Device == "" || torchDevice.MatchString(e.Device), ep+".device", p.Line,
		"%q is not a torch device: give cpu, cuda, cuda:N, or leave it out (the first GPU if there is one)", e.Device)
	for j, g := range e.GPUs {
		r.check(g != "" && !strings.ContainsAny(g, ", \t"), fmt.Sprintf("%s.gpus[%d]", ep, j), r.line(ep+".gpus", p.Line),
			"%q is not a GPU: give one index (0) or UUID (GPU-…) per list item", g)
	}
	r.check(e.MaxRestarts == nil || *e.MaxRestarts >= 0, ep+".max_restarts", r.line(ep+".max_restarts", p.Line),
		"must be ≥ 0 (0: a worker that dies is not started again), got %d", deref(e.MaxRestarts))
	r.check(e.HangTimeout >= 0, ep+".hang_timeout", r.line(ep+".hang_timeout", p.Line), "must be ≥ 0 (0: the default, 2 minutes), got %v", e.HangTimeout)
	if e.Deterministic {
		r.check(p.NumGPUsPerNode <= 1, ep+".deterministic", r.line(ep+".deterministic", p.Line),
			"policy %q: the batch-invariant kernels run on one GPU a worker, and num_gpus_per_node is %d: "+
				"set num_gpus_per_node: 1 or deterministic: false", p.Name, p.NumGPUsPerNode)
		for j, a := range e.Args {
			r.check(!strings.HasPrefix(a, "--kv-cache-dtype") || (j+1 < len(e.Args) && e.Args[j+1] == "auto") || a == "--kv-cache-dtype=auto",
				fmt.Sprintf("%s.args[%d]", ep, j), r.line(ep+".args", p.Line),
				"policy %q: deterministic needs the KV cache in the model's dtype (an fp8 cache rounds the keys generation reads and "+
					"training does not): remove %s", p.Name, a)
		}
	}
	for j, a := range e.Args {
		for _, f := range hostSetFlags {
			r.check(a != f.flag && !strings.HasPrefix(a, f.flag+"="), fmt.Sprintf("%s.args[%d]", ep, j), r.line(ep+".args", p.Line),
				"%s is set by the host from %s; remove it from args", f.flag, f.from)
		}
	}
}

// hostSetFlags are the worker's `serve` flags that the host sets itself, and from what.
var hostSetFlags = []struct{ flag, from string }{
	{"--model", "hf_checkpoint (or load:)"},
	{"--listen", "a free loopback port of its choosing"},
	{"--address-file", "a file of its own"},
	{"--device", "engine.device"},
	{"--token-env", "engine.token_env"},
	{"--deterministic", "engine.deterministic"},
}

// validateShared checks what slime-n checks of shared buffers: the policies pool their samples
// into one group normalisation, so they must agree on how it is done.
func (r *resolver) validateShared() {
	var first *PolicyConfig
	firstAt := 0
	for i := range r.c.Policies {
		p := &r.c.Policies[i]
		if p.BufferMode != "shared" {
			continue
		}
		if first == nil {
			first, firstAt = p, i
			continue
		}
		for _, k := range []struct {
			key  string
			a, b any
		}{
			{"advantage_estimator", first.Train.AdvantageEstimator, p.Train.AdvantageEstimator},
			{"n_samples_per_prompt", first.Train.NSamplesPerPrompt, p.Train.NSamplesPerPrompt},
		} {
			path := fmt.Sprintf("policies[%d].train.%s", i, k.key)
			r.check(k.a == k.b, path, p.Line,
				"shared-buffer policies must agree on %s: %q (line %d) has %v, %q has %v; set the same value in both or use buffer_mode: split",
				k.key, first.Name, r.line(fmt.Sprintf("policies[%d].train.%s", firstAt, k.key), first.Line), k.a, p.Name, k.b)
		}
	}
}

// validatePPO requires a critic wherever an actor trains with PPO: its advantages need values.
func (r *resolver) validatePPO() {
	hasCritic := false
	for i := range r.c.Policies {
		hasCritic = hasCritic || r.c.Policies[i].IsCritic()
	}
	for i := range r.c.Policies {
		p := &r.c.Policies[i]
		if p.Trainable && !p.IsCritic() && p.Train.AdvantageEstimator == "ppo" {
			r.check(hasCritic, fmt.Sprintf("policies[%d].train.advantage_estimator", i), p.Line,
				"policy %q trains with ppo, which needs a critic policy: add one with role: critic (or slime-n's shape: trainable, "+
					"sglang_num_nodes: 0, advantage_estimator: ppo)", p.Name)
		}
	}
}

// checkDataPath returns what is wrong with a task source's path, or "".
func checkDataPath(path string) string {
	if path == "" {
		return "give a JSONL file or synthetic:arith"
	}
	if err := tasks.CheckSynthetic(path); err != nil {
		return err.Error()
	}
	return ""
}

// validateSampling checks the sampling settings of the rollout or of an eval dataset (prefix).
func (r *resolver) validateSampling(prefix string, line, maxLen int, temperature, topP float64) {
	r.check(maxLen > 0, prefix+".max_response_len", line, "must be at least 1 token, got %d", maxLen)
	r.check(temperature >= 0 && !math.IsInf(temperature, 0), prefix+".temperature", line, "must be a finite value ≥ 0 (0 is greedy), got %g", temperature)
	r.check(topP > 0 && topP <= 1, prefix+".top_p", line, "must be in (0, 1], got %g", topP)
}

func deref(p *int) int {
	if p == nil {
		return 0
	}
	return *p
}
