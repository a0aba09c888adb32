package tiny

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
	"sync"

	"github.com/slimen/slimen/engines"
)

// Options configure an Engine.
type Options struct {
	// Threads is the number of goroutines the math runs on; 0 means GOMAXPROCS. Results do not
	// depend on it.
	Threads int
}

// Engine is the embedded engine: one tiny model with its tokenizer, optimizer state and a frozen
// reference copy of its initial weights (the KL reference). It implements engines.Engine and is
// safe for concurrent use; Train and Load exclude everything else while they run.
type Engine struct {
	mu      sync.RWMutex
	spec    string
	threads int
	tok     *Tokenizer
	eos     []int32
	m       *model[float32]
	ref     *model[float32]
	opt     *adamState
	// adapters are the LoRA adapters over the base weights m (AddAdapter), by name.
	adapters map[string]*adapterState
	closed   bool
	// versionStore holds the rollout copies of the weights and serves their engines.Versions
	// methods (versions.go).
	versionStore
}

var (
	_ engines.Engine = (*Engine)(nil)
	_ engines.Valuer = (*Engine)(nil)
)

// ErrClosed is returned by the methods of a closed engine.
var ErrClosed = errors.New("tiny: engine is closed")

// Open loads a model: spec is a Hugging Face model folder written by Save (or by transformers for
// a character-vocabulary Llama) or the name of an embedded checkpoint such as "builtin:tiny-arith".
func Open(spec string, opts Options) (*Engine, error) {
	var (
		fsys  fs.FS
		label = spec
	)
	if name, ok := strings.CutPrefix(spec, "builtin:"); ok {
		sub, err := builtinFS(name)
		if err != nil {
			return nil, err
		}
		fsys = sub
	} else {
		st, err := os.Stat(spec)
		if err != nil {
			return nil, fmt.Errorf("tiny: open %s: %w", spec, err)
		}
		if !st.IsDir() {
			return nil, fmt.Errorf("tiny: open %s: not a folder (want a Hugging Face model folder or builtin:NAME)", spec)
		}
		fsys = os.DirFS(spec)
	}
	ck, err := readCheckpoint(fsys, label)
	if err != nil {
		return nil, fmt.Errorf("tiny: %w", err)
	}
	return newEngine(spec, ck, opts), nil
}

// New returns an engine with a randomly initialised model of the given architecture (drawn from
// seed) and the character vocabulary. VocabSize 0 means the vocabulary's size.
func New(cfg ModelConfig, seed uint64, opts Options) (*Engine, error) {
	return NewWithTokenizer(cfg, newCharTokenizer(), seed, opts)
}

// NewWithTokenizer is New with another vocabulary, such as one from TrainBPE.
func NewWithTokenizer(cfg ModelConfig, tok *Tokenizer, seed uint64, opts Options) (*Engine, error) {
	cfg = cfg.withDefaults(tok.VocabSize())
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("tiny: %w", err)
	}
	if cfg.VocabSize < tok.VocabSize() {
		return nil, fmt.Errorf("tiny: vocab_size %d is smaller than the %d-token vocabulary", cfg.VocabSize, tok.VocabSize())
	}
	w := newWeights[float32](cfg)
	w.initRandom(seed)
	return newEngine(fmt.Sprintf("random(seed=%d)", seed), &checkpoint{w: w, tok: tok, eos: []int32{tok.eos}}, opts), nil
}

func newEngine(spec string, ck *checkpoint, opts Options) *Engine {
	threads := opts.Threads
	if threads <= 0 {
		threads = defaultThreads()
	}
	e := &Engine{spec: spec, threads: threads, tok: ck.tok, eos: ck.eos, m: newModel(ck.w), ref: newModel(ck.w.clone()), opt: ck.opt}
	if e.opt == nil {
		e.opt = newAdamState(ck.w)
	}
	return e
}

// Config returns the model's architecture.
func (e *Engine) Config() ModelConfig {
	e.mu.RLock()
	defer e.mu.RUnlock()
	return e.m.w.cfg
}

// Tokenizer returns the engine's tokenizer.
func (e *Engine) Tokenizer() *Tokenizer {
	e.mu.RLock()
	defer e.mu.RUnlock()
	return e.tok
}

// Info describes the model.
func (e *Engine) Info(ctx context.Context) (engines.Info, error) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.closed {
		return engines.Info{}, ErrClosed
	}
	c := e.m.w.cfg
	params := c.params()
	if e.m.w.score != nil {
		params += int64(c.Hidden + 1)
	}
	return engines.Info{
		Model:        e.spec,
		Architecture: "LlamaForCausalLM",
		VocabSize:    c.VocabSize,
		MaxSeqLen:    c.MaxSeqLen,
		ChatTemplate: e.tok.ChatTemplate(),
		EOSTokens:    append([]int32(nil), e.eos...),
		Params:       params,
		Devices:      []string{"cpu"},
		Capabilities: []string{"generate", "score", "train", "values", "reference", "tis", "constrain"},
	}, nil
}

// Tokenize turns raw text into token ids (no chat template).
func (e *Engine) Tokenize(ctx context.Context, texts []string) ([][]int32, error) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.closed {
		return nil, ErrClosed
	}
	out := make([][]int32, len(texts))
	for i, t := range texts {
		out[i] = e.tok.Encode(t)
	}
	return out, nil
}

// Save writes the model folder (config.json, model.safetensors, tokenizer.json,
// tokenizer_config.json) and, once the optimizer has taken a step, optimizer.safetensors
// (exp_avg.NAME and exp_avg_sq.NAME per parameter) and optimizer.json (the step count). A value
// head, once created, is saved with the weights as score.weight and score.bias.
func (e *Engine) Save(ctx context.Context, dir string) error {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.closed {
		return ErrClosed
	}
	if err := writeCheckpoint(dir, &checkpoint{w: e.m.w, tok: e.tok, eos: e.eos, opt: e.opt}); err != nil {
		return fmt.Errorf("tiny: save %s: %w", dir, err)
	}
	return nil
}

// ErrArchitecture is returned by Load for a folder whose model has another shape.
var ErrArchitecture = errors.New("wrong architecture")

// Load replaces the weights and the optimizer state (reset when the folder has none) with those
// in dir, which must hold a model of the same architecture. The value head is the folder's: a
// folder without one leaves the model without one until it is next used. The KL reference stays
// the model the engine was opened with: resuming a run keeps measuring the distance to the base
// model. dir may also be builtin:NAME, a model built into the binary (a server puts back the
// model it was started with that way).
func (e *Engine) Load(ctx context.Context, dir string) error {
	fsys := os.DirFS(dir)
	if name, ok := strings.CutPrefix(dir, "builtin:"); ok {
		sub, err := builtinFS(name)
		if err != nil {
			return err
		}
		fsys = sub
	}
	ck, err := readCheckpoint(fsys, dir)
	if err != nil {
		return fmt.Errorf("tiny: %w", err)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return ErrClosed
	}
	if ck.w.cfg != e.m.w.cfg {
		return fmt.Errorf("tiny: load %s: %w: its architecture %+v differs from the open model's %+v; "+
			"open it with tiny.Open instead", dir, ErrArchitecture, ck.w.cfg, e.m.w.cfg)
	}
	e.m, e.tok, e.eos = newModel(ck.w), ck.tok, ck.eos
	e.opt = ck.opt
	if e.opt == nil {
		e.opt = newAdamState(ck.w)
	}
	return nil
}

// Close releases the model; later calls return ErrClosed.
func (e *Engine) Close() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.closed = true
	e.m, e.ref, e.opt = nil, nil, nil
	return nil
}

// Render renders each request's messages with the chat template, as token ids (EncodeChat: a
// message's content is plain text). The BPE vocabulary's template renders tools into the system
// turn (EncodeChatTools); the character vocabulary's has no tools variable, so a request with
// tools is refused there (put the schemas in a system message instead).
func (e *Engine) Render(_ context.Context, reqs []engines.RenderRequest) ([][]int32, error) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.closed {
		return nil, ErrClosed
	}
	out := make([][]int32, len(reqs))
	for i, r := range reqs {
		ids, err := e.tok.EncodeChatTools(r.Messages, r.Tools, r.AddGenerationPrompt)
		if err != nil {
			return nil, fmt.Errorf("render request %d: %w", i, err)
		}
		out[i] = ids
	}
	return out, nil
}

// promptTokens resolves the prompt of a request: messages rendered with the chat template and the
// generation prompt, or token ids checked against the vocabulary.
func (e *Engine) promptTokens(msgs []engines.Message, ids []int32) ([]int32, error) {
	switch {
	case len(msgs) > 0 && len(ids) > 0:
		return nil, errors.New("both Messages and PromptTokens are set; set exactly one")
	case len(msgs) > 0:
		return e.tok.EncodeChat(msgs, true), nil
	case len(ids) == 0:
		return nil, errors.New("the prompt is empty: set Messages or PromptTokens")
	}
	if err := e.checkTokens(ids); err != nil {
		return nil, err
	}
	return ids, nil
}

func (e *Engine) checkTokens(ids []int32) error {
	for i, id := range ids {
		if id < 0 || int(id) >= e.m.w.cfg.VocabSize {
			return fmt.Errorf("token %d at index %d is outside the vocabulary [0, %d)", id, i, e.m.w.cfg.VocabSize)
		}
	}
	return nil
}
