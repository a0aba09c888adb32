package script

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"time"

	"go.starlark.net/starlark"
)

// builtinAgent is agent(argv, task_input, policy, timeout=300, env=None, max_calls=64,
// max_tokens=65536, call_max_tokens=None, tools_prompt="template", check=True): it runs an
// external program for one rollout, an agent written against the OpenAI chat-completions API, in
// any language or framework. The program gets OPENAI_BASE_URL (the run's loopback endpoint,
// AgentEndpoint) and an OPENAI_API_KEY of its own that routes its calls to this rollout;
// task_input goes to its stdin and to $SLIMEN_TASK_INPUT. Each chat-completions call it makes is
// a turn of a chat (chat.go) with the policy: sampled through the run's batching like generate,
// with seeds from the call's position, and recorded token-exactly: a call whose history continues
// a recorded conversation continues its token ids, rendering only the messages appended since
// (Chat.sampleLocked); any other history starts a new chat. agent() returns a struct: output (the
// program's stdout), exit_code, stderr (its tail), calls and chats (the recorded conversations,
// for reward and train).
//
// A program that runs past timeout is killed (its process group) and fails the rollout; so does
// one that makes more than max_calls calls or samples more than max_tokens tokens (its calls
// are answered 429 from then on), and, with check=True, one that exits non-zero.
func builtinAgent(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	ts, err := blockingOf(thread, b.Name())
	if err != nil {
		return nil, err
	}
	a, err := parseAgentArgs(thread, b.Name(), args, kwargs)
	if err != nil {
		return nil, err
	}
	return runAgent(ts, b.Name(), a)
}

// agentArgs are agent()'s arguments, unpacked and checked.
type agentArgs struct {
	argv          []string
	input         string
	policy        string
	timeout       float64 // seconds
	env           map[string]string
	maxCalls      int
	maxTokens     int
	callMax       int // call_max_tokens; 0: not given
	toolsInSystem bool
	check         bool
	where         string // the script's place of the call
}

// parseAgentArgs unpacks agent()'s arguments and checks them, each error naming its parameter.
func parseAgentArgs(thread *starlark.Thread, fn string, args starlark.Tuple, kwargs []starlark.Tuple) (agentArgs, error) {
	var argvV, input, env, timeoutV, callMaxV starlark.Value = nil, nil, starlark.None, starlark.None, starlark.None
	a := agentArgs{maxCalls: 64, maxTokens: 65536, check: true, where: callerPos(thread)}
	toolsPrompt := "template"
	if err := starlark.UnpackArgs(fn, args, kwargs, "argv", &argvV, "task_input", &input, "policy", &a.policy,
		"timeout?", &timeoutV, "env?", &env, "max_calls?", &a.maxCalls, "max_tokens?", &a.maxTokens, "call_max_tokens?", &callMaxV,
		"tools_prompt?", &toolsPrompt, "check?", &a.check); err != nil {
		return a, err
	}
	var err error
	if a.timeout, err = optFloat(fn, "timeout", timeoutV, 300, 0, 7*24*3600); err != nil {
		return a, err
	}
	if a.callMax, err = optInt(fn, "call_max_tokens", callMaxV, 0, 1, math.MaxInt32); err != nil {
		return a, err
	}
	a.argv, err = toStrings(fn, "argv", argvV)
	if _, isStr := argvV.(starlark.String); err == nil && (isStr || len(a.argv) == 0 || a.argv[0] == "") {
		err = fmt.Errorf("%s: argv must be a non-empty list of strings (the program and its arguments), got %s", fn, argvV.String())
	}
	if err != nil {
		return a, err
	}
	if a.input, err = agentInput(fn, input); err != nil {
		return a, err
	}
	if a.env, err = agentEnv(fn, env); err != nil {
		return a, err
	}
	a.toolsInSystem = toolsPrompt == "system"
	switch {
	case a.timeout <= 0:
		return a, fmt.Errorf("%s: timeout=%g; give the program more than 0 seconds", fn, a.timeout)
	case a.maxCalls < 1:
		return a, fmt.Errorf("%s: max_calls=%d; allow at least 1 call", fn, a.maxCalls)
	case a.maxTokens < 1:
		return a, fmt.Errorf("%s: max_tokens=%d; allow at least 1 token", fn, a.maxTokens)
	case toolsPrompt != "template" && toolsPrompt != "system":
		return a, fmt.Errorf("%s: tools_prompt=%q; want \"template\" (the chat template's tools variable) "+
			"or \"system\" (a Hermes description in the system message)", fn, toolsPrompt)
	}
	return a, nil
}

// agentInput is task_input as the program's stdin: a string as it is, None as "", another value
// as JSON.
func agentInput(fn string, input starlark.Value) (string, error) {
	if s, ok := input.(starlark.String); ok {
		return string(s), nil
	}
	if input == starlark.None {
		return "", nil
	}
	text, ok := jsonOf(input)
	if !ok {
		return "", fmt.Errorf("%s: task_input must be a string or a JSON-encodable value, got %s", fn, input.Type())
	}
	return string(text), nil
}

// agentEnv is env=, the variables the script adds to the program's environment.
func agentEnv(fn string, env starlark.Value) (map[string]string, error) {
	extra := map[string]string{}
	if env == starlark.None {
		return extra, nil
	}
	d, ok := env.(*starlark.Dict)
	if !ok {
		return nil, fmt.Errorf("%s: env must be a dict of strings, got %s", fn, env.Type())
	}
	for _, kv := range d.Items() {
		k, ok1 := kv[0].(starlark.String)
		v, ok2 := kv[1].(starlark.String)
		if !ok1 || !ok2 {
			return nil, fmt.Errorf("%s: env must map strings to strings, got %s: %s", fn, kv[0].Type(), kv[1].Type())
		}
		extra[string(k)] = string(v)
	}
	return extra, nil
}

// runAgent runs the program of one agent() call of the thread, once the sandbox (when there is
// one) allows it, and returns its result as the script sees it.
func runAgent(ts *threadState, fn string, a agentArgs) (starlark.Value, error) {
	ro := ts.ro
	if err := ro.Budget.mayStart(fn, a.where, a.argv); err != nil {
		return nil, err
	}
	if err := ro.Budget.mayEnv(fn, a.where, a.env); err != nil {
		return nil, err
	}
	if err := ro.mayGenerate(fn, a.policy); err != nil {
		return nil, err
	}
	s := &agentSession{ro: ro, fn: fn, policy: a.policy, key: ts.next(), toolsInSystem: a.toolsInSystem,
		maxCalls: a.maxCalls, maxTokens: a.maxTokens, callMax: a.callMax}
	res, err := s.run(a.argv, a.input, a.env, time.Duration(a.timeout*float64(time.Second)), scriptDir(a.where))
	if err != nil {
		return nil, err
	}
	if a.check && res.exit != 0 {
		return nil, fmt.Errorf("%s: %s exited with status %d%s", fn, a.argv[0], res.exit, stderrTail(res.stderr))
	}
	return s.value(res), nil
}

// callerPos is where the script called the built-in: "file.star:12:5".
func callerPos(thread *starlark.Thread) string {
	if thread.CallStackDepth() < 2 {
		return ""
	}
	return thread.CallFrame(1).Pos.String()
}

// scriptDir is the folder of the script file at pos, where the program runs; "" (the host's
// working directory) when it is not a folder of this machine.
func scriptDir(pos string) string {
	file, _, _ := strings.Cut(pos, ":")
	dir, err := filepath.Abs(filepath.Dir(file))
	if st, serr := os.Stat(dir); err != nil || serr != nil || !st.IsDir() {
		return ""
	}
	return dir
}

func jsonOf(v starlark.Value) (starlark.String, bool) {
	s, err := jsonEncode(v)
	return starlark.String(s), err == nil
}

func stderrTail(s string) string {
	s = strings.TrimSpace(s)
	if s == "" {
		return " (its stderr is empty)"
	}
	if len(s) > 2000 {
		s = "…" + s[len(s)-2000:]
	}
	return "; its stderr ends:\n" + s
}

// PythonEnv names the interpreter that argv "python" or "python3" of agent() runs, as it names
// the torch worker's (docs/agents.md).
const PythonEnv = "SLIMEN_PYTHON"
