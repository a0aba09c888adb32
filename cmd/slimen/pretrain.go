package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"slices"
	"strings"
	"time"

	"github.com/slimen/slimen/engines/tiny"
	"github.com/slimen/slimen/host/tasks"
)

func init() {
	commands["pretrain"] = command{"supervised warm-up of a tiny model on a synthetic task", cmdPretrain}
}

// cmdPretrain trains a tiny model from random weights (or --init's checkpoint) on the
// synthetic:arith corpus (tasks.Arith.Example) or the agent corpus (--task synthetic:calc,
// tasks.Calc.AgentExample) and saves it as a model folder. builtin:tiny-arith and
// builtin:tiny-agent are its outputs; the exact commands are in docs/tiny.md.
func cmdPretrain(args []string) int {
	fs := flag.NewFlagSet("pretrain", flag.ContinueOnError)
	task := fs.String("task", "synthetic:arith", "task source: synthetic:arith[?difficulty=N], or synthetic:calc for the agent corpus of builtin:tiny-agent (with --init builtin:tiny-arith)")
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
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: slimen pretrain --out DIR [--task synthetic:arith] [--difficulty N] [--steps N] [--seed S] …")
		fmt.Fprintln(fs.Output(), "With only --out given it reproduces the embedded builtin:tiny-arith (--steps 900 --seed 1).")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return flagExit(err)
	}
	if *out == "" || fs.NArg() > 0 {
		fs.Usage()
		return 2
	}
	agent := *task == "synthetic:calc"
	if agent {
		*task = "synthetic:arith"
	}
	arith, ok, err := tasks.ParseSpec(*task, *seed)
	if name, _, _ := strings.Cut(strings.TrimPrefix(*task, "synthetic:"), "?"); err != nil && strings.HasPrefix(*task, "synthetic:") && slices.Contains(tasks.SyntheticNames, name) {
		err = fmt.Errorf("--task %s: pretrain takes synthetic:arith[?difficulty=N] or synthetic:calc", *task)
	}
	if err == nil && !ok {
		err = fmt.Errorf("--task %q: only synthetic tasks can be pretrained on (synthetic:arith, synthetic:calc)", *task)
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

	var e *tiny.Engine
	if *init != "" {
		e, err = tiny.Open(*init, tiny.Options{Threads: *threads})
	} else {
		e, err = tiny.New(cfg, *seed, tiny.Options{Threads: *threads})
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "slimen pretrain:", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	info, _ := e.Info(ctx)
	calc, calcHeldOut := tasks.Calc{Seed: arith.Seed}, tasks.Calc{Seed: heldOut.Seed}
	corpus := func(i int) tiny.Example {
		// The tiny engine pretrains on whatever examples its caller hands it: here a synthetic corpus.
		if agent {
			context, response := calc.AgentExample(i)
			return tiny.Example{Context: context, Response: response}
		}
		prompt, response := arith.Example(i)
		return tiny.Example{Prompt: prompt, Response: response}
	}
	source := arith.String()
	if agent {
		source = fmt.Sprintf("the synthetic:calc agent corpus (seed %d)", calc.Seed)
	}
	fmt.Printf("pretrain %s: %d parameters, %d steps × %d examples; held out: seed %d\n",
		source, info.Params, *steps, *batch, heldOut.Seed)
	evaluate := func(step int) error {
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
