package host

import (
	"context"
	"fmt"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/remote"
	"github.com/slimen/slimen/engines/tiny"
	"github.com/slimen/slimen/host/config"
)

// OpenEngine opens the engine a policy's config asks for:
//
//	tiny    the embedded pure-Go engine on hf_checkpoint (a folder or builtin:NAME), or on the
//	        folder given by load: (a checkpoint this engine saved)
//	remote  an engine server at engine.address (slimen serve, python -m slimen_torch serve, …)
func OpenEngine(ctx context.Context, p config.PolicyConfig) (engines.Engine, error) {
	return openEngine(ctx, p, nil)
}

// openEngine is OpenEngine with a place to report a remote engine that restarted (and so lost
// whatever it had learned since its last save).
func openEngine(ctx context.Context, p config.PolicyConfig, logf func(string, ...any)) (engines.Engine, error) {
	switch p.Engine.Kind {
	case "tiny":
		spec := p.HFCheckpoint
		if p.Load != "" {
			spec = p.Load
		}
		return tiny.Open(spec, tiny.Options{Threads: p.Engine.Threads})
	case "remote":
		o := remote.Options{Address: p.Engine.Address, Insecure: p.Engine.Insecure, TokenEnv: p.Engine.TokenEnv,
			MaxMessageBytes: p.Engine.MaxMessageMB << 20, Timeout: p.Engine.Timeout, ReconnectTimeout: p.Engine.ReconnectTimeout}
		if logf != nil {
			o.OnRestart = func(prev, cur string) {
				logf("policy %q: its engine at %s restarted (instance %s → %s) and lost what it learned since its last save; resume from a checkpoint to restore it", p.Name, p.Engine.Address, prev, cur)
			}
		}
		if t := p.Engine.TLS; t != nil {
			o.TLS = &remote.TLS{CAFile: t.CA, CertFile: t.Cert, KeyFile: t.Key, ServerName: t.ServerName}
		}
		return remote.Dial(ctx, o)
	default:
		return nil, fmt.Errorf("engine kind %q is not available in this build (known: tiny, remote)", p.Engine.Kind)
	}
}
