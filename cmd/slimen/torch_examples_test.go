package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// Issue 16, the examples: each agent example runs on the torch engine with its config_torch.yaml
// and no script edit, taking the chat model's settings (system prompt, tool schemas) there. So
// does the eight-agent exam swarm (issue 23): eight LoRA adapters in one worker.

// torchExample is an example folder and what its chat-model settings log in a torch run.
type torchExample struct {
	name     string
	script   string             // the example's script in its folder; "" is name.star
	policies int                // entries of config_torch.yaml (hf_checkpoint and device lines)
	want     map[string]float64 // _run metrics only the chat model's settings log, and their values
	// minPrompt bounds the first turn's prompt tokens from below where the schemas are in it. On
	// make-model's tokenizer (a 512-token byte-level BPE, seed 0) the system prompt and the task
	// come to about 150 tokens (calculator_agent), 290 (agentflow) and 310 (toolorchestra: the
	// longer system prompt and the whole question) without them, and to about 600, 980 and 980
	// with them (the fallback that describes them in the system message: the template has no tools
	// variable).
	minPrompt float64
	workers   int // torch workers the run starts (LoRA policies on one base share one); 0: unchecked
}

var torchExamples = []torchExample{
	{"calculator_agent", "", 1, map[string]float64{"tool_schemas": 1}, 400, 1},
	{"agentflow", "", 3, map[string]float64{"tool_schemas": 2}, 650, 0},
	{"memagent", "", 1, map[string]float64{"chunk_sentences": 10, "memory_chars": 64}, 0, 1},
	{"toolorchestra", "", 2, map[string]float64{"tool_schemas": 2}, 650, 0},
	{"exam_swarm", "exam_swarm8.star", 8, map[string]float64{"boxed_instruction": 1}, 0, 1},
}

// TestExampleTorchConfigs runs each agent example one step with its config_torch.yaml, the model
// folders replaced by one tiny random Qwen3 (make-model tiny-qwen3, its context widened to fit
// the tool schemas) and the device by the CPU: every rollout succeeds, and the chat model's
// settings reach the engine (the schemas are in the first turn's prompt).
func TestExampleTorchConfigs(t *testing.T) {
	py := torchPython(t)
	dir := t.TempDir()
	// A copy of the package's tiny-qwen3 folder, which other tests read as make-model wrote it.
	model := filepath.Join(dir, "model")
	if err := os.CopyFS(model, os.DirFS(torchModelOfShape(t, py, "tiny-qwen3"))); err != nil {
		t.Fatal(err)
	}
	widenContext(t, model, 2048)
	env := []string{"SLIMEN_PYTHON=" + py, "XDG_CACHE_HOME=" + filepath.Join(dir, "cache")}
	for _, ex := range torchExamples {
		t.Run(ex.name, func(t *testing.T) {
			cfg := torchExampleConfig(t, ex, model, dir)
			out := filepath.Join(dir, "run-"+ex.name)
			script := filepath.Join("examples", ex.name, ex.name+".star")
			if ex.script != "" {
				script = filepath.Join("examples", ex.name, ex.script)
			}
			log, err := slimen(t, env, "exec", script, "--config", cfg, "--out", out, "--steps", "1", "--batch-size", "2")
			if err != nil {
				t.Fatalf("%v\n%s", err, log)
			}
			run := runMetricsLine(t, out, 1)
			if run["rollouts"] != 2 || run["failed"] != 0 {
				t.Errorf("rollouts %v, failed %v: want 2 and 0\n%v\n%s", run["rollouts"], run["failed"], run, log)
			}
			for k, v := range ex.want {
				if run[k] != v {
					t.Errorf("%s = %v, want %v (the chat model's settings)\n%v", k, run[k], v, run)
				}
			}
			if ex.workers > 0 {
				ev, err := os.ReadFile(filepath.Join(out, "events.log"))
				if err != nil {
					t.Fatal(err)
				}
				if n := strings.Count(string(ev), "starting a torch worker"); n != ex.workers {
					t.Errorf("%d torch workers started, want %d\n%s", n, ex.workers, ev)
				}
			}
			if ex.minPrompt > 0 && run["first_prompt_tokens"] < ex.minPrompt {
				t.Errorf("first_prompt_tokens = %v: the tool schemas did not reach the first turn's prompt (want >= %v)\n%v",
					run["first_prompt_tokens"], ex.minPrompt, run)
			}
		})
	}
}

// widenContext sets the model folder's max_position_embeddings (the worker's context).
func widenContext(t *testing.T, model string, n int) {
	t.Helper()
	path := filepath.Join(model, "config.json")
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var c map[string]any
	if err := json.Unmarshal(b, &c); err != nil {
		t.Fatal(err)
	}
	c["max_position_embeddings"] = n
	if b, err = json.Marshal(c); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// torchExampleConfig is a copy of the example's config_torch.yaml in dir with every
// hf_checkpoint set to model, every device to the CPU and max_response_len to 32.
func torchExampleConfig(t *testing.T, ex torchExample, model, dir string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "examples", ex.name, "config_torch.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	y := string(b)
	for _, r := range []struct {
		re, to string
		n      int
	}{
		{`(?m)^(\s*hf_checkpoint:) .*$`, "${1} " + model, ex.policies},
		{`engine: \{kind: torch, device: cuda:0\}`, "engine: {kind: torch, device: cpu}", ex.policies},
		{`max_response_len: \d+`, "max_response_len: 32", 1},
	} {
		re := regexp.MustCompile(r.re)
		if n := len(re.FindAllStringIndex(y, -1)); n != r.n {
			t.Fatalf("config_torch.yaml: %d matches of %s, want %d:\n%s", n, r.re, r.n, y)
		}
		y = re.ReplaceAllString(y, r.to)
	}
	path := filepath.Join(dir, ex.name+".yaml")
	if err := os.WriteFile(path, []byte(y), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// runMetricsLine is the _run record of the step in the run's metrics.jsonl.
func runMetricsLine(t *testing.T, out string, step int) map[string]float64 {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(out, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatal(err)
		}
		if m["policy"] != "_run" || m["step"] != float64(step) {
			continue
		}
		f := map[string]float64{}
		for k, v := range m {
			if x, ok := v.(float64); ok {
				f[k] = x
			}
		}
		return f
	}
	t.Fatalf("metrics.jsonl has no _run line for step %d:\n%s", step, b)
	return nil
}
