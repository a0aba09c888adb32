package script

import (
	"encoding/json"
	"fmt"

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
	return fromFields(top), nil
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
