package advantage

import (
	"math"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

func f(x float64) float32 { return float32(x) }

// advCases is the batch of TestAdvantagesByHand: group a has rewards 1 (two tokens), 0, 0; group b
// one sample with reward 5; group c two samples whose advantages the script gave.
var advCases = []Input{
	{Reward: 1, Group: "a", Tokens: 2},
	{Reward: 0, Group: "a", Tokens: 1},
	{Reward: 0, Group: "a", Tokens: 1},
	{Reward: 5, Group: "b", Tokens: 1},
	{Reward: 3, Group: "c", Tokens: 1, Override: []float64{0.25}},
	{Reward: 3, Group: "c", Tokens: 2, Override: []float64{1, 2}},
}

// TestAdvantagesBaselineByHand: reinforce_plus_plus_baseline subtracts the group mean (with
// rewards_normalization, as slime's reward post-processing does), broadcasts it to every token
// without discount and whitens all tokens of the batch with slime's distributed_masked_whiten:
// (x − mean)/sqrt(unbiased var + 1e-8). Script-given advantages stay as given.
func TestAdvantagesBaselineByHand(t *testing.T) {
	// Group a: mean 1/3 → 2/3, −1/3, −1/3; group b: 5 − 5 = 0. Tokens: 2/3, 2/3, −1/3, −1/3, 0.
	// Batch mean 2/15; deviations 8/15 (×2), −7/15 (×2), −2/15; Σ squares 230/225; var 230/900.
	sd := math.Sqrt(230.0/900 + 1e-8)
	hi, lo, b := f((8.0/15)/sd), f((-7.0/15)/sd), f((-2.0/15)/sd)
	want := [][]float32{{hi, hi}, {lo}, {lo}, {b}, {0.25}, {1, 2}}
	// γ does not discount the baseline variant (slime broadcasts r − mean).
	for _, gamma := range []float64{1, 0.5} {
		got, err := Compute(Estimator{Name: "reinforce_plus_plus_baseline", Normalize: true, StdNormalize: true, Gamma: gamma}, advCases)
		if err != nil {
			t.Fatal(err)
		}
		if d := cmp.Diff(want, got, cmpopts.EquateApprox(0, 1e-5)); d != "" {
			t.Errorf("reinforce_plus_plus_baseline, γ=%v (-want +got):\n%s", gamma, d)
		}
	}
	// Without rewards_normalization slime subtracts no baseline: the raw rewards 1, 1, 0, 0, 5
	// are whitened (mean 1.4, Σ squares 17.2, var 17.2/4).
	sd = math.Sqrt(17.2/4 + 1e-8)
	w := func(x float64) float32 { return f((x - 1.4) / sd) }
	got, err := Compute(Estimator{Name: "reinforce_plus_plus_baseline", Gamma: 1}, advCases[:4])
	if err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff([][]float32{{w(1), w(1)}, {w(0)}, {w(0)}, {w(5)}}, got, cmpopts.EquateApprox(0, 1e-5)); d != "" {
		t.Errorf("reinforce_plus_plus_baseline without reward normalisation (-want +got):\n%s", d)
	}
}

// TestReinforcePlusPlusDiscount: slime's returns G_t = r_t + γ·G_{t+1} with the reward on the
// last token (slime's get_reinforce_plus_plus_returns, kl_coef 0), then batch whitening.
func TestReinforcePlusPlusDiscount(t *testing.T) {
	in := []Input{
		{Reward: 2, Group: "a", Tokens: 2}, // γ = 0.5: returns 1, 2
		{Reward: 0, Group: "a", Tokens: 2}, // 0, 0
		{Reward: 9, Group: "b", Tokens: 3, Override: []float64{7}},
	}
	// Tokens 1, 2, 0, 0: mean 0.75, deviations 0.25, 1.25, −0.75, −0.75, Σ squares 2.75, var 2.75/3.
	sd := math.Sqrt(2.75/3 + 1e-8)
	w := func(x float64) float32 { return f((x - 0.75) / sd) }
	got, err := Compute(Estimator{Name: "reinforce_plus_plus", Normalize: true, StdNormalize: true, Gamma: 0.5}, in)
	if err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff([][]float32{{w(1), w(2)}, {w(0), w(0)}, {7, 7, 7}}, got, cmpopts.EquateApprox(0, 1e-5)); d != "" {
		t.Errorf("reinforce++ γ=0.5 (-want +got):\n%s", d)
	}
	// γ = 0: only the last token carries the reward (returns 0, 2 and 0, 0: mean 0.5, var 3/3).
	got, _ = Compute(Estimator{Name: "reinforce_plus_plus", Gamma: 0}, in[:2])
	sd = math.Sqrt(1 + 1e-8)
	if d := cmp.Diff([][]float32{{f(-0.5 / sd), f(1.5 / sd)}, {f(-0.5 / sd), f(-0.5 / sd)}}, got, cmpopts.EquateApprox(0, 1e-5)); d != "" {
		t.Errorf("reinforce++ γ=0 (-want +got):\n%s", d)
	}
}

// TestGSPOAdvantagesByHand: GSPO's advantages are GRPO's group normalisation (the sequence-level
// ratio is the engine's business, selected through LossConfig.PolicyLoss).
func TestGSPOAdvantagesByHand(t *testing.T) {
	// Group a: mean 1/3, unbiased std sqrt(1/3); group b alone: 5 − 5 = 0.
	s := math.Sqrt(1.0 / 3)
	a1, a0 := f((2.0/3)/(s+1e-6)), f((-1.0/3)/(s+1e-6))
	for _, c := range []struct {
		name string
		est  Estimator
		want [][]float32
	}{
		{"std", Estimator{Name: "gspo", Normalize: true, StdNormalize: true, Gamma: 0.5}, [][]float32{{a1, a1}, {a0}, {a0}, {0}, {0.25}, {1, 2}}},
		{"no std", Estimator{Name: "gspo", Normalize: true}, [][]float32{{2.0 / 3, 2.0 / 3}, {-1.0 / 3}, {-1.0 / 3}, {0}, {0.25}, {1, 2}}},
		{"raw", Estimator{Name: "gspo"}, [][]float32{{1, 1}, {0}, {0}, {5}, {0.25}, {1, 2}}},
	} {
		got, err := Compute(c.est, advCases)
		if err != nil {
			t.Fatal(err)
		}
		if d := cmp.Diff(c.want, got, cmpopts.EquateApprox(0, 1e-6)); d != "" {
			t.Errorf("gspo %s (-want +got):\n%s", c.name, d)
		}
	}
}

// The table is what config validation lists and what Compute finds: every name but ppo (the
// host's, from a critic) computes, "" is grpo, an unknown name is an error naming the others.
func TestEstimatorTable(t *testing.T) {
	want := []string{"grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gspo", "ppo"}
	if d := cmp.Diff(want, Names()); d != "" {
		t.Fatalf("Names (-want +got):\n%s", d)
	}
	for _, name := range want[:5] {
		if _, err := Compute(Estimator{Name: name, Normalize: true, Gamma: 1}, advCases); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	grpo, _ := Compute(Estimator{Name: "grpo", Normalize: true, StdNormalize: true}, advCases)
	def, _ := Compute(Estimator{Normalize: true, StdNormalize: true}, advCases)
	if d := cmp.Diff(grpo, def); d != "" {
		t.Errorf("the unnamed estimator is not grpo (-grpo +unnamed):\n%s", d)
	}
	for _, name := range []string{"ppo", "gae"} {
		_, err := Compute(Estimator{Name: name}, advCases)
		if err == nil || !strings.Contains(err.Error(), "(supported: grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, gspo)") {
			t.Errorf("%s: error %v, want one that lists the supported estimators", name, err)
		}
	}
}

func TestAdvantagesByHand(t *testing.T) {
	in := []Input{
		{Reward: 1, Group: "a", Tokens: 2},
		{Reward: 0, Group: "a", Tokens: 1},
		{Reward: 0, Group: "a", Tokens: 1},
		{Reward: 5, Group: "b", Tokens: 1},
		{Reward: 3, Group: "c", Tokens: 1, Override: []float64{0.25}},
		{Reward: 3, Group: "c", Tokens: 2, Override: []float64{1, 2}},
	}
	// Group a: mean 1/3, unbiased std sqrt(((2/3)^2 + 2(1/3)^2)/2) = sqrt(1/3).
	s := math.Sqrt(1.0 / 3)
	a1, a0 := (2.0/3)/(s+1e-6), (-1.0/3)/(s+1e-6)
	want := map[string][][]float32{
		"grpo": {{f(a1), f(a1)}, {f(a0)}, {f(a0)}, {0}, {0.25}, {1, 2}},
		// rloo: 1 − 0 = 1; 0 − 1/2 = −1/2.
		"rloo": {{1, 1}, {-0.5}, {-0.5}, {0}, {0.25}, {1, 2}},
	}
	for name, w := range want {
		got, err := Compute(Estimator{Name: name, Normalize: true, StdNormalize: true}, in)
		if err != nil {
			t.Fatal(err)
		}
		if d := cmp.Diff(w, got, cmpopts.EquateApprox(0, 1e-5)); d != "" {
			t.Errorf("%s advantages (-want +got):\n%s", name, d)
		}
	}
	// Without std normalisation GRPO is r − mean; without reward normalisation it is r.
	got, _ := Compute(Estimator{Name: "grpo", Normalize: true}, in[:4])
	if d := cmp.Diff([][]float32{{2.0 / 3, 2.0 / 3}, {-1.0 / 3}, {-1.0 / 3}, {0}}, got, cmpopts.EquateApprox(0, 1e-6)); d != "" {
		t.Errorf("grpo without std (-want +got):\n%s", d)
	}
	got, _ = Compute(Estimator{Name: "grpo"}, in[:4])
	if d := cmp.Diff([][]float32{{1, 1}, {0}, {0}, {5}}, got); d != "" {
		t.Errorf("grpo without normalisation (-want +got):\n%s", d)
	}
	// REINFORCE++ (γ = 1) whitens over the batch's tokens as slime does: returns 1,1,0,0,5 → mean
	// 1.4, unbiased variance 17.2/4, (x − mean)/sqrt(var + 1e-8). γ < 1: TestReinforcePlusPlusDiscount.
	got, _ = Compute(Estimator{Name: "reinforce_plus_plus", Gamma: 1}, in[:4])
	sd := math.Sqrt(((1-1.4)*(1-1.4)*2+1.4*1.4*2+3.6*3.6)/4 + 1e-8)
	w := func(x float64) float32 { return float32((x - 1.4) / sd) }
	if d := cmp.Diff([][]float32{{w(1), w(1)}, {w(0)}, {w(0)}, {w(5)}}, got, cmpopts.EquateApprox(0, 1e-5)); d != "" {
		t.Errorf("reinforce++ (-want +got):\n%s", d)
	}
	if _, err := Compute(Estimator{Name: "nope"}, in); err == nil {
		t.Error("unknown estimator: no error")
	}
}
