package main

import (
	"strings"
	"testing"

	"github.com/slimen/slimen/host/config"
)

// --wandb PROJECT turns W&B on with that project, keeping the rest of the config's run.wandb.
func TestWandbFlag(t *testing.T) {
	for _, tc := range []struct {
		name string
		from *config.WandbConfig
		want config.WandbConfig
	}{
		{"no run.wandb", nil, config.WandbConfig{Project: "p"}},
		{"run.wandb given", &config.WandbConfig{Project: "q", Mode: "offline"}, config.WandbConfig{Project: "p", Mode: "offline"}},
	} {
		f := newExecFlags()
		if _, err := parseInterleaved(f.fs, []string{"s.star", "--wandb", "p"}); err != nil {
			t.Fatal(err)
		}
		f.set["wandb"] = true
		c := config.Default(nil)
		c.Run.Wandb = tc.from
		if err := f.override(c); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if c.Run.Wandb == nil || *c.Run.Wandb != tc.want {
			t.Errorf("%s: run.wandb = %+v, want %+v", tc.name, c.Run.Wandb, tc.want)
		}
	}
	f := newExecFlags()
	parseInterleaved(f.fs, []string{"s.star", "--wandb", ""})
	f.set["wandb"] = true
	if err := f.override(config.Default(nil)); err == nil || !strings.Contains(err.Error(), "--wandb") {
		t.Errorf("--wandb with no project: got %v, want an error naming --wandb", err)
	}
}
