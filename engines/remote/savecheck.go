package remote

import (
	"context"
	"fmt"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	enginepb "github.com/slimen/slimen/engines/proto"
)

// probeAdapter names no adapter a server can hold (adapters are named after policies, and a
// policy name has no slash).
const probeAdapter = "/slimen-save-probe"

// CheckSaveFolder asks the server whether it would save into dir, a path on its machine, without
// writing anything: a Save of an adapter no server holds. A server confines Save to its roots
// (slimen serve --root) and refuses a folder outside them before it looks for the adapter; any
// answer about the adapter (missing, or none held) means the folder would be taken. The error is
// the server's refusal, naming its roots and the fix, or why the server could not be asked.
func (c *Client) CheckSaveFolder(ctx context.Context, dir string) error {
	req := &enginepb.SaveRequest{Dir: dir, Adapter: probeAdapter}
	var raw error
	err := c.call(ctx, "save", req, func(ctx context.Context, o ...grpc.CallOption) error {
		_, raw = c.rpc.Save(ctx, req, o...)
		return raw
	})
	if err == nil || raw == nil { // raw nil: the call failed on this side (closed, unreachable)
		return err
	}
	st := status.Convert(raw)
	switch st.Code() {
	case codes.NotFound, codes.Unimplemented, codes.InvalidArgument, codes.Unknown:
		// The adapter, not the folder: the folder passed the roots.
		return nil
	case codes.FailedPrecondition:
		if !strings.HasPrefix(st.Message(), "save: ") { // the roots' own refusal starts so
			return nil
		}
		return fmt.Errorf("engine at %s: %s", c.addr, st.Message())
	case codes.PermissionDenied:
		return fmt.Errorf("engine at %s: %s", c.addr, st.Message())
	}
	return err
}
