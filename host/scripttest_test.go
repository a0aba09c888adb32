package host

import (
	"bytes"
	"context"
	"strings"
	"testing"
)

// A scripted reply arrives whole, whatever the default max_response_len: a tool call of 70
// characters was cut at 32 tokens without a word (issue 35).
func TestSimulateReplyArrivesWhole(t *testing.T) {
	f := writeScript(t, `
CALL = '<tool_call>{"name": "calc", "arguments": {"expr": "12*34"}}</tool_call>'
def rollout(task):
    c = generate("p", task.prompt)
    c2 = chat("p")
    c2.user("hi")
    c2.generate()
def test_whole():
    out = simulate(rollout, task = "q", responses = {"p": [CALL]})
    assert.eq([c.text for c in out.completions], [CALL, CALL])
    assert.eq([c.finish_reason for c in out.completions], ["stop", "stop"])
`)
	var out bytes.Buffer
	res := RunScriptTests(context.Background(), []string{f}, &out)
	if len(res) != 1 || res[0].Err != "" {
		t.Errorf("results: %+v\n%s", res, out.String())
	}
}

// A reply cut by a script's own max_tokens is said in the test's output, naming max_tokens, and
// its completion carries the fields of a real one.
func TestSimulateCutReplyIsSaid(t *testing.T) {
	f := writeScript(t, `
def rollout(task):
    generate("p", task.prompt, max_tokens = 5)
def test_cut():
    out = simulate(rollout, task = "q", responses = {"p": ["0123456789"]})
    c = out.completions[0]
    assert.eq(c.text, "01234")
    assert.eq(c.finish_reason, "length")
    assert.eq(len(c.tokens), 5)
    assert.eq(len(c.logprobs), 5)
    assert.eq(c.policy, "p")
    assert.eq(c.prompt, "q")
    assert.true(c.prompt_tokens > 0)
    assert.true(c.id != "")
`)
	var out bytes.Buffer
	res := RunScriptTests(context.Background(), []string{f}, &out)
	if len(res) != 1 || res[0].Err != "" {
		t.Fatalf("results: %+v\n%s", res, out.String())
	}
	if !strings.Contains(out.String(), `p's reply was cut at max_tokens = 5`) {
		t.Errorf("the cut is not said:\n%s", out.String())
	}
}

// skip(reason) ends a test as skipped: counted and printed as such, not as passed.
func TestScriptTestSkip(t *testing.T) {
	f := writeScript(t, `
def test_needs_a_package():
    skip("the openai package is missing")
    fail("not reached")
def test_ok():
    pass
`)
	var out bytes.Buffer
	res := RunScriptTests(context.Background(), []string{f}, &out)
	if len(res) != 2 || res[0].Err != "" || res[0].Skipped != "the openai package is missing" || res[1].Skipped != "" || res[1].Err != "" {
		t.Errorf("results: %+v", res)
	}
	if !strings.Contains(out.String(), "skip "+f+" test_needs_a_package: the openai package is missing") {
		t.Errorf("the skip is not said:\n%s", out.String())
	}
}
