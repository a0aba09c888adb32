package remote

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/slimen/slimen/engines"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// callError turns the error of a failed call into a sentence that names the engine, the call and
// what to do, wrapping ErrUnavailable, engines.ErrNotSupported or the context's error where they
// apply so that callers can tell the cases apart with errors.Is.
func (c *Client) callError(ctx context.Context, method string, err error, out *outage) error {
	if ctxErr := ctx.Err(); ctxErr != nil {
		return c.deadlineError(method, ctxErr, out)
	}
	st := status.Convert(err)
	msg := st.Message()
	switch st.Code() {
	case codes.Unavailable:
		if permanent(msg) {
			return fmt.Errorf("engine at %s: %s: the TLS handshake failed (%s): "+
				"check engine.tls (ca, server_name) against the server's certificate", c.addr, method, msg)
		}
		hint := "check that the engine server is running and reachable from here"
		if strings.Contains(msg, "server preface") && c.opts.TLS == nil {
			// A TLS server drops a plaintext client before speaking HTTP/2.
			hint += ", and whether it serves TLS (then set engine.tls)"
		}
		if t := c.gaveUpAt(); !t.IsZero() && !time.Now().Before(t) {
			// GiveUpAt: the caller stops waiting (a stopping host's grace is over).
			hint = "its client stopped waiting for it (GiveUpAt: the run is stopping and its stop grace is over); " + hint
		}
		if out != nil && out.began() {
			return fmt.Errorf("engine at %s is unreachable: %s gave up after retrying for %s (last error: %s); %s: %w",
				c.addr, method, time.Since(out.since).Round(time.Second), msg, hint, ErrUnavailable)
		}
		return fmt.Errorf("engine at %s is unreachable: %s: %s: %w", c.addr, method, msg, ErrUnavailable)
	case codes.Unauthenticated:
		from := ""
		if c.tokenEnv != "" {
			from = " from $" + c.tokenEnv
		}
		return fmt.Errorf("engine at %s rejected the token%s: %s", c.addr, from, msg)
	case codes.ResourceExhausted:
		return fmt.Errorf("engine at %s: %s: a message was over a size limit (%s): send less per call or raise the limit on "+
			"both sides (engine.max_message_mb here, --max-message-mb on the server)", c.addr, method, msg)
	case codes.Unimplemented:
		return fmt.Errorf("engine at %s: %s: %w (%s)", c.addr, method, engines.ErrNotSupported, msg)
	case codes.DeadlineExceeded:
		return c.deadlineError(method, context.DeadlineExceeded, out)
	case codes.Canceled:
		return fmt.Errorf("engine at %s: %s: %s: %w", c.addr, method, msg, context.Canceled)
	}
	return fmt.Errorf("engine at %s: %s: %s", c.addr, method, msg)
}

func (c *Client) deadlineError(method string, ctxErr error, out *outage) error {
	if errors.Is(ctxErr, context.Canceled) {
		return fmt.Errorf("engine at %s: %s: %w", c.addr, method, ctxErr)
	}
	if out != nil && out.began() {
		return fmt.Errorf("engine at %s: %s: no answer before the call's deadline; the engine had been unreachable for %s (last error: %s): %w: %w",
			c.addr, method, time.Since(out.since).Round(time.Second), status.Convert(out.last).Message(), ErrUnavailable, ctxErr)
	}
	return fmt.Errorf("engine at %s: %s: no answer before the call's deadline (engine.timeout or the caller's): %w", c.addr, method, ctxErr)
}

// permanent reports whether an Unavailable status will not go away by retrying: gRPC reports a
// failed TLS handshake as Unavailable, but a wrong CA or server name stays wrong.
func permanent(msg string) bool {
	return strings.Contains(msg, "authentication handshake failed")
}
