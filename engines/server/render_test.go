package server

import (
	"context"
	"slices"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/slimen/slimen/engines"
	enginepb "github.com/slimen/slimen/engines/proto"
	"github.com/slimen/slimen/engines/scripted"
)

// TestRender: Render serves the engine's chat template as its Render computes it (messages, tools
// and the generation prompt all arrive), and an engine without one answers UNIMPLEMENTED.
func TestRender(t *testing.T) {
	eng := scripted.Echo("x")
	c := start(t, eng, Options{})
	reqs := []engines.RenderRequest{
		{Messages: []engines.Message{{Role: "user", Content: "hi"}}, AddGenerationPrompt: true},
		{Messages: []engines.Message{{Role: "user", Content: "hi"}, {Role: "assistant", Content: "yo"}}, Tools: []string{`{"name":"calc"}`}},
	}
	req := &enginepb.RenderBatchRequest{}
	for _, r := range reqs {
		req.Requests = append(req.Requests, enginepb.EncodeRenderRequest(r))
	}
	got, err := c.Render(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := eng.Render(context.Background(), reqs)
	if len(got.GetTokens()) != len(want) {
		t.Fatalf("%d results for %d requests", len(got.GetTokens()), len(want))
	}
	for i := range want {
		if !slices.Equal(got.GetTokens()[i].GetIds(), want[i]) {
			t.Errorf("request %d: served %v, engine renders %v", i, got.GetTokens()[i].GetIds(), want[i])
		}
	}
	_, err = start(t, newGated(), Options{}).Render(context.Background(), req)
	if status.Code(err) != codes.Unimplemented {
		t.Errorf("an engine without a template: %v, want UNIMPLEMENTED", err)
	}
}
