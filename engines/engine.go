// Package engines defines the Engine interface that every policy engine implements (the embedded
// pure-Go engine in tiny/, the gRPC client in remote/, …) and the request and result types that
// cross it. Engines know nothing of Starlark: the host converts script values into these types.
package engines

import (
	"context"
	"errors"
	"fmt"
	"math"
)

// Engine is one policy's model: it samples completions, scores given tokens, trains on a batch of
// samples and saves and loads its state. Implementations must be safe for concurrent use; the host
// serialises Train against Generate and Score itself (training happens between rollout phases),
// except that with rollout.max_staleness > 0 rollouts sample through Versions while Train runs.
type Engine interface {
	// Info describes the model and what the engine can do.
	Info(ctx context.Context) (Info, error)
	// Generate samples n completions for each request. The result holds Σ n completions, request
	// by request in order, and within a request by sample index.
	Generate(ctx context.Context, reqs []GenerateRequest) ([]Completion, error)
	// Score returns the log-probabilities of each request's response tokens given its prompt.
	Score(ctx context.Context, reqs []ScoreRequest) ([]Scores, error)
	// Train runs one optimizer step on the batch with the policy loss of docs/architecture.md.
	Train(ctx context.Context, b Batch) (TrainStats, error)
	// Tokenize turns raw text (no chat template) into token ids.
	Tokenize(ctx context.Context, texts []string) ([][]int32, error)
	// Save writes the model as a Hugging Face folder plus the optimizer state into dir.
	Save(ctx context.Context, dir string) error
	// Load replaces the model (and optimizer state, when present) with the one in dir.
	Load(ctx context.Context, dir string) error
	// Close releases the engine's resources.
	Close() error
}

// Info describes an engine's model.
type Info struct {
	Model        string   // what was loaded: a folder, "builtin:tiny-arith", …
	Architecture string   // e.g. "LlamaForCausalLM"
	VocabSize    int      //
	MaxSeqLen    int      // longest prompt + response the model accepts
	ChatTemplate string   // the Jinja chat template of tokenizer_config.json
	EOSTokens    []int32  // tokens that end a response
	Params       int64    // number of parameters
	Devices      []string // "cpu", "cuda:0", …
	Capabilities []string // "generate", "score", "train", "values"
}

// Message is one turn of a chat prompt.
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// Sampling holds the sampling settings of one request.
type Sampling struct {
	MaxTokens   int      // maximum response tokens; > 0
	Temperature float64  // 0 means greedy
	TopP        float64  // nucleus mass in (0, 1]; 0 is read as 1
	Stop        []string // the response ends before the first of these strings
	Seed        uint64   // sampling is a deterministic function of (seed, prompt, sample index)
	// Constraint, when not "", is what the response must follow: a JSON value of a schema or
	// Hermes tool calls, as engines/constrain's Spec in JSON. Only tokens that keep the response
	// within it are sampled; Logprobs stay the model's own (temperature 1, before top-p and
	// before the constraint's mask). An engine that lists "constrain" in Info.Capabilities
	// honours it; callers send one only to such an engine (the OpenAI front, agent(), the
	// remote client, which refuses to send it to a server without it), and the openai engine
	// refuses it.
	Constraint string `json:",omitempty"`
}

// GenerateRequest asks for N completions of one prompt. Exactly one of Messages and PromptTokens
// is set: Messages are rendered with the model's chat template (with the generation prompt);
// PromptTokens are used as they are.
type GenerateRequest struct {
	ID           string // unique per request; a retried request reuses it
	Messages     []Message
	PromptTokens []int32
	N            int // samples; 0 is read as 1
	Sampling
}

// Completion is one sampled response.
type Completion struct {
	RequestID    string
	Index        int       // sample index within the request, 0..N-1
	PromptTokens []int32   // the prompt as the model saw it
	Tokens       []int32   // response token ids, including a final EOS token if one was sampled
	Logprobs     []float32 // per token: log-softmax of the temperature-1 logits, before top-p (what Train and Score compute; slime's convention)
	Text         string    // the decoded response, without EOS and stop string
	FinishReason string    // "stop" (EOS or stop string) or "length"
	// Versions, per token, is the weights version that sampled it, when the host continued the
	// generation under a newer version (rollout.partial, docs/async.md); nil: one version.
	// Engines leave it nil.
	Versions []int32 `json:",omitempty"`
}

// ScoreRequest asks for the log-probabilities of Tokens following the prompt. As in
// GenerateRequest, exactly one of Messages (rendered with the chat template and the generation
// prompt) and PromptTokens is set.
type ScoreRequest struct {
	Messages     []Message
	PromptTokens []int32
	Tokens       []int32
	// Reference scores with the engine's frozen KL reference (the model the KL loss measures
	// against) instead of its current weights; engines that have one list "reference" in
	// Info.Capabilities. The host asks for it for the reward-side KL (kl_coef).
	Reference bool
}

// Scores holds one log-probability per scored token.
type Scores struct {
	Logprobs []float32
}

// Sample is one training sequence: a prompt followed by a response. The per-token slices all have
// len(Response) entries.
type Sample struct {
	Prompt      []int32
	Response    []int32
	LossMask    []float32 // 1 for generated tokens that are trained, 0 for injected ones
	OldLogprobs []float32 // log-probs at rollout time
	// TrainLogprobs (optional, read only with LossConfig.UseTIS) are the trainer's log-probs of
	// the response at the weights before the first optimizer step of this rollout step (slime's
	// recomputed old log_probs). Without them the engine uses its own log-probs at the weights
	// before this optimizer step, detached: the same numbers when a rollout step trains in one
	// optimizer step. The host sends them when a step is split into several optimizer steps.
	TrainLogprobs []float32
	Advantages    []float32 // per-token advantage
	Group         string    // samples of one group are averaged together before averaging groups
	// PPO critic (an engine with a value head): the value target of each token and the values
	// at rollout time. A critic trains on these with the clipped value loss; it ignores the
	// policy fields above.
	Returns   []float32
	OldValues []float32
}

// LossConfig holds the loss and optimizer settings of one training step. They travel with every
// batch so a hot-reloaded config takes effect on the next step.
type LossConfig struct {
	LR          float64
	Beta1       float64 // AdamW β1; 0 is read as 0.9
	Beta2       float64 // AdamW β2; 0 is read as 0.999
	AdamEps     float64 // 0 is read as 1e-8
	WeightDecay float64
	MaxGradNorm float64 // clip the global gradient norm; 0 disables clipping
	EpsClip     float64 // lower ratio clip: 1 − EpsClip
	// EpsClipHigh is the upper ratio clip, 1 + EpsClipHigh, taken as given: 0 clips at exactly 1
	// (as slime; the host's config fills eps_clip in when eps_clip_high is not set).
	EpsClipHigh float64
	KLLossCoef  float64 // > 0 adds KL against the frozen reference copy
	KLLossType  string  // "k1", "k2", "k3" or "low_var_kl" (k3 clamped to ±10, as slime); "" is read as "low_var_kl"
	EntropyCoef float64 // subtracts EntropyCoef·H
	// PolicyLoss: "ppo" (default): a ratio per token; "gspo": one ratio per sequence,
	// exp(mean over the sequence's trained tokens of (logp − logp_old)), clipped the same way.
	PolicyLoss string
	// Aggregation is how the per-token losses of the batch are reduced. "sample_mean" (default,
	// slime's): the mean over the batch's samples of each sample's mean over its trained tokens;
	// "token_mean" (slime's calculate_per_token_loss): the mean over the batch's trained tokens;
	// in both a sample without trained tokens still counts, as a sample or as one token.
	// "group_token_mean": the mean over groups of the token-mean within each group; "token_sum":
	// the sum over trained tokens.
	Aggregation string
	// ValueClip is the critic's value clipping: loss = max((V − R)², (clip(V, V_old ± ValueClip)
	// − R)²), reduced as above; 0 disables clipping.
	ValueClip float64
	// UseTIS turns on slime's off-policy correction (--use-tis) for samples generated by other
	// weights than the trainer's (an asynchronous rollout, or a rollout engine whose numerics
	// differ). The ratio's old log-probs are then the trainer's (Sample.TrainLogprobs, else the
	// engine's own before the step, detached), and each token's policy-gradient term is multiplied
	// by a detached weight of its ratio ρ = exp(logp_trainer − logp_rollout), with logp_rollout
	// Sample.OldLogprobs. TISMode "tis" (default, slime's vanilla_tis_function): the weight is
	// clamp(ρ, TISClipLow, TISClip); "icepop" (slime's icepop_function): ρ inside [TISClipLow,
	// TISClip], else 0 (the token is masked but still counts in the reduction's denominators).
	UseTIS     bool
	TISMode    string
	TISClip    float64 // upper bound of the weight; 0 is read as 2 (slime's default)
	TISClipLow float64 // lower bound; slime's default is 0
}

// RenderRequest asks for the token ids of messages rendered with the model's chat template, as
// transformers' apply_chat_template(messages, tools=…, add_generation_prompt=…, tokenize=True)
// makes them. Tools are JSON schemas (one JSON object each) for templates with a `tools`
// variable.
type RenderRequest struct {
	Messages            []Message
	Tools               []string
	AddGenerationPrompt bool
}

// Renderer is implemented by engines that render their chat template to token ids. A
// conversation (the host's chat()) samples from its own token ids and renders only the messages
// appended after a sampled turn, through this call: the engine that owns the template renders it.
type Renderer interface {
	Render(ctx context.Context, reqs []RenderRequest) ([][]int32, error)
}

// Versions is implemented by engines that keep rollout copies of their weights, so that rollouts
// may sample from the weights of an earlier step while the engine trains in place
// (rollout.max_staleness > 0, docs/async.md). A version is named by the number of training steps
// the host had run when it kept it: version 0 is the weights before any training. The host keeps
// a version right after the training of a step (KeepVersion), samples from it for as long as
// steps that generate from it run (GenerateVersion, ScoreVersion), and drops it when none is left
// (DropVersions). Kept weights are read-only: GenerateVersion and ScoreVersion do not wait for
// Train, and Train does not change what they compute. A LoRA adapter's version is its adapter;
// its base does not train.
type Versions interface {
	// KeepVersion copies the current weights as version v (a version kept again is replaced).
	KeepVersion(ctx context.Context, v int) error
	// GenerateVersion is Generate with the weights kept as version v.
	GenerateVersion(ctx context.Context, v int, reqs []GenerateRequest) ([]Completion, error)
	// ScoreVersion is Score with the weights kept as version v (Reference requests are scored by
	// the reference, as in Score).
	ScoreVersion(ctx context.Context, v int, reqs []ScoreRequest) ([]Scores, error)
	// SaveVersion writes the weights kept as version v into dir, as Save writes the model (no
	// optimizer state): a checkpoint holds the versions its next steps generate from, and resume
	// puts them back with Load and KeepVersion.
	SaveVersion(ctx context.Context, v int, dir string) error
	// DropVersions forgets every kept version below v.
	DropVersions(ctx context.Context, below int) error
}

// ErrVersionNotKept is wrapped by the error of a Versions method called with a version the engine
// does not keep (never kept, dropped, or lost by a process that restarted); a server answers it
// with FAILED_PRECONDITION.
var ErrVersionNotKept = errors.New("weights version not kept")

// VersionsProber is implemented by an engine whose Versions methods work only when what serves it
// keeps versions: a remote client (engines/remote) has them, and they work when the server lists
// "versions" in Info.Capabilities (the PyTorch worker does, and `slimen serve` of an engine with
// Versions). KeepsVersions asks; the host uses
// the engine's Versions only when it says yes, and rollout replicas otherwise. An engine with
// Versions and without this method always keeps versions.
type VersionsProber interface {
	KeepsVersions(ctx context.Context) (bool, error)
}

// WeightsPusher is implemented by engines that push their weights to other engines of the same
// model through a process group of their own (the PyTorch worker, which lists "push" in
// Info.Capabilities: torch.distributed, NCCL between GPUs, CUDA IPC on one): a trainer's rollout
// replicas take its weights this way after each step (host/replica.go) instead of through a
// folder. CanPush asks whether what serves the engine can.
type WeightsPusher interface {
	CanPush(ctx context.Context) (bool, error)
	// JoinPushGroup makes the engine member rank of group g (rank 0 sends, the others receive);
	// the host calls every member at once. It returns how the member reaches each rank ("nccl",
	// "cuda-ipc", "gloo"; "" for itself and for ranks it has no link to).
	JoinPushGroup(ctx context.Context, g PushGroup, rank int) ([]string, error)
	// PushWeights sends the weights from rank 0 to rank peer of the group (called on rank 0) or
	// takes them into the engine's weights in place (called on rank peer); the host calls both at
	// once, and only on a receiver that is not generating.
	PushWeights(ctx context.Context, group string, peer, version int) (PushStats, error)
}

// PushGroup is a process group a trainer and its replicas join (WeightsPusher).
type PushGroup struct {
	Name       string  // names the group in PushWeights; unique per group made
	InitMethod string  // where the members meet: tcp://host:port (rank 0 listens there)
	World      int     // members in all: the trainer and its replicas
	TimeoutS   float64 // how long a member waits for the others, at the join and at each push
}

// PushStats is one member's part of a push: the bytes of weights, its seconds (flattening, the
// transfer, copying into place) and the link ("nccl", "cuda-ipc", "gloo").
type PushStats struct {
	Bytes   int64
	Seconds float64
	Link    string
}

// Valuer is implemented by engines with a value head (a PPO critic; Info lists "values").
type Valuer interface {
	// Values returns one value estimate per response token of each request: the value of the
	// state before that token, at the positions whose logits predict it.
	Values(ctx context.Context, reqs []ScoreRequest) ([][]float32, error)
}

// Batch is what one optimizer step trains on.
type Batch struct {
	ID      string // unique per optimizer step; a remote engine applies an ID at most once
	Samples []Sample
	Loss    LossConfig
}

// TrainStats reports one optimizer step.
type TrainStats struct {
	Loss      float64 // the reduced loss
	PGLoss    float64 // policy-gradient part
	KL        float64 // KL to the reference, reduced like the loss (0 when KLLossCoef is 0)
	ClipFrac  float64 // fraction of trained tokens whose ratio was clipped
	Entropy   float64 // entropy of the policy, reduced like the loss: Loss = PGLoss + KLLossCoef·KL − EntropyCoef·Entropy
	GradNorm  float64 // global gradient norm before clipping
	Tokens    int     // trained tokens (loss mask 1)
	ValueLoss float64 // a critic's value loss
	// With LossConfig.UseTIS: the fraction of trained tokens whose TIS weight differs from their
	// ratio ρ (clipped by tis, masked by icepop; slime's tis_clipfrac, here a share of tokens as
	// ClipFrac is), and the mean weight over trained tokens.
	TISClipFrac float64
	TISWeight   float64
	// The rollout/trainer log-prob mismatch of a policy step: |trainer − rollout| per trained
	// token, the trainer's log-prob from the step's forward before its update (with UseTIS the
	// trainer's old log-prob: Sample.TrainLogprobs or that forward's), the rollout's
	// Sample.OldLogprobs. LogprobDiffMean is its mean over trained tokens, LogprobDiffMax its
	// largest, LogprobAbsDiff slime's train_rollout_logprob_abs_diff (reduced with the loss's
	// weights, as Loss is). 0 on an engine whose training reads exactly what it sampled.
	LogprobDiffMean float64
	LogprobDiffMax  float64
	LogprobAbsDiff  float64
	Skipped         bool   // the step was not applied (non-finite loss or gradient)
	Reason          string // why it was skipped
}

// ErrNotSupported is returned by engines for a method they do not implement (for instance Train on
// an engine that only serves a frozen judge).
var ErrNotSupported = errors.New("not supported by this engine")

// NormalizeSampling reads the protocol's zero top_p as 1 (no nucleus cut). Every other setting has
// no default here: the caller (the host, from the run's config) sets it, and Check refuses a
// request that leaves it open.
func NormalizeSampling(s Sampling) Sampling {
	if s.TopP == 0 {
		s.TopP = 1
	}
	return s
}

// Check is the one validation of a request's sampling settings where it enters an engine: n ≥ 0
// (0 is read as 1), max_tokens ≥ 1, a finite temperature ≥ 0 and top_p in [0, 1] (0 is read as 1).
func (r GenerateRequest) Check() error {
	switch {
	case r.N < 0:
		return fmt.Errorf("n = %d; want at least 1", r.N)
	case r.MaxTokens < 1:
		return fmt.Errorf("max_tokens = %d; want at least 1", r.MaxTokens)
	case r.MaxTokens > math.MaxInt32:
		return fmt.Errorf("max_tokens = %d; want at most %d (what the engines' wire format holds)", r.MaxTokens, math.MaxInt32)
	case !(r.Temperature >= 0) || math.IsInf(r.Temperature, 0):
		return fmt.Errorf("temperature %v; want a finite value ≥ 0", r.Temperature)
	case !(r.TopP >= 0 && r.TopP <= 1):
		return fmt.Errorf("top_p %v; want a value in (0, 1]", r.TopP)
	}
	return nil
}

// AdapterGenerator is implemented by engines that hold LoRA adapters over one base model and
// generate a batch whose requests use different adapters in one pass: request i uses adapters[i]
// ("" the base). Each request gets what it would get alone.
type AdapterGenerator interface {
	GenerateAdapters(ctx context.Context, reqs []GenerateRequest, adapters []string) ([]Completion, error)
}

// AdapterView is implemented by an engine that is one LoRA adapter on a base that other
// policies' adapters share (tiny.AdapterEngine, remote.Adapter): the host sends the generate
// batches of all the policies on one base together, through AdapterBase, as one batch.
type AdapterView interface {
	AdapterName() string
	AdapterBase() AdapterGenerator
}

// LoRA describes a LoRA adapter: rank r, the update scaled by Alpha/Rank (PEFT's lora_alpha),
// the projections it adapts. Engines train adapters without dropout (Dropout must be 0).
type LoRA struct {
	Rank    int
	Alpha   float64
	Dropout float64
	Targets []string
}

// AdapterHolder is implemented by engines that hold LoRA adapters over their model as a frozen
// base (the tiny engine); an engine server (engines/server, `slimen serve`) serves their
// adapters to hosts over the protocol's AddAdapter, RemoveAdapter and the adapter field of
// requests, training batches, Save and Load.
type AdapterHolder interface {
	AdapterGenerator
	// NewAdapter adds adapter name: A drawn from seed, B zero (it computes what the base
	// computes until it trains). It returns the adapter's parameter count; a name it has
	// already is an error wrapping ErrAdapterExists.
	NewAdapter(name string, l LoRA, seed uint64) (params int64, err error)
	// DropAdapter removes adapter name; a name it does not have is ignored.
	DropAdapter(name string)
	// LoadAdapter replaces adapter name, making it when new, with the PEFT folder dir.
	LoadAdapter(ctx context.Context, name, dir string) error
	// AdapterNames are the adapters it holds, sorted.
	AdapterNames() []string
	// AdapterEngine is the engine as adapter name sees it: it generates, scores (Reference
	// requests with the base), trains and saves (a PEFT folder) that adapter only.
	AdapterEngine(name string) (Engine, error)
}

// ErrAdapterExists is wrapped by AdapterHolder.NewAdapter's error for a name the engine has.
var ErrAdapterExists = errors.New("adapter exists already")
