package wandb

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/slimen/slimen/host/config"
)

// The sidecar's interpreter: run.wandb.python, else $SLIMEN_PYTHON, else a torch policy's
// engine.python, else python3; each named where it came from.
func TestPython(t *testing.T) {
	c := config.Default(nil)
	c.Policies = []config.PolicyConfig{{Name: "a", Engine: config.EngineConfig{Kind: "tiny"}},
		{Name: "b", Engine: config.EngineConfig{Kind: "torch", Python: "/venv/bin/python"}}}
	c.Run.Wandb = &config.WandbConfig{}
	t.Setenv(PythonEnv, "")
	for _, tc := range []struct{ key, env, py, from string }{
		{"", "", "/venv/bin/python", `policy "b"'s engine.python`},
		{"", "/env/python", "/env/python", "$SLIMEN_PYTHON"},
		{"/key/python", "/env/python", "/key/python", "run.wandb.python"},
	} {
		c.Run.Wandb.Python = tc.key
		t.Setenv(PythonEnv, tc.env)
		if py, from := python(c); py != tc.py || from != tc.from {
			t.Errorf("run.wandb.python %q, $SLIMEN_PYTHON %q: got %s from %s, want %s from %s", tc.key, tc.env, py, from, tc.py, tc.from)
		}
	}
	c.Policies = c.Policies[:1]
	c.Run.Wandb.Python = ""
	t.Setenv(PythonEnv, "")
	if py, _ := python(c); py != "python3" {
		t.Errorf("no interpreter named: got %s, want python3", py)
	}
}

// init names the W&B run after the run folder unless the config or $WANDB_NAME names it, writes
// inside the run folder unless $WANDB_DIR says where, and resumes the W&B run the folder names.
func TestInitMessage(t *testing.T) {
	out := t.TempDir()
	c := config.Default(nil)
	c.Run.Out = out
	c.Run.Wandb = &config.WandbConfig{Project: "p", Mode: "offline"}
	t.Setenv("WANDB_NAME", "")
	t.Setenv("WANDB_DIR", "")
	msg, err := initMessage(c)
	if err != nil {
		t.Fatal(err)
	}
	if msg["name"] != filepath.Base(out) || msg["dir"] != out || msg["project"] != "p" || msg["mode"] != "offline" || msg["id"] != nil {
		t.Errorf("init = %v; want named %s, in %s, project p, offline, no id", msg, filepath.Base(out), out)
	}
	if cfg, _ := msg["config"].(map[string]any); cfg["run"] == nil {
		t.Errorf("init's config %v lacks the resolved config's run block", msg["config"])
	}
	t.Setenv("WANDB_NAME", "env-name")
	t.Setenv("WANDB_DIR", "/elsewhere")
	writeFile(t, filepath.Join(out, runIDFile), "abc\n")
	if msg, _ = initMessage(c); msg["name"] != "" || msg["dir"] != nil || msg["id"] != "abc" {
		t.Errorf("with $WANDB_NAME, $WANDB_DIR and a W&B run id in the folder: init = %v; want the SDK's name and dir, id abc", msg)
	}
}

func writeFile(t *testing.T, path, text string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
}
