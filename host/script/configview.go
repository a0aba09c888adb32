package script

import (
	"encoding/json"
	"fmt"
	"net/url"
	"slices"
	"strings"

	"go.starlark.net/starlark"
	"go.starlark.net/starlarkstruct"

	"github.com/slimen/slimen/host/config"
)

// configValue is the script's read-only `config`: config.policies["solver"].n_samples_per_prompt,
// config.rollout.temperature, config.run.seed, … A policy's train settings are also reachable
// directly on the policy (slime-n's flat names). It reads the run's current config on every access,
// so a reloaded config and zero-config policies created on first use are visible.
type configValue struct {
	get func() *config.Config
}

// ConfigValue is the script's `config` (Options.Config): get returns the run's current config,
// or nil when none is attached.
func ConfigValue(get func() *config.Config) starlark.Value { return configValue{get: get} }

func (v configValue) String() string        { return "<config>" }
func (v configValue) Type() string          { return "config" }
func (v configValue) Freeze()               {}
func (v configValue) Truth() starlark.Bool  { return true }
func (v configValue) Hash() (uint32, error) { return 0, fmt.Errorf("unhashable: config") }
func (v configValue) AttrNames() []string {
	return []string{"data", "eval", "policies", "rollout", "run"}
}

func (v configValue) Attr(name string) (starlark.Value, error) {
	c := v.get()
	if c == nil {
		return nil, fmt.Errorf("config: no run configuration is attached to this script")
	}
	switch name {
	case "policies":
		d := starlark.NewDict(len(c.Policies))
		for _, p := range c.Policies {
			if c.Sandbox.Enabled && len(c.Sandbox.Policies) > 0 && !slices.Contains(c.Sandbox.Policies, p.Name) {
				continue // a sandboxed script sees the policies it is granted, no others
			}
			s, err := policyValue(p)
			if err != nil {
				return nil, err
			}
			d.SetKey(starlark.String(p.Name), s)
		}
		d.Freeze()
		return d, nil
	case "rollout":
		return structOf(c.Rollout)
	case "data":
		return structOf(c.Data)
	case "eval":
		return structOf(c.Eval)
	case "run":
		return structOf(c.Run)
	}
	return nil, nil
}

func policyValue(p config.PolicyConfig) (starlark.Value, error) {
	top, err := jsonFields(p)
	if err != nil {
		return nil, err
	}
	train, err := jsonFields(p.Train)
	if err != nil {
		return nil, err
	}
	for k, x := range train {
		if _, clash := top[k]; !clash {
			top[k] = x
		}
	}
	redactSecrets(top)
	return fromFields(top), nil
}

// hiddenPolicyFields are settings of a policy a script never sees, in or out of the sandbox:
// where its engine's credentials are (token_env, api_key_env: the variables' names; tls: the key
// files) and the worker's own flags (args may carry a key). In the pass-through blocks (extra, an
// engine's server arguments, a server group's overrides) every key whose name says it holds a
// secret is hidden too.
var hiddenPolicyFields = []string{"token_env", "api_key_env", "tls", "args"}

// secretWords are the words (of a key split at _, - and .) that mark a pass-through setting as a
// secret; "key" does too, after one of keyOwners or alone (input_key and label_key name columns).
var (
	secretWords = []string{"secret", "secrets", "password", "passwd", "token", "bearer", "auth",
		"authorization", "header", "headers", "cookie", "cookies", "credential", "credentials", "apikey", "env", "environment"}
	keyOwners = []string{"api", "access", "private", "secret", "client", "signing", "ssh", "hf", "openai", "service", "session", "encryption", "wandb"}
)

// secretName reports whether a setting's name says it holds a secret (api_key, headers, HF_TOKEN,
// env, …). Fields slimen defines that match are not secrets: token_ids.
func secretName(k string) bool {
	if k == "token_ids" {
		return false
	}
	words := strings.FieldsFunc(strings.ToLower(k), func(r rune) bool { return r == '_' || r == '-' || r == '.' })
	for i, w := range words {
		if slices.Contains(secretWords, w) {
			return true
		}
		if (w == "key" || w == "keys") && (i == 0 || slices.Contains(keyOwners, words[i-1])) {
			return true
		}
	}
	return false
}

// redactSecrets removes hiddenPolicyFields and every secretName setting from a policy's fields,
// at every depth, and a URL's user and password (base_url: https://user:key@host/v1).
func redactSecrets(m map[string]any) {
	for k, x := range m {
		if slices.Contains(hiddenPolicyFields, k) || secretName(k) {
			delete(m, k)
			continue
		}
		switch x := x.(type) {
		case map[string]any:
			redactSecrets(x)
		case []any:
			for _, e := range x {
				if sub, ok := e.(map[string]any); ok {
					redactSecrets(sub)
				}
			}
		case string:
			if u, err := url.Parse(x); err == nil && u.User != nil && u.Host != "" {
				u.User = nil
				m[k] = u.String()
			}
		}
	}
}

func structOf(x any) (starlark.Value, error) {
	f, err := jsonFields(x)
	if err != nil {
		return nil, err
	}
	return fromFields(f), nil
}

func jsonFields(x any) (map[string]any, error) {
	b, err := json.Marshal(x)
	if err != nil {
		return nil, err
	}
	var m map[string]any
	err = json.Unmarshal(b, &m)
	return m, err
}

// fromFields builds a frozen struct, nested maps becoming structs too.
func fromFields(m map[string]any) starlark.Value {
	d := starlark.StringDict{}
	for k, x := range m {
		if sub, ok := x.(map[string]any); ok && k != "extra" && k != "overrides" {
			d[k] = fromFields(sub)
			continue
		}
		d[k] = toStarlark(x)
	}
	s := starlarkstruct.FromStringDict(starlarkstruct.Default, d)
	s.Freeze()
	return s
}

// ChildConfig is the config a sandbox child is sent: the run's, without what no script may see
// (redactSecrets: where credentials live, the worker's flags, secret-named pass-through keys, a
// URL's user and password). The child needs the budgets, the rollout settings and the policies'
// names and settings; a credential it never holds cannot leak from it.
func ChildConfig(c *config.Config) (*config.Config, error) {
	raw, err := json.Marshal(c)
	if err != nil {
		return nil, err
	}
	var m map[string]any
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, err
	}
	if ps, ok := m["policies"].([]any); ok {
		for _, p := range ps {
			if pm, ok := p.(map[string]any); ok {
				redactSecrets(pm)
			}
		}
	}
	if raw, err = json.Marshal(m); err != nil {
		return nil, err
	}
	out := &config.Config{}
	return out, json.Unmarshal(raw, out)
}
