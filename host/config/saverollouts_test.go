package config

import (
	"strings"
	"testing"
)

func TestSaveRollouts(t *testing.T) {
	c, err := Parse([]byte("policies:\n  - name: a\n"), "p.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if c.Run.SaveRollouts != DefaultSaveRollouts {
		t.Errorf("run.save_rollouts defaults to %d, want %d", c.Run.SaveRollouts, DefaultSaveRollouts)
	}
	c, err = Parse([]byte("policies:\n  - name: a\nrun:\n  save_rollouts: 0\n  tensorboard: tb\n"), "p.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if c.Run.SaveRollouts != 0 || c.Run.TensorBoard != "tb" {
		t.Errorf("run.save_rollouts 0, tensorboard tb read as %d, %q", c.Run.SaveRollouts, c.Run.TensorBoard)
	}
	for _, bad := range []string{"-1", "100000"} {
		_, err = Parse([]byte("policies:\n  - name: a\nrun:\n  save_rollouts: "+bad+"\n"), "p.yaml")
		if err == nil || !strings.Contains(err.Error(), "run.save_rollouts") {
			t.Errorf("save_rollouts %s: got %v, want an error naming run.save_rollouts", bad, err)
		}
	}
}
