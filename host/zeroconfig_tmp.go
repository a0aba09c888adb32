package host

import (
	"os"

	"gopkg.in/yaml.v3"

	"github.com/slimen/slimen/host/config"
)

// Bridges to host/config's defaults until its loader lands.
func defaultConfig(policies []string) *config.Config {
	c := &config.Config{
		Rollout: config.RolloutConfig{BatchSize: 16, MaxResponseLen: 12, Temperature: 1, TopP: 1, MaxFailedFraction: 0.5},
		Data:    config.DataConfig{Path: "synthetic:arith", InputKey: "prompt", LabelKey: "label"},
		Run:     config.RunConfig{Steps: 40, Seed: 1},
	}
	for _, p := range policies {
		c.Policies = append(c.Policies, defaultPolicy(p))
	}
	return c
}

func defaultPolicy(name string) config.PolicyConfig {
	return config.PolicyConfig{
		Name: name, Role: "actor", Trainable: true, HFCheckpoint: "builtin:tiny-arith", BufferMode: "split",
		Engine: config.EngineConfig{Kind: "tiny"},
		Train: config.TrainConfig{LR: 1e-3, AdvantageEstimator: "grpo", RewardsNormalization: true,
			GRPOStdNormalization: true, EpsClip: 0.2, EpsClipHigh: 0.28, KLLossType: "low_var_kl", ClipGrad: 1,
			AdamBeta1: 0.9, AdamBeta2: 0.999, OPDKLCoef: 1, Gamma: 1, Lambda: 1},
	}
}

func marshalConfig(c *config.Config) ([]byte, error) { return yaml.Marshal(c) }

// DefaultConfig is the zero-config configuration (bridge to config.Default).
func DefaultConfig() *config.Config { return defaultConfig(nil) }

// LoadConfigFile reads a YAML config (bridge to config.Load).
func LoadConfigFile(path string) (*config.Config, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	c := DefaultConfig()
	if err := yaml.Unmarshal(b, c); err != nil {
		return nil, err
	}
	c.File = path
	for i, p := range c.Policies {
		d := defaultPolicy(p.Name)
		if err := yaml.Unmarshal(b, &struct{}{}); err != nil {
			return nil, err
		}
		d.Trainable, d.Train.LR = p.Trainable, p.Train.LR
		c.Policies[i] = d
	}
	return c, nil
}
