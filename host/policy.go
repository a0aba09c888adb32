package host

// This file defines a run's policies (policyTable): finding one by name (zero-config runs create
// it then), and, on Run, opening their engines and registering them with their dispatchers.

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/script"
)

// policy is one policy's engine and its dispatcher.
type policy struct {
	name     string
	cfg      config.PolicyConfig
	eng      engines.Engine
	disp     *dispatcher
	busy     *busyMeter // the engine's generate, train and save calls
	replicas *replicas  // the rollout replicas the run opened for it; nil: none
	// busyMark is busy's total at the end of the last step.
	busyMark time.Duration

	infoMu sync.Mutex
	info   *engines.Info // the engine's Info as chat turns render with it; nil: ask again
}

// chatInfo is the engine's Info for rendering chat turns (template, EOS, context), asked once and
// kept until forgetInfo: a chat renders at every turn, and a remote or torch engine's Info is a
// round trip.
func (p *policy) chatInfo(ctx context.Context) (engines.Info, error) {
	p.infoMu.Lock()
	defer p.infoMu.Unlock()
	if p.info != nil {
		return *p.info, nil
	}
	info, err := p.eng.Info(ctx)
	if err != nil {
		return engines.Info{}, err
	}
	p.info = &info
	return info, nil
}

// forgetInfo drops the kept Info: the engine restarted as a new process, or the run's
// configuration was reloaded, and the next render asks the engine again.
func (p *policy) forgetInfo() {
	p.infoMu.Lock()
	p.info = nil
	p.infoMu.Unlock()
}

// score scores one request of a rollout: through the policy's dispatcher, which batches the score
// calls of all rollouts as it does their generate calls, at the weights version the rollout
// samples from.
func (p *policy) score(ctx context.Context, req engines.ScoreRequest) ([]float32, error) {
	return p.disp.score(ctx, req, versionFor(ctx, p).gen)
}

// policyTable is a run's policies by name, in config order (then order of first use), and what
// they share: the LoRA bases and the batchers of their adapters. The run owns it (Run.pols): it
// opens the engines and registers each policy here (add), and a zero-config run gives the table,
// at construction, create, which makes a policy the script names on first use.
type policyTable struct {
	mu    sync.Mutex
	bases loraBases // the base models the LoRA policies share
	// adapterBatchers send the generate batches of the LoRA policies on one base together.
	adapterBatchers map[engines.AdapterGenerator]*adapterBatcher
	byName          map[string]*policy
	openErrs        map[string]error // zero-config policies whose engine failed to open: not retried
	order           []string         // policy names in config order, then first use

	// cfg is the run's config, for naming its file in messages.
	cfg func() *config.Config
	// create opens and registers policy name on checkpoint (add), called with mu held; nil:
	// the run has a config, and an unknown name is an error.
	create func(name, checkpoint string) (*policy, error)
}

// newPolicyTable makes an empty table; create is nil unless the run is zero-config.
func newPolicyTable(cfg func() *config.Config, create func(name, checkpoint string) (*policy, error)) policyTable {
	return policyTable{byName: map[string]*policy{}, cfg: cfg, create: create}
}

// policyFor returns a policy by name. Zero-config runs create it on first use, on
// config.BuiltinCheckpoint.
func (t *policyTable) policyFor(name string) (*policy, error) {
	return t.policyOn(name, config.BuiltinCheckpoint)
}

// policyOn is policyFor with the checkpoint a zero-config run creates the policy on.
func (t *policyTable) policyOn(name, checkpoint string) (*policy, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if p, ok := t.byName[name]; ok {
		return p, nil
	}
	if t.create == nil {
		hint := ""
		if best := script.ClosestName(name, t.order); best != "" {
			hint = fmt.Sprintf(" (did you mean %q?)", best)
		}
		return nil, fmt.Errorf("unknown policy %q%s; %s defines %s — add it under policies: or fix the name", name, hint, cfgName(t.cfg()),
			config.QuotePolicyNames(t.order))
	}
	if err := config.CheckPolicyName(name); err != nil {
		return nil, fmt.Errorf("%v (a zero-config run creates each policy under the name the script passes, which must be a name a config may give it)", err)
	}
	if err := t.openErrs[name]; err != nil {
		return nil, err
	}
	p, err := t.create(name, checkpoint)
	if err != nil {
		if t.openErrs == nil {
			t.openErrs = map[string]error{}
		}
		t.openErrs[name] = err
		return nil, err
	}
	return p, nil
}

// get returns policy name; nil if the table has none.
func (t *policyTable) get(name string) *policy {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.byName[name]
}

// list returns the policies in config order (then order of first use).
func (t *policyTable) list() []*policy {
	t.mu.Lock()
	defer t.mu.Unlock()
	pols := make([]*policy, len(t.order))
	for i, n := range t.order {
		pols[i] = t.byName[n]
	}
	return pols
}

// names are the names of the policies, sorted, those a zero-config script created included.
func (t *policyTable) names() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return sortedKeys(t.byName)
}

// add puts p in the table, last in order; the caller holds mu, or the run is starting.
func (t *policyTable) add(p *policy) {
	t.byName[p.name] = p
	t.order = append(t.order, p.name)
}

// adapterBatcher returns the batcher of the LoRA adapters on base, made on first use (activity
// is the run's); the caller holds mu, or the run is starting.
func (t *policyTable) adapterBatcher(base engines.AdapterGenerator, activity *activity) *adapterBatcher {
	bt := t.adapterBatchers[base]
	if bt == nil {
		bt = newAdapterBatcher(base.GenerateAdapters, activity)
		if t.adapterBatchers == nil {
			t.adapterBatchers = map[engines.AdapterGenerator]*adapterBatcher{}
		}
		t.adapterBatchers[base] = bt
	}
	return bt
}

// reconfigure gives the policies of a reloaded config their settings pcs (by name; a name the
// table lacks is skipped), and has them ask their engines' Info again.
func (t *policyTable) reconfigure(pcs []config.PolicyConfig) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for i := range pcs {
		if p := t.byName[pcs[i].Name]; p != nil {
			p.cfg = pcs[i]
			p.forgetInfo()
		}
	}
}

// each calls fn on each policy in order, under mu (fn must not use the table).
func (t *policyTable) each(fn func(p *policy)) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, name := range t.order {
		fn(t.byName[name])
	}
}

// cfgName names a run's config file c.File in messages ("the config" for a zero-config run).
func cfgName(c *config.Config) string {
	if c.File != "" {
		return c.File
	}
	return "the config"
}

// cfgPlace names where policy pc was configured in config c, for messages: " in policies.yaml:7".
func cfgPlace(c *config.Config, pc config.PolicyConfig) string {
	if c.File != "" && pc.Line > 0 {
		return fmt.Sprintf(" in %s:%d", c.File, pc.Line)
	}
	return ""
}

// refuseScoringWithoutScore stops a run at start-up, not at its first score call, when its
// script scores with a policy whose engine only generates. Such an engine is of kind openai (the
// OpenAI API returns no log-probabilities of given tokens); the scoring is score("judge", …) or
// train(…, teacher="judge") with the name written literally. (Training such a policy is refused
// by the config check.)
func (r *Run) refuseScoringWithoutScore() error {
	for _, u := range script.ScoringUses(r.script) {
		for _, p := range r.cfg.Policies {
			if p.Name != u.Name || p.Engine.Kind != "openai" {
				continue
			}
			call := fmt.Sprintf("score(%q, …)", u.Name)
			if u.Fn == "train" {
				call = fmt.Sprintf("train(…, teacher=%q)", u.Name)
			}
			return fmt.Errorf("%s: %s scores with policy %q, whose engine (kind openai, %s:%d) only generates: "+
				"the OpenAI API returns no log-probabilities of given tokens; score with a tiny, torch or remote policy",
				u.Pos, call, u.Name, cfgName(r.cfg), p.Line)
		}
	}
	return nil
}

// openScriptPolicies starts, in a zero-config run, the policies the script names literally, and
// warns about names a typo apart. They are then listed at start-up and in config.yaml before the
// first step (names a script computes are still created when first used).
func (r *Run) openScriptPolicies() error {
	uses := script.PolicyNames(r.script)
	for _, w := range script.NearPolicyNames(uses) {
		r.events.printf("warning: %s", w)
	}
	chat := map[string]bool{} // names a chat() with tool schemas uses: on the embedded chat model
	for _, u := range uses {
		chat[u.Name] = chat[u.Name] || u.Tools
	}
	for _, u := range uses {
		checkpoint := config.BuiltinCheckpoint
		if chat[u.Name] {
			checkpoint = config.BuiltinChatCheckpoint
		}
		if _, err := r.pols.policyOn(u.Name, checkpoint); err != nil {
			return fmt.Errorf("%s: %w", u.Pos, err)
		}
	}
	return r.writeConfig()
}

// atOnce runs fn(0), …, fn(n−1) at the same time and returns their errors, by index.
func atOnce(n int, fn func(i int) error) []error {
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = fn(i)
		}()
	}
	wg.Wait()
	return errs
}

// openPolicies opens the config's policies. Their engines start at the same time (eight torch
// workers one after another would add up their start-ups of several seconds each), except
// those that share an engine (addToLane: LoRA policies join their shared bases one at a time, in
// config order); then the policies are registered in config order.
func (r *Run) openPolicies(ctx context.Context) error {
	pcs := r.cfg.Policies
	at := map[string]int{} // a policy's index in pcs
	var lanes [][]*policy
	for i, pc := range pcs {
		at[pc.Name] = i
		lanes = addToLane(lanes, &policy{name: pc.Name, cfg: pc, eng: r.opts.Engines[pc.Name]})
	}
	engs, errs := make([]engines.Engine, len(pcs)), make([]error, len(pcs))
	atOnce(len(lanes), func(l int) error {
		for _, p := range lanes[l] {
			i := at[p.name]
			engs[i], errs[i] = r.openPolicyEngine(ctx, pcs[i])
		}
		return nil
	})
	for i, pc := range pcs {
		if errs[i] == nil {
			_, errs[i] = r.registerPolicy(ctx, pc, engs[i])
		}
		if errs[i] != nil {
			for j := i + 1; j < len(pcs); j++ { // opened, never registered
				if _, given := r.opts.Engines[pcs[j].Name]; !given && engs[j] != nil {
					engs[j].Close()
				}
			}
			return errs[i]
		}
	}
	return nil
}

// createPolicy is a zero-config run's policyTable.create: it opens and registers policy name on
// checkpoint, a policy the run creates after its start, and adds it to the run's config.
func (r *Run) createPolicy(name, checkpoint string) (*policy, error) {
	pc := config.DefaultPolicy(name)
	pc.HFCheckpoint, pc.Engine.ModelPath = checkpoint, checkpoint
	eng, err := r.openPolicyEngine(r.ctx, pc)
	if err != nil {
		return nil, err
	}
	p, err := r.registerPolicy(r.ctx, pc, eng)
	if err != nil {
		return nil, err
	}
	r.cfgMu.Lock()
	r.cfg.Policies = append(r.cfg.Policies, pc)
	r.cfgMu.Unlock()
	r.events.printf("zero-config: policy %q on %s (%s engine)", name, pc.HFCheckpoint, pc.Engine.Kind)
	if r.step > 0 || r.live.total.Load() > 0 {
		// A name the script computed, created mid-run: config.yaml lists it too.
		if err := r.writeConfig(); err != nil {
			r.events.printf("config.yaml: %v", err)
		}
	}
	return p, nil
}

// openPolicyEngine returns the engine of policy pc: the one Options.Engines gives, or a new one.
func (r *Run) openPolicyEngine(ctx context.Context, pc config.PolicyConfig) (engines.Engine, error) {
	eng := r.opts.Engines[pc.Name]
	if eng == nil {
		open := r.opts.OpenEngine
		if open == nil {
			open = func(ctx context.Context, p config.PolicyConfig) (engines.Engine, error) {
				return openEngine(ctx, p, r.opts.Out, engineLogs{printf: r.events.printf, worker: r.events.filef, restarted: r.engineRestarted, bases: &r.pols.bases,
					cfg: r.cfg})
			}
		}
		var err error
		if eng, err = open(ctx, pc); err != nil {
			return nil, fmt.Errorf("policy %q%s: %w", pc.Name, cfgPlace(r.cfg, pc), err)
		}
	}
	return eng, nil
}

// registerPolicy makes policy pc of its engine eng (closed on an error unless Options.Engines
// gave it), starts its dispatcher and adds it to the table (under the table's lock, or alone at
// the run's start).
func (r *Run) registerPolicy(ctx context.Context, pc config.PolicyConfig, eng engines.Engine) (*policy, error) {
	_, given := r.opts.Engines[pc.Name]
	if !given && r.opts.OpenEngine == nil && offHost(pc) { // a server this run reached itself
		// After the policies before it are registered: it checks that no two trainable
		// policies share one server process.
		// The folders first: a run refused for them leaves the server's state as it was.
		if err := r.checkServerFolders(ctx, pc, eng); err != nil {
			eng.Close()
			return nil, fmt.Errorf("policy %q%s: %w", pc.Name, cfgPlace(r.cfg, pc), err)
		}
		if err := r.claimServer(ctx, pc, eng); err != nil {
			eng.Close()
			return nil, fmt.Errorf("policy %q%s: %w", pc.Name, cfgPlace(r.cfg, pc), err)
		}
	}
	if err := checkTIS(ctx, r.cfg, pc, eng); err != nil {
		if !given {
			eng.Close()
		}
		return nil, err
	}
	p := &policy{name: pc.Name, cfg: pc, eng: eng, busy: &busyMeter{}}
	p.disp = newDispatcher(eng, &r.activity, maxBatchSamples(r.cfg))
	p.disp.busy, p.disp.generating = p.busy, &r.generating
	if v, ok := eng.(engines.AdapterView); ok && !r.opts.perPolicyBatches {
		// A LoRA policy on a shared base: its batches go out with the other adapters' batches.
		bt := r.pols.adapterBatcher(v.AdapterBase(), &r.activity)
		name := v.AdapterName()
		bt.join(name, p.disp)
		p.disp.gen = func(ctx context.Context, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
			return bt.generate(ctx, name, reqs)
		}
	}
	go p.disp.loop(r.ctx)
	r.pols.add(p)
	return p, nil
}

// maxBatchSamples is how many samples a dispatcher puts in one engine batch:
// rollout.max_batch_tokens over max_response_len, else 1024.
func maxBatchSamples(c *config.Config) int {
	if c.Rollout.MaxBatchTokens > 0 {
		return max(1, c.Rollout.MaxBatchTokens/max(1, c.Rollout.MaxResponseLen))
	}
	return 1024
}
