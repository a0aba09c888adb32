package scripttest

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func writeScript(t testing.TB, src string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "script_test.star")
	if err := os.WriteFile(p, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

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
	res := Run(context.Background(), []string{f}, &out)
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
	res := Run(context.Background(), []string{f}, &out)
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
	res := Run(context.Background(), []string{f}, &out)
	if len(res) != 2 || res[0].Err != "" || res[0].Skipped != "the openai package is missing" || res[1].Skipped != "" || res[1].Err != "" {
		t.Errorf("results: %+v", res)
	}
	if !strings.Contains(out.String(), "skip "+f+" test_needs_a_package: the openai package is missing") {
		t.Errorf("the skip is not said:\n%s", out.String())
	}
}

// TestScriptTests: the examples' script tests pass, and a failing assertion fails its test with
// the assertion's message and place.
func TestScriptTests(t *testing.T) {
	var out bytes.Buffer
	files, err := FindFiles([]string{"../../examples"})
	if err != nil || len(files) == 0 {
		t.Fatalf("no example tests: %v", err)
	}
	for _, r := range Run(context.Background(), files, &out) {
		if r.Err != "" {
			t.Errorf("%s %s:\n%s", r.File, r.Name, r.Err)
		}
	}
	// A failing assertion fails its test with the assertion's message and place.
	bad := writeScript(t, `
def test_wrong():
    assert.eq(1 + 1, 3, "arithmetic")
def test_fails_checks_pattern():
    assert.fails(lambda: fail("boom"), "bo+m")
`)
	res := Run(context.Background(), []string{bad}, &out)
	if len(res) != 2 || res[0].Err != "" || !strings.Contains(res[1].Err, "assert.eq: got 2, want 3: arithmetic") {
		t.Errorf("results: %+v", res)
	}
}
