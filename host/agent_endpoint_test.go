package host

import (
	"context"
	"net"
	"net/url"
	"os/exec"
	"testing"

	"go.starlark.net/starlark"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
)

// endpointScript stores the endpoint its agent() program was given.
const endpointScript = `
def rollout(task):
    r = agent(["sh", "-c", "printf %s \"$OPENAI_BASE_URL\""], task.prompt, policy = "p")
    state.update("url", lambda _: r.output, None)
`

// TestAgentEndpointPerRun: two runs in one process give their agent() programs endpoints of
// their own, and a run's endpoint stops serving when the run is closed.
func TestAgentEndpointPerRun(t *testing.T) {
	if _, err := exec.LookPath("sh"); err != nil {
		t.Skip("no sh to run as the agent() program")
	}
	endpoint := func() (*Run, string) {
		cfg := testConfig(1, "p")
		cfg.Rollout.MaxFailedFraction = 1
		eng := scripted.New(func(scripted.Request) string { return "x" })
		r := loadRun(t, endpointScript, cfg, map[string]engines.Engine{"p": eng}, listTasks{{ID: "a", Prompt: "q"}})
		res, err := r.Step(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range res.Failed {
			t.Fatalf("rollout failed: %v", f)
		}
		v, ok := r.State().Get("url")
		s, isStr := v.(starlark.String)
		if !ok || !isStr || s == "" {
			t.Fatalf("the program was given OPENAI_BASE_URL %v", v)
		}
		return r, string(s)
	}
	r1, url1 := endpoint()
	_, url2 := endpoint()
	if url1 == url2 {
		t.Errorf("two runs in one process gave their programs the same endpoint, %s", url1)
	}
	u, err := url.Parse(url1)
	if err != nil {
		t.Fatal(err)
	}
	r1.Close()
	if c, err := net.Dial("tcp", u.Host); err == nil {
		c.Close()
		t.Errorf("%s still accepts connections after its run was closed", u.Host)
	}
}
