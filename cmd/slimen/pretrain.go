package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
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
	fs := flag.NewFlagSet("pretrain", flag.ContinueOnError)
	task := fs.String("task", "synthetic:arith", "task source: synthetic:arith[?difficulty=N]; "+
		"synthetic:calc for the agent corpus of builtin:tiny-agent (with --init builtin:tiny-arith); "+
		"synthetic:chat for the chat corpus of builtin:tiny-chat (with --tokenizer bpe:N)")
	difficulty := fs.Int("difficulty", 0, "problem difficulty 1..4 (overrides the task's; default 2)")
	steps := fs.Int("steps", 900, "optimizer steps (900, with every other flag at its default, reproduces builtin:tiny-arith byte for byte)")
	batch := fs.Int("batch-size", 64, "examples per step")
	lr := fs.Float64("lr", 3e-3, "learning rate (after a linear warm-up; constant, so a run of N steps is the start of any longer run)")
	warmup := fs.Int("warmup", 100, "warm-up steps")
	wd := fs.Float64("weight-decay", 0.01, "AdamW weight decay")
	seed := fs.Uint64("seed", 1, "seed of the initial weights and of the training problems")
	evalSeed := fs.Uint64("eval-seed", 0, "seed of the held-out problems (default: seed + 1000)")
	evalEvery := fs.Int("eval-every", 500, "evaluate held-out accuracy every N steps (0: only at the end)")
	evalN := fs.Int("eval-n", 500, "held-out problems per evaluation")
	out := fs.String("out", "", "folder to write the model to (required)")
	init := fs.String("init", "", "start from this checkpoint (a model folder or builtin:NAME) instead of random weights; the architecture flags are then ignored")
	threads := fs.Int("threads", 0, "goroutines for the math (0: all cores; results do not depend on it)")
	cfg := tiny.DefaultConfig()
	fs.IntVar(&cfg.Hidden, "hidden", cfg.Hidden, "hidden size")
	fs.IntVar(&cfg.Intermediate, "intermediate", cfg.Intermediate, "MLP intermediate size")
	fs.IntVar(&cfg.Layers, "layers", cfg.Layers, "decoder layers")
	fs.IntVar(&cfg.Heads, "heads", cfg.Heads, "attention heads")
	fs.IntVar(&cfg.KVHeads, "kv-heads", cfg.KVHeads, "key/value heads")
	fs.IntVar(&cfg.HeadDim, "head-dim", 0, "attention head width (0: hidden / heads)")
	fs.IntVar(&cfg.MaxSeqLen, "positions", cfg.MaxSeqLen, "max_position_embeddings: the longest prompt and response together (up to 4096 and more)")
	fs.Float64Var(&cfg.RopeTheta, "rope-theta", 0, "rotary base θ (0: 10000)")
	tokenizer := fs.String("tokenizer", "char", "vocabulary of a new model: char (the 102 characters of builtin:tiny-arith, "+
		"its <|role|> template) or bpe:N (a byte-level BPE of N tokens trained on the corpus, "+
		"Qwen3's chat template with tools)")
	tokTexts := fs.Int("tokenizer-examples", 20000, "with --tokenizer bpe:N: how many corpus examples (rendered with the chat template) the BPE is trained on")
	corpusFile := fs.String("corpus", "", "JSONL file of examples instead of --task: each line {\"prompt\": …, "+
		"\"response\": …} or {\"messages\": […], \"tools\": [schemas], \"response\": …}; "+
		"the last --eval-n lines are held out for the evaluation (mean loss per response token)")
	evalOnly := fs.Bool("eval-only", false, "evaluate --init's model as a run's evaluation does (the held-out set of --task, "+
		"or --corpus's last --eval-n lines with each one's log-prob) and exit: no training, nothing saved, no --out")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: slimen pretrain --out DIR [--task synthetic:arith | --corpus FILE.jsonl] "+
			"[--tokenizer char|bpe:N] [--positions N] [--steps N] [--seed S] …")
		fmt.Fprintln(fs.Output(), "With only --out given it reproduces the embedded builtin:tiny-arith (--steps 900 --seed 1).")
		fmt.Fprintln(fs.Output(), "--tokenizer bpe:N with --corpus makes a new chat model (Qwen3's chat format with tools); docs/tiny.md has the recipe.")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return flagExit(err)
	}
	if (*out == "" && !*evalOnly) || fs.NArg() > 0 {
		fs.Usage()
		return 2
	}
	if *evalOnly && *init == "" {
		fmt.Fprintln(os.Stderr, "slimen pretrain: --eval-only evaluates a model: give it with --init DIR")
		return 2
	}
	if *corpusFile != "" {
		return pretrainCorpus(*corpusFile, *out, *init, *tokenizer, *tokTexts, cfg, *steps, *batch, *lr, *warmup, *wd, *seed, *evalEvery, *evalN, *threads, *evalOnly)
	}
	agent, chat := *task == "synthetic:calc", *task == "synthetic:chat"
	if agent || chat {
		*task = "synthetic:arith"
	}
	if chat && *init == "" && *tokenizer == "char" {
		fmt.Fprintln(os.Stderr, "slimen pretrain: --task synthetic:chat is Qwen3's chat format with tools: "+
			"give a new model a chat vocabulary with --tokenizer bpe:N "+
			"(docs/tiny.md has the command of builtin:tiny-chat) or --init a chat model")
		return 2
	}
	arith, ok, err := tasks.ParseSpec(*task, *seed)
	if name, _, _ := strings.Cut(strings.TrimPrefix(*task, "synthetic:"), "?"); err != nil && strings.HasPrefix(*task, "synthetic:") &&
		slices.Contains(tasks.SyntheticNames, name) {
		err = fmt.Errorf("--task %s: pretrain takes synthetic:arith[?difficulty=N], synthetic:calc or synthetic:chat", *task)
	}
	if err == nil && !ok {
		err = fmt.Errorf("--task %q: only synthetic tasks can be pretrained on (synthetic:arith, synthetic:calc, synthetic:chat)", *task)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "slimen pretrain:", err)
		return 2
	}
	if *difficulty != 0 {
		if *difficulty < 1 || *difficulty > tasks.MaxDifficulty {
			fmt.Fprintf(os.Stderr, "slimen pretrain: --difficulty must be 1..%d\n", tasks.MaxDifficulty)
			return 2
		}
		arith.Difficulty = *difficulty
	}
	heldOut := arith
	heldOut.Seed = *seed + 1000
	if *evalSeed != 0 {
		heldOut.Seed = *evalSeed
	}
	if heldOut.Seed == arith.Seed {
		fmt.Fprintln(os.Stderr, "slimen pretrain: --eval-seed must differ from the training seed")
		return 2
	}

	calc, calcHeldOut := tasks.Calc{Seed: arith.Seed}, tasks.Calc{Seed: heldOut.Seed}
	chats, chatsHeldOut := tasks.ChatCorpus{Seed: arith.Seed}, tasks.ChatCorpus{Seed: heldOut.Seed}
	corpus := func(i int) tiny.Example {
		// The tiny engine pretrains on whatever examples its caller hands it: here a synthetic corpus.
		if chat {
			ex := chats.Example(i)
			return tiny.Example{Context: ex.Context, Tools: ex.Tools, Response: ex.Response}
		}
		if agent {
			context, response := calc.AgentExample(i)
			return tiny.Example{Context: context, Response: response}
		}
		prompt, response := arith.Example(i)
		return tiny.Example{Prompt: prompt, Response: response}
	}
	source := arith.String()
	switch {
	case agent:
		source = fmt.Sprintf("the synthetic:calc agent corpus (seed %d)", calc.Seed)
	case chat:
		source = chats.String()
	}
	e, err := pretrainEngine(*init, *tokenizer, *tokTexts, cfg, *seed, *threads, corpus)
	if err != nil {
		fmt.Fprintln(os.Stderr, "slimen pretrain:", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	info, _ := e.Info(ctx)
	if !*evalOnly {
		fmt.Printf("pretrain %s: %d parameters, %d steps × %d examples; held out: seed %d\n",
			source, info.Params, *steps, *batch, heldOut.Seed)
	}
	evaluate := func(step int) error {
		if chat {
			right, sample, err := tasks.ChatEval(ctx, e, chatsHeldOut, *evalN, 96)
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
		if agent {
			call, direct, sample, err := tasks.CalcFirstTurns(ctx, e, calcHeldOut, *evalN, 1, 1)
			if err != nil {
				return err
			}
			for _, s := range sample {
				fmt.Printf("  %q\n", s)
			}
			fmt.Printf("step %d: held-out synthetic:calc first turns at temperature 1: %.1f%% the exact tool call, %.1f%% a direct answer\n", step, 100*call, 100*direct)
			return nil
		}
		t1, err := tasks.ArithAccuracy(ctx, e, heldOut, *evalN, 1, 1)
		if err != nil {
			return err
		}
		t0, err := tasks.ArithAccuracy(ctx, e, heldOut, *evalN, 0, 1)
		if err != nil {
			return err
		}
		fmt.Printf("step %d: held-out exact match %.1f%% at temperature 1, %.1f%% greedy\n", step, 100*t1, 100*t0)
		return nil
	}
	if *evalOnly {
		fmt.Printf("evaluate %s (%d parameters) on %s; held out: seed %d\n", *init, info.Params, source, heldOut.Seed)
		if err := evaluate(0); err != nil {
			fmt.Fprintln(os.Stderr, "slimen pretrain:", err)
			return 1
		}
		return 0
	}
	start, sum, count := time.Now(), 0.0, 0
	err = tiny.Pretrain(ctx, e, corpus, tiny.PretrainOptions{
		Steps: *steps, BatchSize: *batch, LR: *lr, WarmupSteps: *warmup, WeightDecay: *wd,
		OnStep: func(step int, loss float64) error {
			sum += loss
			count++
			if step%50 == 0 || step == *steps {
				fmt.Printf("step %d/%d: loss %.4f (%.0fs)\n", step, *steps, sum/float64(count), time.Since(start).Seconds())
				sum, count = 0, 0
			}
			if *evalEvery > 0 && step%*evalEvery == 0 && step != *steps {
				return evaluate(step)
			}
			return nil
		},
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "slimen pretrain:", err)
		return 1
	}
	if err := evaluate(*steps); err != nil {
		fmt.Fprintln(os.Stderr, "slimen pretrain:", err)
		return 1
	}
	if err := e.Save(ctx, *out); err != nil {
		fmt.Fprintln(os.Stderr, "slimen pretrain:", err)
		return 1
	}
	fmt.Printf("saved %s\n", *out)
	return 0
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
		msgs := ex.Context
		if msgs == nil {
			msgs = []engines.Message{{Role: "user", Content: ex.Prompt}}
		}
		text, err := tiny.QwenChatText(msgs, ex.Tools, true)
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
func readCorpus(path string) ([]tiny.Example, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []tiny.Example
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
			return nil, fmt.Errorf("%s:%d: %w", path, n, err)
		}
		switch {
		case c.Response == nil:
			return nil, fmt.Errorf("%s:%d: no \"response\"", path, n)
		case (c.Prompt == "") == (len(c.Messages) == 0):
			return nil, fmt.Errorf("%s:%d: give either \"prompt\" or \"messages\"", path, n)
		case c.Prompt != "" && len(c.Tools) > 0:
			return nil, fmt.Errorf("%s:%d: \"tools\" go with \"messages\"", path, n)
		}
		ex := tiny.Example{Prompt: c.Prompt, Context: c.Messages, Response: *c.Response}
		for _, t := range c.Tools {
			ex.Tools = append(ex.Tools, string(t))
		}
		out = append(out, ex)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return out, nil
}

// pretrainCorpus is `slimen pretrain --corpus FILE`: the examples of a JSONL file, all but the
// last evalN in order (cycled), and as evaluation the mean loss per response token on those
// evalN. With evalOnly it only evaluates init's model, on the last evalN lines (all of them when
// evalN is 0 or more than the file has), and prints each line's log-prob too.
func pretrainCorpus(path, out, init, tokenizer string, nTexts int, cfg tiny.ModelConfig, steps, batch int, lr float64, warmup int,
	wd float64, seed uint64, evalEvery, evalN, threads int, evalOnly bool) int {
	fail := func(code int, err error) int {
		fmt.Fprintln(os.Stderr, "slimen pretrain:", err)
		return code
	}
	all, err := readCorpus(path)
	if err != nil {
		return fail(2, fmt.Errorf("--corpus %w", err))
	}
	if evalOnly && (evalN == 0 || evalN > len(all)) {
		evalN = len(all)
	}
	if evalN < 0 || (len(all) <= evalN && !evalOnly) {
		return fail(2, fmt.Errorf("--corpus %s has %d examples; --eval-n %d are held out and at least one must be left to train on", path, len(all), evalN))
	}
	train, held := all[:len(all)-evalN], all[len(all)-evalN:]
	corpus := func(i int) tiny.Example { return train[i%len(train)] }
	if evalOnly {
		corpus = func(i int) tiny.Example { return held[i%len(held)] }
	}
	e, err := pretrainEngine(init, tokenizer, min(nTexts, len(train)), cfg, seed, threads, corpus)
	if err != nil {
		return fail(2, err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	info, _ := e.Info(ctx)
	tok := e.Tokenizer()
	if evalOnly {
		fmt.Printf("evaluate %s (%d parameters) on the last %d lines of %s\n", init, info.Params, len(held), path)
	} else {
		fmt.Printf("pretrain on %s: %d examples, %d parameters, %d positions, %d tokens, %d steps × %d examples; held out: the last %d\n",
			path, len(train), info.Params, info.MaxSeqLen, info.VocabSize, steps, batch, len(held))
	}
	evaluate := func(step int) error {
		if len(held) == 0 {
			return nil
		}
		reqs := make([]engines.ScoreRequest, len(held))
		for i, ex := range held {
			msgs := ex.Context
			if msgs == nil {
				msgs = []engines.Message{{Role: "user", Content: ex.Prompt}}
			}
			p, err := tok.EncodeChatTools(msgs, ex.Tools, true)
			if err != nil {
				return fmt.Errorf("held-out example %d: %w", i, err)
			}
			reqs[i] = engines.ScoreRequest{PromptTokens: p, Tokens: append(tok.Encode(ex.Response), info.EOSTokens[0])}
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
			if evalOnly {
				fmt.Printf("line %d: %d response tokens, log-prob %.6f\n", len(all)-len(held)+i+1, len(s.Logprobs), one)
			}
		}
		fmt.Printf("step %d: held-out loss %.4f per response token (%d tokens)\n", step, sum/float64(n), n)
		return nil
	}
	if evalOnly {
		if err := evaluate(0); err != nil {
			return fail(1, err)
		}
		return 0
	}
	start, sum, count := time.Now(), 0.0, 0
	err = tiny.Pretrain(ctx, e, corpus, tiny.PretrainOptions{
		Steps: steps, BatchSize: batch, LR: lr, WarmupSteps: warmup, WeightDecay: wd,
		OnStep: func(step int, loss float64) error {
			sum += loss
			count++
			if step%50 == 0 || step == steps {
				fmt.Printf("step %d/%d: loss %.4f (%.0fs)\n", step, steps, sum/float64(count), time.Since(start).Seconds())
				sum, count = 0, 0
			}
			if evalEvery > 0 && step%evalEvery == 0 && step != steps {
				return evaluate(step)
			}
			return nil
		},
	})
	if err != nil {
		return fail(1, err)
	}
	if err := evaluate(steps); err != nil {
		return fail(1, err)
	}
	if err := e.Save(ctx, out); err != nil {
		return fail(1, err)
	}
	fmt.Printf("saved %s\n", out)
	return 0
}
