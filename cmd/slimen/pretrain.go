package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/tiny"
	"github.com/slimen/slimen/host/tasks"
)

func init() {
	commands["pretrain"] = command{"supervised warm-up of a tiny model on a synthetic task", cmdPretrain}
}

// cmdPretrain trains a tiny model from random weights (or --init's checkpoint) on the
// synthetic:arith corpus (tasks.Arith.Example), the agent corpus (--task synthetic:calc,
// tasks.Calc.AgentExample) or the examples of a JSONL file (--corpus), and saves it as a model
// folder. A new model has the character vocabulary or, with --tokenizer bpe:N, a byte-level BPE
// trained on the corpus. builtin:tiny-arith and builtin:tiny-agent are its outputs; the exact
// commands are in docs/tiny.md.
func cmdPretrain(args []string) int {
	f := newPretrainFlags()
	if err := f.fs.Parse(args); err != nil {
		return flagExit(err)
	}
	if f.fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "slimen pretrain: unexpected argument %q: it takes only flags, and they go before anything else\n", f.fs.Arg(0))
		return 2
	}
	if *f.out == "" && !*f.evalOnly {
		f.fs.Usage()
		return 2
	}
	p, err := f.plan()
	if err == nil && !p.evalOnly {
		err = checkOut(p.out) // last: a folder is made only for a plan that holds
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "slimen pretrain:", err)
		return 2
	}
	return p.run()
}

// pretrainFlags are the flags of `slimen pretrain`.
type pretrainFlags struct {
	fs                                  *flag.FlagSet
	task, out, init, tokenizer, corpus  *string
	difficulty, steps, batch, warmup    *int
	evalEvery, evalN, threads, tokTexts *int
	lr, wd                              *float64
	seed, evalSeed                      *uint64
	evalOnly                            *bool
	cfg                                 tiny.ModelConfig // a new model's architecture
}

// newPretrainFlags defines the flags, their defaults those that reproduce builtin:tiny-arith.
func newPretrainFlags() *pretrainFlags {
	fs := flag.NewFlagSet("pretrain", flag.ContinueOnError)
	f := &pretrainFlags{fs: fs, cfg: tiny.DefaultConfig()}
	f.task = fs.String("task", "synthetic:arith", "task source: synthetic:arith[?difficulty=N]; "+
		"synthetic:calc for the agent corpus of builtin:tiny-agent (with --init builtin:tiny-arith); "+
		"synthetic:chat for the chat corpus of builtin:tiny-chat (with --tokenizer bpe:N; options vary_chunks=true, easy_calc=true: docs/torch.md)")
	f.difficulty = fs.Int("difficulty", 0, "problem difficulty 1..4 (overrides the task's; default 2)")
	f.steps = fs.Int("steps", 900, "optimizer steps (900, with every other flag at its default, reproduces builtin:tiny-arith byte for byte)")
	f.batch = fs.Int("batch-size", 64, "examples per step")
	f.lr = fs.Float64("lr", 3e-3, "learning rate (after a linear warm-up; constant, so a run of N steps is the start of any longer run)")
	f.warmup = fs.Int("warmup", 100, "warm-up steps")
	f.wd = fs.Float64("weight-decay", 0.01, "AdamW weight decay")
	f.seed = fs.Uint64("seed", 1, "seed of the initial weights and of the training problems")
	f.evalSeed = fs.Uint64("eval-seed", 0, "seed of the held-out problems (default: seed + 1000)")
	f.evalEvery = fs.Int("eval-every", 500, "evaluate held-out accuracy every N steps (0: only at the end)")
	f.evalN = fs.Int("eval-n", 500, "held-out problems per evaluation")
	f.out = fs.String("out", "", "folder to write the model to (required)")
	f.init = fs.String("init", "", "start from this checkpoint (a model folder or builtin:NAME) instead of random weights; "+
		"the architecture flags are then ignored")
	f.threads = fs.Int("threads", 0, "goroutines for the math (0: all cores; results do not depend on it)")
	cfg := &f.cfg
	fs.IntVar(&cfg.Hidden, "hidden", cfg.Hidden, "hidden size")
	fs.IntVar(&cfg.Intermediate, "intermediate", cfg.Intermediate, "MLP intermediate size")
	fs.IntVar(&cfg.Layers, "layers", cfg.Layers, "decoder layers")
	fs.IntVar(&cfg.Heads, "heads", cfg.Heads, "attention heads")
	fs.IntVar(&cfg.KVHeads, "kv-heads", cfg.KVHeads, "key/value heads")
	fs.IntVar(&cfg.HeadDim, "head-dim", 0, "attention head width (0: hidden / heads)")
	fs.IntVar(&cfg.MaxSeqLen, "positions", cfg.MaxSeqLen, "max_position_embeddings: the longest prompt and response together (up to 4096 and more)")
	fs.Float64Var(&cfg.RopeTheta, "rope-theta", 0, "rotary base θ (0: 10000)")
	f.tokenizer = fs.String("tokenizer", "char", "vocabulary of a new model: char (the 102 characters of builtin:tiny-arith, "+
		"its <|role|> template) or bpe:N (a byte-level BPE of N tokens trained on the corpus, "+
		"Qwen3's chat template with tools)")
	f.tokTexts = fs.Int("tokenizer-examples", 20000, "with --tokenizer bpe:N: how many corpus examples (rendered with the chat template) the BPE is trained on")
	f.corpus = fs.String("corpus", "", "JSONL file of examples instead of --task: each line {\"prompt\": …, "+
		"\"response\": …} or {\"messages\": […], \"tools\": [schemas], \"response\": …}; "+
		"the last --eval-n lines are held out for the evaluation (mean loss per response token)")
	f.evalOnly = fs.Bool("eval-only", false, "evaluate --init's model as a run's evaluation does (the held-out set of --task, "+
		"or --corpus's last --eval-n lines with each one's log-prob) and exit: no training, nothing saved, no --out")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: slimen pretrain --out DIR [--task synthetic:arith | --corpus FILE.jsonl] "+
			"[--tokenizer char|bpe:N] [--positions N] [--steps N] [--seed S] …")
		fmt.Fprintln(fs.Output(), "With only --out given it reproduces the embedded builtin:tiny-arith (--steps 900 --seed 1).")
		fmt.Fprintln(fs.Output(), "--tokenizer bpe:N with --corpus makes a new chat model (Qwen3's chat format with tools); docs/tiny.md has the recipe.")
		fs.PrintDefaults()
	}
	return f
}

// pretrainPlan is what `slimen pretrain` is to do, its flags checked: the examples to train on
// and to evaluate with (data), the model to start from (init's checkpoint, or a new one of cfg
// with tokenizer's vocabulary), the optimizer's settings and the folder the model goes to.
type pretrainPlan struct {
	data                            pretrainData
	init, tokenizer                 string
	nTexts                          int // examples a new BPE vocabulary is trained on
	cfg                             tiny.ModelConfig
	seed                            uint64
	threads                         int
	steps, batch, warmup, evalEvery int
	lr, wd                          float64
	evalOnly                        bool // only evaluate init's model: no training, nothing saved
	out                             string
}

// pretrainData is what a pretraining run trains on and how it evaluates the model: a synthetic
// corpus (synthData) or the lines of a --corpus file (fileData).
type pretrainData interface {
	// example is the i-th example to train on (the tokenizer's too).
	example(i int) tiny.Example
	// heading is the run's first line, once the model is open.
	heading(p *pretrainPlan, info engines.Info) string
	// evaluate prints how e does on the held-out examples after step (0 with --eval-only).
	evaluate(ctx context.Context, e *tiny.Engine, info engines.Info, step int) error
	// check refuses, before any step, an example the model cannot take (its template or its
	// length), naming where it is.
	check(e *tiny.Engine, info engines.Info) error
}

// plan checks the parsed flags and reads --corpus's file.
func (f *pretrainFlags) plan() (*pretrainPlan, error) {
	if *f.evalOnly && *f.init == "" {
		return nil, errors.New("--eval-only evaluates a model: give it with --init DIR")
	}
	p := &pretrainPlan{init: *f.init, tokenizer: *f.tokenizer, nTexts: *f.tokTexts, cfg: f.cfg, seed: *f.seed, threads: *f.threads,
		steps: *f.steps, batch: *f.batch, warmup: *f.warmup, evalEvery: *f.evalEvery, lr: *f.lr, wd: *f.wd, evalOnly: *f.evalOnly, out: *f.out}
	if *f.corpus != "" {
		d, err := readFileData(*f.corpus, *f.evalN, *f.evalOnly)
		if err != nil {
			return nil, err
		}
		p.data, p.nTexts = d, min(p.nTexts, len(d.train))
		return p, nil
	}
	d, err := f.planSynth()
	if err != nil {
		return nil, err
	}
	p.data = d
	return p, nil
}

// checkOut makes the folder the model will be saved into and writes a file there, so that an
// --out that cannot take the model is said before the training, not after it.
func checkOut(out string) error {
	if err := os.MkdirAll(out, 0o755); err != nil {
		return fmt.Errorf("--out %s cannot be made: %w", out, err)
	}
	f, err := os.CreateTemp(out, ".slimen-write-check-*")
	if err != nil {
		return fmt.Errorf("--out %s cannot be written to: %w", out, err)
	}
	f.Close()
	return os.Remove(f.Name())
}

// run opens the model, then trains and saves it or, with --eval-only, only evaluates it. It
// returns the exit code.
func (p *pretrainPlan) run() int {
	e, err := pretrainEngine(p.init, p.tokenizer, p.nTexts, p.cfg, p.seed, p.threads, p.data.example)
	if err != nil {
		fmt.Fprintln(os.Stderr, "slimen pretrain:", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	info, _ := e.Info(ctx)
	if err := p.data.check(e, info); err != nil {
		fmt.Fprintln(os.Stderr, "slimen pretrain:", err)
		return 2
	}
	fmt.Print(p.data.heading(p, info))
	if p.evalOnly {
		err = p.data.evaluate(ctx, e, info, 0)
	} else {
		err = p.train(ctx, e, info)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "slimen pretrain:", err)
		return 1
	}
	return 0
}

// train runs the optimizer steps, printing the mean loss every 50 and evaluating every
// --eval-every, then evaluates the model once more and saves it.
func (p *pretrainPlan) train(ctx context.Context, e *tiny.Engine, info engines.Info) error {
	start, sum, count := time.Now(), 0.0, 0
	err := tiny.Pretrain(ctx, e, p.data.example, tiny.PretrainOptions{
		Steps: p.steps, BatchSize: p.batch, LR: p.lr, WarmupSteps: p.warmup, WeightDecay: p.wd,
		OnStep: func(step int, loss float64) error {
			sum += loss
			count++
			if step%50 == 0 || step == p.steps {
				fmt.Printf("step %d/%d: loss %.4f (%.0fs)\n", step, p.steps, sum/float64(count), time.Since(start).Seconds())
				sum, count = 0, 0
			}
			if p.evalEvery > 0 && step%p.evalEvery == 0 && step != p.steps {
				return p.data.evaluate(ctx, e, info, step)
			}
			return nil
		},
	})
	if err != nil {
		return err
	}
	if err := p.data.evaluate(ctx, e, info, p.steps); err != nil {
		return err
	}
	if err := e.Save(ctx, p.out); err != nil {
		return err
	}
	fmt.Printf("saved %s\n", p.out)
	return nil
}

// synthData is a synthetic corpus to pretrain on: synthetic:arith's worked problems, with agent
// synthetic:calc's agent turns, with chat the chat corpus; each evaluated on the held-out
// problems of another seed.
type synthData struct {
	agent, chat         bool
	arith, heldOut      tasks.Arith
	calc, calcHeldOut   tasks.Calc
	chats, chatsHeldOut tasks.ChatCorpus
	evalN               int
}

// planSynth checks --task, --difficulty and --eval-seed into the synthetic corpus they name.
func (f *pretrainFlags) planSynth() (*synthData, error) {
	task := *f.task
	chat, isChat, err := tasks.ParseChatCorpus(task, *f.seed) // its options; the seeds are set below
	if err != nil {
		return nil, fmt.Errorf("--task %w", err)
	}
	d := &synthData{agent: task == "synthetic:calc", chat: isChat, evalN: *f.evalN}
	if d.agent || d.chat {
		task = "synthetic:arith"
	}
	if d.chat && *f.init == "" && *f.tokenizer == "char" {
		return nil, errors.New("--task synthetic:chat is Qwen3's chat format with tools: " +
			"give a new model a chat vocabulary with --tokenizer bpe:N " +
			"(docs/tiny.md has the command of builtin:tiny-chat) or --init a chat model")
	}
	arith, ok, err := tasks.ParseSpec(task, *f.seed)
	name, _, _ := strings.Cut(strings.TrimPrefix(task, "synthetic:"), "?")
	switch {
	case err != nil && name == "arith":
		err = fmt.Errorf("--task %w", err) // a bad option of synthetic:arith, named by ParseSpec
	case err != nil && strings.HasPrefix(task, "synthetic:") && slices.Contains(tasks.SyntheticNames, name):
		err = fmt.Errorf("--task %s: pretrain takes synthetic:arith[?difficulty=N], synthetic:calc or synthetic:chat", task)
	}
	if err == nil && !ok {
		err = fmt.Errorf("--task %q: only synthetic tasks can be pretrained on (synthetic:arith, synthetic:calc, synthetic:chat)", task)
	}
	if err != nil {
		return nil, err
	}
	if *f.difficulty != 0 {
		if *f.difficulty < 1 || *f.difficulty > tasks.MaxDifficulty {
			return nil, fmt.Errorf("--difficulty must be 1..%d", tasks.MaxDifficulty)
		}
		arith.Difficulty = *f.difficulty
	}
	heldOut := arith
	heldOut.Seed = *f.seed + 1000
	if *f.evalSeed != 0 {
		heldOut.Seed = *f.evalSeed
	}
	if heldOut.Seed == arith.Seed {
		return nil, errors.New("--eval-seed must differ from the training seed")
	}
	d.arith, d.heldOut = arith, heldOut
	d.calc, d.calcHeldOut = tasks.Calc{Seed: arith.Seed}, tasks.Calc{Seed: heldOut.Seed}
	d.chats, d.chatsHeldOut = chat, chat
	d.chats.Seed, d.chatsHeldOut.Seed = arith.Seed, heldOut.Seed
	return d, nil
}

func (d *synthData) example(i int) tiny.Example {
	// The tiny engine pretrains on whatever examples its caller hands it: here a synthetic corpus.
	if d.chat {
		ex := d.chats.Example(i)
		return tiny.Example{Context: ex.Context, Tools: ex.Tools, Response: ex.Response}
	}
	if d.agent {
		context, response := d.calc.AgentExample(i)
		return tiny.Example{Context: context, Response: response}
	}
	prompt, response := d.arith.Example(i)
	return tiny.Example{Prompt: prompt, Response: response}
}

// source names the corpus in the run's first line.
func (d *synthData) source() string {
	switch {
	case d.agent:
		return fmt.Sprintf("the synthetic:calc agent corpus (seed %d)", d.calc.Seed)
	case d.chat:
		return d.chats.String()
	}
	return d.arith.String()
}

func (d *synthData) heading(p *pretrainPlan, info engines.Info) string {
	if p.evalOnly {
		return fmt.Sprintf("evaluate %s (%d parameters) on %s; held out: seed %d\n", p.init, info.Params, d.source(), d.heldOut.Seed)
	}
	return fmt.Sprintf("pretrain %s: %d parameters, %d steps × %d examples; held out: seed %d\n",
		d.source(), info.Params, p.steps, p.batch, d.heldOut.Seed)
}

// check has nothing to do: a synthetic task's examples fit the models it is refused for or not
// in plan.
func (d *synthData) check(*tiny.Engine, engines.Info) error { return nil }

// evaluate prints the held-out accuracy: of the chat corpus's answers (greedy), of synthetic:calc's
// first turns (the tool call or a direct answer), or of the arithmetic problems at temperatures 1
// and 0.
func (d *synthData) evaluate(ctx context.Context, e *tiny.Engine, _ engines.Info, step int) error {
	if d.chat {
		right, sample, err := tasks.ChatEval(ctx, e, d.chatsHeldOut, d.evalN, 96)
		if err != nil {
			return err
		}
		for _, s := range sample {
			fmt.Printf("  %q\n", s)
		}
		fmt.Printf("step %d: held-out chat corpus, greedy answers equal to the right ones: %.1f%% (calc %.1f%%, "+
			"orchestra %.1f%%, planner %.1f%%, verifier %.1f%%, memory %.1f%%, arith %.1f%%)\n",
			step, 100*right["all"], 100*right["calc"], 100*right["orchestra"], 100*right["planner"], 100*right["verifier"], 100*right["memory"], 100*right["arith"])
		return nil
	}
	if d.agent {
		call, direct, sample, err := tasks.CalcFirstTurns(ctx, e, d.calcHeldOut, d.evalN, 1, 1)
		if err != nil {
			return err
		}
		for _, s := range sample {
			fmt.Printf("  %q\n", s)
		}
		fmt.Printf("step %d: held-out synthetic:calc first turns at temperature 1: %.1f%% the exact tool call, %.1f%% a direct answer\n", step, 100*call, 100*direct)
		return nil
	}
	t1, err := tasks.ArithAccuracy(ctx, e, d.heldOut, d.evalN, 1, 1)
	if err != nil {
		return err
	}
	t0, err := tasks.ArithAccuracy(ctx, e, d.heldOut, d.evalN, 0, 1)
	if err != nil {
		return err
	}
	fmt.Printf("step %d: held-out exact match %.1f%% at temperature 1, %.1f%% greedy\n", step, 100*t1, 100*t0)
	return nil
}

// pretrainEngine opens --init's checkpoint or makes a new model of cfg with the vocabulary
// --tokenizer names: the character vocabulary, or a byte-level BPE trained (tiny.TrainBPE) on
// the first nTexts examples of the corpus, each rendered with the chat template and followed by
// its response.
func pretrainEngine(init, tokenizer string, nTexts int, cfg tiny.ModelConfig, seed uint64, threads int, corpus func(int) tiny.Example) (*tiny.Engine, error) {
	opts := tiny.Options{Threads: threads}
	if init != "" {
		if tokenizer != "char" {
			return nil, fmt.Errorf("--tokenizer makes a new model's vocabulary; --init %s keeps its own", init)
		}
		return tiny.Open(init, opts)
	}
	if tokenizer == "char" {
		return tiny.New(cfg, seed, opts)
	}
	n, err := strconv.Atoi(strings.TrimPrefix(tokenizer, "bpe:"))
	if !strings.HasPrefix(tokenizer, "bpe:") || err != nil || n <= 0 {
		return nil, fmt.Errorf("--tokenizer %q: want char or bpe:N (N tokens, e.g. bpe:4096)", tokenizer)
	}
	if nTexts <= 0 {
		return nil, fmt.Errorf("--tokenizer-examples must be positive")
	}
	start := time.Now()
	texts := make([]string, nTexts)
	size := 0
	for i := range texts {
		ex := corpus(i)
		text, err := tiny.QwenChatText(ex.Messages(), ex.Tools, true)
		if err != nil {
			return nil, fmt.Errorf("corpus example %d: %w", i, err)
		}
		texts[i] = text + ex.Response
		size += len(texts[i])
	}
	tok, err := tiny.TrainBPE(texts, n, tiny.ChatSpecials)
	if err != nil {
		return nil, err
	}
	fmt.Printf("tokenizer: byte-level BPE of %d tokens trained on %d examples (%.1f MB) in %.1fs\n",
		tok.VocabSize(), nTexts, float64(size)/1e6, time.Since(start).Seconds())
	return tiny.NewWithTokenizer(cfg, tok, seed, opts)
}

// corpusLine is one line of a --corpus file.
type corpusLine struct {
	Prompt   string            `json:"prompt"`
	Messages []engines.Message `json:"messages"`
	Tools    []json.RawMessage `json:"tools"`
	Response *string           `json:"response"`
}

// readCorpus reads a --corpus JSONL file; errors name the file and line.
func readCorpus(path string) ([]tiny.Example, []int, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	var out []tiny.Example
	var lines []int // each example's line in the file (blank lines are skipped)
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	for n := 1; sc.Scan(); n++ {
		line := bytes.TrimSpace(sc.Bytes())
		if len(line) == 0 {
			continue
		}
		var c corpusLine
		dec := json.NewDecoder(bytes.NewReader(line))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&c); err != nil {
			return nil, nil, fmt.Errorf("%s:%d: %w", path, n, err)
		}
		switch {
		case c.Response == nil:
			return nil, nil, fmt.Errorf("%s:%d: no \"response\"", path, n)
		case (c.Prompt == "") == (len(c.Messages) == 0):
			return nil, nil, fmt.Errorf("%s:%d: give either \"prompt\" or \"messages\"", path, n)
		case c.Prompt != "" && len(c.Tools) > 0:
			return nil, nil, fmt.Errorf("%s:%d: \"tools\" go with \"messages\"", path, n)
		}
		ex := tiny.Example{Prompt: c.Prompt, Context: c.Messages, Response: *c.Response}
		for _, t := range c.Tools {
			ex.Tools = append(ex.Tools, string(t))
		}
		out = append(out, ex)
		lines = append(lines, n)
	}
	if err := sc.Err(); err != nil {
		return nil, nil, fmt.Errorf("%s: %w", path, err)
	}
	return out, lines, nil
}

// fileData is `slimen pretrain --corpus FILE`: the examples of a JSONL file, all but the last
// evalN in order (cycled), and as evaluation the mean loss per response token on those evalN.
// With evalOnly it evaluates on the last evalN lines (all of them when evalN is 0 or more than
// the file has), and prints each line's log-prob too.
type fileData struct {
	path        string
	train, held []tiny.Example
	lines       []int // the file's line of each example, train's then held's
	evalOnly    bool
}

// readFileData reads --corpus path and holds out its last evalN lines.
func readFileData(path string, evalN int, evalOnly bool) (*fileData, error) {
	all, lines, err := readCorpus(path)
	if err != nil {
		return nil, fmt.Errorf("--corpus %w", err)
	}
	if evalOnly && (evalN == 0 || evalN > len(all)) {
		evalN = len(all)
	}
	if evalN < 0 || (len(all) <= evalN && !evalOnly) {
		return nil, fmt.Errorf("--corpus %s has %d examples; --eval-n %d are held out and at least one must be left to train on", path, len(all), evalN)
	}
	return &fileData{path: path, train: all[:len(all)-evalN], held: all[len(all)-evalN:], lines: lines, evalOnly: evalOnly}, nil
}

// check encodes every example as training and evaluation will and names the file's line of the
// first the model cannot take: tools under a template without them, or more tokens than its
// positions.
func (d *fileData) check(e *tiny.Engine, info engines.Info) error {
	for i, ex := range append(d.train[:len(d.train):len(d.train)], d.held...) {
		p, r, err := e.EncodeExample(ex)
		if err != nil {
			return fmt.Errorf("%s:%d: %w", d.path, d.lines[i], err)
		}
		if n := len(p) + len(r); n > info.MaxSeqLen {
			return fmt.Errorf("%s:%d: the example is %d tokens with its end of turn, more than the model's %d positions", d.path, d.lines[i], n, info.MaxSeqLen)
		}
	}
	return nil
}

// example cycles through the lines trained on (with evalOnly, the held-out ones).
func (d *fileData) example(i int) tiny.Example {
	if d.evalOnly {
		return d.held[i%len(d.held)]
	}
	return d.train[i%len(d.train)]
}

func (d *fileData) heading(p *pretrainPlan, info engines.Info) string {
	if d.evalOnly {
		return fmt.Sprintf("evaluate %s (%d parameters) on the last %d lines of %s\n", p.init, info.Params, len(d.held), d.path)
	}
	return fmt.Sprintf("pretrain on %s: %d examples, %d parameters, %d positions, %d tokens, %d steps × %d examples; held out: the last %d\n",
		d.path, len(d.train), info.Params, info.MaxSeqLen, info.VocabSize, p.steps, p.batch, len(d.held))
}

// evaluate prints the mean loss per response token of the held-out lines (with evalOnly each
// line's log-prob first).
func (d *fileData) evaluate(ctx context.Context, e *tiny.Engine, info engines.Info, step int) error {
	if len(d.held) == 0 {
		return nil
	}
	reqs := make([]engines.ScoreRequest, len(d.held))
	for i, ex := range d.held {
		p, r, err := e.EncodeExample(ex)
		if err != nil {
			return fmt.Errorf("%s:%d: %w", d.path, d.lines[len(d.train)+i], err)
		}
		reqs[i] = engines.ScoreRequest{PromptTokens: p, Tokens: r}
	}
	scores, err := e.Score(ctx, reqs)
	if err != nil {
		return err
	}
	sum, n := 0.0, 0
	for i, s := range scores {
		one := 0.0
		for _, lp := range s.Logprobs {
			sum -= float64(lp)
			one += float64(lp)
			n++
		}
		if d.evalOnly {
			fmt.Printf("line %d: %d response tokens, log-prob %.6f\n", d.lines[len(d.train)+i], len(s.Logprobs), one)
		}
	}
	fmt.Printf("step %d: held-out loss %.4f per response token (%d tokens)\n", step, sum/float64(n), n)
	return nil
}
