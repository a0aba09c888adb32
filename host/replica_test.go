package host

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/slimen/slimen/engines"
	"github.com/slimen/slimen/engines/tiny"
)

// pushBus stands in for a push group's transport between fake pushers: the sender (rank 0)
// saves its weights into a folder and hands it to the receiver, which loads it. fail makes a
// member's join or push fail ("join 1": rank 1's join; "push": every push).
type pushBus struct {
	dir   string
	fail  string
	mu    sync.Mutex
	sends map[string]chan string // group/peer → the folder of the weights sent
	joins []int
}

func (b *pushBus) ch(group string, peer int) chan string {
	b.mu.Lock()
	defer b.mu.Unlock()
	k := fmt.Sprint(group, "/", peer)
	if b.sends[k] == nil {
		b.sends[k] = make(chan string, 1)
	}
	return b.sends[k]
}

// pushEngine is a plain engine (it keeps no versions) that joins push groups over a pushBus.
type pushEngine struct {
	engines.Engine
	bus  *pushBus
	rank int
}

func (p *pushEngine) CanPush(context.Context) (bool, error) { return true, nil }

func (p *pushEngine) JoinPushGroup(ctx context.Context, g engines.PushGroup, rank int) ([]string, error) {
	if !strings.HasPrefix(g.InitMethod, "tcp://127.0.0.1:") || g.World < 2 {
		return nil, fmt.Errorf("group %+v", g)
	}
	if p.bus.fail == fmt.Sprint("join ", rank) {
		return nil, errors.New("no route to the trainer")
	}
	p.rank = rank
	p.bus.mu.Lock()
	p.bus.joins = append(p.bus.joins, rank)
	p.bus.mu.Unlock()
	links := make([]string, g.World)
	for i := range links {
		if i != rank {
			links[i] = "fake"
		}
	}
	return links, nil
}

func (p *pushEngine) PushWeights(ctx context.Context, group string, peer, version int) (engines.PushStats, error) {
	if p.bus.fail == "push" {
		return engines.PushStats{}, errors.New("the link broke")
	}
	if p.rank == 0 {
		dir := filepath.Join(p.bus.dir, fmt.Sprint(group, "-", peer, "-", version))
		if err := p.Save(ctx, dir); err != nil {
			return engines.PushStats{}, err
		}
		dropOptimizerFiles(dir)
		p.bus.ch(group, peer) <- dir
		return engines.PushStats{Bytes: treeSize(dir), Link: "fake"}, nil
	}
	if p.rank != peer {
		return engines.PushStats{}, fmt.Errorf("a push to rank %d reached rank %d", peer, p.rank)
	}
	select {
	case dir := <-p.bus.ch(group, peer):
		return engines.PushStats{Bytes: treeSize(dir), Link: "fake"}, p.Load(ctx, dir)
	case <-ctx.Done():
		return engines.PushStats{}, ctx.Err()
	}
}

// TestReplicaPush: rollout replicas whose engines join a push group take the trainer's weights
// through it (events.log: "by broadcast"), and the run writes the metrics of the engine that keeps
// its own versions; a group that cannot be made, or a push that fails, falls back to the folder
// (events.log says why) and the run completes with the same metrics.
func TestReplicaPush(t *testing.T) {
	model := tinyModel(t, 1)
	script := writeScript(t, tinyScript)
	run := func(fail string, push bool) (string, string) {
		if !push {
			return asyncSteps(t, script, model, 2, nil)
		}
		bus := &pushBus{dir: t.TempDir(), fail: fail, sends: map[string]chan string{}}
		return asyncSteps(t, script, model, 2, func(e *tiny.Engine) engines.Engine { return &pushEngine{Engine: e, bus: bus} })
	}
	native, _ := run("", false)
	for _, c := range []struct{ fail, want, not string }{
		{"", "pushed to its rollout replica by broadcast in", "replicas through a folder"},
		{"join 2", "could not be made: rollout replica 2: no route to the trainer", "by broadcast in"},
		{"push", "pushing weights version 0 by broadcast failed, so it and the later versions go through a folder: the trainer: the link broke", "by broadcast in"},
	} {
		t.Run("fail="+c.fail, func(t *testing.T) {
			got, events := run(c.fail, true)
			if got != native {
				t.Errorf("the metrics differ from the run whose engine keeps its versions:\n%s\n---\n%s", native, got)
			}
			if !strings.Contains(events, c.want) {
				t.Errorf("events.log lacks %q:\n%s", c.want, events)
			}
			if strings.Contains(events, c.not) {
				t.Errorf("events.log has %q:\n%s", c.not, events)
			}
			if c.fail != "" && !strings.Contains(events, "s/GB saved and loaded") {
				t.Errorf("no push through the folder after the fallback:\n%s", events)
			}
			if c.fail == "" && !strings.Contains(events, "joined push group") {
				t.Errorf("events.log does not say the group was made:\n%s", events)
			}
		})
	}
}
