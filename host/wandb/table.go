package wandb

import (
	"strings"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host"
)

// rolloutColumns are the columns of a rollouts table: one row per call of a saved rollout (a
// sampled completion, or a conversation), and one for a rollout that failed before any call.
var rolloutColumns = []string{"step", "dataset", "rollout", "task", "label", "policy", "kind", "prompt", "response",
	"reward", "advantage", "trained", "finish_reason", "result", "error"}

// rolloutTable is the sidecar's table of saved rollouts.
func rolloutTable(recs []host.RolloutRecord) map[string]any {
	var rows [][]any
	for _, r := range recs {
		var label any
		if r.Task.Label != nil {
			label = *r.Task.Label
		}
		head := []any{r.Step, r.Dataset, r.Index, r.Task.ID, label}
		tail := []any{r.Result, r.Error}
		if len(r.Calls) == 0 {
			row := append(append(head, "", "", taskPrompt(r.Task), "", nil, nil, false, ""), tail...)
			rows = append(rows, row)
			continue
		}
		for _, c := range r.Calls {
			var reward any
			if c.Reward != nil {
				reward, _ = number(*c.Reward)
			}
			var adv any
			if a, ok := meanAdvantage(c); ok {
				adv, _ = number(a)
			}
			prompt := c.Prompt
			if len(c.Messages) > 0 {
				prompt = messagesText(c.Messages)
			} else if prompt == "" {
				prompt = taskPrompt(r.Task)
			}
			row := append(append(append([]any(nil), head...), c.Policy, c.Kind, prompt, c.Response, reward, adv, c.Trained, c.FinishReason), tail...)
			rows = append(rows, row)
		}
	}
	return map[string]any{"columns": rolloutColumns, "rows": rows}
}

// meanAdvantage is a trained call's advantage over its trained tokens (loss mask 1).
func meanAdvantage(c host.CallRecord) (float64, bool) {
	if !c.Trained || len(c.Advantage) == 0 {
		return 0, false
	}
	var sum, n float64
	for i, a := range c.Advantage {
		if i < len(c.Mask) && c.Mask[i] == 0 {
			continue
		}
		sum += float64(a)
		n++
	}
	if n == 0 {
		return 0, false
	}
	return sum / n, true
}

func taskPrompt(t host.TaskRecord) string {
	if len(t.Messages) > 0 {
		return messagesText(t.Messages)
	}
	return t.Prompt
}

// messagesText shows a chat prompt as "role: content" paragraphs.
func messagesText(ms []engines.Message) string {
	var b strings.Builder
	for i, m := range ms {
		if i > 0 {
			b.WriteString("\n\n")
		}
		b.WriteString(m.Role + ": " + m.Content)
	}
	return b.String()
}
