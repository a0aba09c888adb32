package host

import (
	"context"
	"io/fs"
	"strings"
	"testing"
	"testing/fstest"

	"go.starlark.net/starlark"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/scripted"
)

// Options.Modules are loadable as @NAME//file.star, and may not shadow a bundled package; an
// fs.FS script's relative loads stay inside its folder; Go built-ins and modules cannot reach a
// sandboxed run's children, and an fs.FS script cannot be watched.
func TestEmbeddingOptions(t *testing.T) {
	ctx := context.Background()
	lib := fstest.MapFS{"grade.star": {Data: []byte("def grade(text):\n    return 1.0 if text == \"yes\" else 0.0\n")}}
	files := fstest.MapFS{
		"s/s.star":     {Data: []byte("load(\"@mine//grade.star\", \"grade\")\n\ndef rollout(task):\n    c = generate(\"p\", task.prompt)\n    reward(c, grade(c.text))\n    train(c)\n")},
		"s/bad.star":   {Data: []byte("load(\"../outside.star\", \"x\")\n\ndef rollout(task):\n    pass\n")},
		"outside.star": {Data: []byte("x = 1\n")},
	}
	opts := Options{Config: testConfig(2, "p"), FS: files, Tasks: numberedTasks(2), Modules: map[string]fs.FS{"mine": lib},
		Engines: map[string]engines.Engine{"p": scripted.Echo("yes")}}
	r, err := Load(ctx, "s/s.star", opts)
	if err != nil {
		t.Fatal(err)
	}
	res, err := r.Step(ctx)
	if err != nil || res.Policies[0].Float("reward_mean") != 1 {
		t.Fatalf("step with a module from Options.Modules: %v, %v", err, res)
	}
	if err := r.Watch(""); err == nil || !strings.Contains(err.Error(), "only files on disk can be watched") {
		t.Errorf("watching an fs.FS script: %v", err)
	}
	r.Close()

	if _, err := Load(ctx, "s/bad.star", opts); err == nil || !strings.Contains(err.Error(), `load "../outside.star": it escapes the script's folder s`) {
		t.Errorf("a load out of the script's folder in an fs.FS: %v", err)
	}
	shadow := opts
	shadow.Modules = map[string]fs.FS{"graphs": lib}
	if _, err := Load(ctx, "s/s.star", shadow); err == nil || !strings.Contains(err.Error(), "module package @graphs: the name is taken") {
		t.Errorf("a module shadowing @graphs: %v", err)
	}
	sandboxed := opts
	sandboxed.Sandbox, sandboxed.Builtins = true, starlark.StringDict{"x": starlark.MakeInt(1)}
	if _, err := Load(ctx, "s/s.star", sandboxed); err == nil || !strings.Contains(err.Error(), "a sandboxed run cannot have Options.Builtins or Options.Modules") {
		t.Errorf("a sandboxed run with Go built-ins: %v", err)
	}
}
