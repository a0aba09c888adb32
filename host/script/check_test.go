package script

import (
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/slimen/slimen/host/config"
)

var update = flag.Bool("update", false, "rewrite golden files")

// TestCheckGolden: `slimen check` on the error scripts. Static problems (syntax, names, unknown
// policies, a top-level generate, no rollout) are found without running; the others are "ok".
func TestCheckGolden(t *testing.T) {
	cfg, err := config.Load("../../testdata/errors/config.yaml")
	if err != nil {
		t.Fatal(err)
	}
	files, _ := filepath.Glob("../../testdata/errors/*.star")
	for _, f := range files {
		name := strings.TrimSuffix(filepath.Base(f), ".star")
		t.Run(name, func(t *testing.T) {
			got := "ok\n"
			if problems := Check(f, cfg); len(problems) > 0 {
				got = strings.ReplaceAll(strings.Join(problems, "\n"), "../../testdata/", "testdata/") + "\n"
			}
			golden := strings.TrimSuffix(f, ".star") + ".check"
			if *update {
				os.WriteFile(golden, []byte(got), 0o644)
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatalf("%v (run go test -update to create it)", err)
			}
			if d := cmp.Diff(string(want), got); d != "" {
				t.Errorf("check (-want +got):\n%s", d)
			}
		})
	}
}

// TestLintWarnings: names a typo apart and a policy sampled once a task under grpo are warnings
// (the script runs, but not as meant); the examples have neither.
func TestLintWarnings(t *testing.T) {
	dir := t.TempDir()
	write := func(name, src string) string {
		p := filepath.Join(dir, name)
		os.WriteFile(p, []byte(src), 0o644)
		return p
	}
	typo := write("typo.star", `
def rollout(task):
    a = generate("solver", task.prompt)
    b = generate("sovler", "Summarize: " + a.text)
    reward([a, b], 1.0)
    train([a, b])
`)
	problems, warnings := Lint(typo, nil)
	if len(problems) != 0 || len(warnings) != 3 ||
		!strings.Contains(warnings[0], `typo.star:3:18: generate("solver") and `) || !strings.Contains(warnings[0], `typo.star:4:18: generate("sovler") name two policies`) ||
		!strings.Contains(warnings[1], `generate("solver", …) is the policy's only sample of a task`) {
		t.Fatalf("problems %q, warnings %q", problems, warnings)
	}
	// With a config the typo is a problem, with a did-you-mean.
	cfg := config.Default([]string{"solver"})
	if problems, _ := Lint(typo, cfg); len(problems) != 1 || !strings.Contains(problems[0], `unknown policy "sovler" (did you mean "solver"?)`) {
		t.Errorf("with a config: %q", problems)
	}
	// Several samples, a loop, an explicit group, or n_samples_per_prompt: no single-sample warning.
	for _, src := range []string{
		"def rollout(task):\n    cs = generate(\"p\", task.prompt, n = 4)\n    reward(cs, 1.0)\n    train(cs)\n",
		"def rollout(task):\n    for i in range(4):\n        c = generate(\"p\", task.prompt)\n        reward(c, 1.0)\n        train(c)\n",
		"def rollout(task):\n    c = generate(\"p\", task.prompt)\n    reward(c, 1.0)\n    train(c, group = \"all\")\n",
	} {
		if _, w := Lint(write("ok.star", src), nil); len(w) != 0 {
			t.Errorf("%s: warnings %q", src, w)
		}
	}
	one := "def rollout(task):\n    c = generate(\"p\", task.prompt)\n    reward(c, 1.0)\n    train(c)\n"
	cfg = config.Default([]string{"p"})
	cfg.Policies[0].Train.NSamplesPerPrompt = 4
	if _, w := Lint(write("one.star", one), cfg); len(w) != 0 {
		t.Errorf("n_samples_per_prompt 4: warnings %q", w)
	}
	examples, _ := filepath.Glob("../../examples/*/*.star")
	for _, f := range examples {
		if strings.HasSuffix(f, "_test.star") {
			continue
		}
		if p, w := Lint(f, nil); len(p)+len(w) != 0 {
			t.Errorf("%s: problems %q, warnings %q", f, p, w)
		}
	}
}

// A script that never names train is warned about (issue 35): it runs, rewards and checkpoints,
// and nothing learns. One that trains in a helper, or through an @graphs topology, is not.
func TestLintNeverTrains(t *testing.T) {
	dir := t.TempDir()
	write := func(name, src string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	f := write("notrain.star", "def rollout(task):\n    cs = generate(\"p\", task.prompt, n = 4)\n    reward(cs, 1.0)\n")
	_, w := Lint(f, nil)
	want := f + ":1:1: the script never calls train(): its rewards are logged but no policy learns from them; queue what you reward with train(c)"
	if len(w) != 1 || w[0] != want {
		t.Errorf("warnings %q, want [%q]", w, want)
	}
	write("helper.star", "def learn(cs):\n    train(cs)\n")
	for _, src := range []string{
		"load(\"helper.star\", \"learn\")\ndef rollout(task):\n    cs = generate(\"p\", task.prompt, n = 4)\n    reward(cs, 1.0)\n    learn(cs)\n",
		"load(\"@graphs//debate.star\", \"debate\")\ndef rollout(task):\n    debate(task)\n",
	} {
		if _, w := Lint(write("ok.star", src), nil); len(w) != 0 {
			t.Errorf("%s: warnings %q", src, w)
		}
	}
}

// chat("p") names a policy as generate("p", …) does: a zero-config run creates the policies of
// a chat-only script before its step-0 eval (which graded no policy and printed an empty line),
// and check --config finds a chat's unknown policy (issue 35).
func TestChatNamesAPolicy(t *testing.T) {
	p := filepath.Join(t.TempDir(), "chat.star")
	src := "def rollout(task):\n    c = chat(\"arith\")\n    c.user(task.prompt)\n    c.generate()\n    d = chat(policy = \"critic\", system = \"Check.\")\n    reward([c, d], 1.0)\n    train([c, d])\n"
	if err := os.WriteFile(p, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	s, err := Load(p, Options{})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, u := range PolicyNames(s) {
		names = append(names, u.Fn+" "+u.Name)
	}
	if want := []string{"chat arith", "chat critic"}; !cmp.Equal(names, want) {
		t.Errorf("PolicyNames = %q, want %q", names, want)
	}
	if problems, _ := Lint(p, config.Default([]string{"arith", "critc"})); len(problems) != 1 || !strings.Contains(problems[0], `chat: unknown policy "critic"`) {
		t.Errorf("check --config: %q", problems)
	}
}

// TestCheckPolicyThroughHelpers: a policy name passed to the script's own function, which passes
// it on (through another function, a lambda, a keyword or a default) to generate/score/chat, is
// checked against the config like one written in generate's call, at the place it is written;
// so is one passed through a package module (@graphs//debate.star). A parameter that never
// reaches a policy argument is not a policy name.
func TestCheckPolicyThroughHelpers(t *testing.T) {
	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "config.yaml")
	os.WriteFile(cfgPath, []byte("policies:\n  - name: solver\n  - name: judge\n  - name: critic\n"), 0o644)
	cfg, err := config.Load(cfgPath)
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, "helpers.star")
	os.WriteFile(p, []byte(`load("@graphs//debate.star", "debate")

def ask(p, q, n = 1):
    return generate(p, q, n = n)

def judge(policy = "judgee"):
    return lambda t: score(policy, t)

def twice(who, q):
    return parallel(lambda i: ask(who, q), range(2))

def talk(task, system = "solver", policy = "solver"):
    return chat(policy = policy, system = system)

def rollout(task):
    a = ask("sovler", task.prompt)
    twice(q = task.prompt, who = "solvr")
    judge()(a.text)
    talk(task, system = "not a policy")
    ask("solver", "fine")
    debate(task, generator = "solver", critic = "critc")
    train(a)
`), 0o644)
	problems, _ := Lint(p, cfg)
	got := strings.ReplaceAll(strings.Join(problems, "\n"), dir+string(filepath.Separator), "")
	tail := `; config.yaml defines "solver", "judge", "critic" — add it under policies: or fix the name`
	want := strings.Join([]string{
		`helpers.star:16:13: ask → generate: unknown policy "sovler" (did you mean "solver"?)` + tail,
		`helpers.star:17:34: twice → generate: unknown policy "solvr" (did you mean "solver"?)` + tail,
		`helpers.star:18:5: judge (its default policy="judgee") → score: unknown policy "judgee" (did you mean "judge"?)` + tail,
		`helpers.star:21:49: debate → generate: unknown policy "critc" (did you mean "critic"?)` + tail,
	}, "\n")
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("problems (-want +got):\n%s", d)
	}
}

// TestLintOneChatPerTask: a chat() made once per task under a group estimator is a GRPO group of
// one conversation (every advantage 0, nothing learned); check says so and what to do. Several
// conversations (a loop, parallel, fork(), .generate(n=4)), an explicit group, another estimator
// or n_samples_per_prompt > 1: no warning.
func TestLintOneChatPerTask(t *testing.T) {
	dir := t.TempDir()
	write := func(name, src string) string {
		p := filepath.Join(dir, name)
		os.WriteFile(p, []byte(src), 0o644)
		return p
	}
	const one = `
def rollout(task):
    c = chat("agent", system = "Be brief.")
    c.user(task.prompt)
    t = c.generate()
    reward(c, 1.0)
    train(c)
`
	_, warnings := Lint(write("one.star", one), nil)
	want := `one.star:3:14: chat("agent", …) makes one conversation per task, so each grpo group holds one sample and every advantage is 0: nothing is learned from it. Run each task several times (n_samples_per_prompt: 4 under the policy's train:), make several conversations in the rollout (parallel(lambda i: talk(task), range(4)), or c.fork() one after its first turns), sample a turn several times (c.generate(n=4) returns 4 forks), or use advantage_estimator: reinforce_plus_plus`
	if len(warnings) != 1 || !strings.HasSuffix(warnings[0], want) {
		t.Fatalf("warnings %q, want one ending %q", warnings, want)
	}
	for name, src := range map[string]string{
		"fork":     strings.Replace(one, "    t = c.generate()\n", "    d = c.fork()\n    t = c.generate()\n    d.generate()\n    reward(d, 0.0)\n    train(d)\n", 1),
		"n":        strings.Replace(one, "c.generate()", "c.generate(n = 4)", 1),
		"parallel": "def talk(task):\n    c = chat(\"agent\")\n    c.user(task.prompt)\n    c.generate()\n    reward(c, 1.0)\n    train(c)\n\ndef rollout(task):\n    parallel(lambda i: talk(task), range(4))\n",
		"group":    strings.Replace(one, "train(c)", "train(c, group = \"all\")", 1),
	} {
		if _, w := Lint(write(name+".star", src), nil); len(w) != 0 {
			t.Errorf("%s: warnings %q", name, w)
		}
	}
	cfg := config.Default([]string{"agent"})
	cfg.Policies[0].Train.NSamplesPerPrompt = 4
	if _, w := Lint(write("one.star", one), cfg); len(w) != 0 {
		t.Errorf("n_samples_per_prompt 4: warnings %q", w)
	}
	cfg = config.Default([]string{"agent"})
	cfg.Policies[0].Train.AdvantageEstimator = "reinforce_plus_plus"
	if _, w := Lint(write("one.star", one), cfg); len(w) != 0 {
		t.Errorf("reinforce_plus_plus: warnings %q", w)
	}
}

// TestCheckPolicyThroughVariables: a policy name held in a module-level variable, in one loaded
// from another file, in a local variable or returned by a helper reaches generate as surely as a
// literal, and is checked against the config where the literal is written. A loop variable, a
// parameter or a computed name is not followed.
func TestCheckPolicyThroughVariables(t *testing.T) {
	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "config.yaml")
	os.WriteFile(cfgPath, []byte("policies:\n  - name: solver\n  - name: judge\n  - name: critic\n"), 0o644)
	cfg, err := config.Load(cfgPath)
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(dir, "names.star"), []byte(`JUDGE = "jduge"
`), 0o644)
	p := filepath.Join(dir, "vars.star")
	os.WriteFile(p, []byte(`load("names.star", "JUDGE")

SOLVER = "sovler"

def critic_name():
    return "critc"

def ask(p, q):
    return generate(p, q)

def rollout(task):
    a = generate(SOLVER, task.prompt)
    score(JUDGE, a.text)
    who = "solvr" if task.prompt else "solver"
    ask(who, task.prompt)
    ask(critic_name(), a.text)
    for name in ["x"]:
        generate(name, "fine")
    n = "solver"
    n += "2"
    generate(n, "computed")
    generate("sol" + "ver", "computed")
    train(a)
`), 0o644)
	problems, _ := Lint(p, cfg)
	got := strings.ReplaceAll(strings.Join(problems, "\n"), dir+string(filepath.Separator), "")
	tail := `; config.yaml defines "solver", "judge", "critic" — add it under policies: or fix the name`
	want := strings.Join([]string{
		`names.star:1:9: JUDGE → score: unknown policy "jduge" (did you mean "judge"?)` + tail,
		`vars.star:14:11: who → ask → generate: unknown policy "solvr" (did you mean "solver"?)` + tail,
		`vars.star:3:10: SOLVER → generate: unknown policy "sovler" (did you mean "solver"?)` + tail,
		`vars.star:6:12: critic_name() → ask → generate: unknown policy "critc" (did you mean "critic"?)` + tail,
	}, "\n")
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("problems (-want +got):\n%s", d)
	}
	// With no config, the names a typo apart are a warning, each written as it reads.
	_, warnings := Lint(p, nil)
	if w := strings.Join(warnings, "\n"); !strings.Contains(w, `vars.star:3:10: SOLVER = "sovler" → generate and `) {
		t.Errorf("warnings do not name SOLVER's typo:\n%s", w)
	}
}

// TestCheckTaskFields: task.promt in rollout (or eval_rollout) fails every rollout; check says so
// where it is written, with the field meant. A nested function's own task, a task the rollout
// rebinds and the real fields are not reported.
func TestCheckTaskFields(t *testing.T) {
	p := filepath.Join(t.TempDir(), "task.star")
	os.WriteFile(p, []byte(`def rollout(task):
    c = generate("p", task.promt)
    f = lambda task: task.anything
    reward(c, 1.0 if c.text == task.label else 0.0)
    train(c)
    return task.id + str(task.step) + str(task.metadata) + task.prompt

def eval_rollout(task):
    return {"x": len(task.lable)}
`), 0o644)
	problems, _ := Lint(p, nil)
	got := strings.ReplaceAll(strings.Join(problems, "\n"), filepath.Dir(p)+string(filepath.Separator), "")
	want := strings.Join([]string{
		`task.star:2:28: rollout(task): a task has no field .promt (did you mean .prompt?); its fields are .id, .prompt, .label, .metadata and .step`,
		`task.star:9:27: eval_rollout(task): a task has no field .lable (did you mean .label?); its fields are .id, .prompt, .label, .metadata and .step`,
	}, "\n")
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("problems (-want +got):\n%s", d)
	}
	os.WriteFile(p, []byte("def rollout(task):\n    task = {\"promt\": 1}\n    return task.promt\n"), 0o644)
	if problems, _ := Lint(p, nil); len(problems) != 0 {
		t.Errorf("a rebound task: %v", problems)
	}
}

// TestCheckBuiltinKeywords: a keyword a built-in does not take fails every rollout at run time;
// check reports it where it is written, in the built-in's own words (with the keyword meant,
// where Starlark finds one). A function of the script's own
// that shadows a built-in's name takes what it declares.
func TestCheckBuiltinKeywords(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "kw.star")
	os.WriteFile(p, []byte(`def rollout(task):
    c = generate("p", task.prompt, n = 4, max_token = 5)
    reward(c, 1.0, replace = True)
    train(c, grup = "x")
`), 0o644)
	problems, _ := Lint(p, nil)
	got := strings.ReplaceAll(strings.Join(problems, "\n"), dir+string(filepath.Separator), "")
	want := strings.Join([]string{
		`kw.star:2:43: generate: unexpected keyword argument "max_token" (did you mean max_tokens?)`,
		`kw.star:4:14: train: unexpected keyword argument "grup"`,
	}, "\n")
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("problems (-want +got):\n%s", d)
	}
	os.WriteFile(p, []byte("def train(x, grup = None):\n    return x\n\ndef rollout(task):\n    c = generate(\"p\", task.prompt)\n    train(c, grup = 1)\n"), 0o644)
	if problems, _ := Lint(p, nil); len(problems) != 0 {
		t.Errorf("the script's own train: %v", problems)
	}
}
