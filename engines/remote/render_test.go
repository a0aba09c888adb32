package remote_test

import (
	"context"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/remote"
	"github.com/slimen/slimen/engines/scripted"
	"github.com/slimen/slimen/engines/server"
)

// TestRenderMatchesTheEngineInProcess: the client's Render answers what the served engine's
// Render does, for messages, tools and both settings of the generation prompt.
func TestRenderMatchesTheEngineInProcess(t *testing.T) {
	ctx := context.Background()
	local := scripted.Echo("x")
	c := dial(t, remote.Options{Address: serve(t, scripted.Echo("x"), server.Options{})})
	reqs := []engines.RenderRequest{
		{Messages: []engines.Message{{Role: "system", Content: "s"}, {Role: "user", Content: "hi"}}, AddGenerationPrompt: true},
		{Messages: []engines.Message{{Role: "user", Content: "hi"}, {Role: "assistant", Content: "yo"}}, Tools: []string{`{"name": "calc"}`}},
	}
	want, _ := local.Render(ctx, reqs)
	got, err := c.Render(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("Render (-in-process +remote):\n%s", d)
	}
}
