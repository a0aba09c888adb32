package config

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestWandb(t *testing.T) {
	c, err := Parse([]byte("policies:\n  - name: a\n"), "p.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if c.Run.Wandb != nil {
		t.Errorf("run.wandb not given read as %+v, want nil (no W&B)", c.Run.Wandb)
	}
	src := "policies:\n  - name: a\nrun:\n  wandb: {project: p, entity: e, name: n, mode: offline, python: /py}\n"
	if c, err = Parse([]byte(src), "p.yaml"); err != nil {
		t.Fatal(err)
	}
	want := &WandbConfig{Project: "p", Entity: "e", Name: "n", Mode: "offline", Python: "/py"}
	if diff := cmp.Diff(want, c.Run.Wandb); diff != "" {
		t.Errorf("run.wandb (-want +got):\n%s", diff)
	}
	// The resolved config.yaml of a run folder keeps it, so a resumed run logs where it did.
	b, err := c.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	again, err := Parse(b, "config.yaml")
	if err != nil {
		t.Fatalf("%v\n%s", err, b)
	}
	if diff := cmp.Diff(want, again.Run.Wandb); diff != "" {
		t.Errorf("run.wandb after config.yaml (-want +got):\n%s", diff)
	}
	if c, err = Parse([]byte("policies:\n  - name: a\nrun:\n  wandb: {}\n"), "p.yaml"); err != nil || c.Run.Wandb == nil {
		t.Errorf("run.wandb: {} read as %+v, %v; want W&B with the SDK's defaults", c.Run.Wandb, err)
	}
	for _, tc := range []struct{ src, want string }{
		{"run:\n  wandb:\n    project: p\n    mode: online2\n", `p.yaml:6: run.wandb.mode: must be online, offline or disabled`},
		{"run:\n  wandb:\n    project: p\n    team: x\n", `p.yaml:6: run.wandb: unknown key "team"`},
		{"run:\n  wandb: p\n", `p.yaml:4: run.wandb: expected a mapping`},
	} {
		_, err := Parse([]byte("policies:\n  - name: a\n"+tc.src), "p.yaml")
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: got %v, want an error containing %q", tc.src, err, tc.want)
		}
	}
}
