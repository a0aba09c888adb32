package host

import (
	"context"
	"fmt"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/host/config"
)

// OpenEngine opens the engine a policy's config asks for.
func OpenEngine(ctx context.Context, p config.PolicyConfig) (engines.Engine, error) {
	switch p.Engine.Kind {
	default:
		return nil, fmt.Errorf("engine kind %q is not available in this build (known: tiny, remote, torch)", p.Engine.Kind)
	}
}
