package host

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"go.starlark.net/starlark"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/script"
	"github.com/slimen/slimen/starlib"
)

// localHost is the script.Host of an in-process rollout: the run itself. A sandboxed rollout's
// calls reach it too, through the host's side of the pipe.
type localHost struct{ r *Run }

var _ script.Host = localHost{}

func (h localHost) CheckPolicy(name string) (bool, string, error) {
	p, err := h.r.pols.policyFor(name)
	if err != nil {
		return false, "", err
	}
	return p.cfg.Trainable, cfgPlace(h.r.cfg, p.cfg), nil
}

func (h localHost) Sampling() engines.Sampling { return h.r.sampling() }

func (h localHost) Generate(ctx context.Context, policy string, req engines.GenerateRequest) ([]engines.Completion, error) {
	p, err := h.r.pols.policyFor(policy)
	if err != nil {
		return nil, err
	}
	req.ID = script.WireID(ctx, req.ID) // a sandboxed rollout's requests come this way too
	v := versionFor(ctx, p)
	if v.gen >= 0 && h.r.Config().Rollout.Partial {
		return h.r.vers.generatePartial(ctx, p, req, v)
	}
	return p.disp.generate(ctx, req, v.gen)
}

func (h localHost) Score(ctx context.Context, policy string, req engines.ScoreRequest) ([]float32, error) {
	p, err := h.r.pols.policyFor(policy)
	if err != nil {
		return nil, err
	}
	return p.score(ctx, req)
}

func (h localHost) Render(ctx context.Context, policy string, reqs []engines.RenderRequest) (script.Rendered, error) {
	// A zero-config policy first used by a conversation with tool schemas is created on the
	// embedded chat model, whose template takes them (builtin:tiny-arith would not hold them).
	checkpoint := config.BuiltinCheckpoint
	if slices.ContainsFunc(reqs, func(r engines.RenderRequest) bool { return len(r.Tools) > 0 }) {
		checkpoint = config.BuiltinChatCheckpoint
	}
	p, err := h.r.pols.policyOn(policy, checkpoint)
	if err != nil {
		return script.Rendered{}, err
	}
	rd, ok := p.eng.(engines.Renderer)
	if !ok {
		return script.Rendered{}, fmt.Errorf("policy %q: its engine cannot render its chat template to tokens (no Render), "+
			"which a chat needs; the tiny, remote and torch engines can", policy)
	}
	info, err := p.chatInfo(ctx)
	if err != nil {
		return script.Rendered{}, fmt.Errorf("policy %q: info: %w", policy, err)
	}
	if !strings.Contains(info.ChatTemplate, "tools") {
		reqs = toolsInSystem(reqs)
	}
	toks, err := rd.Render(ctx, reqs)
	if err != nil {
		return script.Rendered{}, fmt.Errorf("policy %q: render: %w", policy, err)
	}
	if len(toks) != len(reqs) {
		return script.Rendered{}, fmt.Errorf("policy %q: render returned %d token lists for %d requests", policy, len(toks), len(reqs))
	}
	return script.Rendered{Tokens: toks, EOS: info.EOSTokens, MaxSeqLen: info.MaxSeqLen, Constrain: slices.Contains(info.Capabilities, "constrain")}, nil
}

// toolsInSystem is the fallback for a chat template without a tools variable: the tool schemas
// described in the system message (starlib.ToolsSystemPrompt), after its own text, or in one of
// their own.
func toolsInSystem(reqs []engines.RenderRequest) []engines.RenderRequest {
	out := make([]engines.RenderRequest, len(reqs))
	for i, r := range reqs {
		out[i] = r
		if len(r.Tools) == 0 {
			continue
		}
		desc := starlib.ToolsSystemPrompt(r.Tools)
		out[i].Tools = nil
		if len(r.Messages) > 0 && r.Messages[0].Role == "system" {
			out[i].Messages = append([]engines.Message{{Role: "system", Content: r.Messages[0].Content + "\n\n" + desc}}, r.Messages[1:]...)
		} else {
			out[i].Messages = append([]engines.Message{{Role: "system", Content: desc}}, r.Messages...)
		}
	}
	return out
}

func (h localHost) StateGet(key string) (starlark.Value, bool, error) {
	v, ok := h.r.state.Get(key)
	return v, ok, nil
}

func (h localHost) StateLock(key string) (starlark.Value, bool, func(starlark.Value) error, func(), error) {
	cur, found, commit, release := h.r.state.Lock(key)
	return cur, found, commit, release, nil
}

func (h localHost) Event(msg string) { h.r.events.printf("%s", msg) }

func (h localHost) Running(n int) { h.r.activity.add(n) }

func (h localHost) Generated(tokens int) { h.r.live.tokens.Add(int64(tokens)) }
