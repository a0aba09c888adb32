package host

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/host/script"
	"github.com/slimen/slimen/host/script/sandbox"
)

// TestSandboxCallArgsChecked checks that a call of a sandbox child whose arguments do not decode
// is refused with an error that says so, for every method whose arguments the host decodes as
// it serves the call, instead of being served with empty arguments.
func TestSandboxCallArgsChecked(t *testing.T) {
	r, err := Load(context.Background(), writeScript(t, forgeScript), Options{Config: testConfig(1, "p"),
		Engines: map[string]engines.Engine{"p": scripted.Echo("a")}, Tasks: numberedTasks(1)})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	c := &sbChild{sb: &pool{r: r}, rollouts: map[int64]*script.Rollout{}}
	for _, method := range []string{"policy", "state_get", "state_lock", "state_set"} {
		p := &pending{m: sandbox.Msg{T: "call", Method: method, Args: json.RawMessage(`{"key": 7`)},
			ro: &script.Rollout{Ctx: context.Background()}}
		_, err := c.serve(p)
		if err == nil || !strings.Contains(err.Error(), "arguments do not decode") {
			t.Errorf("%s call with arguments that do not decode: %v, want an error that says so", method, err)
		}
	}
}
