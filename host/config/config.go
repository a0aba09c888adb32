// Package config loads and validates a run's YAML configuration (docs/config.md): slime-n's policy
// schema unchanged, slimen's own names, defaults for zero-config runs, errors with YAML line numbers.
package config

import "time"

// Config is a run's resolved configuration (docs/config.md). It loads slime-n's policy YAML unchanged
// (`megatron:` and `sglang:` are aliases of `train:` and `engine:`) and fills every default, so
// the rest of the host reads plain fields.
type Config struct {
	Policies []PolicyConfig `yaml:"policies" json:"policies"`
	Rollout  RolloutConfig  `yaml:"rollout" json:"rollout"`
	Data     DataConfig     `yaml:"data" json:"data"`
	Eval     EvalConfig     `yaml:"eval" json:"eval"`
	Run      RunConfig      `yaml:"run" json:"run"`
	Sandbox  SandboxConfig  `yaml:"sandbox" json:"sandbox"`

	// File is the path the config came from ("" for the zero-config defaults).
	File string `yaml:"-" json:"-"`
	// Warnings are things the host prints once at start-up: settings that have no effect, a
	// model_args_path that was not found, pass-through keys that look like typos.
	Warnings []string `yaml:"-" json:"-"`
}

// PolicyConfig is one entry of `policies:`.
type PolicyConfig struct {
	Name             string       `yaml:"name" json:"name"`
	Role             string       `yaml:"role" json:"role"` // actor | critic
	Trainable        bool         `yaml:"trainable" json:"trainable"`
	HFCheckpoint     string       `yaml:"hf_checkpoint" json:"hf_checkpoint"`
	Load             string       `yaml:"load,omitempty" json:"load,omitempty"`
	Save             string       `yaml:"save,omitempty" json:"save,omitempty"`
	RefLoad          string       `yaml:"ref_load,omitempty" json:"ref_load,omitempty"`
	BufferMode       string       `yaml:"buffer_mode" json:"buffer_mode"` // split | shared
	NumGPUsPerNode   int          `yaml:"num_gpus_per_node" json:"num_gpus_per_node"`
	MegatronNumNodes int          `yaml:"megatron_num_nodes" json:"megatron_num_nodes"`
	SGLangNumNodes   int          `yaml:"sglang_num_nodes" json:"sglang_num_nodes"`
	Train            TrainConfig  `yaml:"train" json:"train"`   // alias: megatron
	Engine           EngineConfig `yaml:"engine" json:"engine"` // alias: sglang
	// LoRA, when set, makes the policy a low-rank adapter over hf_checkpoint: it trains (or, frozen,
	// serves) only the adapter, and the LoRA policies on the same hf_checkpoint and engine share
	// one copy of the base (docs/config.md).
	LoRA *LoRAConfig `yaml:"lora,omitempty" json:"lora,omitempty"`

	// Extra holds slime-n policy keys slimen accepts but does not interpret (input_key,
	// label_key, apply_chat_template, eval_datasets: in slimen the script decides what each
	// policy sees).
	Extra map[string]any `yaml:",inline" json:"extra,omitempty"`

	Line int `yaml:"-" json:"-"` // YAML line of the entry, for messages
}

// LoRAConfig is a policy's adapter: rank r, the update scaled by alpha/r (PEFT's lora_alpha),
// dropout on the adapter's input while training, and the projections it adapts.
type LoRAConfig struct {
	Rank    int      `yaml:"rank" json:"rank"`
	Alpha   float64  `yaml:"alpha" json:"alpha"`
	Dropout float64  `yaml:"dropout" json:"dropout"`
	Targets []string `yaml:"targets" json:"targets"`

	Line int `yaml:"-" json:"-"` // YAML line of the block, for messages
}

// TrainConfig holds a policy's training settings (slime-n's `megatron:` block).
type TrainConfig struct {
	LR                   float64 `yaml:"lr" json:"lr"`
	LRDecayStyle         string  `yaml:"lr_decay_style" json:"lr_decay_style"`
	WeightDecay          float64 `yaml:"weight_decay" json:"weight_decay"`
	AdamBeta1            float64 `yaml:"adam_beta1" json:"adam_beta1"`
	AdamBeta2            float64 `yaml:"adam_beta2" json:"adam_beta2"`
	ClipGrad             float64 `yaml:"clip_grad" json:"clip_grad"`
	Optimizer            string  `yaml:"optimizer" json:"optimizer"`
	MicroBatchSize       int     `yaml:"micro_batch_size" json:"micro_batch_size"`
	GlobalBatchSize      int     `yaml:"global_batch_size" json:"global_batch_size"` // samples per optimizer step
	AdvantageEstimator   string  `yaml:"advantage_estimator" json:"advantage_estimator"`
	NSamplesPerPrompt    int     `yaml:"n_samples_per_prompt" json:"n_samples_per_prompt"`
	RewardsNormalization bool    `yaml:"rewards_normalization" json:"rewards_normalization"`
	GRPOStdNormalization bool    `yaml:"grpo_std_normalization" json:"grpo_std_normalization"`
	EpsClip              float64 `yaml:"eps_clip" json:"eps_clip"`
	EpsClipHigh          float64 `yaml:"eps_clip_high" json:"eps_clip_high"`
	KLCoef               float64 `yaml:"kl_coef" json:"kl_coef"` // reward-side KL (reinforce++, reinforce++-baseline, ppo)
	KLLossCoef           float64 `yaml:"kl_loss_coef" json:"kl_loss_coef"`
	KLLossType           string  `yaml:"kl_loss_type" json:"kl_loss_type"`
	UseKLLoss            bool    `yaml:"use_kl_loss" json:"use_kl_loss"`
	EntropyCoef          float64 `yaml:"entropy_coef" json:"entropy_coef"`
	Gamma                float64 `yaml:"gamma" json:"gamma"`
	Lambda               float64 `yaml:"lambd" json:"lambd"`
	UseOPD               bool    `yaml:"use_opd" json:"use_opd"`
	OPDType              string  `yaml:"opd_type,omitempty" json:"opd_type"`
	OPDKLCoef            float64 `yaml:"opd_kl_coef" json:"opd_kl_coef"`
	LossAggregation      string  `yaml:"loss_aggregation" json:"loss_aggregation"` // sample_mean | token_mean | group_token_mean | token_sum
	// CalculatePerTokenLoss is slime's name for loss_aggregation: token_mean (true); false is
	// slime's default, sample_mean.
	CalculatePerTokenLoss bool `yaml:"calculate_per_token_loss" json:"calculate_per_token_loss"`
	// Off-policy correction (slime's --use-tis, docs/config.md): TISMode "tis" (truncated
	// importance sampling) or "icepop" (IcePop's masking), the weight band [TISClipLow, TISClip].
	// CustomTISFunctionPath is slime-n's spelling of the mode: slime's vanilla_tis_function or
	// icepop_function by their Python path.
	UseTIS                bool    `yaml:"use_tis" json:"use_tis"`
	TISMode               string  `yaml:"tis_mode" json:"tis_mode"`
	TISClip               float64 `yaml:"tis_clip" json:"tis_clip"`
	TISClipLow            float64 `yaml:"tis_clip_low" json:"tis_clip_low"`
	CustomTISFunctionPath string  `yaml:"custom_tis_function_path,omitempty" json:"custom_tis_function_path,omitempty"`
	ModelArgsPath         string  `yaml:"model_args_path,omitempty" json:"model_args_path,omitempty"`

	// Extra holds keys slimen does not interpret (tensor_model_parallel_size, …, and the flags
	// read from model_args_path); they pass through to the engine.
	Extra map[string]any `yaml:",inline" json:"extra,omitempty"`
}

// EngineConfig holds a policy's engine settings (slime-n's `sglang:` block plus slimen's `kind`).
type EngineConfig struct {
	Kind              string        `yaml:"kind" json:"kind"`                 // tiny | torch | remote | openai | a registered kind (RegisterEngineKind)
	Address           string        `yaml:"address,omitempty" json:"address"` // remote: host:port
	ModelPath         string        `yaml:"model_path" json:"model_path,omitempty"`
	NumGPUsPerEngine  int           `yaml:"num_gpus_per_engine" json:"num_gpus_per_engine"`
	UpdateWeights     bool          `yaml:"update_weights" json:"update_weights"`
	MemFractionStatic float64       `yaml:"mem_fraction_static,omitempty" json:"mem_fraction_static,omitempty"`
	ServerGroups      []ServerGroup `yaml:"server_groups,omitempty" json:"server_groups,omitempty"`
	Threads           int           `yaml:"threads,omitempty" json:"threads,omitempty"` // tiny: worker goroutines (0: all cores)
	// torch: the worker the host starts (docs/torch.md). Python is its interpreter ("": the
	// variable SLIMEN_PYTHON, else python3 from PATH); Device its --device ("": the first GPU if
	// any); GPUs its CUDA_VISIBLE_DEVICES (none: inherited); Args extra `serve` flags;
	// StartTimeout how long it may take to load the model (0: 10 minutes).
	Python       string        `yaml:"python,omitempty" json:"python,omitempty"`
	Device       string        `yaml:"device,omitempty" json:"device,omitempty"`
	GPUs         []string      `yaml:"gpus,omitempty" json:"gpus,omitempty"`
	Args         []string      `yaml:"args,omitempty" json:"args,omitempty"`
	StartTimeout time.Duration `yaml:"start_timeout,omitempty" json:"start_timeout,omitempty"`
	// torch: MaxRestarts bounds how often a worker that dies or hangs is started again (nil: 3,
	// 0: never); HangTimeout is how long its Health may go unanswered before it is killed as
	// hung (0: 2 minutes).
	MaxRestarts *int          `yaml:"max_restarts,omitempty" json:"max_restarts,omitempty"`
	HangTimeout time.Duration `yaml:"hang_timeout,omitempty" json:"hang_timeout,omitempty"`
	// torch: Deterministic runs the worker with batch-invariant kernels (its --deterministic;
	// docs/torch.md): a sample does not depend on its batch, and the trainer's log-probs equal
	// the rollout's bit for bit. One GPU a worker, the KV cache in the model's dtype.
	Deterministic bool `yaml:"deterministic,omitempty" json:"deterministic,omitempty"`
	// remote: security and limits of the connection (docs/remote.md); torch: TokenEnv makes the
	// worker demand the token, the others are the client's settings.
	TokenEnv     string     `yaml:"token_env,omitempty" json:"token_env,omitempty"` // env var holding the bearer token
	Insecure     bool       `yaml:"insecure,omitempty" json:"insecure,omitempty"`   // plaintext to a non-loopback address
	TLS          *TLSConfig `yaml:"tls,omitempty" json:"tls,omitempty"`
	MaxMessageMB int        `yaml:"max_message_mb,omitempty" json:"max_message_mb,omitempty"`
	// Timeout bounds one call (0: 10 minutes); ReconnectTimeout how long calls wait for an
	// unreachable engine to come back before the run stops (0: 2 minutes).
	Timeout          time.Duration `yaml:"timeout,omitempty" json:"timeout,omitempty"`
	ReconnectTimeout time.Duration `yaml:"reconnect_timeout,omitempty" json:"reconnect_timeout,omitempty"`
	// Continue (remote, trainable): train on from the state the server holds (what an earlier
	// run taught it) instead of resetting it at start-up to the policy's load: folder or the model
	// the server was started with.
	Continue bool `yaml:"continue,omitempty" json:"continue,omitempty"`
	// openai: an OpenAI-compatible server (docs/openai.md). BaseURL is its API root (…/v1),
	// Model the model name, APIKeyEnv the variable holding its key; MaxRetries retries a failed
	// attempt (0: 4, -1: none), MaxConcurrency caps the requests in flight (0: 32), TokenIDs is
	// auto, vllm or none; MaxTokensField auto, max_tokens or max_completion_tokens (the field
	// a response's length is sent in); Timeout bounds one attempt.
	BaseURL        string `yaml:"base_url,omitempty" json:"base_url,omitempty"`
	Model          string `yaml:"model,omitempty" json:"model,omitempty"`
	APIKeyEnv      string `yaml:"api_key_env,omitempty" json:"api_key_env,omitempty"`
	MaxRetries     int    `yaml:"max_retries,omitempty" json:"max_retries,omitempty"`
	MaxConcurrency int    `yaml:"max_concurrency,omitempty" json:"max_concurrency,omitempty"`
	TokenIDs       string `yaml:"token_ids,omitempty" json:"token_ids,omitempty"`
	MaxTokensField string `yaml:"max_tokens_field,omitempty" json:"max_tokens_field,omitempty"`

	// Extra holds the other server arguments (chunked_prefill_size, …); they pass through.
	Extra map[string]any `yaml:",inline" json:"extra,omitempty"`
}

// TLSConfig is how a remote engine's connection is encrypted and checked.
type TLSConfig struct {
	CA         string `yaml:"ca,omitempty" json:"ca,omitempty"`     // PEM file of the CA that signed the server's certificate
	Cert       string `yaml:"cert,omitempty" json:"cert,omitempty"` // client certificate (mutual TLS)
	Key        string `yaml:"key,omitempty" json:"key,omitempty"`
	ServerName string `yaml:"server_name,omitempty" json:"server_name,omitempty"`
}

// ServerGroup is one entry of sglang's `server_groups`.
type ServerGroup struct {
	WorkerType       string         `yaml:"worker_type" json:"worker_type"` // regular | prefill | decode | placeholder | encoder
	NumGPUs          int            `yaml:"num_gpus" json:"num_gpus"`
	NumGPUsPerEngine int            `yaml:"num_gpus_per_engine,omitempty" json:"num_gpus_per_engine,omitempty"`
	Overrides        map[string]any `yaml:"overrides,omitempty" json:"overrides,omitempty"`
}

// RolloutConfig holds the sampling settings shared by all policies.
type RolloutConfig struct {
	BatchSize         int      `yaml:"batch_size" json:"batch_size"` // tasks per step
	MaxResponseLen    int      `yaml:"max_response_len" json:"max_response_len"`
	Temperature       float64  `yaml:"temperature" json:"temperature"`
	TopP              float64  `yaml:"top_p" json:"top_p"`
	Stop              []string `yaml:"stop,omitempty" json:"stop,omitempty"`
	MaxFailedFraction float64  `yaml:"max_failed_fraction" json:"max_failed_fraction"` // a step with more failed rollouts stops the run
	MaxBatchTokens    int      `yaml:"max_batch_tokens" json:"max_batch_tokens,omitempty"`
	// TimeoutS is the wall time one rollout may take (0: none); a rollout past it fails alone.
	TimeoutS float64 `yaml:"timeout_s" json:"timeout_s"`
	// StopGraceS is how long rollouts may still run after Run.Stop (the first SIGINT/SIGTERM)
	// before they are cancelled and the step goes on without them.
	StopGraceS float64 `yaml:"stop_grace_s" json:"stop_grace_s"`
	// MaxStaleness is K of the asynchronous loop (docs/async.md): the rollouts of step s generate
	// from the weights after max(0, s−1−K) training steps, so those of steps k+1…k+K run while
	// the policies train on step k. 0: the synchronous loop.
	MaxStaleness int `yaml:"max_staleness" json:"max_staleness,omitempty"`
	// Partial continues, with MaxStaleness ≥ 1, a generation that has not ended after half its
	// max_tokens under the next weights version (docs/async.md, "Partial rollouts").
	Partial bool `yaml:"partial" json:"partial,omitempty"`
}

// DataConfig names the task source.
type DataConfig struct {
	Path     string `yaml:"path" json:"path"` // JSONL file or synthetic:arith[?difficulty=N]
	InputKey string `yaml:"input_key" json:"input_key"`
	LabelKey string `yaml:"label_key" json:"label_key"`
	Shuffle  bool   `yaml:"shuffle" json:"shuffle"`
}

// EvalConfig names eval datasets. It also reads slime's eval config (`eval: {defaults: …,
// datasets: […]}`); the defaults are applied to every dataset at load.
type EvalConfig struct {
	Datasets []EvalDataset `yaml:"datasets,omitempty" json:"datasets,omitempty"`
	NSamples int           `yaml:"n_samples" json:"n_samples"` // samples per task for pass@k; each dataset's default

	// Defaults is slime's `eval.defaults:` block. Load folds it into every dataset and clears it,
	// so a resolved config has each dataset spelled out.
	Defaults EvalDefaults `yaml:"defaults,omitempty" json:"-"`
}

// EvalDefaults holds the values of slime's `eval.defaults:` block.
type EvalDefaults struct {
	NSamples       int     `yaml:"n_samples_per_eval_prompt,omitempty"`
	Temperature    float64 `yaml:"temperature,omitempty"`
	TopP           float64 `yaml:"top_p,omitempty"`
	MaxResponseLen int     `yaml:"max_response_len,omitempty"`
	InputKey       string  `yaml:"input_key,omitempty"`
	LabelKey       string  `yaml:"label_key,omitempty"`
	RMType         string  `yaml:"rm_type,omitempty"`

	// Extra holds the other slime keys (top_k, tool_key, …); slimen does not interpret them.
	Extra map[string]any `yaml:",inline"`
}

// EvalDataset is one eval set.
type EvalDataset struct {
	Name           string  `yaml:"name" json:"name"`
	Path           string  `yaml:"path" json:"path"` // JSONL file or synthetic:arith[?…]
	InputKey       string  `yaml:"input_key" json:"input_key"`
	LabelKey       string  `yaml:"label_key" json:"label_key"`
	Limit          int     `yaml:"limit" json:"limit"` // tasks to evaluate; 0: the whole file
	NSamples       int     `yaml:"n_samples_per_eval_prompt" json:"n_samples_per_eval_prompt"`
	Temperature    float64 `yaml:"temperature" json:"temperature"`
	TopP           float64 `yaml:"top_p" json:"top_p"`
	MaxResponseLen int     `yaml:"max_response_len" json:"max_response_len"`
	RMType         string  `yaml:"rm_type,omitempty" json:"rm_type,omitempty"` // slime's reward model name, for the script

	// Extra holds slime's other dataset keys (tool_key, custom_generate_function_path, …):
	// accepted, not interpreted.
	Extra map[string]any `yaml:",inline" json:"extra,omitempty"`

	Line int `yaml:"-" json:"-"`
}

// SandboxConfig bounds what a contributed script may do (slimen exec --sandbox, docs/sandbox.md). Most
// budgets are per rollout; state_total_bytes is the run's whole state store, message_bytes one
// message of a child process, and the memory and CPU limits are those of the child processes that
// evaluate the Starlark (docs/sandbox.md).
type SandboxConfig struct {
	Enabled         bool    `yaml:"enabled" json:"enabled"`                     // --sandbox sets it
	Steps           uint64  `yaml:"steps" json:"steps"`                         // Starlark execution steps of a rollout, all its threads together
	GenerateCalls   int     `yaml:"generate_calls" json:"generate_calls"`       // generate calls
	Tokens          int     `yaml:"tokens" json:"tokens"`                       // generated tokens (max_tokens × n counted up front)
	PromptBytes     int     `yaml:"prompt_bytes" json:"prompt_bytes"`           // bytes of one prompt passed to generate or score
	WallSeconds     float64 `yaml:"wall_seconds" json:"wall_seconds"`           // wall time
	PrintBytes      int     `yaml:"print_bytes" json:"print_bytes"`             // bytes of print output
	StateBytes      int     `yaml:"state_bytes" json:"state_bytes"`             // size of one entry (key and value) stored in state
	StateTotalBytes int     `yaml:"state_total_bytes" json:"state_total_bytes"` // size of everything the run's state holds (run-wide)
	ParallelItems   int     `yaml:"parallel_items" json:"parallel_items"`       // items of one parallel() call
	// Threads bounds the threads of one rollout running at once; parallel items past it run on
	// the calling thread.
	Threads      int `yaml:"threads" json:"threads"`
	MessageBytes int `yaml:"message_bytes" json:"message_bytes"` // one message from a child process to the host
	MemoryMB     int `yaml:"memory_mb" json:"memory_mb"`         // memory (RLIMIT_DATA) of a child process
	CPUSeconds   int `yaml:"cpu_seconds" json:"cpu_seconds"`     // CPU time of a child process (0: unlimited)
	Processes    int `yaml:"processes" json:"processes"`         // child processes evaluating rollouts
	// Policies may be used by generate and score (absent: every policy the config names). Train
	// may be trained (absent: none, unless the run is zero-config, where every policy is a fresh
	// model of this run); each must also be trainable.
	Policies []string `yaml:"policies,omitempty" json:"policies,omitempty"`
	Train    []string `yaml:"train,omitempty" json:"train,omitempty"`
	// Programs are the programs agent() may start; absent: none. Only the operator's config
	// grants them. An entry of one word is a program (argv[0] exactly as the script writes it),
	// with any arguments; an entry of several words is an argv pattern: as many words as argv
	// has (a last word "**" matches any further arguments), each matched by path.Match.
	Programs []string `yaml:"programs,omitempty" json:"programs,omitempty"`
	// Each agent() program runs in a jail (host/jail): these bound and open it.
	AgentEnv []string `yaml:"agent_env,omitempty" json:"agent_env,omitempty"` // variables a script may set with env= (never loader or interpreter ones)
	// AgentRead lists the host paths visible read-only, besides the system's, the program's
	// installation and the script's folder.
	AgentRead []string `yaml:"agent_read,omitempty" json:"agent_read,omitempty"`
	AgentPids int      `yaml:"agent_pids" json:"agent_pids"` // processes of a program's whole tree
	AgentCPUs float64  `yaml:"agent_cpus" json:"agent_cpus"` // CPUs of a program's whole tree (memory_mb bounds its memory)
}

// RunConfig holds run-wide settings.
type RunConfig struct {
	Steps        int    `yaml:"steps" json:"steps"`
	Seed         uint64 `yaml:"seed" json:"seed"`
	Out          string `yaml:"out" json:"out"`
	SaveInterval int    `yaml:"save_interval" json:"save_interval"`
	// SaveMinutes checkpoints at the end of the first step that ends this many minutes of wall
	// time after the last checkpoint (or the run's start), whatever save_interval says; 0: off.
	SaveMinutes     float64 `yaml:"save_minutes" json:"save_minutes"`
	EvalInterval    int     `yaml:"eval_interval" json:"eval_interval"`
	KeepCheckpoints int     `yaml:"keep_checkpoints" json:"keep_checkpoints"`
	// OnSignal is what SIGINT/SIGTERM do to the step in progress: "finish" it (default) or
	// "abandon" its rollouts; either way the run then checkpoints and exits 0.
	OnSignal string `yaml:"on_signal" json:"on_signal"`
	Colocate bool   `yaml:"colocate" json:"colocate"`
	// SaveRollouts is how many rollouts of each step the run keeps in rollouts.jsonl (failed ones
	// among them), for slimen view and the sample tables of TensorBoard and W&B; 0: none.
	SaveRollouts int `yaml:"save_rollouts" json:"save_rollouts"`
	// TensorBoard is the folder the run writes TensorBoard event files into ("": none); a
	// relative one is taken from the working directory, as TRL's logging_dir is.
	TensorBoard string `yaml:"tensorboard" json:"tensorboard"`
	// Wandb logs the run to Weights & Biases through the wandb SDK (host/wandb); nil: it does not.
	Wandb *WandbConfig `yaml:"wandb,omitempty" json:"wandb,omitempty"`
}

// WandbConfig is run.wandb: the W&B run a slimen run logs to. Empty fields are the SDK's to fill
// from its environment (WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE, …), except Name, which defaults
// to $WANDB_NAME, else the run folder's name.
type WandbConfig struct {
	Project string `yaml:"project,omitempty" json:"project,omitempty"`
	Entity  string `yaml:"entity,omitempty" json:"entity,omitempty"`
	Name    string `yaml:"name,omitempty" json:"name,omitempty"`
	Mode    string `yaml:"mode,omitempty" json:"mode,omitempty"` // online, offline or disabled
	// Python is the interpreter of an environment with the wandb package ("": $SLIMEN_PYTHON,
	// else python3 from PATH).
	Python string `yaml:"python,omitempty" json:"python,omitempty"`
}
