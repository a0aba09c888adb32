package tiny

import (
	"cmp"
	"context"
	"errors"
	"fmt"

	"github.com/slimen/slimen/engines"
)

// Example is one supervised pair: a prompt, sent as one user turn through the chat template, and
// the response the model should give, which is followed by the EOS token.
type Example struct {
	Prompt   string
	Response string
	// Context, when set, is the conversation before the response (rendered with the chat
	// template and a generation prompt) and Prompt is ignored: a later turn of a multi-turn
	// conversation, e.g. the answer after a tool's result.
	Context []engines.Message
	// Tools are JSON tool schemas rendered into the system turn (a BPE vocabulary's chat
	// template only: EncodeChatTools).
	Tools []string
}

// Messages is the conversation ex answers: its Context, or else its Prompt as one user turn.
func (ex Example) Messages() []engines.Message {
	if ex.Context != nil {
		return ex.Context
	}
	return []engines.Message{{Role: "user", Content: ex.Prompt}}
}

// EncodeExample is ex as Pretrain trains on it: the prompt as the chat template renders its
// messages and tools (with the generation prompt), and the response's tokens with the end of
// turn. An error is the template's (tools under a template without them).
func (e *Engine) EncodeExample(ex Example) (prompt, response []int32, err error) {
	prompt, err = e.tok.EncodeChatTools(ex.Messages(), ex.Tools, true)
	if err != nil {
		return nil, nil, err
	}
	return prompt, append(e.tok.Encode(ex.Response), e.eos[0]), nil
}

// PretrainOptions configure Pretrain. Zero fields take the defaults noted.
type PretrainOptions struct {
	Steps       int     // optimizer steps; required
	BatchSize   int     // examples per step; 0: 64
	LR          float64 // learning rate after warm-up; 0: 3e-3
	WarmupSteps int     // linear warm-up from 0 to LR, then constant
	WeightDecay float64
	MaxGradNorm float64 // 0: 1
	// OnStep, when set, is called after every step with its number (1-based) and mean loss per
	// response token; the engine is free during the call (it may generate, for an evaluation).
	// An error stops Pretrain and is returned.
	OnStep func(step int, loss float64) error
}

// Pretrain trains the engine's model by supervised next-token prediction: step s reads examples
// s·BatchSize … (s+1)·BatchSize−1 and minimises the mean cross-entropy over their response tokens
// (the prompt is context only), with AdamW. It is deterministic: the same engine, examples and
// options give the same weights to the bit. The optimizer state is discarded at the end: the
// result is a base model, and whatever trains it next starts with fresh moments.
func Pretrain(ctx context.Context, e *Engine, examples func(i int) Example, o PretrainOptions) error {
	if o.Steps <= 0 {
		return errors.New("tiny: pretrain: Steps must be positive")
	}
	if o.BatchSize == 0 {
		o.BatchSize = 64
	}
	if o.LR == 0 {
		o.LR = 3e-3
	}
	if o.MaxGradNorm == 0 {
		o.MaxGradNorm = 1
	}
	for step := 1; step <= o.Steps; step++ {
		batch := make([]Example, o.BatchSize)
		for i := range batch {
			batch[i] = examples((step-1)*o.BatchSize + i)
		}
		st, err := e.supervisedStep(ctx, batch, o.lrAt(step), o.WeightDecay, o.MaxGradNorm)
		if err != nil {
			return err
		}
		if st.Skipped {
			return fmt.Errorf("tiny: pretrain step %d: %s", step, st.Reason)
		}
		if o.OnStep != nil {
			if err := o.OnStep(step, st.Loss); err != nil {
				return err
			}
		}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if !e.closed {
		e.opt = newAdamState(e.m.w)
	}
	return nil
}

// lrAt is the learning rate of a step: a linear warm-up, then constant. The schedule does not
// depend on Steps, so a run of N steps is exactly the first N steps of any longer run: one long run
// with evaluations shows what every shorter run would give.
func (o PretrainOptions) lrAt(step int) float64 {
	if step <= o.WarmupSteps {
		return o.LR * float64(step) / float64(o.WarmupSteps)
	}
	return o.LR
}

// supervisedStep runs one AdamW step on the cross-entropy of the examples' responses.
func (e *Engine) supervisedStep(ctx context.Context, batch []Example, lr, wd, maxNorm float64) (engines.TrainStats, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return engines.TrainStats{}, ErrClosed
	}
	oc, err := resolveOptim(lr, 0, 0, 0, wd, maxNorm)
	if err != nil {
		return engines.TrainStats{}, err
	}
	seqs := make([]trainSeq, len(batch))
	total := 0
	for i, ex := range batch {
		p, r, err := e.EncodeExample(ex)
		if err != nil {
			return engines.TrainStats{}, fmt.Errorf("tiny: pretrain: example %d of the batch: %w", i, err)
		}
		if len(p)+len(r) > e.m.w.cfg.MaxSeqLen {
			msgs := ex.Messages()
			return engines.TrainStats{}, fmt.Errorf("tiny: pretrain: example %q is %d tokens, longer than the model's %d",
				cmp.Or(ex.Prompt, msgs[len(msgs)-1].Content), len(p)+len(r), e.m.w.cfg.MaxSeqLen)
		}
		seqs[i] = trainSeq{prompt: p, response: r}
		total += len(r)
	}
	// Mean negative log-likelihood per response token: every token's upstream gradient is −1/total.
	nll := func(_ int, logp, ent, _ [][]float64) (lossStats, [][]float64, [][]float64) {
		var st lossStats
		dl, de := make([][]float64, len(logp)), make([][]float64, len(logp))
		for i, lp := range logp {
			dl[i], de[i] = make([]float64, len(lp)), make([]float64, len(lp))
			for j, v := range lp {
				st.Loss -= v / float64(total)
				st.Entropy += ent[i][j] / float64(total)
				dl[i][j] = -1 / float64(total)
				st.Tokens++
			}
		}
		return st, dl, de
	}
	st, g, err := e.m.accumulateGrads(ctx, e.threads, chunkTokens, seqs, nil, nll)
	if err != nil {
		return engines.TrainStats{}, err
	}
	return e.applyStep(engines.TrainStats{Loss: st.Loss, Entropy: st.Entropy, Tokens: st.Tokens}, g, oc), nil
}
