package config

import "strings"

// BuiltinCheckpoint is the base model embedded in the binary, the zero-setup default.
const BuiltinCheckpoint = "builtin:tiny-arith"

// BuiltinChatCheckpoint is the embedded chat model (Qwen3's chat format with tool schemas): the
// zero-setup model of a policy whose first use is a conversation with tools.
const BuiltinChatCheckpoint = "builtin:tiny-chat"

// TinyTrainDefaults are the training settings of a policy on a builtin:* checkpoint (the
// embedded tiny engine): the zero-config run and any YAML policy on a builtin model start from
// them. They are the tiny engine's to tune; keep them here, in one place.
//
// They depart from slime-n's (SlimeTrainDefaults) where a model of a hundred thousand parameters
// needs it: lr 3e-4 (1e-6 barely moves it) and global_batch_size 32, so a step of 32 tasks with
// 8 samples each makes 8 optimizer steps. BenchmarkGRPOArith measures them (docs/tiny.md has its
// learning curve and a table of learning rates): at 2e-3, or with one optimizer step per rollout
// step, plain GRPO learns less or collapses.
func TinyTrainDefaults() TrainConfig {
	t := SlimeTrainDefaults()
	t.LR = 3e-4
	t.GlobalBatchSize = 32
	return t
}

// SlimeTrainDefaults are slime-n's defaults for the `megatron:` block (as slime-n sets them), used for
// policies on Hugging Face checkpoints.
func SlimeTrainDefaults() TrainConfig {
	return TrainConfig{
		LR:                   1e-6,
		LRDecayStyle:         "constant",
		AdamBeta1:            0.9,
		AdamBeta2:            0.999,
		ClipGrad:             1.0,
		Optimizer:            "adam",
		MicroBatchSize:       1,
		GlobalBatchSize:      64,
		AdvantageEstimator:   "grpo",
		NSamplesPerPrompt:    1,
		RewardsNormalization: true,
		GRPOStdNormalization: true,
		EpsClip:              0.2,
		EpsClipHigh:          0.2, // = eps_clip unless given
		KLLossType:           "low_var_kl",
		Gamma:                1,
		Lambda:               1,
		OPDKLCoef:            1.0,
		LossAggregation:      "sample_mean", // slime's default reduction
		TISMode:              "tis",
		TISClip:              2, // slime's --tis-clip
	}
}

// DefaultLoRA is what a policy's lora: block leaves out: PEFT's defaults (rank 8, alpha 8, no
// dropout, the query and value projections).
func DefaultLoRA() LoRAConfig {
	return LoRAConfig{Rank: 8, Alpha: 8, Targets: []string{"q_proj", "v_proj"}}
}

// DefaultPolicy is the policy a zero-config run gives every name the script uses: trainable, on
// BuiltinCheckpoint, on the embedded tiny engine.
func DefaultPolicy(name string) PolicyConfig {
	return PolicyConfig{
		Name:             name,
		Role:             "actor",
		Trainable:        true,
		HFCheckpoint:     BuiltinCheckpoint,
		BufferMode:       "split",
		MegatronNumNodes: 1,
		SGLangNumNodes:   1,
		Train:            TinyTrainDefaults(),
		Engine: EngineConfig{
			Kind:             "tiny",
			ModelPath:        BuiltinCheckpoint,
			NumGPUsPerEngine: 1,
			UpdateWeights:    true,
		},
	}
}

// Default is the zero-config run: every named policy as DefaultPolicy, the synthetic arithmetic
// task, and the run-wide defaults. The host adds policies the script names later with
// DefaultPolicy.
func Default(policies []string) *Config {
	c := &Config{
		Rollout: defaultRollout(),
		Data:    defaultData(),
		Eval:    EvalConfig{NSamples: 1},
		Run:     defaultRun(),
		Sandbox: DefaultSandbox(),
	}
	for _, name := range policies {
		c.Policies = append(c.Policies, DefaultPolicy(name))
	}
	return c
}

func defaultRollout() RolloutConfig {
	return RolloutConfig{BatchSize: 32, MaxResponseLen: 32, Temperature: 1.0, TopP: 1.0, MaxFailedFraction: 0.5,
		TimeoutS: DefaultRolloutTimeoutS, StopGraceS: DefaultStopGraceS}
}

func defaultData() DataConfig {
	return DataConfig{Path: "synthetic:arith", InputKey: "prompt", LabelKey: "label"}
}

// DefaultSaveRollouts is run.save_rollouts's default: rollouts kept a step in rollouts.jsonl.
const DefaultSaveRollouts = 8

// MaxSaveRollouts bounds run.save_rollouts: the file is for looking at rollouts, not for keeping
// every one of a long run.
const MaxSaveRollouts = 1024

// defaultRun leaves Out empty: the host fills runs/<script name>.
func defaultRun() RunConfig {
	return RunConfig{Steps: 50, Seed: 1, KeepCheckpoints: 3, OnSignal: "finish", SaveMinutes: 5, SaveRollouts: DefaultSaveRollouts}
}

// DefaultSandbox are the budgets of a sandboxed run: room for any topology of the examples, far
// from what could hurt a host (docs/sandbox.md).
func DefaultSandbox() SandboxConfig {
	return SandboxConfig{Steps: 10_000_000, GenerateCalls: 256, Tokens: 65536, PromptBytes: 1 << 20, WallSeconds: 300,
		PrintBytes: 64 << 10, StateBytes: 64 << 10, StateTotalBytes: 16 << 20, ParallelItems: 1024, Threads: 64, MessageBytes: 4 << 20,
		MemoryMB: 1024, CPUSeconds: 0, Processes: 2, AgentPids: 64, AgentCPUs: 1}
}

// DefaultRolloutTimeoutS is rollout.timeout_s: ten minutes, far longer than an honest rollout of
// the examples takes even on a slow engine, short enough that a rollout stuck in an endless loop
// costs one step ten minutes rather than the run forever.
const DefaultRolloutTimeoutS = 600

// DefaultStopGraceS is rollout.stop_grace_s: after the first signal, rollouts get this long to
// finish before they are cancelled, so a Ctrl-C ends a step stuck in a loop within half a minute.
const DefaultStopGraceS = 30

// defaultEvalInterval is the eval cadence when eval datasets are given without eval_interval.
const defaultEvalInterval = 10

// defaultSyntheticEvalLimit bounds an eval on an endless synthetic source given without limit.
const defaultSyntheticEvalLimit = 100

// defaultTorchGPUsPerNode is one GPU: slime-n's default, 8 (a full node), would refuse every
// default torch config on a machine of fewer GPUs; a config sized for 8-GPU nodes says so. Tiny
// engines run on the CPU and remote ones are placed by whoever runs them, so theirs defaults to 0.
const defaultTorchGPUsPerNode = 1

// isBuiltin reports whether a checkpoint is one embedded in the binary.
func isBuiltin(ckpt string) bool { return strings.HasPrefix(ckpt, "builtin:") }
