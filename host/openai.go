package host

import (
	"context"
	"fmt"
	"os"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/openai"
	"github.com/slimen/slimen/host/config"
)

// openOpenAI connects to an OpenAI-compatible server (engine.base_url) and checks that it serves
// engine.model, so that a wrong address, key or name stops the run at start-up. Config
// validation has made sure the policy is frozen: the server only generates.
func openOpenAI(ctx context.Context, p config.PolicyConfig, env EngineEnv) (engines.Engine, error) {
	e := p.Engine
	o := openai.Options{BaseURL: e.BaseURL, Model: e.Model, Timeout: e.Timeout, MaxRetries: e.MaxRetries,
		MaxConcurrency: e.MaxConcurrency, TokenIDs: e.TokenIDs, MaxTokensField: e.MaxTokensField, Logf: func(format string, args ...any) {
			env.Logf("policy %q: "+format, append([]any{p.Name}, args...)...)
		}}
	if e.APIKeyEnv != "" {
		if o.APIKey = os.Getenv(e.APIKeyEnv); o.APIKey == "" {
			return nil, fmt.Errorf("policy %q: engine.api_key_env %s: the environment variable is empty or unset; export the server's API key in it", p.Name,
				e.APIKeyEnv)
		}
	}
	c, err := openai.Open(ctx, o)
	if err != nil {
		return nil, fmt.Errorf("policy %q: %w", p.Name, err)
	}
	return c, nil
}
