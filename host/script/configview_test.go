package script

import (
	"encoding/json"
	"strings"
	"testing"

	"go.starlark.net/starlark"

	"github.com/slimen/slimen/host/config"
)

// TestConfigValueHidesSecretsAndUngranted: the `config` a script reads shows a sandboxed script
// only the policies sandbox.policies grants it, and no script the settings that hold or locate
// credentials (pass-through api keys, headers, tokens, env; token_env, api_key_env, tls, the
// worker's args; a URL's password), while the rest (engine.kind, input_key, pass-through server
// arguments) stays readable.
func TestConfigValueHidesSecretsAndUngranted(t *testing.T) {
	c := config.Default([]string{"p", "hidden"})
	e := &c.Policies[0].Engine
	e.Kind, e.TokenEnv, e.APIKeyEnv, e.BaseURL = "openai", "TOKEN_VAR_NAME", "KEY_VAR_NAME", "https://user:sk-in-url@api.example/v1"
	e.TLS = &config.TLSConfig{Key: "/secret/client.key"}
	e.Args = []string{"--api-key", "sk-in-args"}
	e.Extra = map[string]any{"api_key": "sk-extra", "headers": map[string]any{"Authorization": "Bearer sk-header"},
		"env": map[string]any{"HF_TOKEN": "hf-env"}, "chunked_prefill_size": 8192}
	c.Policies[0].Extra = map[string]any{"input_key": "prompt", "hf_token": "hf-policy", "openai_api_key": "sk-policy"}
	c.Policies[0].Train.Extra = map[string]any{"wandb_key": "wandb-secret", "tensor_model_parallel_size": 2,
		"max_tokens_per_gpu": 4096}
	c.Policies[1].Engine.Extra = map[string]any{"client_secret": "hidden-secret"}
	show := func() string {
		v := ConfigValue(func() *config.Config { return c })
		out, err := starlark.ExecFile(&starlark.Thread{}, "show.star",
			`out = str(config.policies) + " " + config.policies["p"].engine.kind + " " + str(config.policies["p"].extra["input_key"])`,
			starlark.StringDict{"config": v})
		if err != nil {
			t.Fatal(err)
		}
		return string(out["out"].(starlark.String))
	}
	check := func(got string, hiddenPolicy bool) {
		t.Helper()
		for _, secret := range []string{"TOKEN_VAR_NAME", "KEY_VAR_NAME", "sk-in-url", "/secret/client.key", "sk-in-args",
			"sk-extra", "sk-header", "hf-env", "hf-policy", "sk-policy", "wandb-secret", "hidden-secret"} {
			if strings.Contains(got, secret) {
				t.Errorf("the script sees %q:\n%s", secret, got)
			}
		}
		for _, shown := range []string{"openai", "prompt", "chunked_prefill_size", "tensor_model_parallel_size", "max_tokens_per_gpu", "https://api.example/v1"} {
			if !strings.Contains(got, shown) {
				t.Errorf("the script does not see %q:\n%s", shown, got)
			}
		}
		if strings.Contains(got, `"hidden"`) != hiddenPolicy {
			t.Errorf("policy \"hidden\" shown: %v, want %v:\n%s", !hiddenPolicy, hiddenPolicy, got)
		}
	}
	check(show(), true) // in-process: every policy, no secrets
	c.Sandbox.Enabled, c.Sandbox.Policies = true, []string{"p"}
	check(show(), false)
	c.Sandbox.Policies = nil // sandboxed without a grant list: every policy of the config
	check(show(), true)
}

// TestChildConfigHoldsNoSecrets: the config a sandbox child is sent holds none of the secrets the
// `config` value hides, and keeps what the child works with (budgets, rollout settings, policy
// names and their training settings).
func TestChildConfigHoldsNoSecrets(t *testing.T) {
	c := config.Default([]string{"p", "q"})
	e := &c.Policies[0].Engine
	e.Kind, e.TokenEnv, e.BaseURL = "openai", "TOKEN_VAR_NAME", "https://user:sk-in-url@api.example/v1"
	e.Args = []string{"--api-key", "sk-in-args"}
	e.Extra = map[string]any{"api_key": "sk-extra", "headers": map[string]any{"Authorization": "Bearer sk-header"}}
	c.Policies[1].Extra = map[string]any{"hf_token": "hf-policy"}
	c.Sandbox.Enabled, c.Sandbox.Tokens, c.Rollout.Temperature = true, 1234, 0.7
	c.Policies[1].Train.LR = 2e-5
	child, err := ChildConfig(c)
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := json.Marshal(child)
	for _, secret := range []string{"TOKEN_VAR_NAME", "sk-in-url", "sk-in-args", "sk-extra", "sk-header", "hf-policy"} {
		if strings.Contains(string(raw), secret) {
			t.Errorf("the child's config holds %q", secret)
		}
	}
	if child.Sandbox.Tokens != 1234 || !child.Sandbox.Enabled || child.Rollout.Temperature != 0.7 || len(child.Policies) != 2 ||
		child.Policies[1].Train.LR != 2e-5 || child.Policies[0].Engine.BaseURL != "https://api.example/v1" {
		t.Errorf("the child's config lost settings: %s", raw)
	}
}
