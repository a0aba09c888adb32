package host

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"sort"

	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/script"
)

// stepCut returns a *StepCut when a stop cancelled any of the step's rollouts, else nil.
func stepCut(step int, ros []*script.Rollout, grace float64) error {
	cancelled := 0
	for _, ro := range ros {
		var sc *StopCancelled
		if ro.Err != nil && errors.As(context.Cause(ro.Ctx), &sc) {
			cancelled++
		}
	}
	if cancelled == 0 {
		return nil
	}
	return &StepCut{Step: step, Cancelled: cancelled, Total: len(ros), Grace: grace}
}

// checkFolder makes sure run folder dir, whose lock this is, is still the run's and writable: its
// lock file is the one the run holds (not deleted, moved or replaced), and a file can be created
// in it. step is the steps done; lastCheckpoint the run's newest checkpoint, for the hint. The
// run calls it at each step's start and before the step's results are written; a nil lock (no
// folder) checks nothing.
func (l *runLock) checkFolder(dir string, step int, lastCheckpoint func() string) error {
	if l == nil {
		return nil
	}
	if why := l.gone(); why != "" {
		return &RunFolderError{Dir: dir, Why: why, Step: step,
			Hint: fmt.Sprintf("its metrics and checkpoints went with it; if it was moved, move it back to %s and resume with: slimen exec --resume %s", dir, dir)}
	}
	f, err := os.CreateTemp(dir, ".write-check-")
	if err == nil {
		_, err = f.Write([]byte{'\n'})
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		os.Remove(f.Name())
	}
	if err != nil {
		return &RunFolderError{Dir: dir, Why: fmt.Sprintf("it is not writable: %v", err), Step: step, Hint: folderHint(dir, lastCheckpoint())}
	}
	return nil
}

// folderHint is the way on once run folder out is writable again; last is the newest checkpoint
// the run wrote or resumed from ("": none).
func folderHint(out, last string) string {
	if last != "" {
		return fmt.Sprintf("once it is writable again, resume from its last checkpoint (%s) with: slimen exec --resume %s", filepath.Base(last), out)
	}
	if dir, _, err := FindCheckpoint(out); err == nil {
		return fmt.Sprintf("once it is writable again, resume from its last checkpoint (%s) with: slimen exec --resume %s", filepath.Base(dir), out)
	}
	return fmt.Sprintf("it holds no checkpoint yet: once it is writable again, start the run again with another --out (or remove %s)", out)
}

// StopHint is how a run that stopped goes on: the resume command of its newest valid checkpoint,
// or "" when it has no folder or no checkpoint.
func (r *Run) StopHint() string {
	if r.opts.Out == "" {
		return ""
	}
	dir, _, err := FindCheckpoint(r.opts.Out)
	if err != nil {
		return ""
	}
	return fmt.Sprintf("resume from its last checkpoint (%s) with: slimen exec --resume %s", filepath.Base(dir), r.opts.Out)
}

// relocate applies to ckpt, a checkpoint's config, where the engines of moved's policies live —
// engine.address, engine.tls, engine.token_env, engine.insecure, engine.base_url,
// engine.api_key_env — and returns what it changed, one line each. Anything else in which moved
// differs from ckpt (run.out aside) would change what the run computes: it is refused, naming
// the setting. TLS files relative in moved are taken from the current directory.
func relocate(ckpt, moved *config.Config) ([]string, error) {
	byName := map[string]*config.PolicyConfig{}
	for i := range moved.Policies {
		byName[moved.Policies[i].Name] = &moved.Policies[i]
	}
	if len(moved.Policies) != len(ckpt.Policies) {
		return nil, fmt.Errorf("%s has %d policies and the checkpoint's config %d: --config with --resume may change only where engines live", moved.File,
			len(moved.Policies), len(ckpt.Policies))
	}
	var changes []string
	next := make([]config.PolicyConfig, len(ckpt.Policies))
	for i, p := range ckpt.Policies {
		m := byName[p.Name]
		if m == nil {
			return nil, fmt.Errorf("%s has no policy %q, which the checkpoint's config has: --config with --resume may change only where engines live",
				moved.File, p.Name)
		}
		q := p
		e, n := &q.Engine, m.Engine
		if n.TLS != nil {
			t := *n.TLS
			for _, f := range []*string{&t.CA, &t.Cert, &t.Key} {
				if *f != "" && !filepath.IsAbs(*f) {
					*f, _ = filepath.Abs(*f)
				}
			}
			n.TLS = &t
		}
		say := func(key string, from, to any) {
			changes = append(changes, fmt.Sprintf("policy %q: engine.%s %v → %v", p.Name, key, from, to))
		}
		if e.Address != n.Address {
			say("address", e.Address, n.Address)
		}
		if !reflect.DeepEqual(e.TLS, n.TLS) {
			say("tls", tlsText(e.TLS), tlsText(n.TLS))
		}
		if e.TokenEnv != n.TokenEnv {
			say("token_env", e.TokenEnv, n.TokenEnv)
		}
		if e.Insecure != n.Insecure {
			say("insecure", e.Insecure, n.Insecure)
		}
		if e.BaseURL != n.BaseURL {
			say("base_url", e.BaseURL, n.BaseURL)
		}
		if e.APIKeyEnv != n.APIKeyEnv {
			say("api_key_env", e.APIKeyEnv, n.APIKeyEnv)
		}
		e.Address, e.TLS, e.TokenEnv, e.Insecure, e.BaseURL, e.APIKeyEnv = n.Address, n.TLS, n.TokenEnv, n.Insecure, n.BaseURL, n.APIKeyEnv
		if key := firstDifference(q, *m, "line"); key != "" {
			return nil, fmt.Errorf("%s: policy %q: %s differs from the checkpoint's config: --config with --resume may change "+
				"only where engines live (engine.address, tls, token_env, insecure, base_url, "+
				"api_key_env), never what the run computes; resume without --config, or start a new run", moved.File, p.Name, key)
		}
		next[i] = q
	}
	a, b := *ckpt, *moved
	a.Policies, b.Policies = nil, nil
	if key := firstDifference(a, b, "run.out"); key != "" {
		return nil, fmt.Errorf("%s: %s differs from the checkpoint's config: --config with --resume may change only where "+
			"engines live, never what the run computes; resume without --config (--steps, "+
			"--data… still apply), or start a new run", moved.File, key)
	}
	ckpt.Policies = next
	return changes, nil
}

func tlsText(t *config.TLSConfig) string {
	if t == nil {
		return "(none)"
	}
	return fmt.Sprintf("{ca: %s, cert: %s, key: %s, server_name: %s}", t.CA, t.Cert, t.Key, t.ServerName)
}

// firstDifference names the first setting (a dotted JSON key) in which a and b differ, leaving
// out the keys in skip; "" when they agree.
func firstDifference(a, b any, skip ...string) string {
	var ma, mb any
	ja, _ := json.Marshal(a)
	jb, _ := json.Marshal(b)
	json.Unmarshal(ja, &ma)
	json.Unmarshal(jb, &mb)
	return diffKey(ma, mb, "", skip)
}

func diffKey(a, b any, at string, skip []string) string {
	if slices.Contains(skip, at) {
		return ""
	}
	ma, oka := a.(map[string]any)
	mb, okb := b.(map[string]any)
	if !oka || !okb {
		if reflect.DeepEqual(a, b) {
			return ""
		}
		return at
	}
	keys := map[string]bool{}
	for k := range ma {
		keys[k] = true
	}
	for k := range mb {
		keys[k] = true
	}
	sorted := make([]string, 0, len(keys))
	for k := range keys {
		sorted = append(sorted, k)
	}
	sort.Strings(sorted)
	for _, k := range sorted {
		key := k
		if at != "" {
			key = at + "." + k
		}
		if d := diffKey(ma[k], mb[k], key, skip); d != "" {
			return d
		}
	}
	return ""
}
