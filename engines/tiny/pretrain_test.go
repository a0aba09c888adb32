package tiny

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"math"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/slimen/slimen/host/tasks"
)

// Pretraining is deterministic across runs and thread counts, learns, and leaves no optimizer
// state behind.
func TestPretrainDeterministic(t *testing.T) {
	a := tasks.Arith{Seed: 3, Difficulty: 1}
	var snaps [][][]float32
	for _, threads := range []int{1, 2} {
		e := newSmall(t, threads)
		var losses []float64
		err := Pretrain(ctx, e, arithCorpus(a), PretrainOptions{
			Steps: 12, BatchSize: 8, LR: 1e-2, WarmupSteps: 2,
			OnStep: func(_ int, loss float64) error { losses = append(losses, loss); return nil },
		})
		if err != nil {
			t.Fatal(err)
		}
		if losses[len(losses)-1] > losses[0]-0.5 {
			t.Fatalf("loss went from %.3f to %.3f", losses[0], losses[len(losses)-1])
		}
		if e.opt.step != 0 {
			t.Fatal("optimizer state survived pretraining")
		}
		snaps = append(snaps, snapshot(e))
	}
	if !cmp.Equal(snaps[0], snaps[1]) {
		t.Fatal("pretraining with 1 and 2 threads gave different weights")
	}
}

// pretrainRecipe is `slimen pretrain`'s default recipe (cmd/slimen/pretrain.go: DefaultConfig,
// --seed 1, synthetic:arith at difficulty 2, --batch-size 64, --lr 3e-3, --warmup 100,
// --weight-decay 0.01), the one that made builtin:tiny-arith with --steps 900.
func pretrainRecipe(t *testing.T, steps int) *Engine {
	t.Helper()
	arith, ok, err := tasks.ParseSpec("synthetic:arith", 1)
	if err != nil || !ok {
		t.Fatalf("synthetic:arith: %v", err)
	}
	e, err := New(DefaultConfig(), 1, Options{})
	if err != nil {
		t.Fatal(err)
	}
	err = Pretrain(ctx, e, arithCorpus(arith), PretrainOptions{
		Steps: steps, BatchSize: 64, LR: 3e-3, WarmupSteps: 100, WeightDecay: 0.01,
	})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// weightsSHA256 hashes every parameter in canonical order: name, shape, little-endian float32 bits.
func weightsSHA256(e *Engine) string {
	h := sha256.New()
	for _, tn := range e.m.w.tensors() {
		fmt.Fprintf(h, "%s%v;", tn.name, tn.shape)
		buf := make([]byte, 0, 4*len(tn.data))
		for _, v := range tn.data {
			buf = binary.LittleEndian.AppendUint32(buf, math.Float32bits(v))
		}
		h.Write(buf)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// pinnedPretrain is weightsSHA256 after pinnedSteps steps of pretrainRecipe (about 12 s of CPU time). Every bit of the training
// numerics (initialisation, corpus, forward, backward, AdamW, the learning-rate schedule) feeds
// it; builtin:tiny-arith is the same recipe run for 900 steps, so an unintended change here means
// `slimen pretrain` no longer reproduces the embedded checkpoint. If a change is intended, refresh
// the hash with the one this test prints (go test ./engines/tiny -run TestPretrainPinned -v),
// rebuild builtin:tiny-arith with `slimen pretrain --out engines/tiny/builtin/tiny-arith` and
// regenerate the compat fixture (go test ./engines/tiny -run TestCompatTinyArith -update).
const (
	pinnedSteps    = 10
	pinnedPretrain = "c0e4f9ee609f6b33392c7c111e2af78cbb42c2075cde132f5006dd8485742ab4"
)

// TestPretrainPinned guards the pretraining numerics with a short run of the embedded
// checkpoint's recipe.
func TestPretrainPinned(t *testing.T) {
	if got := weightsSHA256(pretrainRecipe(t, pinnedSteps)); got != pinnedPretrain {
		t.Fatalf("%d steps of the builtin:tiny-arith pretraining recipe give weights with sha256 %s, pinned %s: the training numerics changed",
			pinnedSteps, got, pinnedPretrain)
	}
}

// arithCorpus is the pretraining corpus of builtin:tiny-arith on a, as `slimen pretrain` wires it.
func arithCorpus(a tasks.Arith) func(int) Example {
	return func(i int) Example {
		p, r := a.Example(i)
		return Example{Prompt: p, Response: r}
	}
}

// agentRecipe is the recipe of builtin:tiny-agent (`slimen pretrain --init builtin:tiny-arith
// --task synthetic:calc --batch-size 32 --lr 2e-3 --warmup 20`, seed 1, weight decay 0.01) run
// for steps steps: builtin:tiny-arith trained on on the agent corpus (tasks.Calc.AgentExample).
func agentRecipe(t *testing.T, steps int) *Engine {
	t.Helper()
	e, err := Open("builtin:tiny-arith", Options{Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	calc := tasks.Calc{Seed: 1}
	err = Pretrain(ctx, e, func(i int) Example {
		c, r := calc.AgentExample(i)
		return Example{Context: c, Response: r}
	}, PretrainOptions{Steps: steps, BatchSize: 32, LR: 2e-3, WarmupSteps: 20, WeightDecay: 0.01})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// pinnedAgent is weightsSHA256 after pinnedSteps steps of agentRecipe. Like pinnedPretrain, it
// guards `slimen pretrain`'s reproduction of an embedded checkpoint, here builtin:tiny-agent (its
// corpus and multi-turn examples too); refresh it the same way, and rebuild the checkpoint with
// the command in engines/tiny/builtin/README.md.
const pinnedAgent = "881ddc833ee89bea923870bd786932fcf6d97bc825e3b73f24da5d8d2438887e"

func TestPretrainAgentPinned(t *testing.T) {
	if got := weightsSHA256(agentRecipe(t, pinnedSteps)); got != pinnedAgent {
		t.Fatalf("%d steps of the builtin:tiny-agent pretraining recipe give weights with sha256 %s, pinned %s: the training numerics or the agent corpus changed",
			pinnedSteps, got, pinnedAgent)
	}
}
