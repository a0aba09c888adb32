package tiny

import (
	"context"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/slimen/slimen/engines"
)

// checkVersions keeps version 0 of v, trains it, and checks that version 0 still samples and
// scores what v did before training, that the current weights moved, that a version saved and
// loaded back is the same, and that a dropped version is gone.
func checkVersions(t *testing.T, v interface {
	engines.Engine
	engines.Versions
}) {
	t.Helper()
	ctx := context.Background()
	before, err := v.Generate(ctx, loraReqs())
	if err != nil {
		t.Fatal(err)
	}
	score := []engines.ScoreRequest{{Messages: loraReqs()[0].Messages, Tokens: before[0].Tokens}}
	scoreBefore, err := v.Score(ctx, score)
	if err != nil {
		t.Fatal(err)
	}
	if err := v.KeepVersion(ctx, 0); err != nil {
		t.Fatal(err)
	}
	trainAdapter(t, v, 2)
	after, err := v.Generate(ctx, loraReqs())
	if err != nil {
		t.Fatal(err)
	}
	if reflect.DeepEqual(after, before) {
		t.Fatal("training did not change what the engine samples: the test shows nothing")
	}
	old, err := v.GenerateVersion(ctx, 0, loraReqs())
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(old, before) {
		t.Errorf("version 0 sampled\n%+v\nafter training; before training the engine sampled\n%+v", old, before)
	}
	oldScore, err := v.ScoreVersion(ctx, 0, score)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(oldScore, scoreBefore) {
		t.Errorf("version 0 scored %v, the engine before training %v", oldScore, scoreBefore)
	}
	// Saved and loaded back as version 3, version 0 samples the same.
	dir := filepath.Join(t.TempDir(), "v0")
	if err := v.SaveVersion(ctx, 0, dir); err != nil {
		t.Fatal(err)
	}
	cur := filepath.Join(t.TempDir(), "cur")
	if err := v.Save(ctx, cur); err != nil {
		t.Fatal(err)
	}
	if err := v.Load(ctx, dir); err != nil {
		t.Fatal(err)
	}
	if err := v.KeepVersion(ctx, 3); err != nil {
		t.Fatal(err)
	}
	if err := v.Load(ctx, cur); err != nil {
		t.Fatal(err)
	}
	if got, err := v.GenerateVersion(ctx, 3, loraReqs()); err != nil || !reflect.DeepEqual(got, before) {
		t.Errorf("version 0 saved and kept again as 3 samples differently (%v)", err)
	}
	if got, err := v.Generate(ctx, loraReqs()); err != nil || !reflect.DeepEqual(got, after) {
		t.Errorf("the current weights changed by keeping a version (%v)", err)
	}
	if err := v.DropVersions(ctx, 1); err != nil {
		t.Fatal(err)
	}
	if _, err := v.GenerateVersion(ctx, 0, loraReqs()); err == nil || !strings.Contains(err.Error(), "no weights version 0") {
		t.Errorf("a dropped version: %v", err)
	}
	if _, err := v.GenerateVersion(ctx, 3, loraReqs()); err != nil {
		t.Errorf("version 3 was dropped with the versions below 1: %v", err)
	}
}

func TestVersions(t *testing.T) { checkVersions(t, loraTestEngine(t)) }

func TestAdapterVersions(t *testing.T) {
	e := loraTestEngine(t)
	if err := e.AddAdapter("a", LoRAConfig{Rank: 4, Alpha: 8, Targets: LoRATargets}, 1); err != nil {
		t.Fatal(err)
	}
	v, _ := e.Adapter("a")
	checkVersions(t, v)
}

// A kept version samples while the engine trains: the training holds the engine's lock, and
// generating from a version takes none of it.
func TestVersionGeneratesWhileTraining(t *testing.T) {
	ctx := context.Background()
	e := loraTestEngine(t)
	if err := e.KeepVersion(ctx, 0); err != nil {
		t.Fatal(err)
	}
	e.mu.Lock() // what Train holds
	defer e.mu.Unlock()
	if _, err := e.GenerateVersion(ctx, 0, loraReqs()); err != nil {
		t.Fatal(err)
	}
}
