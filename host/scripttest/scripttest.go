// Package scripttest is the runner of `slimen test`: files named *_test.star define test_*
// functions that call simulate() to run a topology's rollout on scripted policies, then check
// rewards, advantages and logged metrics with the assert module. A topology's reward logic is
// unit-tested without a model.
//
//	load("debate.star", "rollout")
//
//	def test_majority_wins():
//	    out = simulate(rollout, task = {"prompt": "2+3?", "label": "5"},
//	                   responses = {"generator": ["\\boxed{5}", "\\boxed{5}", "\\boxed{7}"],
//	                                "critic": lambda prompt, i: "\\boxed{5}"})
//	    assert.eq([s.reward for s in out.samples["generator"]], [1.0, 1.0, 0.0])
package scripttest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync/atomic"
	"time"

	"go.starlark.net/starlark"
	"go.starlark.net/starlarkstruct"
	"go.starlark.net/syntax"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/script"
)

// Result is the outcome of one test function.
type Result struct {
	File, Name string
	Err        string // "" when the test passed or was skipped
	Skipped    string // the reason skip() gave; "" when the test ran to its end
	Duration   time.Duration
}

// skipError is what skip(reason) raises: it ends the test as skipped.
type skipError struct{ reason string }

func (e *skipError) Error() string { return "skipped: " + e.reason }

// builtinSkip is skip(reason): the test ends here, counted and printed as skipped (a program or
// package it needs is missing), not as passed.
func builtinSkip(_ *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var reason string
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "reason", &reason); err != nil {
		return nil, err
	}
	if strings.TrimSpace(reason) == "" {
		return nil, fmt.Errorf("%s: say why the test is skipped", b.Name())
	}
	return nil, &skipError{reason}
}

// FindFiles expands files and folders into *_test.star files (folders searched recursively,
// skipping runs/ and hidden folders).
func FindFiles(args []string) ([]string, error) {
	if len(args) == 0 {
		args = []string{"."}
	}
	var out []string
	for _, a := range args {
		st, err := os.Stat(a)
		if err != nil {
			return nil, err
		}
		if !st.IsDir() {
			out = append(out, a)
			continue
		}
		err = filepath.WalkDir(a, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if d.IsDir() && p != a && (strings.HasPrefix(d.Name(), ".") || d.Name() == "runs") {
				return filepath.SkipDir
			}
			if !d.IsDir() && strings.HasSuffix(p, "_test.star") {
				out = append(out, p)
			}
			return nil
		})
		if err != nil {
			return nil, err
		}
	}
	sort.Strings(out)
	return out, nil
}

// Run runs every test_* function of the files, printing a line per test to w.
func Run(ctx context.Context, files []string, w io.Writer) []Result {
	var results []Result
	for _, f := range files {
		results = append(results, runTestFile(ctx, f, w)...)
	}
	return results
}

func runTestFile(ctx context.Context, file string, w io.Writer) []Result {
	src, err := os.ReadFile(file)
	if err != nil {
		r := Result{File: file, Name: "(load)", Err: err.Error()}
		fmt.Fprintf(w, "FAIL %s: %s\n", file, r.Err)
		return []Result{r}
	}
	sim := &simConfig{}
	s, err := script.LoadSource(file, src, script.Options{Library: true, Config: script.ConfigValue(sim.get),
		Builtins: starlark.StringDict{"assert": assertModule, "simulate": starlark.NewBuiltin("simulate", builtinSimulate),
			"skip": starlark.NewBuiltin("skip", builtinSkip)}})
	if err != nil {
		r := Result{File: file, Name: "(load)", Err: err.Error()}
		fmt.Fprintf(w, "FAIL %s:\n%s\n", file, indent(r.Err))
		return []Result{r}
	}
	globals := s.Globals
	var names []string
	for name, v := range globals {
		if _, ok := v.(*starlark.Function); ok && strings.HasPrefix(name, "test_") {
			names = append(names, name)
		}
	}
	sort.Strings(names)
	var out []Result
	for _, name := range names {
		fn := globals[name].(*starlark.Function)
		start := time.Now()
		th := &starlark.Thread{Name: name, Print: func(_ *starlark.Thread, msg string) { fmt.Fprintf(w, "    %s\n", msg) }}
		th.SetLocal(testCtxLocal, ctx)
		th.SetLocal(simConfigLocal, sim)
		_, err := starlark.Call(th, fn, nil, nil)
		r := Result{File: file, Name: name, Duration: time.Since(start)}
		var skip *skipError
		if errors.As(err, &skip) {
			r.Skipped = skip.reason
			fmt.Fprintf(w, "skip %s %s: %s\n", file, name, skip.reason)
		} else if err != nil {
			r.Err = script.ErrorText(err)
			fmt.Fprintf(w, "FAIL %s %s\n%s\n", file, name, indent(r.Err))
		} else {
			fmt.Fprintf(w, "ok   %s %s (%s)\n", file, name, r.Duration.Round(time.Millisecond))
		}
		out = append(out, r)
	}
	if len(names) == 0 {
		r := Result{File: file, Name: "(none)", Err: "the file defines no test_* function"}
		fmt.Fprintf(w, "FAIL %s: %s\n", file, r.Err)
		out = append(out, r)
	}
	return out
}

const (
	testCtxLocal   = "slimen.test.ctx"
	simConfigLocal = "slimen.test.config"
)

// simConfig is the `config` of a test file's scripts: the configuration of the simulate() run in
// progress (its scripted policies), none outside one.
type simConfig struct{ cfg atomic.Pointer[config.Config] }

func (s *simConfig) get() *config.Config { return s.cfg.Load() }

// simCritic names the scripted critic that simulate adds for estimator "ppo".
const simCritic = "_critic"

// builtinSimulate runs one rollout on scripted policies and returns what the host would train.
//
//	simulate(rollout, task, responses, frozen=[], estimator="grpo", seed=1, value=0.0,
//	         max_response_len=65536)
//
// task: a prompt string or a dict with prompt, label, id, metadata. responses: policy → a list of
// texts (sample i of every call answers with item i, cycling) or a function (prompt, index) →
// text, prompt being the last message's content. estimator "ppo" adds a scripted critic policy
// (role: critic) that values every token at value. Returns a struct with samples (policy → list
// of struct(text, reward, advantage, group, prompt); advantage is the first token's), completions
// (every generated completion, in call order, with a completion's fields and prompt) and logs
// (name → mean of the values logged). The rollout sees the scripted policies in `config`. A
// scripted reply arrives whole unless the script's own max_tokens (or max_response_len, the
// run's default, roomy here and not the config's 32) cuts it; a cut is printed in the test's
// output, naming max_tokens. A failing rollout fails simulate.
func builtinSimulate(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var fn starlark.Callable
	var task starlark.Value
	var responses *starlark.Dict
	var frozen *starlark.List
	estimator := "grpo"
	seed := 1
	var value starlark.Value = starlark.Float(0)
	maxLen := simMaxResponseLen
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "rollout", &fn, "task", &task, "responses", &responses,
		"frozen?", &frozen, "estimator?", &estimator, "seed?", &seed, "value?", &value,
		"max_response_len?", &maxLen); err != nil {
		return nil, err
	}
	if maxLen < 1 {
		return nil, fmt.Errorf("%s: max_response_len = %d; want at least 1", b.Name(), maxLen)
	}
	v, ok := starlark.AsFloat(value)
	if !ok {
		return nil, fmt.Errorf("%s: value must be a number, got %s", b.Name(), value.Type())
	}
	t, err := simTask(b.Name(), task)
	if err != nil {
		return nil, err
	}
	cfg, engs, err := simPolicies(b.Name(), responses, frozen, estimator, seed, v)
	if err != nil {
		return nil, err
	}
	cfg.Rollout.MaxResponseLen = maxLen
	ctx, _ := thread.Local(testCtxLocal).(context.Context)
	if ctx == nil {
		ctx = context.Background()
	}
	if sc, ok := thread.Local(simConfigLocal).(*simConfig); ok {
		defer sc.cfg.Store(sc.cfg.Swap(cfg))
	}
	sim, err := host.Simulate(ctx, cfg, engs, t, fn)
	if err != nil {
		return nil, err
	}
	res, gen := simResult(cfg, sim)
	for _, c := range gen {
		if c.FinishReason() == "length" && thread.Print != nil {
			thread.Print(thread, fmt.Sprintf("simulate: %s's reply was cut at max_tokens = %d (finish_reason \"length\"): %q",
				c.Policy(), len(c.Tokens()), c.Text()))
		}
	}
	return res, nil
}

// simMaxResponseLen is simulate's default max_response_len: a scripted reply is the text the test
// wrote, which the config's default (32 tokens, a byte each here) would cut.
const simMaxResponseLen = 1 << 16

// simPolicies is the config and the scripted engines of a simulate() run: one policy per entry of
// responses (frozen ones not trainable), and for estimator "ppo" a critic that values every token
// at value.
func simPolicies(fn string, responses *starlark.Dict, frozen *starlark.List, estimator string, seed int,
	value float64) (*config.Config, map[string]engines.Engine, error) {
	frozenSet := map[string]bool{}
	if frozen != nil {
		for i := 0; i < frozen.Len(); i++ {
			s, ok := frozen.Index(i).(starlark.String)
			if !ok {
				return nil, nil, fmt.Errorf("%s: frozen must list policy names", fn)
			}
			frozenSet[string(s)] = true
		}
	}
	cfg := config.Default(nil)
	cfg.Rollout.BatchSize = 1
	cfg.Run.Seed = uint64(seed)
	engs := map[string]engines.Engine{}
	for _, kv := range responses.Items() {
		name, ok := kv[0].(starlark.String)
		if !ok {
			return nil, nil, fmt.Errorf("%s: responses keys must be policy names", fn)
		}
		respond, err := responder(fn, string(name), kv[1])
		if err != nil {
			return nil, nil, err
		}
		pc := config.DefaultPolicy(string(name))
		pc.Trainable = !frozenSet[string(name)]
		pc.Train.AdvantageEstimator = estimator
		cfg.Policies = append(cfg.Policies, pc)
		engs[string(name)] = scripted.New(respond)
	}
	if estimator == "ppo" {
		pc := config.DefaultPolicy(simCritic)
		pc.Role = "critic"
		cfg.Policies = append(cfg.Policies, pc)
		crit := scripted.Echo("")
		crit.Value = float32(value)
		engs[simCritic] = crit
	}
	return cfg, engs, nil
}

// simResult is what simulate returns: the samples the host would train, the completions and the
// logs of the rollout; and the completions generated, in call order.
func simResult(cfg *config.Config, sim *host.Simulation) (starlark.Value, []*script.Completion) {
	samples := starlark.NewDict(len(cfg.Policies))
	for _, pc := range cfg.Policies {
		if pc.Name == simCritic {
			continue
		}
		var l []starlark.Value
		for _, s := range sim.Samples[pc.Name] {
			var adv starlark.Value = starlark.None
			if len(s.Advantage) > 0 {
				adv = starlark.Float(s.Advantage[0])
			}
			l = append(l, structOfDict(starlark.StringDict{
				"text": starlark.String(s.C.Text()), "reward": starlark.Float(s.Reward), "advantage": adv,
				"group": starlark.String(s.Group), "prompt": starlark.String(lastContent(s.C.Messages())),
			}))
		}
		samples.SetKey(starlark.String(pc.Name), starlark.NewList(l))
	}
	ro := sim.Rollout
	var comps []starlark.Value
	gen := append([]*script.Completion(nil), ro.Generated()...)
	sort.SliceStable(gen, func(i, j int) bool { return gen[i].Before(gen[j]) })
	for _, c := range gen {
		// A completion's own fields (finish_reason, tokens, ...), read now: a frozen copy, plus
		// the prompt's last message.
		d := starlark.StringDict{"prompt": starlark.String(lastContent(c.Messages()))}
		for _, name := range c.AttrNames() {
			v, err := c.Attr(name)
			if err == nil && v != nil {
				d[name] = v
			}
		}
		comps = append(comps, structOfDict(d))
	}
	logs := starlark.NewDict(len(ro.Logs()))
	for k, v := range ro.Logs() {
		logs.SetKey(starlark.String(k), starlark.Float(v[0]/v[1]))
	}
	return structOfDict(starlark.StringDict{
		"samples": samples, "completions": starlark.NewList(comps), "logs": logs,
	}), gen
}

func simTask(fn string, v starlark.Value) (host.Task, error) {
	t := host.Task{ID: "task"}
	switch v := v.(type) {
	case starlark.String:
		t.Prompt = string(v)
		return t, nil
	case *starlark.Dict:
		for _, kv := range v.Items() {
			k, _ := kv[0].(starlark.String)
			switch k {
			case "prompt":
				msgs, err := script.ToMessages(fn, kv[1])
				if err != nil {
					return t, err
				}
				if s, ok := kv[1].(starlark.String); ok {
					t.Prompt = string(s)
				} else {
					t.Prompt = msgs
				}
			case "label":
				t.Label, t.HasLabel = strings.Trim(kv[1].String(), `"`), kv[1] != starlark.None
			case "id":
				t.ID = strings.Trim(kv[1].String(), `"`)
			case "metadata":
				t.Metadata = map[string]any{}
				if d, ok := kv[1].(*starlark.Dict); ok {
					for _, m := range d.Items() {
						t.Metadata[strings.Trim(m[0].String(), `"`)] = fromStarlark(m[1])
					}
				}
			default:
				return t, fmt.Errorf("%s: task has an unknown key %s (known: prompt, label, id, metadata)", fn, kv[0])
			}
		}
		if t.Prompt == nil {
			return t, fmt.Errorf("%s: task needs a prompt", fn)
		}
		return t, nil
	}
	return t, fmt.Errorf("%s: task must be a prompt string or a dict, got %s", fn, v.Type())
}

func fromStarlark(v starlark.Value) any {
	switch v := v.(type) {
	case starlark.String:
		return string(v)
	case starlark.Int:
		i, _ := v.Int64()
		return i
	case starlark.Float:
		return float64(v)
	case starlark.Bool:
		return bool(v)
	case starlark.NoneType:
		return nil
	case *starlark.List, starlark.Tuple:
		// Nested values, as a JSONL line's metadata holds them (a task's parts, a document's
		// sections).
		out := []any{}
		it := starlark.Iterate(v)
		defer it.Done()
		var x starlark.Value
		for it.Next(&x) {
			out = append(out, fromStarlark(x))
		}
		return out
	case *starlark.Dict:
		out := map[string]any{}
		for _, kv := range v.Items() {
			k, ok := kv[0].(starlark.String)
			if !ok {
				k = starlark.String(kv[0].String())
			}
			out[string(k)] = fromStarlark(kv[1])
		}
		return out
	}
	return v.String()
}

// responder turns a list of texts or a Starlark function into a scripted responder. The function
// is called on a thread of its own: the engine runs on the dispatcher's goroutine.
func responder(fn, policy string, v starlark.Value) (scripted.Responder, error) {
	switch v := v.(type) {
	case *starlark.List, starlark.Tuple:
		var texts []string
		it := starlark.Iterate(v)
		var x starlark.Value
		for it.Next(&x) {
			s, ok := x.(starlark.String)
			if !ok {
				it.Done()
				return nil, fmt.Errorf("%s: responses[%q] must hold strings, got %s", fn, policy, x.Type())
			}
			texts = append(texts, string(s))
		}
		it.Done()
		if len(texts) == 0 {
			return nil, fmt.Errorf("%s: responses[%q] is empty", fn, policy)
		}
		return func(r scripted.Request) string { return texts[r.Index%len(texts)] }, nil
	case starlark.Callable:
		v.Freeze()
		return func(r scripted.Request) string {
			th := &starlark.Thread{Name: "responses " + policy}
			prompt := lastContent(r.Messages)
			if r.Messages == nil {
				prompt = scripted.LastMessage(r.Prompt) // a chat turn: sampled from the conversation's tokens
			}
			out, err := starlark.Call(th, v, starlark.Tuple{starlark.String(prompt), starlark.MakeInt(r.Index)}, nil)
			if err != nil {
				return fmt.Sprintf("<responses[%q] failed: %v>", policy, err)
			}
			s, ok := out.(starlark.String)
			if !ok {
				return fmt.Sprintf("<responses[%q] returned %s, not a string>", policy, out.Type())
			}
			return string(s)
		}, nil
	}
	return nil, fmt.Errorf("%s: responses[%q] must be a list of texts or a function (prompt, index) → text", fn, policy)
}

func lastContent(msgs []engines.Message) string {
	if len(msgs) == 0 {
		return ""
	}
	return msgs[len(msgs)-1].Content
}

func structOfDict(d starlark.StringDict) starlark.Value {
	s := starlarkstruct.FromStringDict(starlarkstruct.Default, d)
	s.Freeze()
	return s
}

// assertModule is the `assert` of script tests.
var assertModule = &starlarkstruct.Module{
	Name: "assert",
	Members: starlark.StringDict{
		"eq":       starlark.NewBuiltin("assert.eq", assertEq),
		"ne":       starlark.NewBuiltin("assert.ne", assertNe),
		"true":     starlark.NewBuiltin("assert.true", assertTrue),
		"contains": starlark.NewBuiltin("assert.contains", assertContains),
		"fails":    starlark.NewBuiltin("assert.fails", assertFails),
	},
}

func assertEq(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var x, y starlark.Value
	msg := ""
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "got", &x, "want", &y, "msg?", &msg); err != nil {
		return nil, err
	}
	eq, err := starlark.Equal(x, y)
	if err != nil {
		return nil, err
	}
	if !eq {
		return nil, fmt.Errorf("%s: got %s, want %s%s", b.Name(), x, y, suffix(msg))
	}
	return starlark.None, nil
}

func assertNe(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var x, y starlark.Value
	msg := ""
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "got", &x, "unwanted", &y, "msg?", &msg); err != nil {
		return nil, err
	}
	eq, err := starlark.Equal(x, y)
	if err != nil {
		return nil, err
	}
	if eq {
		return nil, fmt.Errorf("%s: got %s, want anything else%s", b.Name(), x, suffix(msg))
	}
	return starlark.None, nil
}

func assertTrue(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var x starlark.Value
	msg := ""
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "cond", &x, "msg?", &msg); err != nil {
		return nil, err
	}
	if !x.Truth() {
		return nil, fmt.Errorf("%s: %s is not true%s", b.Name(), x, suffix(msg))
	}
	return starlark.None, nil
}

func assertContains(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var c, x starlark.Value
	msg := ""
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "container", &c, "item", &x, "msg?", &msg); err != nil {
		return nil, err
	}
	var in bool
	if s, ok := c.(starlark.String); ok {
		sub, ok := x.(starlark.String)
		if !ok {
			return nil, fmt.Errorf("%s: a string contains strings, not %s", b.Name(), x.Type())
		}
		in = strings.Contains(string(s), string(sub))
	} else {
		found, err := starlark.Binary(syntax.IN, x, c)
		if err != nil {
			return nil, fmt.Errorf("%s: %v", b.Name(), err)
		}
		in = bool(found.Truth())
	}
	if !in {
		return nil, fmt.Errorf("%s: %s does not contain %s%s", b.Name(), c, x, suffix(msg))
	}
	return starlark.None, nil
}

// assertFails calls fn() and checks that it fails with an error matching the pattern.
func assertFails(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var fn starlark.Callable
	pattern := ""
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "fn", &fn, "pattern?", &pattern); err != nil {
		return nil, err
	}
	re, err := regexp.Compile(pattern)
	if err != nil {
		return nil, fmt.Errorf("%s: bad pattern %q: %v", b.Name(), pattern, err)
	}
	_, callErr := starlark.Call(thread, fn, nil, nil)
	if callErr == nil {
		return nil, fmt.Errorf("%s: %s did not fail", b.Name(), fn.Name())
	}
	if !re.MatchString(callErr.Error()) {
		return nil, fmt.Errorf("%s: the error %q does not match %q", b.Name(), callErr.Error(), pattern)
	}
	return starlark.String(callErr.Error()), nil
}

func suffix(msg string) string {
	if msg == "" {
		return ""
	}
	return ": " + msg
}

func indent(s string) string {
	return "  " + strings.ReplaceAll(strings.TrimRight(s, "\n"), "\n", "\n  ")
}
