package remote

import (
	"context"
	"fmt"

	"github.com/slimen/slimen/engines"
	enginepb "github.com/slimen/slimen/engines/proto"
	"google.golang.org/grpc"
)

// LoRA describes an adapter for AddAdapter: rank r, the update scaled by Alpha/Rank (PEFT's
// lora_alpha), the projections it adapts.
type LoRA = engines.LoRA

// AddAdapter gives the engine a LoRA adapter over its model, which becomes a frozen base that
// every adapter shares (one per policy): A drawn from seed, B zero. It returns the adapter's
// parameter count.
func (c *Client) AddAdapter(ctx context.Context, name string, l LoRA, seed uint64) (int64, error) {
	req := &enginepb.AddAdapterRequest{Name: name, Rank: int32(l.Rank), Alpha: l.Alpha, Dropout: l.Dropout, Targets: l.Targets, Seed: seed}
	var resp *enginepb.AddAdapterResponse
	err := c.call(ctx, "add adapter", req, func(ctx context.Context, o ...grpc.CallOption) (err error) {
		resp, err = c.rpc.AddAdapter(ctx, req, o...)
		return err
	})
	return resp.GetParams(), err
}

// RemoveAdapter drops an adapter of the engine; its requests in flight fail.
func (c *Client) RemoveAdapter(ctx context.Context, name string) error {
	req := &enginepb.RemoveAdapterRequest{Name: name}
	return c.call(ctx, "remove adapter", req, func(ctx context.Context, o ...grpc.CallOption) error {
		_, err := c.rpc.RemoveAdapter(ctx, req, o...)
		return err
	})
}

// Adapter is the engine as one of its LoRA adapters sees it (Client.Adapter): an engines.Engine
// whose requests, training steps, saves and loads name the adapter. Its KL reference is the
// base without the adapter. Close does not close the client.
type Adapter struct {
	c    *Client
	name string
}

var (
	_ engines.Engine   = (*Adapter)(nil)
	_ engines.Renderer = (*Adapter)(nil)
)

// Adapter returns the view of adapter name (added with AddAdapter, or loaded with its Load).
func (c *Client) Adapter(name string) *Adapter { return &Adapter{c: c, name: name} }

// Client is the connection the adapter's calls go through.
func (a *Adapter) Client() *Client { return a.c }

// Name is the adapter's name on the engine.
func (a *Adapter) Name() string { return a.name }

// Info is the engine's, naming the adapter.
func (a *Adapter) Info(ctx context.Context) (engines.Info, error) {
	in, err := a.c.Info(ctx)
	in.Model += " + LoRA " + a.name
	return in, err
}

// Generate samples with the adapter.
func (a *Adapter) Generate(ctx context.Context, reqs []engines.GenerateRequest) ([]engines.Completion, error) {
	names := make([]string, len(reqs))
	for i := range names {
		names[i] = a.name
	}
	return a.c.generate(ctx, reqs, names, nil)
}

// Score scores with the adapter, or with the base for Reference requests.
func (a *Adapter) Score(ctx context.Context, reqs []engines.ScoreRequest) ([]engines.Scores, error) {
	return a.c.score(ctx, reqs, a.name, nil)
}

// Train takes one step of the adapter; the base does not change.
func (a *Adapter) Train(ctx context.Context, b engines.Batch) (engines.TrainStats, error) {
	return a.c.train(ctx, b, a.name)
}

// Tokenize is the base's.
func (a *Adapter) Tokenize(ctx context.Context, texts []string) ([][]int32, error) {
	return a.c.Tokenize(ctx, texts)
}

// Render is the base's: adapters share the tokenizer and chat template.
func (a *Adapter) Render(ctx context.Context, reqs []engines.RenderRequest) ([][]int32, error) {
	return a.c.Render(ctx, reqs)
}

// Save writes the adapter as a PEFT folder (with its optimizer state) into dir on the engine's
// machine.
func (a *Adapter) Save(ctx context.Context, dir string) error {
	req := &enginepb.SaveRequest{Dir: dir, Adapter: a.name}
	return a.c.call(ctx, "save", req, func(ctx context.Context, o ...grpc.CallOption) error {
		_, err := a.c.rpc.Save(ctx, req, o...)
		return err
	})
}

// Load replaces the adapter with the PEFT folder dir on the engine's machine.
func (a *Adapter) Load(ctx context.Context, dir string) error {
	req := &enginepb.LoadRequest{Dir: dir, Adapter: a.name}
	err := a.c.call(ctx, "load", req, func(ctx context.Context, o ...grpc.CallOption) error {
		_, err := a.c.rpc.Load(ctx, req, o...)
		return err
	})
	if err != nil {
		return fmt.Errorf("adapter %q: %w", a.name, err)
	}
	return nil
}

// Close releases nothing: the client belongs to its owner.
func (a *Adapter) Close() error { return nil }

// AdapterName is the adapter's name (engines.AdapterView).
func (a *Adapter) AdapterName() string { return a.name }

// AdapterBase is the client of the engine the adapter is on (engines.AdapterView).
func (a *Adapter) AdapterBase() engines.AdapterGenerator { return a.c }
