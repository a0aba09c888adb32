package host

import (
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Every policy step reports the rollout/trainer log-prob mismatch in metrics.jsonl: ~0 on the
// embedded engine ("on": its trainer reads what its sampler read), one nat for a policy whose
// rollout log-probs are a nat off ("off"). Each step is two optimizer steps without use_tis: only
// the first counts, since the second's forward comes after an update (counting it, "on" would
// show the update's change).
func TestLogprobMismatchMetrics(t *testing.T) {
	cfg := testConfig(2, "off", "on")
	for i := range cfg.Policies {
		cfg.Policies[i].Train.GlobalBatchSize = 2
		cfg.Policies[i].Train.LR = 0.05
	}
	res, out, _ := stepOffOn(t, cfg)
	for _, m := range res.Policies {
		mean, mx, slime := m.Float("logprob_diff_mean"), m.Float("logprob_diff_max"), m.Float("train_rollout_logprob_abs_diff")
		if m.Float("optimizer_steps") != 2 {
			t.Errorf("%s: %v optimizer steps, want 2", m.Policy(), m.Float("optimizer_steps"))
		}
		want := 0.0
		if m.Policy() == "off" {
			want = 1
		}
		if math.Abs(mean-want) > 1e-5 || math.Abs(mx-want) > 1e-5 || math.Abs(slime-want) > 1e-5 {
			t.Errorf("%s: logprob_diff_mean %v, logprob_diff_max %v, train_rollout_logprob_abs_diff %v; want %v", m.Policy(), mean, mx, slime, want)
		}
	}
	b, err := os.ReadFile(filepath.Join(out, "metrics.jsonl"))
	if err != nil || strings.Count(string(b), `"logprob_diff_max":`) != 2 || strings.Count(string(b), `"train_rollout_logprob_abs_diff":`) != 2 {
		t.Errorf("metrics.jsonl lacks the mismatch per policy: %v\n%s", err, b)
	}
}
