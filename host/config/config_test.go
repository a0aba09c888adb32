package config

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

var update = flag.Bool("update", false, "rewrite the golden files under testdata/configs")

const testdata = "../../testdata/configs"

// clean drops the path from the package to the repository root, so golden files read as a user
// at the root would see them.
func clean(s string) string { return strings.ReplaceAll(s, "../../", "") }

func golden(t *testing.T, path, got string) {
	t.Helper()
	if *update {
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test ./host/config -update to create it)", err)
	}
	if diff := cmp.Diff(string(want), got); diff != "" {
		t.Errorf("%s differs (-want +got; go test ./host/config -update rewrites it):\n%s", path, diff)
	}
}

// report is what a golden file of a good config holds: the sizing, the start-up lines and the
// resolved YAML.
func report(t *testing.T, c *Config) string {
	t.Helper()
	var b strings.Builder
	a, r, tot := c.GPUs()
	fmt.Fprintf(&b, "# gpus: actor %d, rollout %d, total %d\n", a, r, tot)
	for _, p := range c.Policies {
		if pt := p.PassThrough(); len(pt) > 0 {
			fmt.Fprintf(&b, "# pass-through %s: %s\n", p.Name, strings.Join(pt, ", "))
		}
	}
	for _, w := range c.Warnings {
		fmt.Fprintf(&b, "# warning: %s\n", w)
	}
	y, err := c.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	b.Write(y)
	return clean(b.String())
}

func TestGoodConfigs(t *testing.T) {
	files, _ := filepath.Glob(filepath.Join(testdata, "good", "*.yaml"))
	if len(files) == 0 {
		t.Fatal("no good configs found")
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			c, err := Load(f)
			if err != nil {
				t.Fatalf("Load: %v", err)
			}
			golden(t, strings.TrimSuffix(f, ".yaml")+".golden", report(t, c))
		})
	}
}

// The resolved YAML the host writes to <out>/config.yaml loads back to the same config.
func TestMarshalRoundTrip(t *testing.T) {
	files, _ := filepath.Glob(filepath.Join(testdata, "good", "*.yaml"))
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			c, err := Load(f)
			if err != nil {
				t.Fatal(err)
			}
			y, err := c.Marshal()
			if err != nil {
				t.Fatal(err)
			}
			back, err := Parse(y, f)
			if err != nil {
				t.Fatalf("reloading the resolved YAML: %v\n%s", err, y)
			}
			ignore := cmpopts.IgnoreFields(PolicyConfig{}, "Line")
			ignoreLoRA := cmpopts.IgnoreFields(LoRAConfig{}, "Line")
			if diff := cmp.Diff(c, back, ignore, ignoreLoRA, cmpopts.IgnoreFields(EvalDataset{}, "Line"),
				cmpopts.IgnoreFields(Config{}, "Warnings")); diff != "" {
				t.Errorf("round trip changed the config (-loaded +reloaded):\n%s", diff)
			}
		})
	}
}

func TestBadConfigs(t *testing.T) {
	files, _ := filepath.Glob(filepath.Join(testdata, "bad", "*.yaml"))
	if len(files) == 0 {
		t.Fatal("no bad configs found")
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			_, err := Load(f)
			if err == nil {
				t.Fatal("Load succeeded; want an error")
			}
			golden(t, strings.TrimSuffix(f, ".yaml")+".err", clean(err.Error())+"\n")
		})
	}
}

// A policy listed by name alone resolves to exactly what a zero-config run gives it.
func TestMinimalYAMLEqualsDefault(t *testing.T) {
	c, err := Parse([]byte("policies:\n  - name: a\n  - name: b\n"), "p.yaml")
	if err != nil {
		t.Fatal(err)
	}
	want := Default([]string{"a", "b"})
	want.File = "p.yaml"
	if diff := cmp.Diff(want, c, cmpopts.IgnoreFields(PolicyConfig{}, "Line")); diff != "" {
		t.Errorf("-Default +loaded:\n%s", diff)
	}
}

func TestDefault(t *testing.T) {
	c := Default([]string{"generator", "critic"})
	p, ok := c.Policy("critic")
	if !ok {
		t.Fatal(`Policy("critic") not found`)
	}
	if p.Engine.Kind != "tiny" || p.HFCheckpoint != BuiltinCheckpoint || !p.Trainable || p.Train.LR != TinyTrainDefaults().LR {
		t.Errorf("default policy = %+v", p)
	}
	if _, ok := c.Policy("judge"); ok {
		t.Error(`Policy("judge") found in a config without it`)
	}
	if a, r, tot := c.GPUs(); a+r+tot != 0 {
		t.Errorf("tiny policies ask for GPUs: %d %d %d", a, r, tot)
	}
	y, err := c.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	back, err := Parse(y, "")
	if err != nil {
		t.Fatalf("the zero-config YAML does not load: %v\n%s", err, y)
	}
	if diff := cmp.Diff(c, back, cmpopts.IgnoreFields(PolicyConfig{}, "Line")); diff != "" {
		t.Errorf("-Default +reloaded:\n%s", diff)
	}
}

func TestGPUs(t *testing.T) {
	pol := func(gpus, megatron, sglang int) PolicyConfig {
		return PolicyConfig{NumGPUsPerNode: gpus, MegatronNumNodes: megatron, SGLangNumNodes: sglang}
	}
	for _, tc := range []struct {
		name                string
		colocate            bool
		policies            []PolicyConfig
		actor, rollout, tot int
	}{
		// slime-n's multi_policy_ppo: actor paired, critic standalone.
		{"ppo", false, []PolicyConfig{pol(1, 1, 1), pol(1, 1, 0)}, 2, 1, 3},
		// slime-n's solver+summarizer with --colocate: 4 GPUs each, shared by training and engines.
		{"colocate", true, []PolicyConfig{pol(4, 1, 1), pol(4, 1, 1)}, 8, 8, 8},
		// A judge hosts only an engine.
		{"judge", false, []PolicyConfig{pol(2, 1, 1), pol(2, 0, 1)}, 2, 4, 6},
	} {
		c := &Config{Policies: tc.policies, Run: RunConfig{Colocate: tc.colocate}}
		a, r, tot := c.GPUs()
		if a != tc.actor || r != tc.rollout || tot != tc.tot {
			t.Errorf("%s: GPUs() = %d, %d, %d; want %d, %d, %d", tc.name, a, r, tot, tc.actor, tc.rollout, tc.tot)
		}
	}
}

func TestOverride(t *testing.T) {
	c := Default([]string{"a"})
	steps, seed, out, data := 5, uint64(9), "runs/x", "synthetic:arith?difficulty=3"
	if err := c.Override(Overrides{Steps: &steps, Seed: &seed, Out: &out, Data: &data}); err != nil {
		t.Fatal(err)
	}
	if c.Run.Steps != 5 || c.Run.Seed != 9 || c.Run.Out != "runs/x" || c.Data.Path != data {
		t.Errorf("after Override: run %+v, data %+v", c.Run, c.Data)
	}
	zero, bad := 0, "synthetic:arith?difficulty=7"
	err := c.Override(Overrides{Steps: &zero, Data: &bad})
	if err == nil {
		t.Fatal("Override accepted --steps 0 and difficulty 7")
	}
	for _, want := range []string{"--steps 0", "difficulty must be 1..4"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
	if c.Run.Steps != 5 || c.Data.Path != data {
		t.Errorf("a rejected override changed the config: steps %d, data %q", c.Run.Steps, c.Data.Path)
	}
}

// Every problem of a file is reported at once, in line order, and can be taken apart.
func TestErrorList(t *testing.T) {
	_, err := Parse([]byte("policies:\n  - name: a\n    role: boss\nrollout:\n  top_p: 2\n  batch_size: x\n"), "p.yaml")
	var list ErrorList
	if !errors.As(err, &list) {
		t.Fatalf("error %v is not an ErrorList", err)
	}
	// batch_size's type error stops the load before range checks: those would only add noise.
	if len(list) != 1 || list[0].Line != 6 || list[0].Path != "rollout.batch_size" {
		t.Fatalf("got %q", err)
	}
	_, err = Parse([]byte("policies:\n  - name: a\n    role: boss\nrollout:\n  top_p: 2\n"), "p.yaml")
	if !errors.As(err, &list) || len(list) != 2 || list[0].Line != 3 || list[1].Line != 5 {
		t.Fatalf("got %q", err)
	}
}

// slime-n's use_kl_loss gate: kl_loss_coef alone does nothing, and the config says so.
func TestKLLossCoefWithoutUseKLLossWarns(t *testing.T) {
	c, err := Parse([]byte("policies:\n  - name: a\n    megatron:\n      kl_loss_coef: 0.1\n"), "p.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Warnings) != 1 || !strings.Contains(c.Warnings[0], "p.yaml:4: policies[0].megatron.kl_loss_coef: 0.1 has no effect") {
		t.Errorf("warnings = %q", c.Warnings)
	}
}

func TestModelArgsMissingFileWarns(t *testing.T) {
	c, err := Parse([]byte("policies:\n  - name: a\n    train: {model_args_path: nowhere/qwen.sh}\n"), "p.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Warnings) != 1 || !strings.Contains(c.Warnings[0], `p.yaml:3: policies[0].train.model_args_path: model_args_path "nowhere/qwen.sh" not found`) {
		t.Errorf("warnings = %q", c.Warnings)
	}
}

func TestParseModelArgs(t *testing.T) {
	src := `MODEL_ARGS=(--num-layers ${N:-4}   # layers
  --swiglu \
  --no-bias-dropout-fusion
  --norm "RMS Norm"
  --sizes 1 2
  --seq-length $SEQ
)
echo --not-in-the-array
`
	flags, skipped := parseModelArgs([]byte(src))
	got := map[string]any{}
	for _, f := range flags {
		got[f.key] = flagValue(f.values)
	}
	want := map[string]any{
		"num_layers": 4, "swiglu": true, "bias_dropout_fusion": false, "norm": "RMS Norm",
		"sizes": []any{1, 2},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("flags (-want +got):\n%s", diff)
	}
	if len(skipped) != 1 || skipped[0].line != 6 || !strings.Contains(skipped[0].msg, "--seq-length uses $SEQ") {
		t.Errorf("skipped = %+v", skipped)
	}
}

func TestNearest(t *testing.T) {
	known := []string{"policies", "rollout", "data", "eval", "run"}
	for key, want := range map[string]string{
		"polices": "policies", "rollouts": "rollout", "Run": "run", "dta": "data", "evaluation": "", "xyz": "",
	} {
		if got := nearest(key, known); got != want {
			t.Errorf("nearest(%q) = %q, want %q", key, got, want)
		}
	}
	if got := nearest("global-batch-size", []string{"global_batch_size"}); got != "global_batch_size" {
		t.Errorf("dashes: got %q", got)
	}
}

func TestRemoteDurations(t *testing.T) {
	c, err := Parse([]byte("policies:\n  - name: p\n    engine: {kind: remote, address: \"127.0.0.1:1\", reconnect_timeout: 30s, timeout: 2m}\n"), "d.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if e := c.Policies[0].Engine; e.ReconnectTimeout != 30*time.Second || e.Timeout != 2*time.Minute {
		t.Errorf("durations: %v %v", e.ReconnectTimeout, e.Timeout)
	}
	_, err = Parse([]byte("policies:\n  - name: p\n    engine: {kind: remote, address: \"127.0.0.1:1\", timeout: soon}\n"), "d.yaml")
	if err == nil || !strings.Contains(err.Error(), "d.yaml:3: policies[0].engine.timeout: expected a duration") {
		t.Errorf("bad duration: %v", err)
	}
}

// slime's loss reduction settings: calculate_per_token_loss selects the token mean, the default is
// slime's per-sample mean, and an explicit eps_clip_high of 0 stays 0 (an upper clip of exactly 1).
func TestSlimeLossSettings(t *testing.T) {
	for _, tc := range []struct {
		yaml, agg string
		hi        float64
	}{
		{"lr: 1.0e-6", "sample_mean", 0.2},
		{"calculate_per_token_loss: true", "token_mean", 0.2},
		{"{calculate_per_token_loss: true, loss_aggregation: token_mean}", "token_mean", 0.2},
		{"loss_aggregation: group_token_mean", "group_token_mean", 0.2},
		{"eps_clip_high: 0", "sample_mean", 0},
		{"{eps_clip: 0.3}", "sample_mean", 0.3},
	} {
		src := "policies:\n  - name: a\n    hf_checkpoint: m\n    megatron:\n      " + strings.Trim(tc.yaml, "{}") + "\n"
		src = strings.ReplaceAll(src, ", ", "\n      ")
		c, err := Parse([]byte(src), "p.yaml")
		if err != nil {
			t.Fatalf("%s: %v", tc.yaml, err)
		}
		if tr := c.Policies[0].Train; tr.LossAggregation != tc.agg || tr.EpsClipHigh != tc.hi {
			t.Errorf("%s: loss_aggregation %q, eps_clip_high %g; want %q, %g", tc.yaml, tr.LossAggregation, tr.EpsClipHigh, tc.agg, tc.hi)
		}
	}
	for _, tc := range []struct{ yaml, want string }{
		{"calculate_per_token_loss: true\n      loss_aggregation: group_token_mean", "p.yaml:5: policies[0].megatron.calculate_per_token_loss: true asks for loss_aggregation token_mean"},
		{"kl_coef: 0.1\n      kl_loss_coef: 0.1\n      advantage_estimator: ppo", "only one of the two may be non-zero"},
	} {
		_, err := Parse([]byte("policies:\n  - name: a\n    hf_checkpoint: m\n    megatron:\n      "+tc.yaml+"\n"), "p.yaml")
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want %q", tc.yaml, err, tc.want)
		}
	}
	c, err := Parse([]byte("policies:\n  - name: a\n    hf_checkpoint: m\n    megatron:\n      kl_coef: 0.1\n"), "p.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Warnings) != 1 || !strings.Contains(c.Warnings[0], "kl_coef: 0.1 has no effect with advantage_estimator grpo") {
		t.Errorf("warnings = %q", c.Warnings)
	}
}

// The off-policy correction: slimen's tis_mode and slime-n's custom_tis_function_path name the
// same two corrections of slime; the band is checked; TIS keys without use_tis are warned about.
func TestTISSettings(t *testing.T) {
	parse := func(yaml string) (*Config, error) {
		return Parse([]byte("policies:\n  - name: a\n    hf_checkpoint: m\n    megatron:\n      "+strings.ReplaceAll(yaml, "; ", "\n      ")+"\n"), "p.yaml")
	}
	for _, tc := range []struct {
		yaml, mode string
		hi, lo     float64
	}{
		{"use_tis: true", "tis", 2, 0},
		{"use_tis: true; tis_mode: icepop; tis_clip: 1.5; tis_clip_low: 0.5", "icepop", 1.5, 0.5},
		{"use_tis: true; custom_tis_function_path: slime.backends.megatron_utils.loss.icepop_function; tis_clip_low: 0.5", "icepop", 2, 0.5},
		{"use_tis: true; custom_tis_function_path: slime.backends.megatron_utils.loss.vanilla_tis_function", "tis", 2, 0},
	} {
		c, err := parse(tc.yaml)
		if err != nil {
			t.Fatalf("%s: %v", tc.yaml, err)
		}
		if tr := c.Policies[0].Train; !tr.UseTIS || tr.TISMode != tc.mode || tr.TISClip != tc.hi || tr.TISClipLow != tc.lo || len(c.Warnings) > 0 {
			t.Errorf("%s: use_tis %v, tis_mode %q, band [%g, %g], warnings %q; want %q [%g, %g]", tc.yaml, tr.UseTIS, tr.TISMode, tr.TISClipLow, tr.TISClip, c.Warnings, tc.mode, tc.lo, tc.hi)
		}
	}
	for _, tc := range []struct{ yaml, want string }{
		{"use_tis: true; tis_mode: rs", "p.yaml:6: policies[0].megatron.tis_mode: tis_mode \"rs\" is not one of tis, icepop"},
		{"use_tis: true; tis_clip: 0", "policies[0].megatron.tis_clip: must be > 0"},
		{"use_tis: true; tis_clip: 1.5; tis_clip_low: 2", "p.yaml:7: policies[0].megatron.tis_clip_low: must be in [0, tis_clip 1.5], got 2"},
		{"use_tis: true; custom_tis_function_path: examples.mis.compute_mis_weights", "p.yaml:6: policies[0].megatron.custom_tis_function_path: \"examples.mis.compute_mis_weights\" is not one of slime's corrections"},
		{"use_tis: true; tis_mode: tis; custom_tis_function_path: slime.backends.megatron_utils.loss.icepop_function", "names slime's icepop function, but tis_mode is \"tis\""},
	} {
		if _, err := parse(tc.yaml); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want %q", tc.yaml, err, tc.want)
		}
	}
	c, err := parse("tis_mode: icepop")
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Warnings) != 1 || !strings.Contains(c.Warnings[0], "megatron.tis_mode: has no effect because use_tis is false") {
		t.Errorf("warnings = %q", c.Warnings)
	}
	// slime's own flags, as a slime-n run script passes them, through model_args_path.
	sh := filepath.Join(t.TempDir(), "args.sh")
	os.WriteFile(sh, []byte("ARGS=(--use-tis --tis-clip 1.5 --tis-clip-low 0.5\n  --custom-tis-function-path slime.backends.megatron_utils.loss.icepop_function\n)\n"), 0o644)
	if c, err = parse("model_args_path: " + sh); err != nil {
		t.Fatal(err)
	}
	if tr := c.Policies[0].Train; !tr.UseTIS || tr.TISMode != "icepop" || tr.TISClip != 1.5 || tr.TISClipLow != 0.5 {
		t.Errorf("from slime's flags: use_tis %v, tis_mode %q, band [%g, %g]", tr.UseTIS, tr.TISMode, tr.TISClipLow, tr.TISClip)
	}
}
