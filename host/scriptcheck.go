package host

import (
	"strings"

	"github.com/slimen/slimen/host/config"
	"github.com/slimen/slimen/host/script"
)

// checkScript refuses at start-up what `slimen check --config` finds without running and every
// rollout would fail on. That is a policy name the config does not define (written in a call,
// passed through the script's functions or held in a variable) and a field a task does not have;
// without the check the first step (after the eval before it) would find them, one failed
// rollout each.
func (r *Run) checkScript() error {
	var cfg *config.Config
	if !r.zero {
		cfg = r.cfg
	}
	problems, _ := script.LintScript(r.script, cfg)
	if len(problems) == 0 {
		return nil
	}
	return &ScriptError{Msg: strings.Join(problems, "\n")}
}
